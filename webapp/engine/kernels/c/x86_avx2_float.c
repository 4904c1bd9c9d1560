/* The float formats' AVX2 products (F32, F16, BF16): a row at a time against up to four tokens' float
 * activations, eight weights a register (F16 by F16C's conversion, BF16 shifted into a float32's upper
 * half, F32 loaded), eight sums a token in fused multiply-adds. These are 2 or 4 bytes a weight, so
 * memory decides their speed: each 64-byte line of weights is fetched ahead like the tiles' blocks. */

static inline __attribute__((always_inline)) __m256 eight_weights(int type, const uint8_t *w) {
  if (type == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
  if (type == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
  return _mm256_loadu_ps((const float *)w);
}

/* N tokens, each with 4 / N chains of sums (four in all: a fused multiply-add's latency is four of its
 * issue slots). */
static inline __attribute__((always_inline)) void float_row(int type, const uint8_t *w, int cols, const float *const *xs, int N, float *acc) {
  const int weight_bytes = type == F32 ? 4 : 2, chains = N >= 4 ? 1 : 4 / N;
  __m256 sum[4][4];
  for (int t = 0; t < N; t++)
    for (int c = 0; c < chains; c++) sum[t][c] = _mm256_setzero_ps();
  for (int i = 0; i < cols; i += 32) {
    const uint8_t *block = w + (size_t)i * weight_bytes;
    for (int line = 0; line < 32 * weight_bytes; line += 64) _mm_prefetch((const char *)(block + PREFETCH_BYTES + line), _MM_HINT_T0);
    __m256 v[4];
    for (int k = 0; k < 4; k++) v[k] = eight_weights(type, block + 8 * k * weight_bytes);
    for (int t = 0; t < N; t++)
      for (int k = 0; k < 4; k++) sum[t][k % chains] = _mm256_fmadd_ps(v[k], _mm256_loadu_ps(xs[t] + i + 8 * k), sum[t][k % chains]);
  }
  for (int t = 0; t < N; t++) {
    __m256 total = sum[t][0];
    for (int c = 1; c < chains; c++) total = _mm256_add_ps(total, sum[t][c]);
    acc[t] += hsum(total);
  }
}

#define FLOAT_ROW(N)                                                                                           \
  static void float_row_##N(int type, const uint8_t *w, int cols, const float *const *xs, float *acc) {     \
    if (type == F16) float_row(F16, w, cols, xs, N, acc);                                                    \
    else if (type == BF16) float_row(BF16, w, cols, xs, N, acc);                                             \
    else float_row(F32, w, cols, xs, N, acc);                                                                \
  }
FLOAT_ROW(1) FLOAT_ROW(2) FLOAT_ROW(3) FLOAT_ROW(4)

static void float_row_dot(int type, const uint8_t *w, int cols, const float *const *xs, int n, float *acc) {
  static void (*const rows[5])(int, const uint8_t *, int, const float *const *, float *) = {0, float_row_1, float_row_2, float_row_3, float_row_4};
  rows[n](type, w, cols, xs, acc);
}
