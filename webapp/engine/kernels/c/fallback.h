/* Which version takes each name of isa.h, name by name (as llama.cpp's arch-fallback.h does it): the
 * highest rung of the build's ladder whose files define the name, else generic.c's.
 *
 * A rung's files define the names they have as NAME_<rung> and list them here, HAS_<RUNG>_<name>, for
 * the builds that include them; below, each name is renamed from the first rung down that has it
 * (`#define NAME_<rung> NAME`), so a rung with a partial set of kernels takes the rest from the rung
 * below, down to the portable version. A lower rung's version that a higher one replaces stays
 * beside it under its own name, for the higher one's tails. A new rung (as x86_avx512*.c did; an ARM
 * NEON set) adds its list and one arm a name; x86's and ARM's rungs never share a build. */
#pragma once

#define HAS(rung, name) HAS_##rung##_##name

#if TQ_AVX2 /* x86_avx2*.c, which every x86 rung builds (tq.c), define every name */
#define HAS_AVX2_fp16 1
#define HAS_AVX2_quantize_row 1
#define HAS_AVX2_interleaves 1
#define HAS_AVX2_tile_rows 1
#define HAS_AVX2_row_dot 1
#define HAS_AVX2_swiglu_row 1
#define HAS_AVX2_halves_from_floats 1
#define HAS_AVX2_attend_item 1
#define HAS_AVX2_attend_lanes 1
#define HAS_AVX2_attend_item_q8 1
#define HAS_AVX2_delta_step 1
#endif

#if TQ_AVX512 /* x86_avx512*.c: the products' tiles, and the layout they read */
#define HAS_AVX512_interleaves 1
#define HAS_AVX512_tile_rows 1
#endif

#if TQ_NEON /* arm_neon*.c: the products' rows, the activations' rounding, float16 conversions, attention over float16 and Q8_0 rows */
#define HAS_NEON_fp16 1
#define HAS_NEON_quantize_row 1
#define HAS_NEON_row_dot 1
#define HAS_NEON_halves_from_floats 1
#define HAS_NEON_attend_item 1
#define HAS_NEON_attend_item_q8 1
#endif

#if TQ_I8MM /* arm_neon_i8mm.c: the products' rows two by two */
#define HAS_I8MM_tile_rows 1
#define HAS_I8MM_row_dot 1
#endif

#if HAS(AVX2, fp16)
#define fp16_avx2 fp16
#elif HAS(NEON, fp16)
#define fp16_neon fp16
#else
#define fp16_generic fp16
#endif
#if HAS(AVX2, quantize_row)
#define quantize_row_avx2 quantize_row
#elif HAS(NEON, quantize_row)
#define quantize_row_neon quantize_row
#else
#define quantize_row_generic quantize_row
#endif
#if HAS(AVX512, interleaves)
#define interleaves_avx512 interleaves
#elif HAS(AVX2, interleaves)
#define interleaves_avx2 interleaves
#else
#define interleaves_generic interleaves
#endif
#if HAS(AVX512, tile_rows)
#define tile_rows_avx512 tile_rows
#elif HAS(AVX2, tile_rows)
#define tile_rows_avx2 tile_rows
#elif HAS(I8MM, tile_rows)
#define tile_rows_i8mm tile_rows
#else
#define tile_rows_generic tile_rows
#endif
#if HAS(AVX2, row_dot)
#define row_dot_avx2 row_dot
#elif HAS(I8MM, row_dot)
#define row_dot_i8mm row_dot
#elif HAS(NEON, row_dot)
#define row_dot_neon row_dot
#else
#define row_dot_generic row_dot
#endif
#if HAS(AVX2, swiglu_row)
#define swiglu_row_avx2 swiglu_row
#else
#define swiglu_row_generic swiglu_row
#endif
#if HAS(AVX2, halves_from_floats)
#define halves_from_floats_avx2 halves_from_floats
#elif HAS(NEON, halves_from_floats)
#define halves_from_floats_neon halves_from_floats
#else
#define halves_from_floats_generic halves_from_floats
#endif
#if HAS(AVX2, attend_item)
#define attend_item_avx2 attend_item
#elif HAS(NEON, attend_item)
#define attend_item_neon attend_item
#else
#define attend_item_generic attend_item
#endif
#if HAS(AVX2, attend_lanes)
#define attend_lanes_avx2 attend_lanes
#else
#define attend_lanes_generic attend_lanes
#endif
#if HAS(AVX2, attend_item_q8)
#define attend_item_q8_avx2 attend_item_q8
#elif HAS(NEON, attend_item_q8)
#define attend_item_q8_neon attend_item_q8
#else
#define attend_item_q8_generic attend_item_q8
#endif
#if HAS(AVX2, delta_step)
#define delta_step_avx2 delta_step
#else
#define delta_step_generic delta_step
#endif
