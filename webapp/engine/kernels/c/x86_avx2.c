/* The x86 versions of isa.h's names (NAME_avx2; AVX2 with FMA and F16C), except the products'
 * (x86_avx2_products.c) and attention's (x86_avx2_attention.c), and the primitives those share.
 * tq.c includes them for every x86 rung of the ladder (build.py's RUNGS): AVX2 as written, the VNNI
 * rungs with dot_u8_add's dpbusd, the AVX-512 rungs compiled with AVX-512's flags. */

/* How far ahead of the block being multiplied the tiles (x86_avx2_*.c) prefetch the weights: further
 * than the next tile's rows, so a small matrix's next rows are on their way from DRAM before the
 * hardware prefetcher would see the stream (bench/RESULTS.md, c9eaf6b, has the measurements). */
enum { PREFETCH_BYTES = 4096 };
/* The K-quant tiles' blocks (over a KiB a group, twice that a pair) are prefetched a share a sub-block:
 * prefetch_share fetches share `part` of `parts` of a block's `bytes`, SHARED_PREFETCH_BYTES ahead. A
 * whole block at once, a burst of 18 to 52 lines, made one-token steps slower (bench/RESULTS.md, 2026-12-07). */
enum { SHARED_PREFETCH_BYTES = 8192 };
static inline void prefetch_share(const uint8_t *g, int bytes, int part, int parts) {
  for (int at = part * bytes / parts / 64 * 64; at < (part + 1) * bytes / parts; at += 64)
    _mm_prefetch((const char *)(g + SHARED_PREFETCH_BYTES + at), _MM_HINT_T0);
}

static float fp16_avx2(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* The integer dot products every tile and row kernel is made of, and the one place their instructions
 * are chosen: with VNNI (tq.c's TQ_VNNI: AVX512-VNNI with VL, or Intel's AVX-VNNI), dpbusd multiplies
 * unsigned by signed bytes and adds each four products into an int32 lane, one instruction; with
 * AVX2 alone, maddubs adds pairs into int16 lanes (saturating) and madd adds those pairs into int32.
 * They give the same integers exactly where no int16 sum of the maddubs path leaves int16: dot_u8_add's
 * pairs are at most 2 * 128 * 127 = 32,512 (weights 0..128, activations -127..127: quantize_row never
 * makes -128), and dot_u8_quads' callers bound their K pairs' sum each (see each). Then the VNNI rungs
 * are bit for bit the AVX2 one (tests/integration/test_isa_ladder.py), and a kernel gains VNNI without
 * a copy of its own. A caller whose int16 sums could leave the range would make the two differ, and
 * must not take these. The row kernels that call maddubs themselves (Q6_K's and x86_avx2_k_low.c's,
 * whose widening madd applies two sub-scales) run the same instructions on every rung. */
#if TQ_VNNI
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD _mm256_dpbusd_epi32 /* AVX512-VNNI's 256-bit form (AMD Zen 4, Intel server cores) */
#else
#define DPBUSD _mm256_dpbusd_avx_epi32 /* AVX-VNNI's VEX form (Intel client cores) */
#endif
/* acc + the dot products of 32 unsigned weights (0..128) and 32 signed activations, per four, as 8 int32 */
static inline __m256i dot_u8_add(__m256i acc, __m256i w, __m256i x) { return DPBUSD(acc, w, x); }
/* sum over k < K of q[k] times the four activations fours[k] broadcast to every lane, as 8 int32; in
 * two chains, each dpbusd waiting on its own chain's last: a one-lane tile waits on that latency */
static inline __attribute__((always_inline)) __m256i dot_u8_quads(const __m256i *q, const int32_t *fours, const int K) {
  __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int k = 0; k < K; k++) sum[k & 1] = DPBUSD(sum[k & 1], q[k], _mm256_set1_epi32(fours[k]));
  return _mm256_add_epi32(sum[0], sum[1]);
}
/* dot_u8_quads times each lane's scale (int32 lanes, each within int16) */
static inline __attribute__((always_inline)) __m256i dot_u8_quads_scaled(const __m256i *q, const int32_t *fours, const int K, __m256i scale) {
  return _mm256_mullo_epi32(dot_u8_quads(q, fours, K), scale);
}
#else
static inline __m256i dot_u8_add(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
/* the K maddubs add up within int16 lanes, one madd widens them: K + 1 instructions, not 2K */
static inline __attribute__((always_inline)) __m256i dot_u8_quads(const __m256i *q, const int32_t *fours, const int K) {
  __m256i sum = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(fours[0]));
  for (int k = 1; k < K; k++) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(q[k], _mm256_set1_epi32(fours[k])));
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
}
/* the madd that widens the pairs applies the scales: scale in both int16 halves of each lane */
static inline __attribute__((always_inline)) __m256i dot_u8_quads_scaled(const __m256i *q, const int32_t *fours, const int K, __m256i scale) {
  __m256i sum = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(fours[0]));
  for (int k = 1; k < K; k++) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(q[k], _mm256_set1_epi32(fours[k])));
  return _mm256_madd_epi16(sum, _mm256_or_si256(_mm256_and_si256(scale, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(scale, 16)));
}
#endif
/* 32 unsigned weights (0..128) times 32 signed activations, as 8 int32 partial sums */
static inline __m256i dot_u8(__m256i w, __m256i x) { return dot_u8_add(_mm256_setzero_si256(), w, x); }
/* signed times signed: move w's sign onto x */
static inline __m256i dot_s8(__m256i w, __m256i x) { return dot_u8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
static inline __m256i nibbles(const uint8_t *qs) {  /* 16 bytes -> 32 values: low nibbles first, then high */
  const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}
/* Eight interleaved slices of signed weights q (magnitude[k] = |q[k]|) times a token's 32 activations,
 * four at a time broadcast: maddubs takes one unsigned operand, so the activations take the weights'
 * signs, and each slice's pair sums (up to 2 * 128 * 127) widen to int32 on their own. The Q8_0 and
 * IQ4_NL tiles' dot. */
static inline __attribute__((always_inline)) __m256i dot_s8_slices(const __m256i *q, const __m256i *magnitude, const xblock *x) {
  int32_t four[8];
  memcpy(four, x->q, 32);
  __m256i sum = _mm256_setzero_si256();
  for (int k = 0; k < 8; k++) sum = dot_u8_add(sum, magnitude[k], _mm256_sign_epi8(_mm256_set1_epi32(four[k]), q[k]));
  return sum;
}

/* IQ4_TABLE (format_iq4_table.c) in both 128-bit halves, for pshufb lookups of IQ4_NL's and IQ4_XS's indices */
static inline __m256i iq4_table(void) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_TABLE)); }
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

/* max |x| of n values (a multiple of 8): exact in any order */
static float max_magnitude(const float *x, int n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 top = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
  return _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
}

static void quantize_row_avx2(const float *x, int cols, int format, xblock *out) {
  /* the same numbers as quantize_row_generic 8 at a time: the conversion rounds to nearest even as
     lrintf does */
  for (int b = 0; b < cols / 32; b++, out++) {
    const float *v = x + 32 * b;
    float inv;
    const float d = step_of(max_magnitude(v, 32), format, &inv);
    const __m256 scale = _mm256_set1_ps(inv);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), scale));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), scale));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), scale));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), scale));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)); /* lanes shuffled per 128 bits */
    _mm256_storeu_si256((__m256i *)out->q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    int sum[2];
    for (int half = 0; half < 2; half++) {
      const __m256i s8 = half ? _mm256_add_epi32(i2, i3) : _mm256_add_epi32(i0, i1);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      sum[half] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
    }
    /* summed as unsigned: a row that is not finite (a broken file's) converts to INT_MIN, and wraps here as in the vectors */
    set_block_scale(out, format, d, (int)((unsigned)sum[0] + (unsigned)sum[1]));
    out->sum16[0] = (int16_t)sum[0];
    out->sum16[1] = (int16_t)sum[1];
  }
}

/* Every interleaved layout (formats.c) has its group tile (x86_avx2_products.c). */
static int interleaves_avx2(int type) { return interleaving_of(type) ? 8 : 0; }

/* silu(gate) * up, on the calling thread, so vectorized: the sigmoid from e = exp(-|gate|) as
 * 1 / (1 + e) or e / (1 + e), by the sign (no overflow either way). */
static void swiglu_row_avx2(const float *gate, const float *up, int n, float *y) {
  int i = 0;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign)); /* exp(-|g|) */
    const __m256 numerator = _mm256_blendv_ps(one, e, g);     /* e where g is negative */
    const __m256 sigmoid = _mm256_div_ps(numerator, _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
  }
  swiglu_row_generic(gate + i, up + i, n - i, y + i);
}

/* the same rounding as half_from_float, 8 at a time */
static void halves_from_floats_avx2(const float *x, int n, uint16_t *to) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(to + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  halves_from_floats_generic(x + i, n - i, to + i);
}
