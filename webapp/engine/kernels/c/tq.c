/* Matrix products over GGUF's quantized weight blocks, on every core, for tinyserve's CPU path.
 *
 * Contract: tq.h (cpu.py compiles this file, which includes the others: one translation unit, so the
 * compiler inlines across them). tq_linear and the fused linears multiply a matrix in its file's
 * blocks, tq_attend runs a layer's attention, tq_layer a whole layer (five of those in a row) and
 * tq_forward a whole step, the model's tensors passed by address. Fused this way, a step is one call
 * (a layer five kernels where a matrix has no kernel) and nothing runs on tinygrad's single thread
 * between them.
 *
 * The files: format_*.c (a block format each: its dequantization), formats.c (their table,
 * interleaved rows), isa.h (what depends on the instruction set), generic.c and x86_avx2*.c (its
 * portable and x86 versions, which every x86 rung of the ladder builds; fallback.h choosing, name by
 * name; x86_avx2_<format>.c a format's own products; x86_avx512*.c the AVX-512 rungs' own, x86_avx512_<format>.c a format's pair tile;
 * arm_neon*.c the ARM rungs'),
 * pool.c (the thread pool), linear.c (the products and the fused linears), attention.c (attention_q8.c: its
 * 8-bit KV cache rows), vision_encoder.c (a vision encoder's attention and gelu), float_gemm.c (its products), moe.c (a mixture of experts' feed-forward), mla.c (multi-head latent attention), gated_delta.c (Qwen3.5's recurrent
 * and gated attention layers), lora.c (LoRA adapters' low-rank products), step.c (a layer, a step) and abi.c (tq_abi).
 *
 * Why this shape: a decode step reads every weight once, so bytes decide its speed; keeping the file's
 * 4.5-bit blocks reads a third of what float16 copies did. Activations are quantized per 32 values to
 * int8 (a scale and the block's sum kept beside them), so every block pair is an integer dot product
 * (AVX2: 32 multiply-adds per maddubs) scaled once. A token's numbers depend on its own row of x only,
 * never on which other requests share the step. Rows are handed out in chunks from an atomic counter,
 * so a core busy with a web thread just takes fewer chunks, and the caller waits for rows, not threads.
 */
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "tq.h"

/* The build's rung (tq.h's ISA_*), from what the compiler targets: build.py's flags for a rung give
 * exactly its macros. TQ_AVX2: x86_avx2*.c are built, which every x86 rung runs; TQ_VNNI: their
 * integer dots take the 256-bit dpbusd (x86_avx2.c's dot_u8_add). */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TQ_AVX2 1
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define TQ_VNNI 1
#else
#define TQ_VNNI 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TQ_ISA (TQ_VNNI ? ISA_AVX512_VNNI : ISA_AVX512)
#else
#define TQ_ISA (TQ_VNNI ? ISA_AVX2_VNNI : ISA_AVX2)
#endif
#elif defined(__aarch64__) && defined(TQ_NEON_RUNG)
/* TQ_NEON: arm_neon*.c are built, which every ARM rung runs (an aarch64 compiler always targets NEON,
 * so build.py's flags for those rungs name it, TQ_NEON_RUNG, and the portable rung leaves it out);
 * their integer dots take sdot where the target has ARMv8.2's dot product (arm_neon.c's dot16).
 * TQ_I8MM: arm_neon_i8mm.c too, where it has ARMv8.6's int8 matrix multiply (smmla) */
#include <arm_neon.h>
#define TQ_AVX2 0
#define TQ_VNNI 0
#define TQ_NEON 1
#if defined(__ARM_FEATURE_MATMUL_INT8) && defined(__ARM_FEATURE_DOTPROD)
#define TQ_ISA ISA_NEON_I8MM
#define TQ_I8MM 1
#elif defined(__ARM_FEATURE_DOTPROD)
#define TQ_ISA ISA_NEON_DOTPROD
#else
#define TQ_ISA ISA_NEON
#endif
#else
#define TQ_AVX2 0
#define TQ_VNNI 0
#define TQ_ISA ISA_GENERIC
#endif
#ifndef TQ_NEON
#define TQ_NEON 0
#endif
#ifndef TQ_I8MM
#define TQ_I8MM 0
#endif
/* TQ_AVX512: x86_avx512*.c are built too (the AVX-512 rungs' own kernels, over AVX2's) */
#if TQ_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TQ_AVX512 1
#else
#define TQ_AVX512 0
#endif

#include "isa.h"
#include "fallback.h"
#include "format_32.c"
#include "format_k.c"
#include "format_iq4_table.c"
#include "format_iq4_xs.c"
#include "format_k_low.c"
#include "format_q5.c"
#include "format_iq4_nl.c"
#include "format_mxfp4.c"
#include "format_float.c"
#include "formats.c"
#include "generic.c"
#include "attention_q8.c"
#if TQ_AVX2
#include "x86_avx2.c"
#include "x86_avx2_iq4_xs.c"
#include "x86_avx2_k_low.c"
#include "x86_avx2_q5.c"
#include "x86_avx2_iq4_nl.c"
#include "x86_avx2_mxfp4.c"
#include "x86_avx2_products.c"
#include "x86_avx2_attention.c"
#include "x86_avx2_attention_lanes.c"
#include "x86_avx2_attention_q8.c"
#include "x86_avx2_delta.c"
#endif
#if TQ_NEON
#include "arm_neon.c"
#include "arm_neon_products.c"
#include "arm_neon_attention.c"
#endif
#if TQ_I8MM
#include "arm_neon_i8mm.c"
#endif
#if TQ_AVX512
#include "x86_avx512.c"
#include "x86_avx512_iq4.c"
#include "x86_avx512_q5.c"
#include "x86_avx512_mxfp4.c"
#include "x86_avx512_k_low.c"
#include "x86_avx512_products.c"
#endif
#include "pool.c"
#include "vectors.h"
#include "float_gemm.c"
#include "linear.c"
#include "attention.c"
#include "vision_encoder.c"
#include "shared_expert.c"
#include "moe.c"
#include "mla.c"
#include "gated_delta.c"
#include "lora.c"
#include "step.c"
#include "abi.c"

int tq_isa(void) { return TQ_ISA; }
