/* The AVX-512 pair tile of IQ4_XS (x86_avx2_iq4_xs.c's, two groups at once); IQ4_NL's is Q8_0's
 * (x86_avx512_products.c's pair_signed). */

/* tile_iq4_xs_x8 for a pair at g: the table's levels are signed, so the activations take the weights'
 * signs as in pair_signed */
static inline __attribute__((always_inline)) void pair_iq4_xs(const uint8_t *g, size_t next, const xblock *const *xs, int N, int nb, float *out,
                                                              size_t out_stride) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_TABLE));
  __m512 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm512_setzero_ps();
  for (int sb = 0; sb < nb / 8; sb++, g += 2 * 8 * 136) {
    const __m512 d = pair_halves(g + IQ4XS_GROUP_D, next);
    const __m512i high = _mm512_cvtepu16_epi32(
        _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(g + next + IQ4XS_GROUP_SCALES_HIGH)), _mm_loadu_si128((const __m128i *)(g + IQ4XS_GROUP_SCALES_HIGH))));
    const __m512i lows = pair_load(g + IQ4XS_GROUP_SCALES_LOW, next);
    for (int j = 0; j < 8; j++) {
      prefetch_share(g, 2 * 8 * 136, j, 8);
      const __m512i scale = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(lows, 4 * j), _mm512_set1_epi32(15)),
                                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * j), _mm512_set1_epi32(3)), 4));
      const __m512 row_scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(scale, _mm512_set1_epi32(32))));
      __m512i magnitude[8];
      __mmask64 negative[8];
      signed_levels(g + IQ4XS_GROUP_QUANTS + 128 * j, next, table, magnitude, negative);
      TOKENS_UNROLLED
      for (int t = 0; t < N; t++) {
        const xblock *x = &xs[t][8 * sb + j];
        int32_t fours[8];
        fours_of(x, fours);
        const __m512i sum = dot512_signed(magnitude, negative, fours);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(row_scale, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(sum), acc[t]);
      }
    }
  }
  for (int t = 0; t < N; t++) _mm512_storeu_ps(out + t * out_stride, acc[t]);
}
