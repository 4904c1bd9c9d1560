/* The AVX-512 pair tile of Q5_0 and Q5_1 (x86_avx2_q5.c's, two groups at once). */

/* tile_q5_x8 (Q5_0, and Q5_1 where `with_min`) for a pair at g: its comment says how pshufb spreads
 * each row's fifth-bit word over the row's lane, which a 512-bit pshufb does in each 128-bit lane */
static inline __attribute__((always_inline)) void pair_q5(const uint8_t *g, size_t next, const xblock *const *xs, int N, int nb, float *out,
                                                          size_t out_stride, const int with_min) {
  const int group_bytes = with_min ? 8 * 24 : 8 * 22, bits_at = with_min ? 32 : 16, quants_at = bits_at + 32;
  const __m512i low = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
  const __m512i lane_bytes = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c));
  __m512 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; b++, g += 2 * group_bytes) {
    prefetch_share(g, 2 * group_bytes, 0, 1);
    const __m512 d = pair_halves(g, next);
    const __m512 m = with_min ? pair_halves(g + 16, next) : _mm512_mul_ps(d, _mm512_set1_ps(-16.0f));
    const __m512i words = pair_load(g + bits_at, next);
    __m512i q[8];
    for (int k = 0; k < 4; k++) {
      const __m512i raw = pair_load(g + quants_at + 32 * k, next);
      const __m512i bit = _mm512_set1_epi32(k % 2 ? (int)0x80402010 : 0x08040201);
      const __m512i lo_bits = _mm512_shuffle_epi8(words, _mm512_add_epi8(lane_bytes, _mm512_set1_epi8((char)(k / 2))));
      const __m512i hi_bits = _mm512_shuffle_epi8(words, _mm512_add_epi8(lane_bytes, _mm512_set1_epi8((char)(2 + k / 2))));
      const __m512i lo_fifth = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(lo_bits, bit), sixteen);
      const __m512i hi_fifth = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(hi_bits, bit), sixteen);
      q[k] = _mm512_or_si512(_mm512_and_si512(raw, low), lo_fifth);
      q[4 + k] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), hi_fifth);
    }
    TOKENS_UNROLLED
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      int32_t four[8];
      fours_of(x, four);
      /* as in tile_q5_x8: values reach 31, so four maddubs at most share an int16 lane */
      acc[t] = add_block(acc[t], d, m, x, _mm512_add_epi32(dot512_u8_quads(q, four, 4), dot512_u8_quads(q + 4, four + 4, 4)));
    }
  }
  for (int t = 0; t < N; t++) _mm512_storeu_ps(out + t * out_stride, acc[t]);
}
