/* What the AVX-512 rungs' tiles (x86_avx512_*.c) are made of: x86_avx2.c's integer dots sixteen int32
 * lanes wide, loads of the same place in a pair's two groups of rows (ROWS_X16, formats.c's
 * group_place), and the steps several tiles share. */

/* The integer dots of x86_avx2.c, sixteen int32 lanes wide: VNNI's dpbusd where the build has it,
 * else maddubs and madd (AVX512-BW), the same integers as their 256-bit forms lane for lane. */
#if defined(__AVX512VNNI__)
static inline __m512i dot512_u8_add(__m512i acc, __m512i w, __m512i x) { return _mm512_dpbusd_epi32(acc, w, x); }
static inline __attribute__((always_inline)) __m512i dot512_u8_quads(const __m512i *q, const int32_t *fours, const int K) {
  __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int k = 0; k < K; k++) sum[k & 1] = _mm512_dpbusd_epi32(sum[k & 1], q[k], _mm512_set1_epi32(fours[k]));
  return _mm512_add_epi32(sum[0], sum[1]);
}
#else
static inline __m512i dot512_u8_add(__m512i acc, __m512i w, __m512i x) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
static inline __attribute__((always_inline)) __m512i dot512_u8_quads(const __m512i *q, const int32_t *fours, const int K) {
  __m512i sum = _mm512_maddubs_epi16(q[0], _mm512_set1_epi32(fours[0]));
  for (int k = 1; k < K; k++) sum = _mm512_add_epi16(sum, _mm512_maddubs_epi16(q[k], _mm512_set1_epi32(fours[k])));
  return _mm512_madd_epi16(sum, _mm512_set1_epi16(1));
}
#endif

/* dot512_u8_quads times each lane's scale (int32 lanes, each within int16): x86_avx2.c's dot_u8_quads_scaled */
static inline __attribute__((always_inline)) __m512i dot512_u8_quads_scaled(const __m512i *q, const int32_t *fours, const int K, __m512i scale) {
#if defined(__AVX512VNNI__)
  return _mm512_mullo_epi32(dot512_u8_quads(q, fours, K), scale);
#else
  __m512i sum = _mm512_maddubs_epi16(q[0], _mm512_set1_epi32(fours[0]));
  for (int k = 1; k < K; k++) sum = _mm512_add_epi16(sum, _mm512_maddubs_epi16(q[k], _mm512_set1_epi32(fours[k])));
  return _mm512_madd_epi16(sum, _mm512_or_si512(_mm512_and_si512(scale, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(scale, 16)));
#endif
}

/* 32 bytes at p (low half) and at p + next (high half): the same place in a pair's two groups */
static inline __m512i pair_load(const uint8_t *p, size_t next) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)), _mm256_loadu_si256((const __m256i *)(p + next)), 1);
}
/* eight float16 at p and eight at p + next, as sixteen floats */
static inline __m512 pair_halves(const uint8_t *p, size_t next) {
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + next)), _mm_loadu_si128((const __m128i *)p)));
}
/* eight bytes at p and at p + next, each widened to int32 (signed or not) */
static inline __m512i pair_bytes(const uint8_t *p, size_t next, int is_signed) {
  uint64_t a, b;
  memcpy(&a, p, 8);
  memcpy(&b, p + next, 8);
  const __m128i both = _mm_set_epi64x((long long)b, (long long)a);
  return is_signed ? _mm512_cvtepi8_epi32(both) : _mm512_cvtepu8_epi32(both);
}
/* Before a tile's loop over its N tokens: unrolled whole, each token's sums stay in a register of their
 * own; left a loop, clang kept them on the stack, and each sub-block's sum waited on a store and a load
 * (bench/RESULTS.md, 2026-12-07) */
#define TOKENS_UNROLLED _Pragma("clang loop unroll(full)")
static inline void fours_of(const xblock *x, int32_t four[8]) { memcpy(four, x->q, 32); }

/* Signed weights times a token's 32 activations (fours, four a lane broadcast), as dot_s8_slices: the
 * weights' magnitudes against the activations given the weights' signs. No 512-bit psignb: a masked
 * negation where the weight is negative; where it is zero so is its magnitude, so either sign gives
 * psignb's product. */
static inline __attribute__((always_inline)) __m512i dot512_signed(const __m512i *magnitude, const __mmask64 *negative, const int32_t *fours) {
  __m512i sum = _mm512_setzero_si512();
  for (int k = 0; k < 8; k++) {
    const __m512i xk = _mm512_set1_epi32(fours[k]);
    sum = dot512_u8_add(sum, magnitude[k], _mm512_mask_sub_epi8(xk, negative[k], _mm512_setzero_si512(), xk));
  }
  return sum;
}
/* A pair's four nibble slices at p looked up in `levels` (IQ4's signed table): each value's magnitude
 * and sign, low nibbles as slices 0..3, high ones as 4..7 */
static inline __attribute__((always_inline)) void signed_levels(const uint8_t *p, size_t next, __m512i levels, __m512i *magnitude, __mmask64 *negative) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int k = 0; k < 4; k++) {
    const __m512i raw = pair_load(p + 32 * k, next);
    const __m512i lo = _mm512_shuffle_epi8(levels, _mm512_and_si512(raw, low));
    const __m512i hi = _mm512_shuffle_epi8(levels, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    magnitude[k] = _mm512_abs_epi8(lo), negative[k] = _mm512_movepi8_mask(lo);
    magnitude[4 + k] = _mm512_abs_epi8(hi), negative[4 + k] = _mm512_movepi8_mask(hi);
  }
}

/* acc + a block's dot scaled by the rows' d and the token's, and the rows' m (their minimum, or Q4_0's and
 * Q5_0's offset times d) by the token's d * sum(q): a 32-value format with a minimum, as tile_x8 adds it */
static inline __m512 add_block(__m512 acc, __m512 d, __m512 m, const xblock *x, __m512i dot) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(dot), acc);
  return _mm512_fmadd_ps(m, _mm512_set1_ps(x->s), acc);
}
