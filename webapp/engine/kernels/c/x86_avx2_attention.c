/* AVX2 attention: an item's heads together over its keys (attend_item of isa.h). */

/* Four keys' scores for one query head from their chains of sums (acc[k]: key k's eight partial
 * sums), times `scale`, into to[0..3]. */
static inline __attribute__((always_inline)) void store_four_scores(const __m256 *acc, float scale, float *to) {
  const __m256 sums8 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3])); /* per 128-bit half */
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(sums8), _mm256_extractf128_ps(sums8, 1));
  _mm_storeu_ps(to, _mm_mul_ps(sums, _mm_set1_ps(scale)));
}

/* store_four_scores for two keys: the same additions in the same order, so each key's score has the
 * same bits as in a group of four. */
static inline __attribute__((always_inline)) void store_two_scores(const __m256 *acc, float scale, float *to) {
  const __m256 pairs = _mm256_hadd_ps(acc[0], acc[1]);
  const __m256 sums8 = _mm256_hadd_ps(pairs, pairs);
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(sums8), _mm256_extractf128_ps(sums8, 1));
  to[0] = _mm_cvtss_f32(sums) * scale;
  to[1] = _mm_cvtss_f32(_mm_movehdup_ps(sums)) * scale;
}

static inline __m256 load_half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* For the S query heads (1..MAX_SHARED_HEADS) that share one kv head, held contiguously in q:
 * scores[h * stride + j] = q_h . k_j * scale for j < n. Each key is converted once for all S heads,
 * four keys at a time (one horizontal sum per four keys). A head's numbers are the same whatever S
 * is: every (head, key) pair sums its products in the same order. */
static inline __attribute__((always_inline)) void attend_scores(const float *q, const int S, const uint16_t *k, int n, int Hd, float scale,
                                                                float *scores, size_t stride) {
  int j = 0;
  /* three heads' sums of four keys and the queries would take 16 registers and more: the compiler
     kept one sum in memory, and its chain through a store and a load held each step to ~10 cycles
     instead of 6. Three heads take a group of four keys as two pairs, each summed as in the group. */
  for (; S == 3 && (j & ~3) + 4 <= n; j += 2) { /* while the pair's group of four is whole */
    __m256 acc[3][2];
    for (int h = 0; h < 3; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    const uint16_t *kj = k + (size_t)j * Hd;
    for (int i = 0; i < Hd; i += 8)
      for (int kk = 0; kk < 2; kk++) {
        const __m256 key = load_half8(kj + kk * Hd + i);
        for (int h = 0; h < 3; h++) acc[h][kk] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * Hd + i), key, acc[h][kk]);
      }
    for (int h = 0; h < 3; h++) store_two_scores(acc[h], scale, scores + h * stride + j);
  }
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
    for (int h = 0; h < S; h++) store_four_scores(acc[h], scale, scores + h * stride + j);
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
 * o_stride), the S x W sums held in registers; W is a constant in each use, so they stay there. One
 * loop over the item's keys that moves to the next run's rows at a run's end: a loop over the runs
 * around it slowed the float16 item (its 16 ymm registers shuffled at every key; bench/RESULTS.md,
 * figures moved out of code comments). */
static inline __attribute__((always_inline)) void attend_value_columns(const float *w, size_t stride, const int S, const key_runs *runs, int n,
                                                                       int Hd, int i0, const int W, float *o, size_t o_stride) {
  __m256 acc[MAX_SHARED_HEADS][4];
  for (int h = 0; h < S; h++)
    for (int c = 0; c < W; c++) acc[h][c] = _mm256_setzero_ps();
  const uint16_t *vj = (const uint16_t *)runs->values[0] + i0;
  for (int j = 0, run_end = runs->run_keys; j < n; j++, vj += Hd) {
    if (j == run_end) {
      vj = (const uint16_t *)runs->values[j / runs->run_keys] + i0;
      run_end += runs->run_keys;
    }
    __m256 p[MAX_SHARED_HEADS];
    for (int h = 0; h < S; h++) p[h] = _mm256_broadcast_ss(w + h * stride + j);
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
static inline __attribute__((always_inline)) void attend_values(const float *w, size_t stride, const int S, const key_runs *runs, int n, int Hd,
                                                                float *o, size_t o_stride) {
  int i0 = 0;
  /* three heads take 16 dimensions at a time: 12 sums, 3 weights and a value are more registers than
     there are, and a sum kept in memory chained each key's step through a store and a load */
  if (S == 3)
    for (; i0 + 16 <= Hd; i0 += 16) attend_value_columns(w, stride, S, runs, n, Hd, i0, 2, o, o_stride);
  for (; i0 + 32 <= Hd; i0 += 32) attend_value_columns(w, stride, S, runs, n, Hd, i0, 4, o, o_stride);
  for (; i0 < Hd; i0 += 8) attend_value_columns(w, stride, S, runs, n, Hd, i0, 1, o, o_stride);
}

/* The S heads of one item over n keys, S a constant in each instance below: head h's unnormalized
 * output at part + h * part_stride, then its scores' max and its sum of e^(score - max). Each run's
 * scores land at its keys' place in the item's row of scores. */
static inline __attribute__((always_inline)) void attend_heads(const float *q, const int S, const key_runs *runs, int n, int Hd, float scale,
                                                               float *scores, size_t stride, float *part, size_t part_stride) {
  for (int r = 0, first = 0; first < n; r++, first += runs->run_keys)
    attend_scores(q, S, (const uint16_t *)runs->keys[r], run_length(runs, first, n), Hd, scale, scores + first, stride);
  for (int h = 0; h < S; h++) part[h * part_stride + Hd + 1] = attend_softmax(scores + h * stride, n, &part[h * part_stride + Hd]);
  attend_values(scores, stride, S, runs, n, Hd, part, part_stride);
}

static void attend_item_avx2(const float *q, int heads, const key_runs *runs, int n, int Hd, float scale, float *part, size_t part_stride) {
  /* An item's keys and values are a few KB to 64 KB each: ask for all of them at once rather than
     wait for the hardware prefetcher to notice each stream (the B=8 step's attention with every
     layer's cache from DRAM: bench/RESULTS.md, one call a step: the feb8690 row). */
  for (int r = 0, first = 0; first < n; r++, first += runs->run_keys)
    for (size_t at = 0; at < (size_t)run_length(runs, first, n) * Hd * 2; at += 64) {
      _mm_prefetch((const char *)runs->keys[r] + at, _MM_HINT_T0);
      _mm_prefetch((const char *)runs->values[r] + at, _MM_HINT_T0);
    }
  if (Hd % 8 != 0) {
    attend_item_generic(q, heads, runs, n, Hd, scale, part, part_stride);
    return;
  }
  float scores[MAX_SHARED_HEADS * (KEY_CHUNK + 8)];
  const size_t stride = KEY_CHUNK + 8;
  if (heads == 3) attend_heads(q, 3, runs, n, Hd, scale, scores, stride, part, part_stride);
  else if (heads == 2) attend_heads(q, 2, runs, n, Hd, scale, scores, stride, part, part_stride);
  else attend_heads(q, 1, runs, n, Hd, scale, scores, stride, part, part_stride);
}
