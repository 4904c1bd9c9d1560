/* Q3_K's and Q2_K's AVX2 row products. Activation block c = 4h + j of a 256-value block (h the half, j
 * 0..3) takes its 2-bit values from bit pair j of the half's 32 bytes (Q3_K: its third bit from bit c
 * of the 32 high-bit bytes); its first 16 values share sub-scale 2c, the last 16 the next one. After
 * maddubs, int16 lanes 0-7 hold the first 16 values' pair sums and lanes 8-15 the second 16's, so the
 * madd that widens them applies the two sub-scales too (as row_dot_q6_k does). Q3_K's values are
 * stored plus 4 and Q2_K's mins are per sub-block: both are taken off with the activations' half sums. */

static void row_dot_q3_k(const uint8_t *w, int nb, const xblock *const *xs, int n, float *acc) {
  __m256 sum[MAX_TOKEN_GROUP];
  float extra[MAX_TOKEN_GROUP] = {0};
  for (int t = 0; t < n; t++) sum[t] = _mm256_setzero_ps();
  const __m256i pair = _mm256_set1_epi8(3), bit = _mm256_set1_epi8(1);
  for (int sb = 0; sb < nb / 8; sb++, w += 110) {
    const float d = fp16(w + Q3K_D);
    const __m256 dv = _mm256_set1_ps(d);
    const __m256i high = _mm256_loadu_si256((const __m256i *)(w + Q3K_HIGH));
    for (int c = 0; c < 8; c++) {
      const __m256i lows = _mm256_loadu_si256((const __m256i *)(w + Q3K_LOW + 32 * (c / 4)));
      const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lows, 2 * (c % 4)), pair),
                                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, c), bit), 2));
      const int s0 = q3k_scale(w + Q3K_SCALES, 2 * c), s1 = q3k_scale(w + Q3K_SCALES, 2 * c + 1);
      const __m256i scales = _mm256_set_m128i(_mm_set1_epi16((short)s1), _mm_set1_epi16((short)s0));
      for (int t = 0; t < n; t++) {
        const xblock *x = &xs[t][8 * sb + c];
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq(x)), scales);
        sum[t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(dot), sum[t]);
        extra[t] -= 4.0f * d * x->d * (float)(s0 * x->sum16[0] + s1 * x->sum16[1]);
      }
    }
  }
  for (int t = 0; t < n; t++) acc[t] += hsum(sum[t]) + extra[t];
}

static void row_dot_q2_k(const uint8_t *w, int nb, const xblock *const *xs, int n, float *acc) {
  __m256 sum[MAX_TOKEN_GROUP];
  float extra[MAX_TOKEN_GROUP] = {0};
  for (int t = 0; t < n; t++) sum[t] = _mm256_setzero_ps();
  const __m256i pair = _mm256_set1_epi8(3);
  for (int sb = 0; sb < nb / 8; sb++, w += 84) {
    const float d = fp16(w + Q2K_D), dmin = fp16(w + Q2K_DMIN);
    const __m256 dv = _mm256_set1_ps(d);
    for (int c = 0; c < 8; c++) {
      const __m256i lows = _mm256_loadu_si256((const __m256i *)(w + Q2K_QUANTS + 32 * (c / 4)));
      const __m256i q = _mm256_and_si256(_mm256_srli_epi16(lows, 2 * (c % 4)), pair);
      const int sm0 = w[Q2K_SCALES + 2 * c], sm1 = w[Q2K_SCALES + 2 * c + 1];
      const __m256i scales = _mm256_set_m128i(_mm_set1_epi16((short)(sm1 & 15)), _mm_set1_epi16((short)(sm0 & 15)));
      for (int t = 0; t < n; t++) {
        const xblock *x = &xs[t][8 * sb + c];
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq(x)), scales);
        sum[t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(dot), sum[t]);
        extra[t] -= dmin * x->d * (float)((sm0 >> 4) * x->sum16[0] + (sm1 >> 4) * x->sum16[1]);
      }
    }
  }
  for (int t = 0; t < n; t++) acc[t] += hsum(sum[t]) + extra[t];
}
