/* The AVX-512 rungs' products (tile_rows_avx512): two groups of eight interleaved rows at once, each
 * 512-bit register holding one group's eight row lanes in its low half and the next group's in its
 * high half, so one instruction does what AVX2's tiles (x86_avx2_products.c) do in two. The pair is
 * stored block by block (ROWS_X16, formats.c's group_place), so its tile reads one stream of memory:
 * read from two places a group apart, a one-token product ran slower than AVX2's (bench/RESULTS.md,
 * 2026-12-07), as it did with its blocks prefetched whole (prefetch_share). Every lane runs the same
 * integer dots and the same float operations in the same order as AVX2's tile for its row, so the
 * results are AVX2's bits (tests/integration/test_isa_ladder.py). Every format with an AVX2 group tile
 * has a pair tile: the 32-value formats' and the K-quants' here, the others' in x86_avx512_<format>.c.
 * A matrix's last group without a partner, and rows outside groups, take AVX2's tiles and row kernels. */

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

/* tile_x8_q8 (Q8_0), and tile_iq4_nl_x8 where `looked_up` (IQ4_NL: Q4_0's nibble slices looked up in
 * its table), for a pair at g: signed weights, so the activations take their signs (dot512_signed) */
static inline __attribute__((always_inline)) void pair_signed(const uint8_t *g, size_t next, const xblock *const *xs, int N, int nb, float *out,
                                                              size_t out_stride, const int looked_up) {
  /* Q8_0's pair block (nine lines) is prefetched in two halves, IQ4_NL's (five) whole */
  const int group_bytes = looked_up ? 8 * 18 : 8 * 34, halves = looked_up ? 1 : 2;
  const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_TABLE));
  __m512 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; b++, g += 2 * group_bytes) {
    prefetch_share(g, 2 * group_bytes, 0, halves);
    const __m512 d = pair_halves(g, next);
    __m512i magnitude[8];
    __mmask64 negative[8];
    if (looked_up) {
      signed_levels(g + 16, next, levels, magnitude, negative);
    } else {
      for (int k = 0; k < 8; k++) {
        const __m512i q = pair_load(g + 16 + 32 * k, next);
        magnitude[k] = _mm512_abs_epi8(q);
        negative[k] = _mm512_movepi8_mask(q);
      }
    }
    TOKENS_UNROLLED
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      int32_t four[8];
      fours_of(x, four);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(dot512_signed(magnitude, negative, four)), acc[t]);
    }
    if (halves == 2) prefetch_share(g, 2 * group_bytes, 1, 2);
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

/* Every format AVX2 has a group tile for has a pair tile here, so is stored in pairs of groups. */
static int interleaves_avx512(int type) {
  return interleaves_avx2(type) ? 16 : 0;
}

#define PAIR(N)                                                                                                       \
  static void pair_##N(int type, const uint8_t *g, size_t next, const xblock *const *xs, int nb, float *out, size_t stride) { \
    if (type == Q8_0x8) pair_signed(g, next, xs, N, nb, out, stride, 0);                                             \
    else if (type == Q4_Kx8) pair_q4_k(g, next, xs, N, nb, out, stride, 0);                                          \
    else if (type == Q5_Kx8) pair_q4_k(g, next, xs, N, nb, out, stride, 1);                                          \
    else if (type == Q6_Kx8) pair_q6_k(g, next, xs, N, nb, out, stride);                                             \
    else if (type == IQ4_XSx8) pair_iq4_xs(g, next, xs, N, nb, out, stride);                                         \
    else if (type == Q5_0x8) pair_q5(g, next, xs, N, nb, out, stride, 0);                                            \
    else if (type == Q5_1x8) pair_q5(g, next, xs, N, nb, out, stride, 1);                                            \
    else if (type == IQ4_NLx8) pair_signed(g, next, xs, N, nb, out, stride, 1);                                       \
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
