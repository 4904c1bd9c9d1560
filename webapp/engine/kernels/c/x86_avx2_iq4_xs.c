/* IQ4_XS's AVX2 products: a row at a time, and eight interleaved rows (formats.c) at a time. One
 * shuffle looks up 32 indices in IQ4_TABLE (pshufb reads a 16-byte table in each 128-bit half), which
 * gives signed int8 weights; maddubs wants one operand unsigned, so the weights lend their signs to
 * the activations, as dot_s8 does. A pair of products is then up to 2 * 127 * 127, so every maddubs
 * widens to int32 on its own (dot_u8_add): an offset to unsigned weights would overflow the int16
 * pair sums. */

static void row_dot_iq4_xs(const uint8_t *w, int nb, const xblock *const *xs, int n, float *acc) {
  __m256 sum[MAX_TOKEN_GROUP];
  for (int t = 0; t < n; t++) sum[t] = _mm256_setzero_ps();
  const __m256i table = iq4_table();
  for (int sb = 0; sb < nb / 8; sb++, w += 136) {
    const float d = fp16(w + IQ4XS_D);
    for (int j = 0; j < 8; j++) {
      const __m256i q = _mm256_shuffle_epi8(table, nibbles(w + IQ4XS_QUANTS + 16 * j)), magnitude = _mm256_sign_epi8(q, q);
      const __m256 dl = _mm256_set1_ps(d * iq4_xs_scale(w, j));
      for (int t = 0; t < n; t++) {
        const xblock *x = &xs[t][8 * sb + j];
        const __m256i dot = dot_u8(magnitude, _mm256_sign_epi8(xq(x), q));
        sum[t] = _mm256_fmadd_ps(_mm256_mul_ps(dl, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(dot), sum[t]);
      }
    }
  }
  for (int t = 0; t < n; t++) acc[t] += hsum(sum[t]);
}

/* IQ4_XSx8 times N tokens: sub-block j's 16 bytes per row are slices 4j..4j+3, whose low nibbles are
 * values 4k..4k+3 of the eight rows and high nibbles 16 + 4k.., as in a Q4_0x8 block; the eight rows'
 * scales for j come out of two loads, one lane a row. `nb` counts 32-value blocks. */
static inline __attribute__((always_inline)) void tile_iq4_xs_x8(const uint8_t *g, const xblock *const *xs, int N, int nb, float *out,
                                                                 size_t out_stride) {
  const __m256i table = iq4_table(), low = _mm256_set1_epi8(15);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nb / 8; sb++, g += 8 * 136) {
    for (int ahead = 0; ahead < 8 * 136; ahead += 64) _mm_prefetch((const char *)(g + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + IQ4XS_GROUP_D)));
    const __m256i high = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g + IQ4XS_GROUP_SCALES_HIGH)));
    const __m256i lows = _mm256_loadu_si256((const __m256i *)(g + IQ4XS_GROUP_SCALES_LOW));
    for (int j = 0; j < 8; j++) {
      const __m256i scale = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(lows, 4 * j), _mm256_set1_epi32(15)),
                                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, 2 * j), _mm256_set1_epi32(3)), 4));
      const __m256 row_scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(scale, _mm256_set1_epi32(32))));
      const uint8_t *slices = g + IQ4XS_GROUP_QUANTS + 128 * j;
      __m256i q[8], magnitude[8];
      for (int k = 0; k < 4; k++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(slices + 32 * k));
        q[k] = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, low));
        q[4 + k] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
      }
      for (int k = 0; k < 8; k++) magnitude[k] = _mm256_sign_epi8(q[k], q[k]);
      for (int t = 0; t < N; t++) {
        const xblock *x = &xs[t][8 * sb + j];
        int32_t fours[8];
        memcpy(fours, x->q, 32);
        __m256i sum = _mm256_setzero_si256();
        for (int k = 0; k < 8; k++) sum = dot_u8_add(sum, magnitude[k], _mm256_sign_epi8(_mm256_set1_epi32(fours[k]), q[k]));
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(row_scale, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(sum), acc[t]);
      }
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}
