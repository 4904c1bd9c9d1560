/* Matrix products over GGUF's quantized weight blocks, on every core, for tinyserve's CPU path.
 *
 * Contract (see cpu.py, which compiles and loads this file):
 *   tq_linear(out, w, x, shape)  out[t][r] = sum_i W[r][i] * x[t][i] for t < tokens, r < rows, where
 *                                W's rows are stored as GGML blocks of `type` (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K),
 *                                or as parts of several (STACKED), and shape = {type, rows, cols, tokens} (int32).
 *   tq_norm_linear(out, w, x, norm, shape)          the same over rms_norm(x) * norm; shape[4] = eps's bits
 *   tq_residual_linear(out, w, x, residual, shape)  residual + the product
 *   tq_swiglu_linear(out, w, gate_up, residual, shape)  residual + W . (silu(gate) * up), x = gate | up
 *   tq_attend(out, qkv, cache, lanes, inv_freq, extras, shape)  a layer's attention from its qkv rows:
 *                                bias, q/k norm, RoPE, the new keys and values into the float16 KV cache,
 *                                then softmax attention over it (see the attention section)
 *   tq_embed(out, w, ids, shape) out[t] = W[ids[t]] dequantized; shape = {type, rows, cols, tokens}.
 *   tq_start(threads, spin_us)   sizes the thread pool; called once from Python before any product.
 *   tq_layer(out, x, w_qkv, w_o, w_gate_up, w_down, attn_norm, ffn_norm, cache, lanes, inv_freq, extras,
 *            shape)              a whole layer: those five in a row
 *   tq_forward(logits, tokens, lanes, picks, model, shape)  a whole step: embedding, every layer, the
 *                                final norm and the head, the model's tensors passed by address
 *   tq_repack(dst, src, shape)   a Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K matrix into the interleaved layout its products use
 * Fused this way, a step is one call (a layer five kernels where a matrix has no kernel) and nothing
 * runs on tinygrad's single thread between them.
 * out and x are float32, row-major; every argument arrives as a 64-bit word, as tinygrad's CPU worker
 * passes them to a program.
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TQ_AVX2 1
#else
#define TQ_AVX2 0
#endif

#include "tq.h"
#include "isa.h"
#include "fallback.h"
#include "formats.c"
#include "generic.c"
#if TQ_AVX2
#include "x86_avx2.c"
#include "x86_avx2_products.c"
#include "x86_avx2_attention.c"
#endif
#include "pool.c"
#include "linear.c"
#include "attention.c"
#include "step.c"

int tq_simd(void) { return TQ_AVX2; }
