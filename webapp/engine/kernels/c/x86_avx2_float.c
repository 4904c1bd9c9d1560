/* The float formats' AVX2 products (F32, F16, BF16) against up to four tokens' float activations:
 * eight weights a register (F16 by F16C's conversion, BF16 shifted into a float32's upper half, F32
 * loaded) into fused multiply-adds, a row at a time for one token and two rows for more. These are 2
 * or 4 bytes a weight, so memory decides a one-token product's speed: each 64-byte line of weights is
 * fetched ahead like the tiles' blocks. */

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

/* Two rows times N tokens (N >= 2), sixteen values a step: each activation load serves both rows,
 * where a row alone took one load per multiply-add; 2N chains of sums. */
static inline __attribute__((always_inline)) void float_pair(int type, const uint8_t *w, size_t row_bytes, int cols, const float *const *xs, int N,
                                                             float *acc0, float *acc1) {
  const int weight_bytes = type == F32 ? 4 : 2;
  __m256 sum0[4], sum1[4];
  for (int t = 0; t < N; t++) sum0[t] = sum1[t] = _mm256_setzero_ps();
  for (int i = 0; i < cols; i += 16) {
    const uint8_t *a = w + (size_t)i * weight_bytes, *b = a + row_bytes;
    if (i % 32 == 0)
      for (int line = 0; line < 32 * weight_bytes; line += 64) {
        _mm_prefetch((const char *)(a + PREFETCH_BYTES + line), _MM_HINT_T0);
        _mm_prefetch((const char *)(b + PREFETCH_BYTES + line), _MM_HINT_T0);
      }
    const __m256 a0 = eight_weights(type, a), a1 = eight_weights(type, a + 8 * weight_bytes);
    const __m256 b0 = eight_weights(type, b), b1 = eight_weights(type, b + 8 * weight_bytes);
    for (int t = 0; t < N; t++) {
      const __m256 x0 = _mm256_loadu_ps(xs[t] + i), x1 = _mm256_loadu_ps(xs[t] + i + 8);
      sum0[t] = _mm256_fmadd_ps(a1, x1, _mm256_fmadd_ps(a0, x0, sum0[t]));
      sum1[t] = _mm256_fmadd_ps(b1, x1, _mm256_fmadd_ps(b0, x0, sum1[t]));
    }
  }
  for (int t = 0; t < N; t++) acc0[t] = hsum(sum0[t]), acc1[t] = hsum(sum1[t]);
}

#define FLOAT_ROWS(N)                                                                                                                             \
  static void float_format_rows_##N(int type, const uint8_t *w, size_t rb, int cols, const float *const *xs, float *out, size_t stride,           \
                                    int r, int last) {                                                                                            \
    for (; N > 1 && r + 2 <= last; r += 2) {                                                                                                      \
      float acc0[4], acc1[4];                                                                                                                     \
      if (type == F16) float_pair(F16, w + r * rb, rb, cols, xs, N, acc0, acc1);                                                                  \
      else if (type == BF16) float_pair(BF16, w + r * rb, rb, cols, xs, N, acc0, acc1);                                                           \
      else float_pair(F32, w + r * rb, rb, cols, xs, N, acc0, acc1);                                                                              \
      for (int t = 0; t < N; t++) out[t * stride + r] = acc0[t], out[t * stride + r + 1] = acc1[t];                                               \
    }                                                                                                                                             \
    for (; r < last; r++) {                                                                                                                       \
      float acc[4] = {0};                                                                                                                         \
      if (type == F16) float_row(F16, w + r * rb, cols, xs, N, acc);                                                                              \
      else if (type == BF16) float_row(BF16, w + r * rb, cols, xs, N, acc);                                                                       \
      else float_row(F32, w + r * rb, cols, xs, N, acc);                                                                                          \
      for (int t = 0; t < N; t++) out[t * stride + r] = acc[t];                                                                                   \
    }                                                                                                                                             \
  }
FLOAT_ROWS(1) FLOAT_ROWS(2) FLOAT_ROWS(3) FLOAT_ROWS(4)

static void float_format_rows(int type, const uint8_t *w, size_t row_bytes, int cols, const float *const *xs, int n, float *out, size_t stride,
                              int first, int last) {
  static void (*const groups[5])(int, const uint8_t *, size_t, int, const float *const *, float *, size_t, int, int) = {
      0, float_format_rows_1, float_format_rows_2, float_format_rows_3, float_format_rows_4};
  groups[n](type, w, row_bytes, cols, xs, out, stride, first, last);
}
