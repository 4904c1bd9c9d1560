/* AVX2 attention over Q8_0 cache rows (attend_item_q8 of isa.h): x86_avx2_attention.c's item, each key
 * and value converted in registers from its blocks (8 int8 -> 8 floats, times the block's scale), the
 * softmax shared with it. Hd is a multiple of 32 (a block): the loader refuses other heads. */

static inline __m256 load_q8x8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

/* scores[h * stride + j] = q_h . k_j * scale for the S heads sharing the kv head, four keys at a time
 * (one horizontal sum per four keys), each key block converted once for all S heads. A head's numbers
 * are the same whatever S is. */
static inline __attribute__((always_inline)) void attend_scores_q8(const float *q, const int S, const uint8_t *k, size_t row, int n, int Hd,
                                                                   float scale, float *scores, size_t stride) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 acc[MAX_SHARED_HEADS][4];
    for (int h = 0; h < S; h++)
      for (int kk = 0; kk < 4; kk++) acc[h][kk] = _mm256_setzero_ps();
    for (int b = 0; b < Hd / 32; b++)
      for (int kk = 0; kk < 4; kk++) {
        const uint8_t *block = k + (j + kk) * row + (size_t)b * Q8_BLOCK_BYTES;
        const __m256 d = _mm256_set1_ps(fp16(block));
        for (int c = 0; c < 4; c++) {
          const __m256 key = _mm256_mul_ps(load_q8x8(block + 2 + 8 * c), d);
          for (int h = 0; h < S; h++) acc[h][kk] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * Hd + 32 * b + 8 * c), key, acc[h][kk]);
        }
      }
    for (int h = 0; h < S; h++) store_four_scores(acc[h], scale, scores + h * stride + j);
  }
  for (; j < n; j++) {
    __m256 acc[MAX_SHARED_HEADS];
    for (int h = 0; h < S; h++) acc[h] = _mm256_setzero_ps();
    for (int b = 0; b < Hd / 32; b++) {
      const uint8_t *block = k + j * row + (size_t)b * Q8_BLOCK_BYTES;
      const __m256 d = _mm256_set1_ps(fp16(block));
      for (int c = 0; c < 4; c++) {
        const __m256 key = _mm256_mul_ps(load_q8x8(block + 2 + 8 * c), d);
        for (int h = 0; h < S; h++) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * Hd + 32 * b + 8 * c), key, acc[h]);
      }
    }
    for (int h = 0; h < S; h++) scores[h * stride + j] = hsum(acc[h]) * scale;
  }
}

/* o_h = sum_j w[h * stride + j] v_j for the S heads, a block (32 dimensions) at a time: the S x 4 sums
 * in registers, each value block converted once for all S heads and its scale folded into the
 * weights; the keys in one loop that moves to the next run's rows at a run's end, as
 * attend_value_columns does. */
static inline __attribute__((always_inline)) void attend_values_q8(const float *w, size_t stride, const int S, const key_runs *runs, size_t row,
                                                                   int n, int Hd, float *o, size_t o_stride) {
  for (int b = 0; b < Hd / 32; b++) {
    __m256 acc[MAX_SHARED_HEADS][4];
    for (int h = 0; h < S; h++)
      for (int c = 0; c < 4; c++) acc[h][c] = _mm256_setzero_ps();
    const uint8_t *block = runs->values[0] + (size_t)b * Q8_BLOCK_BYTES;
    for (int j = 0, run_end = runs->run_keys; j < n; j++, block += row) {
      if (j == run_end) {
        block = runs->values[j / runs->run_keys] + (size_t)b * Q8_BLOCK_BYTES;
        run_end += runs->run_keys;
      }
      const float d = fp16(block);
      __m256 p[MAX_SHARED_HEADS];
      for (int h = 0; h < S; h++) p[h] = _mm256_set1_ps(w[h * stride + j] * d);
      for (int c = 0; c < 4; c++) {
        const __m256 value = load_q8x8(block + 2 + 8 * c);
        for (int h = 0; h < S; h++) acc[h][c] = _mm256_fmadd_ps(p[h], value, acc[h][c]);
      }
    }
    for (int h = 0; h < S; h++)
      for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + h * o_stride + 32 * b + 8 * c, acc[h][c]);
  }
}

/* As attend_heads (x86_avx2_attention.c): each run's scores at its keys' place in the item's row. */
static inline __attribute__((always_inline)) void attend_heads_q8(const float *q, const int S, const key_runs *runs, size_t row, int n, int Hd,
                                                                  float scale, float *scores, size_t stride, float *part, size_t part_stride) {
  for (int r = 0, first = 0; first < n; r++, first += runs->run_keys)
    attend_scores_q8(q, S, runs->keys[r], row, run_length(runs, first, n), Hd, scale, scores + first, stride);
  for (int h = 0; h < S; h++) part[h * part_stride + Hd + 1] = attend_softmax(scores + h * stride, n, &part[h * part_stride + Hd]);
  attend_values_q8(scores, stride, S, runs, row, n, Hd, part, part_stride);
}

static void attend_item_q8_avx2(const float *q, int heads, const key_runs *runs, int n, int Hd, float scale, float *part, size_t part_stride) {
  const size_t row = (size_t)Hd / 32 * Q8_BLOCK_BYTES;
  for (int r = 0, first = 0; first < n; r++, first += runs->run_keys) /* as attend_item: the item's rows asked for at once */
    for (size_t at = 0; at < (size_t)run_length(runs, first, n) * row; at += 64) {
      _mm_prefetch((const char *)runs->keys[r] + at, _MM_HINT_T0);
      _mm_prefetch((const char *)runs->values[r] + at, _MM_HINT_T0);
    }
  float scores[MAX_SHARED_HEADS * (KEY_CHUNK + 8)];
  const size_t stride = KEY_CHUNK + 8;
  if (heads == 3) attend_heads_q8(q, 3, runs, row, n, Hd, scale, scores, stride, part, part_stride);
  else if (heads == 2) attend_heads_q8(q, 2, runs, row, n, Hd, scale, scores, stride, part, part_stride);
  else attend_heads_q8(q, 1, runs, row, n, Hd, scale, scores, stride, part, part_stride);
}
