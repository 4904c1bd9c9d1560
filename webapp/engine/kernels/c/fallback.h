/* The portable version takes a name of isa.h wherever the build's ISA has no version of its own. */
#pragma once

#if TQ_AVX2
/* x86_avx2*.c define every name of isa.h */
#else
#define fp16_generic fp16
#define quantize_row_generic quantize_row
#define interleaves_generic interleaves
#define tile_rows_generic tile_rows
#define row_dot_generic row_dot
#define float_format_rows_generic float_format_rows
#define swiglu_row_generic swiglu_row
#define halves_from_floats_generic halves_from_floats
#define attend_item_generic attend_item
#define attend_lanes_generic attend_lanes
#define attend_item_q8_generic attend_item_q8
#define delta_step_generic delta_step
#endif
