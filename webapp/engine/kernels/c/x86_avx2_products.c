/* The AVX2 products: tiles of rows times tokens for the 32-value formats, tiles of eight interleaved
 * rows for every format, and a row at a time for the rest (tile_rows, row_dot of isa.h). */

/* A tile of R weight rows times N tokens for the 32-value formats (Q4_0, Q4_1, Q8_0): each weight
 * block is unpacked once for N tokens and each activation block loaded once for R rows, with R*N
 * independent accumulators in registers. R and N are constants in every instance below. */
static inline __attribute__((always_inline)) void tile32(int type, const uint8_t *w, size_t row_bytes, int R, const xblock *const *xs, int N, int nb,
                                                         float *out, size_t out_stride) {
  const int bb = block_bytes(type);
  __m256 acc[4][4];
  float extra[4][4];
  for (int r = 0; r < R; r++)
    for (int t = 0; t < N; t++) acc[r][t] = _mm256_setzero_ps(), extra[r][t] = 0.0f;
  for (int b = 0; b < nb; b++) {
    __m256i q[4];
    __m256 dw[4];
    float m[4];
    for (int r = 0; r < R; r++) {
      const uint8_t *blk = w + r * row_bytes + (size_t)b * bb;
      /* the rows of the tiles after this one follow it: fetch them while this one computes */
      _mm_prefetch((const char *)(blk + PREFETCH_BYTES), _MM_HINT_T0);
      const float d = fp16(blk);
      dw[r] = _mm256_set1_ps(d);
      if (type == Q8_0) {
        q[r] = _mm256_loadu_si256((const __m256i *)(blk + 2));
      } else {
        q[r] = nibbles(blk + (type == Q4_1 ? 4 : 2));
        m[r] = type == Q4_1 ? fp16(blk + 2) : -8.0f * d;
      }
    }
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      const __m256i xv = xq(x);
      const __m256 dx = _mm256_broadcast_ss(&x->d);
      for (int r = 0; r < R; r++) {
        const __m256i dot = type == Q8_0 ? dot_s8(q[r], xv) : dot_u8(q[r], xv);
        acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(dw[r], dx), _mm256_cvtepi32_ps(dot), acc[r][t]);
        if (type != Q8_0) extra[r][t] += m[r] * x->s;
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int t = 0; t < N; t++) out[t * out_stride + r] = hsum(acc[r][t]) + extra[r][t];
}

#define TILE32(R, N)                                                                                                                   \
  static void tile32_##R##x##N(int type, const uint8_t *w, size_t rb, const xblock *const *xs, int nb, float *out, size_t stride) { \
    if (type == Q8_0) tile32(Q8_0, w, rb, R, xs, N, nb, out, stride);                                                                \
    else if (type == Q4_1) tile32(Q4_1, w, rb, R, xs, N, nb, out, stride);                                                           \
    else tile32(Q4_0, w, rb, R, xs, N, nb, out, stride);                                                                             \
  }
TILE32(4, 1) TILE32(2, 2) TILE32(2, 3) TILE32(2, 4) TILE32(1, 1) TILE32(1, 2) TILE32(1, 3) TILE32(1, 4)
typedef void (*tile_fn)(int, const uint8_t *, size_t, const xblock *const *, int, float *, size_t);

/* Eight interleaved rows (one group) times N tokens: out[t * out_stride + i] for row i of the group.
 * The unpacked quants are shared by the N tokens; a token's 32 activations enter four at a time,
 * broadcast. A block's eight maddubs results add up within int16: each lane is at most 2 * 15 * 127 in
 * size, eight of them 30,480. */
static inline __attribute__((always_inline)) void tile_x8(int type, const uint8_t *g, const xblock *const *xs, int N, int nb, float *out,
                                                          size_t out_stride) {
  const int hdr = type == Q4_1x8 ? 4 : 2, group_bytes = 8 * block_bytes(type); /* scale (and min) per row */
  const __m256i low = _mm256_set1_epi8(15);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++, g += group_bytes) {
    for (int ahead = 0; ahead < group_bytes; ahead += 64) _mm_prefetch((const char *)(g + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    const __m256 m = hdr == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16))) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    __m256i q[8];
    for (int k = 0; k < 4; k++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i *)(g + 8 * hdr + 32 * k));
      q[k] = _mm256_and_si256(raw, low);
      q[4 + k] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      int32_t four[8];
      memcpy(four, x->q, 32);
      const __m256 dot = _mm256_cvtepi32_ps(dot_u8_quads(q, four, 8));
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&x->d)), dot, acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(&x->s), acc[t]);
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

/* The same for Q8_0's signed quants (dot_s8_slices: the activations take the weights' signs). */
static inline __attribute__((always_inline)) void tile_x8_q8(const uint8_t *g, const xblock *const *xs, int N, int nb, float *out, size_t out_stride) {
  const int group_bytes = 8 * 34;
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++, g += group_bytes) {
    for (int ahead = 0; ahead < group_bytes; ahead += 64) _mm_prefetch((const char *)(g + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    __m256i q[8], magnitude[8];
    for (int k = 0; k < 8; k++) {
      q[k] = _mm256_loadu_si256((const __m256i *)(g + 16 + 32 * k));
      magnitude[k] = _mm256_sign_epi8(q[k], q[k]);
    }
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(dot_s8_slices(q, magnitude, x)), acc[t]);
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

/* Q4_Kx8 times N tokens: per 256-value block and pair of sub-blocks, the low nibbles of eight slices
 * against sub-block 2p's activations and the high nibbles against 2p + 1's, as tile_x8 does with a
 * Q4_0 block; each sub-block's product scaled by the eight rows' d * scale, less their dmin * min times
 * the activations' sum. `nb` counts 32-value blocks, as for the other tiles. */
static inline __attribute__((always_inline)) void tile_q4_k_x8(const uint8_t *g, const xblock *const *xs, int N, int nb, float *out,
                                                               size_t out_stride, const int five) {
  const int block_bytes = five ? 8 * 176 : 8 * 144, quants = five ? Q5K_QUANTS : Q4K_QUANTS;
  const __m256i low = _mm256_set1_epi8(15), bit = _mm256_set1_epi8(1);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nb / 8; sb++, g += block_bytes) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + Q4K_D)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + Q4K_DMIN)));
    uint64_t packed[12], scale[8], min[8];
    memcpy(packed, g + Q4K_SCALES, sizeof packed);
    const uint64_t six = 0x3f3f3f3f3f3f3f3fULL, four = 0x0f0f0f0f0f0f0f0fULL, two = 0x0303030303030303ULL;
    for (int j = 0; j < 4; j++) { /* q4k_scale_min, eight rows a word */
      scale[j] = packed[j] & six;
      min[j] = packed[j + 4] & six;
      scale[j + 4] = (packed[j + 8] & four) | (((packed[j] >> 6) & two) << 4);
      min[j + 4] = ((packed[j + 8] >> 4) & four) | (((packed[j + 4] >> 6) & two) << 4);
    }
    for (int j = 0; j < 8; j++) {
      prefetch_share(g, block_bytes, j, 8);
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scale[j])));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)min[j])));
      const __m256 row_scale = _mm256_mul_ps(d, sc), row_min = _mm256_mul_ps(dmin, mn);
      const uint8_t *slices = g + quants + 256 * (j / 2);
      __m256i q[8];
      for (int k = 0; k < 8; k++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(slices + 32 * k));
        q[k] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, low);
        if (five) { /* bit j of each fifth-bit byte, to bit 4 */
          const __m256i high = _mm256_loadu_si256((const __m256i *)(g + Q5K_HIGH + 32 * k));
          q[k] = _mm256_or_si256(q[k], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, j), bit), 4));
        }
      }
      for (int t = 0; t < N; t++) {
        const xblock *x = &xs[t][8 * sb + j];
        int32_t fours[8];
        memcpy(fours, x->q, 32);
        /* Q5_K's values reach 31: four maddubs (at most 2 * 31 * 127 each) fill an int16 lane */
        const __m256i dots = five ? _mm256_add_epi32(dot_u8_quads(q, fours, 4), dot_u8_quads(q + 4, fours + 4, 4)) : dot_u8_quads(q, fours, 8);
        const __m256 dot = _mm256_cvtepi32_ps(dots);
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(row_scale, _mm256_broadcast_ss(&x->d)), dot, acc[t]);
        acc[t] = _mm256_fnmadd_ps(row_min, _mm256_broadcast_ss(&x->s), acc[t]);
      }
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

/* Q6_Kx8 times N tokens. Activation block c = 4h + k of a 256-value block (h the half, k 0..3) takes
 * its 6-bit values from ql slices 16h + 8(k & 1) + m (nibble k >> 1) and qh slices 8h + m (bits 2k,
 * 2k + 1), m = 0..7 for its values 4m..4m+3; its first 16 values share sub-scale 8h + 2k, the last 16
 * the next one. Values are stored plus 32: a sub-block's dot is sum(q * x) - 32 * sum(x), the latter
 * from the activations' half sums. Two maddubs (each at most 2 * 63 * 127) still fit an int16 lane. */
static inline __attribute__((always_inline)) void tile_q6_k_x8(const uint8_t *g, const xblock *const *xs, int N, int nb, float *out,
                                                               size_t out_stride) {
  const __m256i low = _mm256_set1_epi8(15), pair = _mm256_set1_epi8(3);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nb / 8; sb++, g += 8 * 210) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + Q6K_D)));
    for (int c = 0; c < 8; c++) {
      const int h = c / 4, k = c % 4;
      prefetch_share(g, 8 * 210, c, 8);
      const __m256i scale_a = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + Q6K_SCALES + 8 * (8 * h + 2 * k))));
      const __m256i scale_b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + Q6K_SCALES + 8 * (8 * h + 2 * k + 1))));
      const uint8_t *ql = g + Q6K_LOW + 32 * (16 * h + 8 * (k & 1)), *qh = g + Q6K_HIGH + 32 * (8 * h);
      __m256i q[8];
      for (int m = 0; m < 8; m++) {
        const __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 32 * m)), hi = _mm256_loadu_si256((const __m256i *)(qh + 32 * m));
        const __m256i nibble = _mm256_and_si256(k >> 1 ? _mm256_srli_epi16(l, 4) : l, low);
        const __m256i top = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * k), pair);
        q[m] = _mm256_or_si256(nibble, _mm256_slli_epi16(top, 4));
      }
      for (int t = 0; t < N; t++) {
        const xblock *x = &xs[t][8 * sb + c];
        int32_t fours[8];
        memcpy(fours, x->q, 32);
        __m256i half_dot[2];
        for (int part = 0; part < 2; part++) {
          const int m = 4 * part;
          const __m256i dot = _mm256_add_epi32(dot_u8_quads(q + m, fours + m, 2), dot_u8_quads(q + m + 2, fours + m + 2, 2));
          half_dot[part] = _mm256_sub_epi32(dot, _mm256_set1_epi32(32 * x->sum16[part]));
        }
        const __m256i scaled = _mm256_add_epi32(_mm256_mullo_epi32(half_dot[0], scale_a), _mm256_mullo_epi32(half_dot[1], scale_b));
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(scaled), acc[t]);
      }
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

#define TILE_X8(N)                                                                                                           \
  static void tile_x8_##N(int type, const uint8_t *g, const xblock *const *xs, int nb, float *out, size_t stride) {         \
    if (type == Q8_0x8) tile_x8_q8(g, xs, N, nb, out, stride);                                                              \
    else if (type == Q4_Kx8) tile_q4_k_x8(g, xs, N, nb, out, stride, 0);                                                    \
    else if (type == Q5_Kx8) tile_q4_k_x8(g, xs, N, nb, out, stride, 1);                                                    \
    else if (type == Q6_Kx8) tile_q6_k_x8(g, xs, N, nb, out, stride);                                                       \
    else if (type == IQ4_XSx8) tile_iq4_xs_x8(g, xs, N, nb, out, stride);                                                   \
    else if (type == Q3_Kx8) tile_k_low_x8(g, xs, N, nb, out, stride, 1);                                                   \
    else if (type == Q2_Kx8) tile_k_low_x8(g, xs, N, nb, out, stride, 0);                                                   \
    else if (type == Q5_0x8) tile_q5_x8(g, xs, N, nb, out, stride, 0);                                                      \
    else if (type == Q5_1x8) tile_q5_x8(g, xs, N, nb, out, stride, 1);                                                      \
    else if (type == IQ4_NLx8) tile_iq4_nl_x8(g, xs, N, nb, out, stride);                                                   \
    else if (type == MXFP4x8) tile_mxfp4_x8(g, xs, N, nb, out, stride);                                                     \
    else if (type == Q4_1x8) tile_x8(Q4_1x8, g, xs, N, nb, out, stride);                                                    \
    else tile_x8(Q4_0x8, g, xs, N, nb, out, stride);                                                                        \
  }
TILE_X8(1) TILE_X8(2) TILE_X8(3) TILE_X8(4) TILE_X8(5) TILE_X8(6) TILE_X8(7) TILE_X8(8)
typedef void (*group_fn)(int, const uint8_t *, const xblock *const *, int, float *, size_t);

static int tile_rows_avx2(int type, const uint8_t *w, size_t row_bytes, int nb, const xblock *const *xs, int n, float *out, size_t stride,
                          int first, int last) {
  int r = first;
  if (type > ROWS_X8) { /* first and last are multiples of 8: chunks are of 16 rows */
    static const group_fn groups[9] = {0, tile_x8_1, tile_x8_2, tile_x8_3, tile_x8_4, tile_x8_5, tile_x8_6, tile_x8_7, tile_x8_8};
    for (; r < last; r += 8) groups[n](type, w + r * row_bytes, xs, nb, out + r, stride);
  }
  if (type == Q4_0 || type == Q4_1 || type == Q8_0) {
    if (n > 4) { /* tile32's sums (R x N registers) take four tokens: more go in a second pass over the same rows */
      const int done = tile_rows_avx2(type, w, row_bytes, nb, xs, 4, out, stride, first, last);
      tile_rows_avx2(type, w, row_bytes, nb, xs + 4, n - 4, out + 4 * stride, stride, first, last);
      return done;
    }
    static const tile_fn wide[5] = {0, tile32_4x1, tile32_2x2, tile32_2x3, tile32_2x4};
    static const tile_fn narrow[5] = {0, tile32_1x1, tile32_1x2, tile32_1x3, tile32_1x4};
    const int step = n == 1 ? 4 : 2;
    for (; r + step <= last; r += step) wide[n](type, w + r * row_bytes, row_bytes, xs, nb, out + r, stride);
    for (; r < last; r++) narrow[n](type, w + r * row_bytes, row_bytes, xs, nb, out + r, stride);
  }
  return r;
}

/* A row at a time, for rows outside the tiles (a matrix whose rows are not in eights). Each format's
 * row kernel: acc[t] += W_row . x[t] for its nb 32-value blocks. */

static void prefetch_next_row(const uint8_t *w, size_t row_bytes) {
  for (size_t off = 0; off < row_bytes; off += 64) _mm_prefetch((const char *)(w + row_bytes + off), _MM_HINT_T0);
}

/* Q4_0, Q4_1 and Q8_0 */
static void row_dot_32(int type, const uint8_t *w, int nb, const xblock *const *xs, int n, float *acc) {
  __m256 sum[MAX_TOKEN_GROUP];
  float extra[MAX_TOKEN_GROUP] = {0};
  for (int t = 0; t < n; t++) sum[t] = _mm256_setzero_ps();
  const int bb = block_bytes(type);
  for (int b = 0; b < nb; b++, w += bb) {
    const float d = fp16(w);
    if (type == Q8_0) {
      const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2));
      for (int t = 0; t < n; t++)
        sum[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs[t][b].d), _mm256_cvtepi32_ps(dot_s8(q, xq(&xs[t][b]))), sum[t]);
    } else {
      /* value = d*q + m with q in 0..15 (Q4_0: m = -8d): dot = d*dx*sum(q*xq) + m*dx*sum(xq) */
      const float m = type == Q4_1 ? fp16(w + 2) : -8.0f * d;
      const __m256i q = nibbles(w + (type == Q4_1 ? 4 : 2));
      for (int t = 0; t < n; t++) {
        const xblock *x = &xs[t][b];
        sum[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(dot_u8(q, xq(x))), sum[t]);
        extra[t] += m * x->d * (x->sum16[0] + x->sum16[1]);
      }
    }
  }
  for (int t = 0; t < n; t++) acc[t] += hsum(sum[t]) + extra[t];
}

static void row_dot_q4_k(const uint8_t *w, int nb, const xblock *const *xs, int n, float *acc) {
  __m256 sum[MAX_TOKEN_GROUP];
  float extra[MAX_TOKEN_GROUP] = {0};
  for (int t = 0; t < n; t++) sum[t] = _mm256_setzero_ps();
  for (int sb = 0; sb < nb / 8; sb++, w += 144) {
    const float d = fp16(w), dmin = fp16(w + 2);
    const uint8_t *qs = w + 16;
    for (int j = 0; j < 8; j += 2, qs += 32) {
      int sc0, m0, sc1, m1;
      q4k_scale_min(w + 4, j, &sc0, &m0);
      q4k_scale_min(w + 4, j + 1, &sc1, &m1);
      const __m256 ds0 = _mm256_set1_ps(d * sc0), ds1 = _mm256_set1_ps(d * sc1);
      const float dm0 = dmin * m0, dm1 = dmin * m1;
      const __m256i raw = _mm256_loadu_si256((const __m256i *)qs), mask = _mm256_set1_epi8(15);
      const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      for (int t = 0; t < n; t++) {
        const xblock *x0 = &xs[t][8 * sb + j], *x1 = x0 + 1;
        sum[t] = _mm256_fmadd_ps(_mm256_mul_ps(ds0, _mm256_broadcast_ss(&x0->d)), _mm256_cvtepi32_ps(dot_u8(lo, xq(x0))), sum[t]);
        sum[t] = _mm256_fmadd_ps(_mm256_mul_ps(ds1, _mm256_broadcast_ss(&x1->d)), _mm256_cvtepi32_ps(dot_u8(hi, xq(x1))), sum[t]);
        extra[t] -= dm0 * x0->s + dm1 * x1->s;
      }
    }
  }
  for (int t = 0; t < n; t++) acc[t] += hsum(sum[t]) + extra[t];
}

static void row_dot_q6_k(const uint8_t *w, int nb, const xblock *const *xs, int n, float *acc) {
  __m256 sum[MAX_TOKEN_GROUP];
  float extra[MAX_TOKEN_GROUP] = {0};
  for (int t = 0; t < n; t++) sum[t] = _mm256_setzero_ps();
  const __m256i mask4 = _mm256_set1_epi8(15), mask2 = _mm256_set1_epi8(3);
  for (int sb = 0; sb < nb / 8; sb++, w += 210) {
    const uint8_t *ql = w, *qh = w + 128;
    const int8_t *sc = (const int8_t *)(w + 192);
    const float d = fp16(w + 208);
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8) {
      const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
      const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
      /* the four 32-value sub-blocks of this half, 6-bit values 0..63 (stored minus 32) */
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, mask4), _mm256_slli_epi16(_mm256_and_si256(h, mask2), 4)),
          _mm256_or_si256(_mm256_and_si256(l1, mask4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), mask2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), mask4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), mask2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), mask4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), mask2), 4)),
      };
      for (int k = 0; k < 4; k++) {
        const int s0 = sc[2 * k], s1 = sc[2 * k + 1];
        /* int16 lanes 0-7 hold the first 16 values' pair sums, lanes 8-15 the second 16's; the madd
           that widens them applies the two sub-scales too, so this one is not dot_u8 */
        const __m256i scales = _mm256_set_m128i(_mm_set1_epi16((short)s1), _mm_set1_epi16((short)s0));
        const __m256 dv = _mm256_set1_ps(d);
        for (int t = 0; t < n; t++) {
          const xblock *x = &xs[t][8 * sb + 4 * half + k];
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], xq(x)), scales);
          sum[t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(dot), sum[t]);
          extra[t] -= 32.0f * d * x->d * (float)(s0 * x->sum16[0] + s1 * x->sum16[1]);
        }
      }
    }
  }
  for (int t = 0; t < n; t++) acc[t] += hsum(sum[t]) + extra[t];
}

/* Q5_K has no row kernel here: its rows come in eights in real files, and so are interleaved. */
static void row_dot_avx2(int type, const uint8_t *w, int cols, const xblock *const *xs, int n, float *acc) {
  const int nb = cols / 32;
  prefetch_next_row(w, (size_t)cols / block_values(type) * block_bytes(type));
  switch (type) {
    case Q4_0:
    case Q4_1:
    case Q8_0: row_dot_32(type, w, nb, xs, n, acc); return;
    case Q4_K: row_dot_q4_k(w, nb, xs, n, acc); return;
    case Q6_K: row_dot_q6_k(w, nb, xs, n, acc); return;
    case Q2_K: row_dot_q2_k(w, nb, xs, n, acc); return;
    case Q3_K: row_dot_q3_k(w, nb, xs, n, acc); return;
    case IQ4_XS: row_dot_iq4_xs(w, nb, xs, n, acc); return;
    case Q5_0:
    case Q5_1: row_dot_q5(type, w, nb, xs, n, acc); return;
    case IQ4_NL: row_dot_iq4_nl(w, nb, xs, n, acc); return;
    case MXFP4: row_dot_mxfp4(w, nb, xs, n, acc); return;
    default: row_dot_generic(type, w, cols, xs, n, acc);
  }
}
