/* The AVX-512 pair tile of Q2_K and Q3_K (x86_avx2_k_low.c's, two groups at once). */

/* a group's sixteen sub-blocks' scale bytes for its eight rows, a 64-bit word (a byte a row) each:
 * tile_k_low_x8's unpacking */
static inline void k_low_group_scales(const uint8_t *g, int three, uint64_t scale[16]) {
  if (three) {
    uint64_t packed[12];
    memcpy(packed, g + Q3K_GROUP_SCALES, sizeof packed);
    for (int k = 0; k < 16; k++)
      scale[k] = ((packed[k % 8] >> 4 * (k / 8)) & 0x0f0f0f0f0f0f0f0fULL) | ((packed[8 + k % 4] >> 2 * (k / 4)) & 0x0303030303030303ULL) << 4;
  } else {
    memcpy(scale, g + Q2K_GROUP_SCALES, 16 * sizeof *scale);
  }
}

/* tile_k_low_x8 (Q3_K where `three`, else Q2_K) for a pair at g (its comment says how a block's values
 * and sub-scales are laid out) */
static inline __attribute__((always_inline)) void pair_k_low(const uint8_t *g, size_t next, const xblock *const *xs, int N, int nb, float *out,
                                                             size_t out_stride, const int three) {
  const int group_bytes = three ? 8 * 110 : 8 * 84, pairs = three ? Q3K_GROUP_LOW : Q2K_GROUP_QUANTS;
  const __m512i two_bits = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
  __m512 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm512_setzero_ps();
  for (int sb = 0; sb < nb / 8; sb++, g += 2 * group_bytes) {
    const __m512 d = pair_halves(g + (three ? Q3K_GROUP_D : Q2K_GROUP_D), next);
    const __m512 dmin = three ? _mm512_setzero_ps() : pair_halves(g + Q2K_GROUP_DMIN, next);
    uint64_t scale[2][16];
    k_low_group_scales(g, three, scale[0]);
    k_low_group_scales(g + next, three, scale[1]);
    for (int c = 0; c < 8; c++) {
      prefetch_share(g, 2 * group_bytes, c, 8);
      __m512i sc[2], mn[2];
      for (int half = 0; half < 2; half++) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)scale[1][2 * c + half], (long long)scale[0][2 * c + half]));
        sc[half] = three ? _mm512_sub_epi32(bytes, _mm512_set1_epi32(32)) : _mm512_and_si512(bytes, _mm512_set1_epi32(15));
        mn[half] = _mm512_srli_epi32(bytes, 4);
      }
      const __m512i low16 = _mm512_set1_epi32(0xffff);
      const __m512i sc_pairs = _mm512_or_si512(_mm512_and_si512(sc[0], low16), _mm512_slli_epi32(sc[1], 16));
      const __m512i mn_pairs = _mm512_or_si512(mn[0], _mm512_slli_epi32(mn[1], 16));
      const uint8_t *slices = g + pairs + 32 * 8 * (c / 4);
      __m512i q[8];
      for (int m = 0; m < 8; m++) {
        q[m] = _mm512_and_si512(_mm512_srli_epi16(pair_load(slices + 32 * m, next), 2 * (c % 4)), two_bits);
        if (three) {
          const __m512i high = pair_load(g + Q3K_GROUP_HIGH + 32 * m, next);
          const __m512i moved = c >= 2 ? _mm512_srli_epi16(high, c - 2) : _mm512_slli_epi16(high, 2 - c);
          q[m] = _mm512_or_si512(q[m], _mm512_and_si512(moved, four));
        }
      }
      TOKENS_UNROLLED
      for (int t = 0; t < N; t++) {
        const xblock *x = &xs[t][8 * sb + c];
        int32_t fours[8], half_sums;
        fours_of(x, fours);
        memcpy(&half_sums, x->sum16, 4);
        __m512i dot = _mm512_add_epi32(dot512_u8_quads_scaled(q, fours, 4, sc[0]), dot512_u8_quads_scaled(q + 4, fours + 4, 4, sc[1]));
        if (three) dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(_mm512_madd_epi16(sc_pairs, _mm512_set1_epi32(half_sums)), 2));
        const __m512 dx = _mm512_set1_ps(x->d);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(dot), acc[t]);
        if (!three) {
          const __m512i mins = _mm512_madd_epi16(mn_pairs, _mm512_set1_epi32(half_sums));
          acc[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(mins), acc[t]);
        }
      }
    }
  }
  for (int t = 0; t < N; t++) _mm512_storeu_ps(out + t * out_stride, acc[t]);
}
