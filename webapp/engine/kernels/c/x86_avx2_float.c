/* The float formats' AVX2 products (F32, F16, BF16) against up to four tokens' float activations:
 * eight weights a register (F16 by F16C's conversion, BF16 shifted into a float32's upper half, F32
 * loaded) into fused multiply-adds. These are 2 or 4 bytes a weight, so memory decides a one-token
 * product's speed: each 64-byte line of weights is fetched ahead like the tiles' blocks. */

static inline __attribute__((always_inline)) __m256 eight_weights(int type, const uint8_t *w) {
  if (type == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
  if (type == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
  return _mm256_loadu_ps((const float *)w);
}

/* One row against N tokens (N <= 2), four chains of sums a token (a fused multiply-add's latency is
 * four of its issue slots): chain k takes weights 8k..8k+7 of every 32, and the chains add up in one
 * order. A token's sum is thus the same whatever tokens share the call, so prefill equals decode and
 * a lane never depends on the step's other lanes. Two tokens at most: 4 weights and 8 sums fill 12 of
 * the 16 registers (four tokens spilled). */
static inline __attribute__((always_inline)) void float_row(int type, const uint8_t *w, int cols, const float *const *xs, int N, float *acc) {
  const int weight_bytes = type == F32 ? 4 : 2;
  __m256 sum[2][4];
  for (int t = 0; t < N; t++)
    for (int k = 0; k < 4; k++) sum[t][k] = _mm256_setzero_ps();
  for (int i = 0; i < cols; i += 32) {
    const uint8_t *block = w + (size_t)i * weight_bytes;
    for (int line = 0; line < 32 * weight_bytes; line += 64) _mm_prefetch((const char *)(block + PREFETCH_BYTES + line), _MM_HINT_T0);
    __m256 v[4];
    for (int k = 0; k < 4; k++) v[k] = eight_weights(type, block + 8 * k * weight_bytes);
    for (int t = 0; t < N; t++)
      for (int k = 0; k < 4; k++) sum[t][k] = _mm256_fmadd_ps(v[k], _mm256_loadu_ps(xs[t] + i + 8 * k), sum[t][k]);
  }
  for (int t = 0; t < N; t++) acc[t] = hsum(_mm256_add_ps(_mm256_add_ps(sum[t][0], sum[t][1]), _mm256_add_ps(sum[t][2], sum[t][3])));
}

/* Rows first..last - 1, a row at a time, its tokens two by two: a row's 2-4 bytes a weight are read
 * from memory once, and again from the L1 cache for the next two tokens. */
static void float_format_rows_avx2(int type, const uint8_t *w, size_t row_bytes, int cols, const float *const *xs, int n, float *out, size_t stride,
                                   int first, int last) {
  for (int r = first; r < last; r++) {
    const uint8_t *row = w + (size_t)r * row_bytes;
    for (int t = 0; t < n; t += 2) {
      const int N = n - t < 2 ? n - t : 2;
      float acc[2];
      if (type == F16) float_row(F16, row, cols, xs + t, N, acc);
      else if (type == BF16) float_row(BF16, row, cols, xs + t, N, acc);
      else float_row(F32, row, cols, xs + t, N, acc);
      for (int j = 0; j < N; j++) out[(size_t)(t + j) * stride + r] = acc[j];
    }
  }
}
