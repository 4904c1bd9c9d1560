/* The AVX2 products of IQ4_NL (format_iq4_nl.c): a row kernel and a tile of eight interleaved rows
 * (IQ4_NLx8, Q4_0x8's layout).
 *
 * pshufb looks the nibbles up in the 16-level table, giving the values as signed bytes; maddubs wants
 * one operand unsigned, so the activations take the levels' signs (dot_s8's way). A pair sum is then
 * at most 2 * 127 * 127 = 32,258: one maddubs fills an int16 lane, and each is widened on its own. */

static void row_dot_iq4_nl(const uint8_t *w, int nb, const xblock *const *xs, int n, float *acc) {
  const __m256i levels = iq4_table();
  __m256 sum[MAX_TOKEN_GROUP];
  for (int t = 0; t < n; t++) sum[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++, w += 18) {
    const float d = fp16(w);
    const __m256i q = _mm256_shuffle_epi8(levels, nibbles(w + 2)), magnitude = _mm256_sign_epi8(q, q);
    for (int t = 0; t < n; t++) {
      const xblock *x = &xs[t][b];
      const __m256i dot = dot_u8(magnitude, _mm256_sign_epi8(xq(x), q));
      sum[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(dot), sum[t]);
    }
  }
  for (int t = 0; t < n; t++) acc[t] += hsum(sum[t]);
}

/* Eight interleaved rows times N tokens: tile_x8's slices, looked up, then tile_x8_q8's signed dot. */
static inline __attribute__((always_inline)) void tile_iq4_nl_x8(const uint8_t *g, const xblock *const *xs, int N, int nb, float *out,
                                                                 size_t out_stride) {
  const int group_bytes = 8 * 18;
  const __m256i levels = iq4_table(), low = _mm256_set1_epi8(15);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++, g += group_bytes) {
    for (int ahead = 0; ahead < group_bytes; ahead += 64) _mm_prefetch((const char *)(g + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    __m256i q[8], magnitude[8];
    for (int k = 0; k < 4; k++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i *)(g + 16 + 32 * k));
      q[k] = _mm256_shuffle_epi8(levels, _mm256_and_si256(raw, low));
      q[4 + k] = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
    }
    for (int k = 0; k < 8; k++) magnitude[k] = _mm256_sign_epi8(q[k], q[k]);
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(dot_s8_slices(q, magnitude, x)), acc[t]);
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}
