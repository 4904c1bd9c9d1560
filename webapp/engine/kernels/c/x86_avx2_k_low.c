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

/* Q3_Kx8 and Q2_Kx8 times N tokens: for activation block c = 4h + j, slice 8h + m of the pairs (bit
 * pair j) holds values 4m..4m+3 of the eight rows (Q3_K: with slice m of the high bits, bit c), one row
 * a lane; slices 0..3 make the first 16 values, under sub-scale 2c, and 4..7 the last 16. Values are
 * at most 7, so four maddubs stay within int16. The eight rows' sub-scales come eight at a time: Q2_K's
 * as a byte row of the group, Q3_K's unpacked from its twelve byte rows as q3k_scale does, a 64-bit
 * word (eight rows) at a time. `nb` counts 32-value blocks. */
static inline __attribute__((always_inline)) void tile_k_low_x8(const uint8_t *g, const xblock *const *xs, int N, int nb, float *out,
                                                                size_t out_stride, const int three) {
  const int group_bytes = three ? 8 * 110 : 8 * 84, pairs = three ? Q3K_GROUP_LOW : Q2K_GROUP_QUANTS;
  const __m256i pair = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nb / 8; sb++, g += group_bytes) {
    for (int ahead = 0; ahead < group_bytes; ahead += 64) _mm_prefetch((const char *)(g + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + (three ? Q3K_GROUP_D : Q2K_GROUP_D))));
    const __m256 dmin = three ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + Q2K_GROUP_DMIN)));
    uint64_t scale[16]; /* sub-block k's byte for each of the eight rows (Q2_K: scale and min nibbles) */
    if (three) {
      uint64_t packed[12];
      memcpy(packed, g + Q3K_GROUP_SCALES, sizeof packed);
      for (int k = 0; k < 16; k++)
        scale[k] = ((packed[k % 8] >> 4 * (k / 8)) & 0x0f0f0f0f0f0f0f0fULL) | ((packed[8 + k % 4] >> 2 * (k / 4)) & 0x0303030303030303ULL) << 4;
    } else {
      memcpy(scale, g + Q2K_GROUP_SCALES, sizeof scale);
    }
    for (int c = 0; c < 8; c++) {
      /* the eight rows' sub-scales (int32 lanes) for the two halves, and both as int16 pairs (first
         half low) against the activations' two half sums; Q2_K's mins likewise */
      __m256i sc[2], mn[2];
      for (int half = 0; half < 2; half++) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scale[2 * c + half]));
        sc[half] = three ? _mm256_sub_epi32(bytes, _mm256_set1_epi32(32)) : _mm256_and_si256(bytes, _mm256_set1_epi32(15));
        mn[half] = _mm256_srli_epi32(bytes, 4);
      }
      const __m256i low16 = _mm256_set1_epi32(0xffff);
      const __m256i sc_pairs = _mm256_or_si256(_mm256_and_si256(sc[0], low16), _mm256_slli_epi32(sc[1], 16));
      const __m256i mn_pairs = _mm256_or_si256(mn[0], _mm256_slli_epi32(mn[1], 16));
      const uint8_t *slices = g + pairs + 32 * 8 * (c / 4);
      __m256i q[8];
      for (int m = 0; m < 8; m++) {
        q[m] = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(slices + 32 * m)), 2 * (c % 4)), pair);
        if (three) { /* bit c of the high bits, to bit 2: one shift either way */
          const __m256i high = _mm256_loadu_si256((const __m256i *)(g + Q3K_GROUP_HIGH + 32 * m));
          const __m256i moved = c >= 2 ? _mm256_srli_epi16(high, c - 2) : _mm256_slli_epi16(high, 2 - c);
          q[m] = _mm256_or_si256(q[m], _mm256_and_si256(moved, four));
        }
      }
      for (int t = 0; t < N; t++) {
        const xblock *x = &xs[t][8 * sb + c];
        int32_t fours[8], half_sums;
        memcpy(fours, x->q, 32);
        memcpy(&half_sums, x->sum16, 4);
        __m256i dot = _mm256_add_epi32(dot_u8_quads_scaled(q, fours, 4, sc[0]), dot_u8_quads_scaled(q + 4, fours + 4, 4, sc[1]));
        if (three) /* values stored plus 4: less 4 * (scale_a * sum_a + scale_b * sum_b) */
          dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(_mm256_madd_epi16(sc_pairs, _mm256_set1_epi32(half_sums)), 2));
        const __m256 dx = _mm256_broadcast_ss(&x->d);
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(dot), acc[t]);
        if (!three) {
          const __m256i mins = _mm256_madd_epi16(mn_pairs, _mm256_set1_epi32(half_sums));
          acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mins), acc[t]);
        }
      }
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}
