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

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
/* Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K with eight rows' blocks side by side (see "interleaved rows" below): not GGUF
 * types, made from them at load by tq_repack */
enum { INTERLEAVED = 100, Q4_0x8 = INTERLEAVED + Q4_0, Q4_1x8 = INTERLEAVED + Q4_1, Q8_0x8 = INTERLEAVED + Q8_0, Q4_Kx8 = INTERLEAVED + Q4_K,
       Q5_Kx8 = INTERLEAVED + Q5_K,
       Q6_Kx8 = INTERLEAVED + Q6_K };
/* A matrix stacked by rows from parts of different types (a Q4_K_M layer's q and k in Q4_K over its v in
 * Q6_K), made at load by cpu.py: its bytes open with a stack_header (STACK_HEADER_BYTES), then each
 * part's blocks in turn, each in its own layout (interleaved or not). Products run a part at a time. */
enum { STACKED = 1000, MAX_PARTS = 7, STACK_HEADER_BYTES = 64 };
typedef struct {
  int32_t parts, types[MAX_PARTS], rows[MAX_PARTS], unused;
} stack_header;
_Static_assert(sizeof(stack_header) == STACK_HEADER_BYTES, "the header cpu.py writes");
enum { MAX_THREADS = 64, MAX_TOKEN_GROUP = 4 };
/* How far ahead of the block being multiplied the tiles prefetch the weights. From DRAM the hardware
 * prefetcher alone left a one-token step at 31 ms here; the next tile's rows (1.4 KB ahead for the
 * default model's small matrices) gave 18.6 ms and 4 KB ahead 16.3 ms (medians of 100 steps). */
enum { PREFETCH_BYTES = 4096 };

/* One quantized block of 32 activations: x[i] ~ d * q[i]; s = d * sum(q); sum16 = the sums of q over each half. */
typedef struct {
  float d, s;
  int16_t sum16[2];
  int8_t q[32];
} xblock;

static float fp16(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
#if TQ_AVX2
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, mant = h & 1023, bits;
  if (exp == 0) {
    float v = ldexpf((float)mant, -24);
    return sign ? -v : v;
  }
  bits = exp == 31 ? sign | 0x7f800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
  float f;
  memcpy(&f, &bits, 4);
  return f;
#endif
}

/* ---- block formats: bytes per block, values per block --------------------------------------- */

static int block_values(int type) {
  const int base = type % INTERLEAVED;
  return base == Q4_K || base == Q5_K || base == Q6_K ? 256 : 32;
}
static int block_bytes(int type) {
  switch (type % INTERLEAVED) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
  }
  return 0;
}

/* Q4_K packs eight 6-bit scales and mins into 12 bytes. */
static void q4k_scale_min(const uint8_t *s, int j, int *scale, int *min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

/* Dequantize one row of `cols` values (the reference the tests check the products against, and the
 * embedding lookup). */
static void dequantize_row(int type, const uint8_t *w, int cols, float *y) {
  const int bv = block_values(type), bb = block_bytes(type);
  for (int b = 0; b < cols / bv; b++, w += bb, y += bv) {
    if (type == Q4_0 || type == Q4_1) {
      const float d = fp16(w), m = type == Q4_1 ? fp16(w + 2) : -8.0f * d;
      const uint8_t *qs = w + (type == Q4_1 ? 4 : 2);
      for (int i = 0; i < 16; i++) {
        y[i] = d * (qs[i] & 15) + m;
        y[i + 16] = d * (qs[i] >> 4) + m;
      }
    } else if (type == Q8_0) {
      const float d = fp16(w);
      for (int i = 0; i < 32; i++) y[i] = d * (int8_t)w[2 + i];
    } else if (type == Q4_K || type == Q5_K) {
      /* Q5_K: Q4_K's scales, then 32 bytes whose bit j of byte i is value i of sub-block j's fifth bit */
      const float d = fp16(w), dmin = fp16(w + 2);
      const uint8_t *qh = w + 16, *qs = w + (type == Q5_K ? 48 : 16);
      for (int j = 0; j < 8; j += 2, qs += 32) {
        int sc0, m0, sc1, m1;
        q4k_scale_min(w + 4, j, &sc0, &m0);
        q4k_scale_min(w + 4, j + 1, &sc1, &m1);
        for (int i = 0; i < 32; i++) {
          const int h0 = type == Q5_K ? ((qh[i] >> j) & 1) << 4 : 0, h1 = type == Q5_K ? ((qh[i] >> (j + 1)) & 1) << 4 : 0;
          y[32 * j + i] = d * sc0 * ((qs[i] & 15) | h0) - dmin * m0;
          y[32 * j + 32 + i] = d * sc1 * ((qs[i] >> 4) | h1) - dmin * m1;
        }
      }
    } else if (type == Q6_K) {
      const uint8_t *ql = w, *qh = w + 128;
      const int8_t *sc = (const int8_t *)(w + 192);
      const float d = fp16(w + 208);
      for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8) {
        float *yh = y + 128 * half;
        for (int l = 0; l < 32; l++) {
          const int is = l / 16;
          yh[l] = d * sc[is] * (((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
          yh[l + 32] = d * sc[is + 2] * (((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
          yh[l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          yh[l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
    }
  }
}

/* ---- interleaved rows ------------------------------------------------------------------------ */
/* A matrix whose rows come in eights is stored with each group of eight rows' blocks side by side,
 * the same bytes in another order. A block's bytes are a few fields (its scale, its min, packed
 * sub-scales, quants); each field is laid out as the eight rows' pieces of `width` bytes in turn:
 * piece k of every row, then piece k + 1. For 32-value blocks: the eight rows' scales (float16), for
 * Q4_1 their eight mins, then slices of 32 bytes, slice k holding bytes 4k..4k+3 of each row's quant
 * bytes: four slices of nibbles, eight of Q8_0's bytes. A Q4 slice's low nibbles are values 4k..4k+3
 * of the eight rows, its high nibbles values 16+4k..19+4k. One load (masked and shifted) thus gives
 * 8 rows x 4 values, each row a lane of a register, which maddubs multiplies with 4 activations
 * broadcast to every lane. A block's 256 multiply-adds for eight rows then take eight maddubs and one
 * madd (Q8_0: eight of each), where a row at a time took eight of each and a horizontal sum per row;
 * and as a lane is a row, no horizontal sums at all. The K-quants' 256-value blocks follow the same
 * plan: Q4_K and Q5_K keep their 12 packed 6-bit scale bytes as twelve 8-byte rows (byte k of each
 * row's 12), so one 64-bit word unpacks a sub-block's scales or mins for all eight rows; their quants
 * (32 bytes per pair of sub-blocks: 2p in the low nibbles, 2p + 1 in the high) and Q5_K's fifth bits
 * (bit j of byte i: value i of sub-block j) come as 4-byte slices, as do Q6_K's low nibbles and high
 * pairs, with its sixteen int8 sub-scales as sixteen 8-byte rows. */

typedef struct {
  int from, bytes, width, to; /* its place in a row's block, its size, its pieces' size (1, 2 or 4), its place in the group */
} field;
typedef struct {
  int type, fields;
  field field[5];
} interleaving;

enum { Q4K_D = 0, Q4K_DMIN = 16, Q4K_SCALES = 32, Q4K_QUANTS = 128 };
enum { Q5K_HIGH = 128, Q5K_QUANTS = 128 + 256 };
enum { Q6K_D = 0, Q6K_SCALES = 16, Q6K_LOW = 144, Q6K_HIGH = 144 + 1024 };
static const interleaving INTERLEAVINGS[] = {
    {Q4_0, 2, {{0, 2, 2, 0}, {2, 16, 4, 16}}},
    {Q4_1, 3, {{0, 2, 2, 0}, {2, 2, 2, 16}, {4, 16, 4, 32}}},
    {Q8_0, 2, {{0, 2, 2, 0}, {2, 32, 4, 16}}},
    {Q4_K, 4, {{0, 2, 2, Q4K_D}, {2, 2, 2, Q4K_DMIN}, {4, 12, 1, Q4K_SCALES}, {16, 128, 4, Q4K_QUANTS}}},
    {Q5_K, 5, {{0, 2, 2, Q4K_D}, {2, 2, 2, Q4K_DMIN}, {4, 12, 1, Q4K_SCALES}, {16, 32, 4, Q5K_HIGH}, {48, 128, 4, Q5K_QUANTS}}},
    {Q6_K, 4, {{208, 2, 2, Q6K_D}, {192, 16, 1, Q6K_SCALES}, {0, 128, 4, Q6K_LOW}, {128, 64, 4, Q6K_HIGH}}},
};

static const interleaving *interleaving_of(int type) {
  for (size_t i = 0; i < sizeof INTERLEAVINGS / sizeof *INTERLEAVINGS; i++)
    if (INTERLEAVINGS[i].type == type % INTERLEAVED) return &INTERLEAVINGS[i];
  return 0;
}

/* Row `lane`'s block into its group's block (into_group: from a row's block to the group), or back. */
static void move_block(const interleaving *layout, const uint8_t *from, uint8_t *to, int lane, int into_group) {
  for (int f = 0; f < layout->fields; f++) {
    const field *x = &layout->field[f];
    for (int k = 0; k < x->bytes / x->width; k++) {
      const size_t in_group = x->to + 8 * x->width * k + x->width * lane, in_row = x->from + x->width * k;
      uint8_t *dst = to + (into_group ? in_group : in_row);
      const uint8_t *src = from + (into_group ? in_row : in_group);
      /* sizes the compiler knows: a load and a store each, not a call (loading took ~25% longer) */
      if (x->width == 4) memcpy(dst, src, 4);
      else if (x->width == 2) memcpy(dst, src, 2);
      else *dst = *src;
    }
  }
}

/* tq_repack(dst, src, shape): src's rows (shape = {type, rows, cols}) into the interleaved layout;
 * returns the type written: the interleaved one where the SIMD kernels have it and rows % 8 == 0, else
 * the same type (a plain copy). */
int tq_repack(uint8_t *dst, const uint8_t *src, const int32_t *shape) {
  const int type = shape[0], rows = shape[1], cols = shape[2], bb = block_bytes(type), nb = cols / block_values(type);
  /* a row is cols / block_values blocks: Q4_K and Q6_K hold 256 values a block, and counting 32 here
   * copied eight times each matrix's size, past both buffers' ends */
  const size_t row_bytes = (size_t)nb * bb;
  const interleaving *layout = interleaving_of(type);
  if (!TQ_AVX2 || !layout || rows % 8 != 0) {
    memcpy(dst, src, (size_t)rows * row_bytes);
    return type;
  }
  for (int g = 0; g < rows / 8; g++)
    for (int b = 0; b < nb; b++)
      for (int i = 0; i < 8; i++)
        move_block(layout, src + (size_t)(8 * g + i) * row_bytes + (size_t)b * bb, dst + ((size_t)g * nb + b) * 8 * bb, i, 1);
  return INTERLEAVED + type;
}

/* Row r of a matrix of `type` dequantized, whatever its layout. */
static void row_values(int type, const uint8_t *w, int r, int cols, float *y) {
  const size_t row_bytes = (size_t)cols / block_values(type) * block_bytes(type);
  if (type < INTERLEAVED) {
    dequantize_row(type, w + (size_t)r * row_bytes, cols, y);
    return;
  }
  const int bb = block_bytes(type), bv = block_values(type);
  const interleaving *layout = interleaving_of(type);
  const uint8_t *group = w + (size_t)(r / 8) * 8 * row_bytes;
  uint8_t own[256];
  for (int b = 0; b < cols / bv; b++, group += 8 * bb, y += bv) {
    move_block(layout, group, own, r % 8, 0);
    dequantize_row(type - INTERLEAVED, own, bv, y);
  }
}

/* ---- activations ---------------------------------------------------------------------------- */

static void quantize_row(const float *x, int cols, xblock *out) {
#if TQ_AVX2
  /* the same numbers 8 at a time: the max is exact in any order, and the conversion rounds to
     nearest even as lrintf does */
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < cols / 32; b++, x += 32, out++) {
    const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                               _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 scale = _mm256_set1_ps(inv);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, scale)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, scale));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, scale)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, scale));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)); /* lanes shuffled per 128 bits */
    _mm256_storeu_si256((__m256i *)out->q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    int sum[2];
    for (int half = 0; half < 2; half++) {
      const __m256i s8 = half ? _mm256_add_epi32(i2, i3) : _mm256_add_epi32(i0, i1);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      sum[half] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
    }
    out->d = d;
    out->s = d * (float)(sum[0] + sum[1]);
    out->sum16[0] = (int16_t)sum[0];
    out->sum16[1] = (int16_t)sum[1];
  }
#else
  for (int b = 0; b < cols / 32; b++, x += 32, out++) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int sum[2] = {0, 0};
    for (int i = 0; i < 32; i++) {
      const int q = (int)lrintf(x[i] * inv);
      out->q[i] = (int8_t)q;
      sum[i / 16] += q;
    }
    out->d = d;
    out->s = d * (float)(sum[0] + sum[1]);
    out->sum16[0] = (int16_t)sum[0];
    out->sum16[1] = (int16_t)sum[1];
  }
#endif
}

/* ---- one weight row against a group of tokens' activations ---------------------------------- */
/* acc[t] += W_row . x[t] for t < n; xs[t] points at token t's blocks (cols / 32 of them). */

#if TQ_AVX2
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* 32 unsigned weights (0..127) times 32 signed activations, as 8 int32 partial sums */
static inline __m256i dot_u8(__m256i w, __m256i x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)); }
/* signed times signed: move w's sign onto x */
static inline __m256i dot_s8(__m256i w, __m256i x) { return dot_u8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
static inline __m256i nibbles(const uint8_t *qs) {  /* 16 bytes -> 32 values: low nibbles first, then high */
  const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}
static inline __m256i xq(const xblock *x) { return _mm256_loadu_si256((const __m256i *)x->q); }

/* e^x for 8 floats with x <= 0 (softmax after subtracting the maximum): x = n ln2 + r, |r| <= ln2/2,
 * e^r by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n put in the exponent bits. */
static inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

#endif

#if TQ_AVX2
/* A tile of R weight rows times N tokens for the 32-value formats (Q4_0, Q4_1, Q8_0): each weight
 * block is unpacked once for N tokens and each activation block loaded once for R rows, with R*N
 * independent accumulators in registers. R and N are constants in every instance below. */
static inline __attribute__((always_inline)) void tile32(int type, const uint8_t *w, size_t row_bytes, int R, const xblock *const *xs, int N, int nb,
                                                         float *out, size_t out_stride) {
  const int bb = block_bytes(type);
  __m256 acc[4][4];
  float extra[4][4];
  for (int r = 0; r < R; r++)
    for (int t = 0; t < N; t++) acc[r][t] = _mm256_setzero_ps(), extra[r][t] = 0.0f;
  for (int b = 0; b < nb; b++) {
    __m256i q[4];
    __m256 dw[4];
    float m[4];
    for (int r = 0; r < R; r++) {
      const uint8_t *blk = w + r * row_bytes + (size_t)b * bb;
      /* the rows of the tiles after this one follow it: fetch them while this one computes */
      _mm_prefetch((const char *)(blk + PREFETCH_BYTES), _MM_HINT_T0);
      const float d = fp16(blk);
      dw[r] = _mm256_set1_ps(d);
      if (type == Q8_0) {
        q[r] = _mm256_loadu_si256((const __m256i *)(blk + 2));
      } else {
        q[r] = nibbles(blk + (type == Q4_1 ? 4 : 2));
        m[r] = type == Q4_1 ? fp16(blk + 2) : -8.0f * d;
      }
    }
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      const __m256i xv = xq(x);
      const __m256 dx = _mm256_broadcast_ss(&x->d);
      for (int r = 0; r < R; r++) {
        const __m256i dot = type == Q8_0 ? dot_s8(q[r], xv) : dot_u8(q[r], xv);
        acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(dw[r], dx), _mm256_cvtepi32_ps(dot), acc[r][t]);
        if (type != Q8_0) extra[r][t] += m[r] * x->s;
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int t = 0; t < N; t++) out[t * out_stride + r] = hsum(acc[r][t]) + extra[r][t];
}

#define TILE32(R, N)                                                                                                                   \
  static void tile32_##R##x##N(int type, const uint8_t *w, size_t rb, const xblock *const *xs, int nb, float *out, size_t stride) { \
    if (type == Q8_0) tile32(Q8_0, w, rb, R, xs, N, nb, out, stride);                                                                \
    else if (type == Q4_1) tile32(Q4_1, w, rb, R, xs, N, nb, out, stride);                                                           \
    else tile32(Q4_0, w, rb, R, xs, N, nb, out, stride);                                                                             \
  }
TILE32(4, 1) TILE32(2, 2) TILE32(2, 3) TILE32(2, 4) TILE32(1, 1) TILE32(1, 2) TILE32(1, 3) TILE32(1, 4)
typedef void (*tile_fn)(int, const uint8_t *, size_t, const xblock *const *, int, float *, size_t);

/* Eight interleaved rows (one group) times N tokens: out[t * out_stride + i] for row i of the group.
 * The unpacked quants are shared by the N tokens; a token's 32 activations enter four at a time,
 * broadcast. A block's eight maddubs results add up within int16: each lane is at most 2 * 15 * 127 in
 * size, eight of them 30,480. */
static inline __attribute__((always_inline)) void tile_x8(int type, const uint8_t *g, const xblock *const *xs, int N, int nb, float *out,
                                                          size_t out_stride) {
  const int hdr = type == Q4_1x8 ? 4 : 2, group_bytes = 8 * block_bytes(type); /* scale (and min) per row */
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++, g += group_bytes) {
    for (int ahead = 0; ahead < group_bytes; ahead += 64) _mm_prefetch((const char *)(g + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    const __m256 m = hdr == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16))) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    __m256i q[8];
    for (int k = 0; k < 4; k++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i *)(g + 8 * hdr + 32 * k));
      q[k] = _mm256_and_si256(raw, low);
      q[4 + k] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      int32_t four[8];
      memcpy(four, x->q, 32);
      __m256i sum = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(four[0]));
      for (int k = 1; k < 8; k++) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(q[k], _mm256_set1_epi32(four[k])));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&x->d)), dot, acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(&x->s), acc[t]);
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

/* The same for Q8_0's signed quants: maddubs takes one unsigned operand, so the activations take the
 * weights' signs (|w| <= 128 then); a slice's pair sums reach 2 * 128 * 127, so each is widened to
 * int32 on its own. */
static inline __attribute__((always_inline)) void tile_x8_q8(const uint8_t *g, const xblock *const *xs, int N, int nb, float *out, size_t out_stride) {
  const int group_bytes = 8 * 34;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++, g += group_bytes) {
    for (int ahead = 0; ahead < group_bytes; ahead += 64) _mm_prefetch((const char *)(g + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    __m256i q[8], magnitude[8];
    for (int k = 0; k < 8; k++) {
      q[k] = _mm256_loadu_si256((const __m256i *)(g + 16 + 32 * k));
      magnitude[k] = _mm256_sign_epi8(q[k], q[k]);
    }
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      int32_t four[8];
      memcpy(four, x->q, 32);
      __m256i sum = _mm256_setzero_si256();
      for (int k = 0; k < 8; k++) {
        const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(four[k]), q[k]);
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[k], signed_x), ones));
      }
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(sum), acc[t]);
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

/* Q4_Kx8 times N tokens: per 256-value block and pair of sub-blocks, the low nibbles of eight slices
 * against sub-block 2p's activations and the high nibbles against 2p + 1's, as tile_x8 does with a
 * Q4_0 block; each sub-block's product scaled by the eight rows' d * scale, less their dmin * min times
 * the activations' sum. `nb` counts 32-value blocks, as for the other tiles. */
static inline __attribute__((always_inline)) void tile_q4_k_x8(const uint8_t *g, const xblock *const *xs, int N, int nb, float *out,
                                                               size_t out_stride, const int five) {
  const int block_bytes = five ? 8 * 176 : 8 * 144, quants = five ? Q5K_QUANTS : Q4K_QUANTS;
  const __m256i low = _mm256_set1_epi8(15), bit = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nb / 8; sb++, g += block_bytes) {
    for (int ahead = 0; ahead < block_bytes; ahead += 64) _mm_prefetch((const char *)(g + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + Q4K_D)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + Q4K_DMIN)));
    uint64_t packed[12], scale[8], min[8];
    memcpy(packed, g + Q4K_SCALES, sizeof packed);
    const uint64_t six = 0x3f3f3f3f3f3f3f3fULL, four = 0x0f0f0f0f0f0f0f0fULL, two = 0x0303030303030303ULL;
    for (int j = 0; j < 4; j++) { /* q4k_scale_min, eight rows a word */
      scale[j] = packed[j] & six;
      min[j] = packed[j + 4] & six;
      scale[j + 4] = (packed[j + 8] & four) | (((packed[j] >> 6) & two) << 4);
      min[j + 4] = ((packed[j + 8] >> 4) & four) | (((packed[j + 4] >> 6) & two) << 4);
    }
    for (int j = 0; j < 8; j++) {
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scale[j])));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)min[j])));
      const __m256 row_scale = _mm256_mul_ps(d, sc), row_min = _mm256_mul_ps(dmin, mn);
      const uint8_t *slices = g + quants + 256 * (j / 2);
      __m256i q[8];
      for (int k = 0; k < 8; k++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(slices + 32 * k));
        q[k] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, low);
        if (five) { /* bit j of each fifth-bit byte, to bit 4 */
          const __m256i high = _mm256_loadu_si256((const __m256i *)(g + Q5K_HIGH + 32 * k));
          q[k] = _mm256_or_si256(q[k], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, j), bit), 4));
        }
      }
      for (int t = 0; t < N; t++) {
        const xblock *x = &xs[t][8 * sb + j];
        int32_t fours[8];
        memcpy(fours, x->q, 32);
        __m256i dots;
        if (five) { /* values to 31: four maddubs (at most 2 * 31 * 127 each) fill an int16 lane */
          __m256i half[2];
          for (int part = 0; part < 2; part++) {
            __m256i sum = _mm256_maddubs_epi16(q[4 * part], _mm256_set1_epi32(fours[4 * part]));
            for (int k = 1; k < 4; k++) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(q[4 * part + k], _mm256_set1_epi32(fours[4 * part + k])));
            half[part] = _mm256_madd_epi16(sum, ones);
          }
          dots = _mm256_add_epi32(half[0], half[1]);
        } else {
          __m256i sum = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(fours[0]));
          for (int k = 1; k < 8; k++) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(q[k], _mm256_set1_epi32(fours[k])));
          dots = _mm256_madd_epi16(sum, ones);
        }
        const __m256 dot = _mm256_cvtepi32_ps(dots);
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(row_scale, _mm256_broadcast_ss(&x->d)), dot, acc[t]);
        acc[t] = _mm256_fnmadd_ps(row_min, _mm256_broadcast_ss(&x->s), acc[t]);
      }
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

/* Q6_Kx8 times N tokens. Activation block c = 4h + k of a 256-value block (h the half, k 0..3) takes
 * its 6-bit values from ql slices 16h + 8(k & 1) + m (nibble k >> 1) and qh slices 8h + m (bits 2k,
 * 2k + 1), m = 0..7 for its values 4m..4m+3; its first 16 values share sub-scale 8h + 2k, the last 16
 * the next one. Values are stored plus 32: a sub-block's dot is sum(q * x) - 32 * sum(x), the latter
 * from the activations' half sums. Two maddubs (each at most 2 * 63 * 127) still fit an int16 lane. */
static inline __attribute__((always_inline)) void tile_q6_k_x8(const uint8_t *g, const xblock *const *xs, int N, int nb, float *out,
                                                               size_t out_stride) {
  const __m256i low = _mm256_set1_epi8(15), pair = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nb / 8; sb++, g += 8 * 210) {
    for (int ahead = 0; ahead < 8 * 210; ahead += 64) _mm_prefetch((const char *)(g + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + Q6K_D)));
    for (int c = 0; c < 8; c++) {
      const int h = c / 4, k = c % 4;
      const __m256i scale_a = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + Q6K_SCALES + 8 * (8 * h + 2 * k))));
      const __m256i scale_b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + Q6K_SCALES + 8 * (8 * h + 2 * k + 1))));
      const uint8_t *ql = g + Q6K_LOW + 32 * (16 * h + 8 * (k & 1)), *qh = g + Q6K_HIGH + 32 * (8 * h);
      __m256i q[8];
      for (int m = 0; m < 8; m++) {
        const __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 32 * m)), hi = _mm256_loadu_si256((const __m256i *)(qh + 32 * m));
        const __m256i nibble = _mm256_and_si256(k >> 1 ? _mm256_srli_epi16(l, 4) : l, low);
        const __m256i top = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * k), pair);
        q[m] = _mm256_or_si256(nibble, _mm256_slli_epi16(top, 4));
      }
      for (int t = 0; t < N; t++) {
        const xblock *x = &xs[t][8 * sb + c];
        int32_t fours[8];
        memcpy(fours, x->q, 32);
        __m256i half_dot[2];
        for (int part = 0; part < 2; part++) {
          const int m = 4 * part;
          const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(q[m], _mm256_set1_epi32(fours[m])),
                                              _mm256_maddubs_epi16(q[m + 1], _mm256_set1_epi32(fours[m + 1])));
          const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(q[m + 2], _mm256_set1_epi32(fours[m + 2])),
                                              _mm256_maddubs_epi16(q[m + 3], _mm256_set1_epi32(fours[m + 3])));
          const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
          half_dot[part] = _mm256_sub_epi32(dot, _mm256_set1_epi32(32 * x->sum16[part]));
        }
        const __m256i scaled = _mm256_add_epi32(_mm256_mullo_epi32(half_dot[0], scale_a), _mm256_mullo_epi32(half_dot[1], scale_b));
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(scaled), acc[t]);
      }
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

#define TILE_X8(N)                                                                                                           \
  static void tile_x8_##N(int type, const uint8_t *g, const xblock *const *xs, int nb, float *out, size_t stride) {         \
    if (type == Q8_0x8) tile_x8_q8(g, xs, N, nb, out, stride);                                                              \
    else if (type == Q4_Kx8) tile_q4_k_x8(g, xs, N, nb, out, stride, 0);                                                    \
    else if (type == Q5_Kx8) tile_q4_k_x8(g, xs, N, nb, out, stride, 1);                                                    \
    else if (type == Q6_Kx8) tile_q6_k_x8(g, xs, N, nb, out, stride);                                                       \
    else if (type == Q4_1x8) tile_x8(Q4_1x8, g, xs, N, nb, out, stride);                                                    \
    else tile_x8(Q4_0x8, g, xs, N, nb, out, stride);                                                                        \
  }
TILE_X8(1) TILE_X8(2) TILE_X8(3) TILE_X8(4)
typedef void (*group_fn)(int, const uint8_t *, const xblock *const *, int, float *, size_t);
#endif

/* The portable product: the same integer products one value at a time, from dequantized blocks; the
 * SIMD build's path for a type without a row kernel of its own (Q5_K, whose rows come in eights in
 * real files and so are interleaved) */
static void row_dot_dequantized(int type, const uint8_t *w, int cols, const xblock *const *xs, int n, float *acc) {
  float row[256];
  const int bv = block_values(type), bb = block_bytes(type);
  for (int b = 0; b < cols / bv; b++, w += bb) {
    dequantize_row(type, w, bv, row);
    for (int t = 0; t < n; t++) {
      float s = 0.0f;
      for (int i = 0; i < bv; i++) s += row[i] * xs[t][b * bv / 32 + i / 32].q[i % 32] * xs[t][b * bv / 32 + i / 32].d;
      acc[t] += s;
    }
  }
}

static void row_dot(int type, const uint8_t *w, int cols, const xblock *const *xs, int n, float *acc) {
  const int nb = cols / 32;
  if (!TQ_AVX2 || type == Q5_K) {
    row_dot_dequantized(type, w, cols, xs, n, acc);
    return;
  }
#if TQ_AVX2
  const size_t row_bytes = (size_t)cols / block_values(type) * block_bytes(type);
  for (size_t off = 0; off < row_bytes; off += 64) _mm_prefetch((const char *)(w + row_bytes + off), _MM_HINT_T0); /* the next row */
  __m256 sum[MAX_TOKEN_GROUP];
  float extra[MAX_TOKEN_GROUP] = {0};
  for (int t = 0; t < n; t++) sum[t] = _mm256_setzero_ps();
  if (type == Q4_0 || type == Q4_1 || type == Q8_0) {
    const int bb = block_bytes(type);
    for (int b = 0; b < nb; b++, w += bb) {
      const float d = fp16(w);
      if (type == Q8_0) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2));
        for (int t = 0; t < n; t++)
          sum[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs[t][b].d), _mm256_cvtepi32_ps(dot_s8(q, xq(&xs[t][b]))), sum[t]);
      } else {
        /* value = d*q + m with q in 0..15 (Q4_0: m = -8d): dot = d*dx*sum(q*xq) + m*dx*sum(xq) */
        const float m = type == Q4_1 ? fp16(w + 2) : -8.0f * d;
        const __m256i q = nibbles(w + (type == Q4_1 ? 4 : 2));
        for (int t = 0; t < n; t++) {
          const xblock *x = &xs[t][b];
          sum[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(dot_u8(q, xq(x))), sum[t]);
          extra[t] += m * x->d * (x->sum16[0] + x->sum16[1]);
        }
      }
    }
  } else if (type == Q4_K) {
    for (int sb = 0; sb < nb / 8; sb++, w += 144) {
      const float d = fp16(w), dmin = fp16(w + 2);
      const uint8_t *qs = w + 16;
      for (int j = 0; j < 8; j += 2, qs += 32) {
        int sc0, m0, sc1, m1;
        q4k_scale_min(w + 4, j, &sc0, &m0);
        q4k_scale_min(w + 4, j + 1, &sc1, &m1);
        const __m256 ds0 = _mm256_set1_ps(d * sc0), ds1 = _mm256_set1_ps(d * sc1);
        const float dm0 = dmin * m0, dm1 = dmin * m1;
        const __m256i raw = _mm256_loadu_si256((const __m256i *)qs), mask = _mm256_set1_epi8(15);
        const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        for (int t = 0; t < n; t++) {
          const xblock *x0 = &xs[t][8 * sb + j], *x1 = x0 + 1;
          sum[t] = _mm256_fmadd_ps(_mm256_mul_ps(ds0, _mm256_broadcast_ss(&x0->d)), _mm256_cvtepi32_ps(dot_u8(lo, xq(x0))), sum[t]);
          sum[t] = _mm256_fmadd_ps(_mm256_mul_ps(ds1, _mm256_broadcast_ss(&x1->d)), _mm256_cvtepi32_ps(dot_u8(hi, xq(x1))), sum[t]);
          extra[t] -= dm0 * x0->s + dm1 * x1->s;
        }
      }
    }
  } else if (type == Q6_K) {
    const __m256i mask4 = _mm256_set1_epi8(15), mask2 = _mm256_set1_epi8(3);
    for (int sb = 0; sb < nb / 8; sb++, w += 210) {
      const uint8_t *ql = w, *qh = w + 128;
      const int8_t *sc = (const int8_t *)(w + 192);
      const float d = fp16(w + 208);
      for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
        /* the four 32-value sub-blocks of this half, 6-bit values 0..63 (stored minus 32) */
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, mask4), _mm256_slli_epi16(_mm256_and_si256(h, mask2), 4)),
            _mm256_or_si256(_mm256_and_si256(l1, mask4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), mask2), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), mask4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), mask2), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), mask4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), mask2), 4)),
        };
        for (int k = 0; k < 4; k++) {
          const int s0 = sc[2 * k], s1 = sc[2 * k + 1];
          /* int16 lanes 0-7 hold the first 16 values' pair sums, lanes 8-15 the second 16's */
          const __m256i scales = _mm256_set_m128i(_mm_set1_epi16((short)s1), _mm_set1_epi16((short)s0));
          const __m256 dv = _mm256_set1_ps(d);
          for (int t = 0; t < n; t++) {
            const xblock *x = &xs[t][8 * sb + 4 * half + k];
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], xq(x)), scales);
            sum[t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(dot), sum[t]);
            extra[t] -= 32.0f * d * x->d * (float)(s0 * x->sum16[0] + s1 * x->sum16[1]);
          }
        }
      }
    }
  }
  for (int t = 0; t < n; t++) acc[t] += hsum(sum[t]) + extra[t];
#else
  (void)nb;
#endif
}

/* ---- the thread pool ------------------------------------------------------------------------ */
/* One job at a time. The caller publishes it, takes row chunks itself like any worker, and waits
 * only until every row is done: a worker that the OS has not scheduled yet (another process, a web
 * thread) holds nothing up, since it has claimed nothing. Claims go through one 64-bit counter that
 * carries the job's generation beside the next row, so a worker that wakes late can never claim rows
 * of a newer job with an older job's fields. Idle workers spin for `spin_ns` (a decode step calls
 * ~120 products microseconds apart) before sleeping on the condition variable. */

typedef struct {
  int type, rows, cols, tokens;
  size_t stride; /* floats from one token's output row to the next: rows, or a stacked matrix's rows */
  float *out;
  const uint8_t *w;
  const xblock *x;
  const float *residual; /* (tokens, rows) added to the product, or null */
} linear_t;

/* A job: run(ctx, first, last) over items [0, items), handed out `chunk` at a time. */
typedef struct {
  void (*run)(const void *ctx, int first, int last);
  const void *ctx;
  int items, chunk;
} job_t;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER, job_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int n_workers, started;
static long spin_ns = 100000;
static job_t jobs[2];            /* the current job and the one before, indexed by generation */
static unsigned generation;      /* bumped to publish a job */
static uint64_t claim;           /* generation << 32 | next unclaimed row */
static int items_done;

static long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

static void run_rows(const void *ctx, int first, int last) {
  const linear_t *j = ctx;
  const int nb = j->cols / 32;
  const size_t row_bytes = (size_t)j->cols / block_values(j->type) * block_bytes(j->type);
#if TQ_AVX2
  const int tiled = j->type == Q4_0 || j->type == Q4_1 || j->type == Q8_0;
#endif
  for (int t0 = 0; t0 < j->tokens; t0 += MAX_TOKEN_GROUP) {
    const int n = j->tokens - t0 < MAX_TOKEN_GROUP ? j->tokens - t0 : MAX_TOKEN_GROUP;
    const xblock *xs[MAX_TOKEN_GROUP];
    for (int t = 0; t < n; t++) xs[t] = j->x + (size_t)(t0 + t) * nb;
    float *out = j->out + (size_t)t0 * j->stride;
    int r = first;
#if TQ_AVX2
    if (j->type > INTERLEAVED) { /* first and last are multiples of 8: chunks are of 16 rows */
      static const group_fn groups[5] = {0, tile_x8_1, tile_x8_2, tile_x8_3, tile_x8_4};
      for (; r < last; r += 8) groups[n](j->type, j->w + r * row_bytes, xs, nb, out + r, j->stride);
    }
    if (tiled) {
      static const tile_fn wide[5] = {0, tile32_4x1, tile32_2x2, tile32_2x3, tile32_2x4};
      static const tile_fn narrow[5] = {0, tile32_1x1, tile32_1x2, tile32_1x3, tile32_1x4};
      const int step = n == 1 ? 4 : 2;
      for (; r + step <= last; r += step) wide[n](j->type, j->w + r * row_bytes, row_bytes, xs, nb, out + r, j->stride);
      for (; r < last; r++) narrow[n](j->type, j->w + r * row_bytes, row_bytes, xs, nb, out + r, j->stride);
    }
#endif
    for (; r < last; r++) {
      float acc[MAX_TOKEN_GROUP] = {0};
      row_dot(j->type, j->w + (size_t)r * row_bytes, j->cols, xs, n, acc);
      for (int t = 0; t < n; t++) out[(size_t)t * j->stride + r] = acc[t];
    }
    if (j->residual)
      for (int t = 0; t < n; t++) {
        const float *add = j->residual + (size_t)(t0 + t) * j->stride;
        float *o = out + (size_t)t * j->stride;
        for (r = first; r < last; r++) o[r] += add[r];
      }
  }
}

/* Claim and run chunks of generation g's job until none is left (or a newer job was published). */
static void take_items(unsigned g) {
  const job_t j = jobs[g & 1];
  for (;;) {
    uint64_t c = __atomic_load_n(&claim, __ATOMIC_ACQUIRE);
    const int first = (int)(c & 0xffffffffu);
    if ((unsigned)(c >> 32) != g || first >= j.items) return;
    const int last = first + j.chunk < j.items ? first + j.chunk : j.items;
    if (!__atomic_compare_exchange_n(&claim, &c, ((uint64_t)g << 32) | (uint64_t)last, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
    j.run(j.ctx, first, last);
    __atomic_fetch_add(&items_done, last - first, __ATOMIC_RELEASE);
  }
}

static void *worker(void *unused) {
  (void)unused;
  unsigned seen = 0;
  for (;;) {
    unsigned g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
    if (g == seen) {
      const long until = now_ns() + spin_ns;
      for (int i = 0; g == seen; i++) {
        relax();
        g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        if ((i & 255) == 255 && now_ns() > until) break;
      }
      if (g == seen) {
        pthread_mutex_lock(&pool_lock);
        while ((g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE)) == seen) pthread_cond_wait(&wake, &pool_lock);
        pthread_mutex_unlock(&pool_lock);
      }
    }
    seen = g;
    take_items(g);
  }
  return 0;
}

void tq_start(long threads, long spin_us) {
  pthread_mutex_lock(&job_lock);
  if (!started) {
    started = 1;
    spin_ns = spin_us * 1000;
    for (long i = 1; i < threads && i < MAX_THREADS; i++) {
      pthread_t tid;
      if (pthread_create(&tid, 0, worker, 0) != 0) break;
      pthread_detach(tid);
      n_workers++;
    }
  }
  pthread_mutex_unlock(&job_lock);
}

static void run_job(const job_t *j) {
  pthread_mutex_lock(&job_lock); /* jobs from two tinygrad devices would otherwise share the pool */
  const unsigned g = generation + 1;
  jobs[g & 1] = *j;
  __atomic_store_n(&items_done, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&claim, (uint64_t)g << 32, __ATOMIC_RELEASE);
  pthread_mutex_lock(&pool_lock);
  __atomic_store_n(&generation, g, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&wake);
  pthread_mutex_unlock(&pool_lock);
  take_items(g);
  while (__atomic_load_n(&items_done, __ATOMIC_ACQUIRE) < j->items) relax();
  pthread_mutex_unlock(&job_lock);
}

/* ---- entry points --------------------------------------------------------------------------- */

/* A thread's buffer, grown when a call needs more and reused after. */
typedef struct {
  void *data;
  size_t bytes;
} scratch_t;

static void *at_least(scratch_t *s, size_t bytes) {
  if (bytes > s->bytes) {
    free(s->data);
    s->data = malloc(bytes);
    s->bytes = bytes;
  }
  return s->data;
}

/* the activations' int8 blocks; one row of transformed activations, or attention's queries; a layer's intermediates */
static __thread scratch_t int8_activations, float_rows, layer_intermediates, attend_partials;

/* How a token's row of x becomes the product's input, before quantizing. */
enum { AS_IS, RMS_NORM, SWIGLU };

static float int_bits_float(int32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* sums[r] = x[r * n + 0]^2 + ... + x[r * n + n - 1]^2 for `rows` rows, each one float sum in order
 * by fused multiply-adds (as `sum += x[i] * x[i]` compiles here), eight rows' chains interleaved: one
 * row's chain of n dependent steps took ~1 us for 576 values, eight rows ~6 us of each norm of a B=8
 * step; interleaved, they take about one row's time, with every sum bit for bit what it was. */
static void square_sums(const float *x, int rows, int n, float *sums) {
  for (int r0 = 0; r0 < rows; r0 += 8) {
    const int g = rows - r0 < 8 ? rows - r0 : 8;
    float s[8] = {0};
    for (int i = 0; i < n; i++)
      for (int t = 0; t < g; t++) s[t] = fmaf(x[(size_t)(r0 + t) * n + i], x[(size_t)(r0 + t) * n + i], s[t]);
    memcpy(sums + r0, s, g * sizeof(float));
  }
}

/* y = x / sqrt(sum / n + eps) * weight, sum being x's square_sums */
static void rms_scale_row(const float *x, float sum, const float *weight, int n, float eps, float *y) {
  const float inv = 1.0f / sqrtf(sum / n + eps);
  for (int i = 0; i < n; i++) y[i] = x[i] * inv * weight[i];
}

/* y = x / sqrt(mean(x^2) + eps) * weight */
static void rms_norm_row(const float *x, const float *weight, int n, float eps, float *y) {
  float sum;
  square_sums(x, 1, n, &sum);
  rms_scale_row(x, sum, weight, n, eps, y);
}

/* y = silu(gate) * up = gate * sigmoid(gate) * up; on the calling thread, so vectorized: the sigmoid
 * from e = exp(-|gate|) as 1 / (1 + e) or e / (1 + e), by the sign (no overflow either way). */
static void swiglu_row(const float *gate, const float *up, int n, float *y) {
  int i = 0;
#if TQ_AVX2
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign)); /* exp(-|g|) */
    const __m256 numerator = _mm256_blendv_ps(one, e, g);     /* e where g is negative */
    const __m256 sigmoid = _mm256_div_ps(numerator, _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; i++) y[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* One matrix's product over the pool: out[t * stride + r] = [residual[t * stride + r] +] W[r] . x[t]. */
static void product(int type, int rows, int cols, int tokens, size_t stride, float *out, const uint8_t *w, const xblock *xq8, const float *residual) {
  /* ~8 chunks a thread balances load without making the counter hot */
  int chunk = rows / (8 * (n_workers + 1));
  chunk = chunk < 16 ? 16 : chunk - chunk % 16;
  const linear_t lin = {type, rows, cols, tokens, stride, out, w, xq8, residual};
  const job_t j = {run_rows, &lin, rows, chunk};
  run_job(&j);
}

/* out (tokens, rows) = [residual +] W . f(x) with f one of AS_IS, RMS_NORM (by `norm`, eps) or
 * SWIGLU (x holds gate then up, 2 * cols per token: silu(gate) * up). */
static void linear(float *out, const uint8_t *w, const float *x, const int32_t *shape, int input, const float *norm, const float *residual) {
  const int type = shape[0], rows = shape[1], cols = shape[2], tokens = shape[3];
  xblock *xq8 = at_least(&int8_activations, (size_t)tokens * (cols / 32) * sizeof(xblock));
  float *row = input == AS_IS ? 0 : at_least(&float_rows, ((size_t)cols + tokens) * sizeof(float)), *sums = row + cols;
  if (input == RMS_NORM) square_sums(x, tokens, cols, sums);
  for (int t = 0; t < tokens; t++) {
    const float *in = x + (size_t)t * cols;
    if (input == RMS_NORM) {
      rms_scale_row(in, sums[t], norm, cols, int_bits_float(shape[4]), row);
      in = row;
    } else if (input == SWIGLU) {
      const float *gate = x + (size_t)t * 2 * cols, *up = gate + cols;
      swiglu_row(gate, up, cols, row);
      in = row;
    }
    quantize_row(in, cols, xq8 + (size_t)t * (cols / 32));
  }
  if (type != STACKED) {
    product(type, rows, cols, tokens, rows, out, w, xq8, residual);
    return;
  }
  /* a part at a time, each into its rows of every token's output, from the same int8 activations */
  const stack_header *header = (const stack_header *)w;
  const uint8_t *part = w + STACK_HEADER_BYTES;
  for (int p = 0, first = 0; p < header->parts; first += header->rows[p], p++) {
    product(header->types[p], header->rows[p], cols, tokens, rows, out + first, part, xq8, residual ? residual + first : 0);
    part += (size_t)header->rows[p] * (cols / block_values(header->types[p])) * block_bytes(header->types[p]);
  }
}

void tq_linear(float *out, const uint8_t *w, const float *x, const int32_t *shape) { linear(out, w, x, shape, AS_IS, 0, 0); }
/* shape[4] holds eps's float bits */
void tq_norm_linear(float *out, const uint8_t *w, const float *x, const float *norm, const int32_t *shape) {
  linear(out, w, x, shape, RMS_NORM, norm, 0);
}
void tq_residual_linear(float *out, const uint8_t *w, const float *x, const float *residual, const int32_t *shape) {
  linear(out, w, x, shape, AS_IS, 0, residual);
}
void tq_swiglu_linear(float *out, const uint8_t *w, const float *gate_up, const float *residual, const int32_t *shape) {
  linear(out, w, gate_up, shape, SWIGLU, 0, residual);
}

/* ---- attention ------------------------------------------------------------------------------ */
/* tq_attend(out, qkv, cache, lanes, inv_freq, extras, shape) runs a layer's attention for B lanes (a
 * decode step's sequences, or a prefill piece's tokens, each a lane of the same slot), from the qkv
 * product's rows (B, (H + 2 KvH) Hd) float32 to out (B, H Hd) float32:
 *   1. on the calling thread, per lane: add the bias, rms-normalize each q and k head (qwen3), rotate
 *      q and k by RoPE at the lane's position (half-split pairs, angle = pos * inv_freq[i]), and write
 *      k and v as float16 at that position of the lane's slot in the KV cache (2, slots, KvH,
 *      positions, Hd);
 *   2. over the pool: softmax(q . K[0..pos] / sqrt(Hd)) . V[0..pos] for every (lane, query head),
 *      reading the cache in place, in chunks of KEY_CHUNK keys; an item is a chunk of keys for a
 *      lane's query heads that share a kv head (up to MAX_SHARED_HEADS of them), or for a single head
 *      when that leaves a thread fewer than two items. Each chunk keeps its own max, sum and
 *      unnormalized output; 3. the calling thread combines a lane's chunks in order. The chunks are
 *      fixed by position alone, so a lane's numbers never depend on the other lanes, and one long
 *      sequence spreads over every core (a single lane at position 1,000 had 3 items for 2 threads,
 *      each streaming a whole kv head).
 * shape = {B, H, KvH, slots, positions, Hd, flags, eps bits}; lanes = {slot_0.., pos_0..}; extras holds
 * the qkv bias (flag 1), then the q and k norm weights (flag 2). Writing and reading in one kernel
 * keeps their order inside it, where tinygrad cannot reorder them. */
enum { HAS_BIAS = 1, HAS_QK_NORM = 2, MAX_HEAD_DIM = 512, MAX_SHARED_HEADS = 3, KEY_CHUNK = 256 };

/* float32 -> float16, rounding to nearest even as a hardware or compiler conversion does, so a key
 * written here equals the same key written by tinygrad's cast during prefill. */
static uint16_t half_from_float(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | 0x7c00 | (x > 0x7f800000u ? 0x200 : 0); /* inf, nan */
  if (x >= 0x477ff000u) return sign | 0x7c00;                                   /* rounds past 65504 */
  if (x < 0x38800000u) { /* below 2^-14: a subnormal half, in units of 2^-24 */
    float magnitude;
    memcpy(&magnitude, &x, 4);
    return sign | (uint16_t)__builtin_rintf(magnitude * 16777216.0f);
  }
  return sign | (uint16_t)((x + 0xfffu + ((x >> 13) & 1u) - 0x38000000u) >> 13);
}

typedef struct {
  const float *q;
  const uint16_t *cache;
  const int32_t *shape, *lanes;
  int shared; /* query heads an item attends together over their kv head's keys */
  int chunks; /* chunks of KEY_CHUNK keys of the lane with the most */
  float *partials; /* (B, H, chunks, Hd + 2): each chunk's unnormalized output, its scores' max and sum */
} attend_t;

static float half_to_float(uint16_t h) {
  uint8_t b[2];
  memcpy(b, &h, 2);
  return fp16(b);
}

#if TQ_AVX2
static inline __m256 load_half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* For the S query heads (1..MAX_SHARED_HEADS) that share one kv head, held contiguously in q:
 * scores[h * stride + j] = q_h . k_j * scale for j < n. Each key is converted once for all S heads,
 * four keys at a time (one horizontal sum per four keys). A head's numbers are the same whatever S
 * is: every (head, key) pair sums its products in the same order. */
static inline __attribute__((always_inline)) void attend_scores(const float *q, const int S, const uint16_t *k, int n, int Hd, float scale,
                                                                float *scores, size_t stride) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 acc[MAX_SHARED_HEADS][4];
    for (int h = 0; h < S; h++)
      for (int kk = 0; kk < 4; kk++) acc[h][kk] = _mm256_setzero_ps();
    const uint16_t *kj = k + (size_t)j * Hd;
    for (int i = 0; i < Hd; i += 8)
      for (int kk = 0; kk < 4; kk++) {
        const __m256 key = load_half8(kj + kk * Hd + i);
        for (int h = 0; h < S; h++) acc[h][kk] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * Hd + i), key, acc[h][kk]);
      }
    for (int h = 0; h < S; h++) {
      const __m256 sums8 = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]), _mm256_hadd_ps(acc[h][2], acc[h][3])); /* per 128-bit half */
      const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(sums8), _mm256_extractf128_ps(sums8, 1));
      _mm_storeu_ps(scores + h * stride + j, _mm_mul_ps(sums, _mm_set1_ps(scale)));
    }
  }
  for (; j < n; j++) {
    __m256 acc[MAX_SHARED_HEADS];
    for (int h = 0; h < S; h++) acc[h] = _mm256_setzero_ps();
    for (int i = 0; i < Hd; i += 8) {
      const __m256 key = load_half8(k + (size_t)j * Hd + i);
      for (int h = 0; h < S; h++) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * Hd + i), key, acc[h]);
    }
    for (int h = 0; h < S; h++) scores[h * stride + j] = hsum(acc[h]) * scale;
  }
}

/* scores[0..n) <- e^(scores - max); returns their sum, and the max in *top_out. */
static float attend_softmax(float *scores, int n, float *top_out) {
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int j = 0;
  for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(scores + j));
  float top = -INFINITY, lanes[8];
  _mm256_storeu_ps(lanes, top8);
  for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
  for (; j < n; j++) top = scores[j] > top ? scores[j] : top;
  __m256 total8 = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
    _mm256_storeu_ps(scores + j, e);
    total8 = _mm256_add_ps(total8, e);
  }
  if (j < n) { /* the tail through the same polynomial, so a score's weight never depends on where it falls */
    float tail[8] = {0};
    for (int i = j; i < n; i++) tail[i - j] = scores[i] - top;
    __m256 e = exp_nonpositive(_mm256_loadu_ps(tail));
    e = _mm256_blendv_ps(_mm256_setzero_ps(), e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
    _mm256_storeu_ps(tail, e);
    for (int i = j; i < n; i++) scores[i] = tail[i - j];
    total8 = _mm256_add_ps(total8, e);
  }
  *top_out = top;
  return hsum(total8);
}

/* o_h[i0..i0 + 8 W) = sum_j w[h * stride + j] v_j[i0..i0 + 8 W) for the S heads (head h's at o + h *
 * o_stride), the S x W sums held in registers; W is a constant in each use, so they stay there. */
static inline __attribute__((always_inline)) void attend_value_columns(const float *w, size_t stride, const int S, const uint16_t *v, int n, int Hd,
                                                                       int i0, const int W, float *o, size_t o_stride) {
  __m256 acc[MAX_SHARED_HEADS][4];
  for (int h = 0; h < S; h++)
    for (int c = 0; c < W; c++) acc[h][c] = _mm256_setzero_ps();
  for (int j = 0; j < n; j++) {
    __m256 p[MAX_SHARED_HEADS];
    for (int h = 0; h < S; h++) p[h] = _mm256_broadcast_ss(w + h * stride + j);
    const uint16_t *vj = v + (size_t)j * Hd + i0;
    for (int c = 0; c < W; c++) {
      const __m256 value = load_half8(vj + 8 * c);
      for (int h = 0; h < S; h++) acc[h][c] = _mm256_fmadd_ps(p[h], value, acc[h][c]);
    }
  }
  for (int h = 0; h < S; h++)
    for (int c = 0; c < W; c++) _mm256_storeu_ps(o + h * o_stride + i0 + 8 * c, acc[h][c]);
}

/* o_h = sum_j w[h * stride + j] v_j for the S heads: 32 dimensions at a time, then 8 at a time;
 * each value vector is converted once for all S heads. */
static inline __attribute__((always_inline)) void attend_values(const float *w, size_t stride, const int S, const uint16_t *v, int n, int Hd,
                                                                float *o, size_t o_stride) {
  int i0 = 0;
  for (; i0 + 32 <= Hd; i0 += 32) attend_value_columns(w, stride, S, v, n, Hd, i0, 4, o, o_stride);
  for (; i0 < Hd; i0 += 8) attend_value_columns(w, stride, S, v, n, Hd, i0, 1, o, o_stride);
}

/* The S heads of one item over n keys, S a constant in each instance below: head h's unnormalized
 * output at part + h * part_stride, then its scores' max and its sum of e^(score - max). */
static inline __attribute__((always_inline)) void attend_heads(const float *q, const int S, const uint16_t *k, const uint16_t *v, int n, int Hd,
                                                               float scale, float *scores, size_t stride, float *part, size_t part_stride) {
  attend_scores(q, S, k, n, Hd, scale, scores, stride);
  for (int h = 0; h < S; h++) part[h * part_stride + Hd + 1] = attend_softmax(scores + h * stride, n, &part[h * part_stride + Hd]);
  attend_values(scores, stride, S, v, n, Hd, part, part_stride);
}
#endif

static void run_attend(const void *ctx, int first, int last) {
  const attend_t *a = ctx;
  const int B = a->shape[0], H = a->shape[1], KvH = a->shape[2], C = a->shape[4], Hd = a->shape[5];
  const int group = H / KvH, shared = a->shared, parts = (group + shared - 1) / shared, chunks = a->chunks;
  const size_t plane = (size_t)a->shape[3] * KvH * C * Hd, stride = KEY_CHUNK + 8, part_stride = (size_t)chunks * (Hd + 2);
  const float scale = 1.0f / sqrtf((float)Hd);
  float scores[MAX_SHARED_HEADS * (KEY_CHUNK + 8)];
  (void)stride; /* the portable path keeps one head's scores at a time */
  for (int item = first; item < last; item++) {
    /* item = ((lane, kv head, part of its query heads), chunk of keys), the part `shared` heads wide */
    const int chunk = item % chunks, rest = item / chunks;
    const int b = rest / (KvH * parts), kvh = rest / parts % KvH, h0 = kvh * group + rest % parts * shared;
    const int heads = group - (h0 - kvh * group) < shared ? group - (h0 - kvh * group) : shared;
    const int slot = a->lanes[b], j0 = chunk * KEY_CHUNK, n = a->lanes[B + b] + 1 - j0 < KEY_CHUNK ? a->lanes[B + b] + 1 - j0 : KEY_CHUNK;
    if (n <= 0) continue; /* past this lane's position */
    const uint16_t *k = a->cache + (((size_t)slot * KvH + kvh) * C + j0) * Hd, *v = k + plane;
#if TQ_AVX2
    /* An item's keys and values are a few KB to 64 KB each: ask for all of them at once rather than
       wait for the hardware prefetcher to notice each stream. The B=8 step's attention at position
       100 went from 6.1-7.0 to 5.0-5.6 ms (4 alternating pairs, every layer's cache from DRAM). */
    for (size_t at = 0; at < (size_t)n * Hd * 2; at += 64) {
      _mm_prefetch((const char *)k + at, _MM_HINT_T0);
      _mm_prefetch((const char *)v + at, _MM_HINT_T0);
    }
#endif
    for (int h = h0; h < h0 + heads; h++) {
      const float *q = a->q + ((size_t)b * H + h) * Hd;
      float *part = a->partials + ((size_t)b * H + h) * part_stride + (size_t)chunk * (Hd + 2);
#if TQ_AVX2
      if (Hd % 8 == 0) {
        if (heads == 3) attend_heads(q, 3, k, v, n, Hd, scale, scores, stride, part, part_stride);
        else if (heads == 2) attend_heads(q, 2, k, v, n, Hd, scale, scores, stride, part, part_stride);
        else attend_heads(q, 1, k, v, n, Hd, scale, scores, stride, part, part_stride);
        break; /* all of the item's heads at once */
      }
#endif
      float top = -INFINITY;
      for (int j = 0; j < n; j++) {
        float dot = 0.0f;
        for (int i = 0; i < Hd; i++) dot += q[i] * half_to_float(k[(size_t)j * Hd + i]);
        scores[j] = dot * scale;
        top = scores[j] > top ? scores[j] : top;
      }
      float total = 0.0f;
      for (int j = 0; j < n; j++) total += (scores[j] = expf(scores[j] - top));
      for (int i = 0; i < Hd; i++) part[i] = 0.0f;
      for (int j = 0; j < n; j++)
        for (int i = 0; i < Hd; i++) part[i] += scores[j] * half_to_float(v[(size_t)j * Hd + i]);
      part[Hd] = top;
      part[Hd + 1] = total;
    }
  }
}

/* The chunks of keys a lane at position pos attends (keys 0..pos). */
static int key_chunks(int pos) { return (pos + KEY_CHUNK) / KEY_CHUNK; }

/* out = the lane's chunks' outputs, each weighted by e^(its max - the overall max), over their sums
 * weighted alike: the softmax over all the keys, whatever the chunks. */
static void combine_chunks(const float *parts, int chunks, int Hd, float *out) {
  float top = -INFINITY, total = 0.0f;
  for (int c = 0; c < chunks; c++) top = parts[c * (Hd + 2) + Hd] > top ? parts[c * (Hd + 2) + Hd] : top;
  for (int i = 0; i < Hd; i++) out[i] = 0.0f;
  for (int c = 0; c < chunks; c++) {
    const float *part = parts + (size_t)c * (Hd + 2), weight = expf(part[Hd] - top);
    total += weight * part[Hd + 1];
    for (int i = 0; i < Hd; i++) out[i] += weight * part[i];
  }
  const float inv = 1.0f / total;
  for (int i = 0; i < Hd; i++) out[i] *= inv;
}

/* (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for the half-split pairs of one head */
static void rotate_half_pairs(const float *x, const float *cos_sin, int half, float *y) {
  for (int i = 0; i < half; i++) {
    const float c = cos_sin[i], s = cos_sin[half + i];
    y[i] = x[i] * c - x[half + i] * s;
    y[half + i] = x[half + i] * c + x[i] * s;
  }
}

static __thread scratch_t rotation_rows;

/* In this thread's scratch: rotations[b * Hd ..] = the cosines, then the sines, of lane b's RoPE
 * angles (pos * inv_freq[i]), for B lanes. */
static const float *rope_rotations(const int32_t *lanes, int B, const float *inv_freq, int Hd) {
  float *rotations = at_least(&rotation_rows, (size_t)B * Hd * sizeof(float));
  const int half = Hd / 2;
  for (int b = 0; b < B; b++)
    for (int i = 0; i < half; i++) {
      const float angle = (float)lanes[B + b] * inv_freq[i];
      rotations[(size_t)b * Hd + i] = cosf(angle);
      rotations[(size_t)b * Hd + half + i] = sinf(angle);
    }
  return rotations;
}

/* tq_attend with each lane's rotations already computed (rope_rotations): a step computes them once
 * for all its layers, 64 cosines and sines a lane that took ~0.4 ms of a B=8 step when each layer
 * computed its own. */
static void attend(float *out, const float *qkv, uint16_t *cache, const int32_t *lanes, const float *rotations, const float *extras, const int32_t *shape) {
  const int B = shape[0], H = shape[1], KvH = shape[2], S = shape[3], C = shape[4], Hd = shape[5], flags = shape[6];
  const float eps = int_bits_float(shape[7]);
  const int width = (H + 2 * KvH) * Hd, half = Hd / 2;
  const float *bias = flags & HAS_BIAS ? extras : 0;
  const float *q_norm = flags & HAS_QK_NORM ? extras + (bias ? width : 0) : 0;
  float *queries = at_least(&float_rows, ((size_t)B * H * Hd + width) * sizeof(float));
  float *row = queries + (size_t)B * H * Hd, rotated[MAX_HEAD_DIM];
  for (int b = 0; b < B; b++) {
    const int slot = lanes[b], pos = lanes[B + b];
    const float *cos_sin = rotations + (size_t)b * Hd;
    for (int i = 0; i < width; i++) row[i] = qkv[(size_t)b * width + i] + (bias ? bias[i] : 0.0f);
    for (int h = 0; h < H + 2 * KvH; h++) {
      float *x = row + (size_t)h * Hd;
      const int is_v = h >= H + KvH;
      if (q_norm && !is_v) rms_norm_row(x, h < H ? q_norm : q_norm + Hd, Hd, eps, x);
      if (h < H) {
        rotate_half_pairs(x, cos_sin, half, queries + ((size_t)b * H + h) * Hd);
        continue;
      }
      const float *value = x;
      if (!is_v) {
        rotate_half_pairs(x, cos_sin, half, rotated);
        value = rotated;
      }
      const int kvh = is_v ? h - H - KvH : h - H;
      uint16_t *to = cache + ((((size_t)is_v * S + slot) * KvH + kvh) * C + pos) * Hd;
      int i = 0;
#if TQ_AVX2 /* the same rounding as half_from_float, 8 at a time */
      for (; i + 8 <= Hd; i += 8) _mm_storeu_si128((__m128i *)(to + i), _mm256_cvtps_ph(_mm256_loadu_ps(value + i), _MM_FROUND_TO_NEAREST_INT));
#endif
      for (; i < Hd; i++) to[i] = half_from_float(value[i]);
    }
  }
  /* Query heads sharing a kv head read its keys and values once as one item, up to MAX_SHARED_HEADS
   * of them, when that still leaves every thread two items or more; else a head per item. A head's
   * numbers are the same either way. */
  const int group = H / KvH;
  int shared = group < MAX_SHARED_HEADS ? group : MAX_SHARED_HEADS;
  const int parts = (group + shared - 1) / shared;
  shared = (group + parts - 1) / parts; /* parts of equal width: 4 = 2 + 2, not 3 + 1 */
  int chunks = 1;
  for (int b = 0; b < B; b++) chunks = key_chunks(lanes[B + b]) > chunks ? key_chunks(lanes[B + b]) : chunks;
  if (B * KvH * parts * chunks < 2 * (n_workers + 1)) shared = 1;
  float *partials = at_least(&attend_partials, (size_t)B * H * chunks * (Hd + 2) * sizeof(float));
  const attend_t a = {queries, cache, shape, lanes, shared, chunks, partials};
  const job_t j = {run_attend, &a, B * KvH * ((group + shared - 1) / shared) * chunks, 1};
  run_job(&j);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < H; h++)
      combine_chunks(partials + ((size_t)b * H + h) * chunks * (Hd + 2), key_chunks(lanes[B + b]), Hd, out + ((size_t)b * H + h) * Hd);
}

void tq_attend(float *out, const float *qkv, uint16_t *cache, const int32_t *lanes, const float *inv_freq, const float *extras, const int32_t *shape) {
  attend(out, qkv, cache, lanes, rope_rotations(lanes, shape[0], inv_freq, shape[5]), extras, shape);
}

/* ---- a whole layer ---------------------------------------------------------------------------- */
/* tq_layer(out, x, w_qkv, w_o, w_gate_up, w_down, attn_norm, ffn_norm, cache, lanes, inv_freq, extras,
 * shape): one transformer layer for B lanes, the five kernels above in a row with their intermediates
 * in this thread's scratch:
 *   qkv = W_qkv . rms_norm(x) * attn_norm;  a = attention(qkv);  h = x + W_o . a;
 *   out = h + W_down . swiglu(W_gate_up . rms_norm(h) * ffn_norm)
 * One kernel a layer keeps a captured step at ~30 kernels: tinygrad's capture and replay cost grows
 * with their count. shape = {the attention's 8 (B, H, KvH, slots, positions, Hd, flags, eps bits), D,
 * F, then the type of each matrix: qkv, o, gate_up, down}. */
/* Ask for the cache lines that attend() will write (each lane's new keys and values) before the qkv
 * product, which hides their misses: writing them cold took ~0.5 of a B=8 step's 0.7 ms of RoPE and
 * cache writes (every layer's cache from DRAM at position 100). */
static void prefetch_new_entries(const uint16_t *cache, const int32_t *lanes, const int32_t *shape) {
  const int B = shape[0], KvH = shape[2], S = shape[3], C = shape[4], Hd = shape[5];
  for (int b = 0; b < B; b++)
    for (int is_v = 0; is_v < 2; is_v++)
      for (int kvh = 0; kvh < KvH; kvh++) {
        const char *entry = (const char *)(cache + ((((size_t)is_v * S + lanes[b]) * KvH + kvh) * C + lanes[B + b]) * Hd);
        for (int at = 0; at < Hd * 2; at += 64) __builtin_prefetch(entry + at, 1, 3);
      }
}

static void layer(float *out, const float *x, const uint8_t *w_qkv, const uint8_t *w_o, const uint8_t *w_gate_up, const uint8_t *w_down,
                  const float *attn_norm, const float *ffn_norm, uint16_t *cache, const int32_t *lanes, const float *rotations, const float *extras,
                  const int32_t *shape) {
  const int B = shape[0], H = shape[1], KvH = shape[2], Hd = shape[5], eps_bits = shape[7], D = shape[8], F = shape[9];
  const int width = (H + 2 * KvH) * Hd;
  float *qkv = at_least(&layer_intermediates, (size_t)B * (width + H * Hd + D + 2 * F) * sizeof(float)), *attn = qkv + (size_t)B * width, *h = attn + (size_t)B * H * Hd, *gate_up = h + (size_t)B * D;
  const int32_t qkv_shape[5] = {shape[10], width, D, B, eps_bits}, o_shape[4] = {shape[11], D, H * Hd, B};
  const int32_t gate_up_shape[5] = {shape[12], 2 * F, D, B, eps_bits}, down_shape[4] = {shape[13], D, F, B};
  prefetch_new_entries(cache, lanes, shape);
  linear(qkv, w_qkv, x, qkv_shape, RMS_NORM, attn_norm, 0);
  attend(attn, qkv, cache, lanes, rotations, extras, shape);
  linear(h, w_o, attn, o_shape, AS_IS, 0, x);
  linear(gate_up, w_gate_up, h, gate_up_shape, RMS_NORM, ffn_norm, 0);
  linear(out, w_down, gate_up, down_shape, SWIGLU, 0, h);
}

void tq_layer(float *out, const float *x, const uint8_t *w_qkv, const uint8_t *w_o, const uint8_t *w_gate_up, const uint8_t *w_down,
              const float *attn_norm, const float *ffn_norm, uint16_t *cache, const int32_t *lanes, const float *inv_freq, const float *extras,
              const int32_t *shape) {
  const float *rotations = rope_rotations(lanes, shape[0], inv_freq, shape[5]);
  layer(out, x, w_qkv, w_o, w_gate_up, w_down, attn_norm, ffn_norm, cache, lanes, rotations, extras, shape);
}

void tq_embed(float *out, const uint8_t *w, const int32_t *ids, const int32_t *shape) {
  const int type = shape[0], rows = shape[1], cols = shape[2], tokens = shape[3];
  for (int t = 0; t < tokens; t++) {
    const int id = ids[t] < 0 || ids[t] >= rows ? 0 : ids[t];
    row_values(type, w, id, cols, out + (size_t)t * cols);
  }
}

/* ---- a whole step --------------------------------------------------------------------------- */
/* tq_forward(logits, tokens, lanes, picks, model, shape): a whole step for B lanes, from token ids to
 * the logits of the lanes in `picks` (R of them: every lane of a decode step, a prefill piece's last
 * real token): embedding, every layer as tq_layer, then the final norm and the output head.
 * `model` holds the model's tensors by address (uint64): the embedding matrix, the final norm, the
 * head matrix, the RoPE inverse frequencies, then per layer its qkv, o, gate_up and down matrices, its
 * two norms, its KV cache and its attention extras (the order of the LAYER_* entries below). shape =
 * {the attention's 8 (as tq_attend), D, F, layers, vocab, embedding type, head type, R, then each
 * layer's 4 matrix types}. cpu.py calls it directly, on the model thread, which then works through
 * the pool's jobs itself: replayed inside a TinyJit, the same one-kernel step took 2.8 ms longer of
 * 15.5 (Python before it started, tinygrad's worker thread running it, noticing its end). */
enum { MODEL_EMBED, MODEL_NORM, MODEL_HEAD, MODEL_INV_FREQ, MODEL_LAYERS };
enum { LAYER_QKV, LAYER_O, LAYER_GATE_UP, LAYER_DOWN, LAYER_ATTN_NORM, LAYER_FFN_NORM, LAYER_CACHE, LAYER_EXTRAS, LAYER_ENTRIES };
static __thread scratch_t step_rows;

void tq_forward(float *logits, const int32_t *tokens, const int32_t *lanes, const int32_t *picks, const uint64_t *model, const int32_t *shape) {
  const int B = shape[0], D = shape[8], layers = shape[10], vocab = shape[11], R = shape[14];
  float *x = at_least(&step_rows, (size_t)(B + R) * D * sizeof(float)), *picked = x + (size_t)B * D;
  const float *rotations = rope_rotations(lanes, B, (const float *)(uintptr_t)model[MODEL_INV_FREQ], shape[5]);
  const int32_t embed_shape[4] = {shape[12], vocab, D, B};
  tq_embed(x, (const uint8_t *)(uintptr_t)model[MODEL_EMBED], tokens, embed_shape);
  int32_t layer_shape[14];
  memcpy(layer_shape, shape, 10 * sizeof(int32_t));
  for (int l = 0; l < layers; l++) {
    const uint64_t *m = model + MODEL_LAYERS + (size_t)l * LAYER_ENTRIES;
    memcpy(layer_shape + 10, shape + 15 + 4 * l, 4 * sizeof(int32_t));
#define AT(type, entry) ((type)(uintptr_t)m[entry])
    /* in place: layer() reads x for the last time (the attention's residual) before it writes out */
    layer(x, x, AT(const uint8_t *, LAYER_QKV), AT(const uint8_t *, LAYER_O), AT(const uint8_t *, LAYER_GATE_UP), AT(const uint8_t *, LAYER_DOWN),
          AT(const float *, LAYER_ATTN_NORM), AT(const float *, LAYER_FFN_NORM), AT(uint16_t *, LAYER_CACHE), lanes, rotations,
          AT(const float *, LAYER_EXTRAS), layer_shape);
#undef AT
  }
  for (int r = 0; r < R; r++) memcpy(picked + (size_t)r * D, x + (size_t)(picks[r] < 0 || picks[r] >= B ? 0 : picks[r]) * D, D * sizeof(float));
  const int32_t head_shape[5] = {shape[13], vocab, D, R, shape[7]};
  linear(logits, (const uint8_t *)(uintptr_t)model[MODEL_HEAD], picked, head_shape, RMS_NORM, (const float *)(uintptr_t)model[MODEL_NORM], 0);
}

/* For the tests: the dequantized row, and the products through the portable path. */
void tq_dequantize(float *out, const uint8_t *w, const int32_t *shape) {
  const int type = shape[0], rows = shape[1], cols = shape[2];
  for (int r = 0; r < rows; r++) row_values(type, w, r, cols, out + (size_t)r * cols);
}

int tq_simd(void) { return TQ_AVX2; }
