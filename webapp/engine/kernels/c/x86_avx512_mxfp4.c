/* The AVX-512 pair tile of MXFP4 (x86_avx2_mxfp4.c's, two groups at once). */

/* tile_mxfp4_x8 for a pair at g: levels plus OFFSET, unsigned, as Q4_0's; the offset's share of the
 * dot taken back from the activations' sums */
static inline __attribute__((always_inline)) void pair_mxfp4(const uint8_t *g, size_t next, const xblock *const *xs, int N, int nb, float *out,
                                                             size_t out_stride) {
  const int group_bytes = 8 * 17;
  const __m512i levels = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MXFP4_TABLE)), _mm512_set1_epi8(OFFSET));
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; b++, g += 2 * group_bytes) {
    prefetch_share(g, 2 * group_bytes, 0, 1);
    /* mxfp4_half_scales' bits for sixteen E8M0 bytes */
    const __m512i e = pair_bytes(g, next, 0);
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __m512 d = _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), normal, subnormal));
    __m512i q[8];
    for (int k = 0; k < 4; k++) {
      const __m512i raw = pair_load(g + 8 + 32 * k, next);
      q[k] = _mm512_shuffle_epi8(levels, _mm512_and_si512(raw, low));
      q[4 + k] = _mm512_shuffle_epi8(levels, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
    TOKENS_UNROLLED
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      int32_t four[8];
      fours_of(x, four);
      const __m512i dot = _mm512_add_epi32(dot512_u8_quads(q, four, 4), dot512_u8_quads(q + 4, four + 4, 4));
      const __m512i exact = _mm512_sub_epi32(dot, _mm512_set1_epi32(OFFSET * (x->sum16[0] + x->sum16[1])));
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(exact), acc[t]);
    }
  }
  for (int t = 0; t < N; t++) _mm512_storeu_ps(out + t * out_stride, acc[t]);
}
