/* The neon_i8mm rung's products (ARMv8.6's int8 matrix multiply, smmla): two rows against two tokens
 * at a time, each smmla multiplying two rows' eight int8 weights by two tokens' eight activations into
 * the four int32 dots of the pairs, so one instruction does the work of four sdot lanes. A 2 x 2 tile's
 * four float32 lanes (row 0 with tokens 0 and 1, then row 1 with them) each carry one row's sum with
 * one token; a row or token without a partner is paired with zeros, so every row's and token's numbers
 * are the same whichever rows and tokens share the call (and whichever rows a thread's chunk holds). */

/* [a's values 8h..8h + 7, b's values 8h..8h + 7]: two rows (or tokens) of eight, as smmla reads them */
static inline int8x16_t eight_and_eight(int8x16_t a, int8x16_t b, int h) {
  const int64x2_t a64 = vreinterpretq_s64_s8(a), b64 = vreinterpretq_s64_s8(b);
  return vreinterpretq_s8_s64(h ? vzip2q_s64(a64, b64) : vzip1q_s64(a64, b64));
}

/* the int32 dots of two rows' sixteen weights (w0, w1) with two tokens' sixteen activations (x0, x1):
 * [w0.x0, w0.x1, w1.x0, w1.x1] */
static inline int32x4_t dots_2x2(int8x16_t w0, int8x16_t w1, int8x16_t x0, int8x16_t x1) {
  const int32x4_t first = vmmlaq_s32(vdupq_n_s32(0), eight_and_eight(w0, w1, 0), eight_and_eight(x0, x1, 0));
  return vmmlaq_s32(first, eight_and_eight(w0, w1, 1), eight_and_eight(x0, x1, 1));
}

/* acc0[t] += W_row0 . x[t] and acc1[t] += W_row1 . x[t] for t < n; row1 null: a row of zeros. Returns
 * 0 (nothing added) for a type arm_neon_products.c does not unpack. */
static int row_pair_dot(int type, const uint8_t *row0, const uint8_t *row1, int cols, const xblock *const *xs, int n, float *acc0, float *acc1) {
  const int bv = block_values(type), bb = block_bytes(type), sub_blocks = bv / 32;
  unpacked_block u[2];
  memset(&u[1], 0, sizeof u[1]);
  if (!unpack_block(type, row0, &u[0])) return 0;
  float32x4_t sum[MAX_TOKEN_GROUP / 2];
  float extra[2][MAX_TOKEN_GROUP] = {{0}};
  for (int p = 0; p < (n + 1) / 2; p++) sum[p] = vdupq_n_f32(0.0f);
  const int8x16_t none = vdupq_n_s8(0);
  for (int b = 0; b < cols / bv; b++) {
    if (b > 0) unpack_block(type, row0 + (size_t)b * bb, &u[0]);
    if (row1) unpack_block(type, row1 + (size_t)b * bb, &u[1]);
    for (int s = 0; s < sub_blocks; s++) {
      const int8x16_t w00 = vld1q_s8(u[0].q + 32 * s), w01 = vld1q_s8(u[0].q + 32 * s + 16);
      const int8x16_t w10 = vld1q_s8(u[1].q + 32 * s), w11 = vld1q_s8(u[1].q + 32 * s + 16);
      const float32x4_t scale0 = {u[0].scale[2 * s], u[0].scale[2 * s], u[1].scale[2 * s], u[1].scale[2 * s]};
      const float32x4_t scale1 = {u[0].scale[2 * s + 1], u[0].scale[2 * s + 1], u[1].scale[2 * s + 1], u[1].scale[2 * s + 1]};
      for (int t = 0; t < n; t += 2) {
        const xblock *x0 = &xs[t][b * sub_blocks + s], *x1 = t + 1 < n ? &xs[t + 1][b * sub_blocks + s] : 0;
        const int8x16_t q00 = vld1q_s8(x0->q), q01 = vld1q_s8(x0->q + 16);
        const int8x16_t q10 = x1 ? vld1q_s8(x1->q) : none, q11 = x1 ? vld1q_s8(x1->q + 16) : none;
        const float d1 = x1 ? x1->d : 0.0f;
        const float32x4_t d = {x0->d, d1, x0->d, d1};
        sum[t / 2] = vfmaq_f32(sum[t / 2], vcvtq_f32_s32(dots_2x2(w00, w10, q00, q10)), vmulq_f32(scale0, d));
        sum[t / 2] = vfmaq_f32(sum[t / 2], vcvtq_f32_s32(dots_2x2(w01, w11, q01, q11)), vmulq_f32(scale1, d));
      }
      for (int r = 0; r < 2; r++)
        for (int t = 0; t < n; t++) add_min_terms(&extra[r][t], &u[r], s, &xs[t][b * sub_blocks + s]);
    }
  }
  for (int t = 0; t < n; t++) {
    float lanes[4];
    vst1q_f32(lanes, sum[t / 2]);
    acc0[t] += lanes[t % 2] + extra[0][t];
    acc1[t] += lanes[2 + t % 2] + extra[1][t];
  }
  return 1;
}

/* Rows first..last - 1 in pairs; the odd one out goes to row_dot_i8mm, which pairs it with zeros. */
static int tile_rows_i8mm(int type, const uint8_t *w, size_t row_bytes, int nb, const xblock *const *xs, int n, float *out, size_t stride,
                          int first, int last) {
  int r = first;
  for (; r + 1 < last; r += 2) {
    float acc[2][MAX_TOKEN_GROUP] = {{0}};
    if (!row_pair_dot(type, w + (size_t)r * row_bytes, w + (size_t)(r + 1) * row_bytes, nb * 32, xs, n, acc[0], acc[1])) return r;
    for (int t = 0; t < n; t++) out[(size_t)t * stride + r] = acc[0][t], out[(size_t)t * stride + r + 1] = acc[1][t];
  }
  return r;
}

static void row_dot_i8mm(int type, const uint8_t *w, int cols, const xblock *const *xs, int n, float *acc) {
  float unused[MAX_TOKEN_GROUP] = {0};
  if (!row_pair_dot(type, w, 0, cols, xs, n, acc, unused)) row_dot_generic(type, w, cols, xs, n, acc);
}
