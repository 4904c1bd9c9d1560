/* The AVX-512 rungs' products (tile_rows_avx512): two groups of eight interleaved rows at once, each
 * 512-bit register holding one group's eight row lanes in its low half and the next group's in its
 * high half, so one instruction does what AVX2's tiles (x86_avx2_products.c) do in two. The pair is
 * stored block by block (ROWS_X16, formats.c's group_place), so its tile reads one stream of memory:
 * read from two places a group apart, a one-token product ran slower than AVX2's (bench/RESULTS.md,
 * 2026-12-07), as it did with its blocks prefetched whole (prefetch_share). Every lane
 * runs the same integer dots and the same float operations in the same order as AVX2's tile for its
 * row, so the results are AVX2's bits (tests/integration/test_isa_ladder.py). Every format with an
 * AVX2 group tile has a pair tile here; a group of eight left over, and the rows outside groups, take
 * AVX2's tiles and row kernels. */

/* The integer dots of x86_avx2.c, sixteen int32 lanes wide: VNNI's dpbusd where the build has it,
 * else maddubs and madd (AVX512-BW), the same integers as their 256-bit forms lane for lane. */
#if defined(__AVX512VNNI__)
static inline __m512i dot512_u8_add(__m512i acc, __m512i w, __m512i x) { return _mm512_dpbusd_epi32(acc, w, x); }
static inline __attribute__((always_inline)) __m512i dot512_u8_quads(const __m512i *q, const int32_t *fours, const int K) {
  __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int k = 0; k < K; k++) sum[k & 1] = _mm512_dpbusd_epi32(sum[k & 1], q[k], _mm512_set1_epi32(fours[k]));
  return _mm512_add_epi32(sum[0], sum[1]);
}
#else
static inline __m512i dot512_u8_add(__m512i acc, __m512i w, __m512i x) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
static inline __attribute__((always_inline)) __m512i dot512_u8_quads(const __m512i *q, const int32_t *fours, const int K) {
  __m512i sum = _mm512_maddubs_epi16(q[0], _mm512_set1_epi32(fours[0]));
  for (int k = 1; k < K; k++) sum = _mm512_add_epi16(sum, _mm512_maddubs_epi16(q[k], _mm512_set1_epi32(fours[k])));
  return _mm512_madd_epi16(sum, _mm512_set1_epi16(1));
}
#endif

/* dot512_u8_quads times each lane's scale (int32 lanes, each within int16): x86_avx2.c's dot_u8_quads_scaled */
static inline __attribute__((always_inline)) __m512i dot512_u8_quads_scaled(const __m512i *q, const int32_t *fours, const int K, __m512i scale) {
#if defined(__AVX512VNNI__)
  return _mm512_mullo_epi32(dot512_u8_quads(q, fours, K), scale);
#else
  __m512i sum = _mm512_maddubs_epi16(q[0], _mm512_set1_epi32(fours[0]));
  for (int k = 1; k < K; k++) sum = _mm512_add_epi16(sum, _mm512_maddubs_epi16(q[k], _mm512_set1_epi32(fours[k])));
  return _mm512_madd_epi16(sum, _mm512_or_si512(_mm512_and_si512(scale, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(scale, 16)));
#endif
}

/* 32 bytes at p (low half) and at p + next (high half): the same place in a pair's two groups */
static inline __m512i pair_load(const uint8_t *p, size_t next) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)), _mm256_loadu_si256((const __m256i *)(p + next)), 1);
}
/* eight float16 at p and eight at p + next, as sixteen floats */
static inline __m512 pair_halves(const uint8_t *p, size_t next) {
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + next)), _mm_loadu_si128((const __m128i *)p)));
}
/* eight bytes at p and at p + next, each widened to int32 (signed or not) */
static inline __m512i pair_bytes(const uint8_t *p, size_t next, int is_signed) {
  uint64_t a, b;
  memcpy(&a, p, 8);
  memcpy(&b, p + next, 8);
  const __m128i both = _mm_set_epi64x((long long)b, (long long)a);
  return is_signed ? _mm512_cvtepi8_epi32(both) : _mm512_cvtepu8_epi32(both);
}
/* Before a tile's loop over its N tokens: unrolled whole, each token's sums stay in a register of their
 * own; left a loop, clang kept them on the stack, and each sub-block's sum waited on a store and a load
 * (bench/RESULTS.md, 2026-12-07) */
#define TOKENS_UNROLLED _Pragma("clang loop unroll(full)")
static inline void fours_of(const xblock *x, int32_t four[8]) { memcpy(four, x->q, 32); }

/* Signed weights times a token's 32 activations (fours, four a lane broadcast), as dot_s8_slices: the
 * weights' magnitudes against the activations given the weights' signs. No 512-bit psignb: a masked
 * negation where the weight is negative; where it is zero so is its magnitude, so either sign gives
 * psignb's product. */
static inline __attribute__((always_inline)) __m512i dot512_signed(const __m512i *magnitude, const __mmask64 *negative, const int32_t *fours) {
  __m512i sum = _mm512_setzero_si512();
  for (int k = 0; k < 8; k++) {
    const __m512i xk = _mm512_set1_epi32(fours[k]);
    sum = dot512_u8_add(sum, magnitude[k], _mm512_mask_sub_epi8(xk, negative[k], _mm512_setzero_si512(), xk));
  }
  return sum;
}
/* A pair's four nibble slices at p looked up in `levels` (IQ4's signed table): each value's magnitude
 * and sign, low nibbles as slices 0..3, high ones as 4..7 */
static inline __attribute__((always_inline)) void signed_levels(const uint8_t *p, size_t next, __m512i levels, __m512i *magnitude, __mmask64 *negative) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int k = 0; k < 4; k++) {
    const __m512i raw = pair_load(p + 32 * k, next);
    const __m512i lo = _mm512_shuffle_epi8(levels, _mm512_and_si512(raw, low));
    const __m512i hi = _mm512_shuffle_epi8(levels, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    magnitude[k] = _mm512_abs_epi8(lo), negative[k] = _mm512_movepi8_mask(lo);
    magnitude[4 + k] = _mm512_abs_epi8(hi), negative[4 + k] = _mm512_movepi8_mask(hi);
  }
}

/* acc + a block's dot scaled by the rows' d and the token's, and the rows' m (their minimum, or Q4_0's and
 * Q5_0's offset times d) by the token's d * sum(q): a 32-value format with a minimum, as tile_x8 adds it */
static inline __m512 add_block(__m512 acc, __m512 d, __m512 m, const xblock *x, __m512i dot) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(dot), acc);
  return _mm512_fmadd_ps(m, _mm512_set1_ps(x->s), acc);
}

/* tile_x8's Q4_0x8 and Q4_1x8 for a pair at g (its second group's block `next` bytes after the first's) */
static inline __attribute__((always_inline)) void pair_x8(int type, const uint8_t *g, size_t next, const xblock *const *xs, int N, int nb, float *out,
                                                          size_t out_stride) {
  const int hdr = type == Q4_1x8 ? 4 : 2, group_bytes = 8 * block_bytes(type);
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; b++, g += 2 * group_bytes) {
    prefetch_share(g, 2 * group_bytes, 0, 1);
    const __m512 d = pair_halves(g, next);
    const __m512 m = hdr == 4 ? pair_halves(g + 16, next) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    __m512i q[8];
    for (int k = 0; k < 4; k++) {
      const __m512i raw = pair_load(g + 8 * hdr + 32 * k, next);
      q[k] = _mm512_and_si512(raw, low);
      q[4 + k] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    TOKENS_UNROLLED
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      int32_t four[8];
      fours_of(x, four);
      acc[t] = add_block(acc[t], d, m, x, dot512_u8_quads(q, four, 8));
    }
  }
  for (int t = 0; t < N; t++) _mm512_storeu_ps(out + t * out_stride, acc[t]);
}

/* tile_x8_q8: the activations take the weights' signs (dot512_signed) */
static inline __attribute__((always_inline)) void pair_x8_q8(const uint8_t *g, size_t next, const xblock *const *xs, int N, int nb, float *out,
                                                             size_t out_stride) {
  const int group_bytes = 8 * 34;
  __m512 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; b++, g += 2 * group_bytes) {
    prefetch_share(g, 2 * group_bytes, 0, 2);
    const __m512 d = pair_halves(g, next);
    __m512i magnitude[8];
    __mmask64 negative[8];
    for (int k = 0; k < 8; k++) {
      const __m512i q = pair_load(g + 16 + 32 * k, next);
      magnitude[k] = _mm512_abs_epi8(q);
      negative[k] = _mm512_movepi8_mask(q);
    }
    TOKENS_UNROLLED
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      int32_t four[8];
      fours_of(x, four);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(dot512_signed(magnitude, negative, four)), acc[t]);
    }
    prefetch_share(g, 2 * group_bytes, 1, 2);
  }
  for (int t = 0; t < N; t++) _mm512_storeu_ps(out + t * out_stride, acc[t]);
}

/* q4k_scale_min of a group's eight rows, a byte a row in each word: sub-block j's scales and mins */
static inline void q4k_group_scales(const uint8_t *g, uint64_t scale[8], uint64_t min[8]) {
  uint64_t packed[12];
  memcpy(packed, g + Q4K_SCALES, sizeof packed);
  const uint64_t six = 0x3f3f3f3f3f3f3f3fULL, four = 0x0f0f0f0f0f0f0f0fULL, two = 0x0303030303030303ULL;
  for (int j = 0; j < 4; j++) {
    scale[j] = packed[j] & six;
    min[j] = packed[j + 4] & six;
    scale[j + 4] = (packed[j + 8] & four) | (((packed[j] >> 6) & two) << 4);
    min[j + 4] = ((packed[j + 8] >> 4) & four) | (((packed[j + 4] >> 6) & two) << 4);
  }
}

/* tile_q4_k_x8 (Q4_K, and Q5_K where `five`) for a pair at g */
static inline __attribute__((always_inline)) void pair_q4_k(const uint8_t *g, size_t next, const xblock *const *xs, int N, int nb, float *out,
                                                            size_t out_stride, const int five) {
  const int block_bytes = five ? 8 * 176 : 8 * 144, quants = five ? Q5K_QUANTS : Q4K_QUANTS;
  const __m512i low = _mm512_set1_epi8(15), bit = _mm512_set1_epi8(1);
  __m512 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm512_setzero_ps();
  for (int sb = 0; sb < nb / 8; sb++, g += 2 * block_bytes) {
    const __m512 d = pair_halves(g + Q4K_D, next), dmin = pair_halves(g + Q4K_DMIN, next);
    uint64_t scale[2][8], min[2][8];
    q4k_group_scales(g, scale[0], min[0]);
    q4k_group_scales(g + next, scale[1], min[1]);
    for (int j = 0; j < 8; j++) {
      prefetch_share(g, 2 * block_bytes, j, 8);
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x((long long)scale[1][j], (long long)scale[0][j])));
      const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x((long long)min[1][j], (long long)min[0][j])));
      const __m512 row_scale = _mm512_mul_ps(d, sc), row_min = _mm512_mul_ps(dmin, mn);
      const uint8_t *slices = g + quants + 256 * (j / 2);
      __m512i q[8];
      for (int k = 0; k < 8; k++) {
        const __m512i raw = pair_load(slices + 32 * k, next);
        q[k] = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(raw, 4) : raw, low);
        if (five) {
          const __m512i high = pair_load(g + Q5K_HIGH + 32 * k, next);
          q[k] = _mm512_or_si512(q[k], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(high, j), bit), 4));
        }
      }
      TOKENS_UNROLLED
      for (int t = 0; t < N; t++) {
        const xblock *x = &xs[t][8 * sb + j];
        int32_t fours[8];
        fours_of(x, fours);
        /* as in tile_q4_k_x8: Q5_K's values reach 31, so four maddubs at most share an int16 lane */
        const __m512i dots = five ? _mm512_add_epi32(dot512_u8_quads(q, fours, 4), dot512_u8_quads(q + 4, fours + 4, 4)) : dot512_u8_quads(q, fours, 8);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(row_scale, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(dots), acc[t]);
        acc[t] = _mm512_fnmadd_ps(row_min, _mm512_set1_ps(x->s), acc[t]);
      }
    }
  }
  for (int t = 0; t < N; t++) _mm512_storeu_ps(out + t * out_stride, acc[t]);
}

/* tile_q6_k_x8 for a pair at g (its comment says how a block's values are laid out) */
static inline __attribute__((always_inline)) void pair_q6_k(const uint8_t *g, size_t next, const xblock *const *xs, int N, int nb, float *out,
                                                            size_t out_stride) {
  const __m512i low = _mm512_set1_epi8(15), two_bits = _mm512_set1_epi8(3);
  __m512 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm512_setzero_ps();
  for (int sb = 0; sb < nb / 8; sb++, g += 2 * 8 * 210) {
    const __m512 d = pair_halves(g + Q6K_D, next);
    for (int c = 0; c < 8; c++) {
      const int h = c / 4, k = c % 4;
      prefetch_share(g, 2 * 8 * 210, c, 8);
      const __m512i scale_a = pair_bytes(g + Q6K_SCALES + 8 * (8 * h + 2 * k), next, 1);
      const __m512i scale_b = pair_bytes(g + Q6K_SCALES + 8 * (8 * h + 2 * k + 1), next, 1);
      const uint8_t *ql = g + Q6K_LOW + 32 * (16 * h + 8 * (k & 1)), *qh = g + Q6K_HIGH + 32 * (8 * h);
      __m512i q[8];
      for (int m = 0; m < 8; m++) {
        const __m512i l = pair_load(ql + 32 * m, next), hi = pair_load(qh + 32 * m, next);
        const __m512i nibble = _mm512_and_si512(k >> 1 ? _mm512_srli_epi16(l, 4) : l, low);
        const __m512i top = _mm512_and_si512(_mm512_srli_epi16(hi, 2 * k), two_bits);
        q[m] = _mm512_or_si512(nibble, _mm512_slli_epi16(top, 4));
      }
      TOKENS_UNROLLED
      for (int t = 0; t < N; t++) {
        const xblock *x = &xs[t][8 * sb + c];
        int32_t fours[8];
        fours_of(x, fours);
        __m512i half_dot[2];
        for (int part = 0; part < 2; part++) {
          const int m = 4 * part;
          const __m512i dot = _mm512_add_epi32(dot512_u8_quads(q + m, fours + m, 2), dot512_u8_quads(q + m + 2, fours + m + 2, 2));
          half_dot[part] = _mm512_sub_epi32(dot, _mm512_set1_epi32(32 * x->sum16[part]));
        }
        const __m512i scaled = _mm512_add_epi32(_mm512_mullo_epi32(half_dot[0], scale_a), _mm512_mullo_epi32(half_dot[1], scale_b));
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(scaled), acc[t]);
      }
    }
  }
  for (int t = 0; t < N; t++) _mm512_storeu_ps(out + t * out_stride, acc[t]);
}

/* tile_iq4_xs_x8 for a pair at g: the table's levels are signed, so the activations take the weights'
 * signs as in pair_x8_q8 */
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

/* tile_iq4_nl_x8 for a pair at g: Q4_0's slices looked up, then pair_x8_q8's signed dot */
static inline __attribute__((always_inline)) void pair_iq4_nl(const uint8_t *g, size_t next, const xblock *const *xs, int N, int nb, float *out,
                                                              size_t out_stride) {
  const int group_bytes = 8 * 18;
  const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_TABLE));
  __m512 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; b++, g += 2 * group_bytes) {
    prefetch_share(g, 2 * group_bytes, 0, 1);
    const __m512 d = pair_halves(g, next);
    __m512i magnitude[8];
    __mmask64 negative[8];
    signed_levels(g + 16, next, levels, magnitude, negative);
    TOKENS_UNROLLED
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      int32_t four[8];
      fours_of(x, four);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(dot512_signed(magnitude, negative, four)), acc[t]);
    }
  }
  for (int t = 0; t < N; t++) _mm512_storeu_ps(out + t * out_stride, acc[t]);
}

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

/* Every format AVX2 has a group tile for has a pair tile here, so is stored in pairs of groups. */
static int interleaves_avx512(int type) {
  return interleaves_avx2(type) ? 16 : 0;
}

#define PAIR(N)                                                                                                       \
  static void pair_##N(int type, const uint8_t *g, size_t next, const xblock *const *xs, int nb, float *out, size_t stride) { \
    if (type == Q8_0x8) pair_x8_q8(g, next, xs, N, nb, out, stride);                                                 \
    else if (type == Q4_Kx8) pair_q4_k(g, next, xs, N, nb, out, stride, 0);                                          \
    else if (type == Q5_Kx8) pair_q4_k(g, next, xs, N, nb, out, stride, 1);                                          \
    else if (type == Q6_Kx8) pair_q6_k(g, next, xs, N, nb, out, stride);                                             \
    else if (type == IQ4_XSx8) pair_iq4_xs(g, next, xs, N, nb, out, stride);                                         \
    else if (type == Q5_0x8) pair_q5(g, next, xs, N, nb, out, stride, 0);                                            \
    else if (type == Q5_1x8) pair_q5(g, next, xs, N, nb, out, stride, 1);                                            \
    else if (type == IQ4_NLx8) pair_iq4_nl(g, next, xs, N, nb, out, stride);                                         \
    else if (type == MXFP4x8) pair_mxfp4(g, next, xs, N, nb, out, stride);                                           \
    else if (type == Q3_Kx8) pair_k_low(g, next, xs, N, nb, out, stride, 1);                                         \
    else if (type == Q2_Kx8) pair_k_low(g, next, xs, N, nb, out, stride, 0);                                         \
    else if (type == Q4_1x8) pair_x8(Q4_1x8, g, next, xs, N, nb, out, stride);                                       \
    else pair_x8(Q4_0x8, g, next, xs, N, nb, out, stride);                                                           \
  }
PAIR(1) PAIR(2) PAIR(3) PAIR(4) PAIR(5) PAIR(6) PAIR(7) PAIR(8)
typedef void (*pair_fn)(int, const uint8_t *, size_t, const xblock *const *, int, float *, size_t);

static int tile_rows_avx512(int type, const uint8_t *w, size_t row_bytes, int nb, const xblock *const *xs, int n, float *out, size_t stride,
                            int first, int last) {
  if (type < ROWS_X16 || type >= STACKED) return tile_rows_avx2(type, w, row_bytes, nb, xs, n, out, stride, first, last);
  static const pair_fn pairs[9] = {0, pair_1, pair_2, pair_3, pair_4, pair_5, pair_6, pair_7, pair_8};
  const int in_eights = type - ROWS_X16 + ROWS_X8, group_block = 8 * block_bytes(type);
  int r = first; /* a multiple of 16 (linear.c's chunks), last one of 8 */
  for (; r + 16 <= last; r += 16) pairs[n](in_eights, w + r * row_bytes, group_block, xs, nb, out + r, stride);
  /* the matrix's last group, without a partner, is stored as in eights */
  return r < last ? tile_rows_avx2(in_eights, w, row_bytes, nb, xs, n, out, stride, r, last) : r;
}
