/* The ARM rungs' products, a row at a time (no interleaved tiles yet: interleaves_generic keeps the
 * file's layout). Each format's block is first unpacked into int8 weights with a float scale and a
 * float min per sixteen values; every 32 weights then meet each token's 32 int8 activations in two
 * exact integer dots (dot16), scaled in float. Unpacking once a block serves all of a call's tokens. */

/* A block unpacked: value i = scale[i / 16] * q[i] + min[i / 16]. `mins` says how a min meets the
 * activations: MINS_NONE (no min), MINS_PER_32 (min[2s] == min[2s + 1], times the block's s as the
 * generic product and llama.cpp take it), MINS_PER_16 (each min times its half's sum16). */
enum { MINS_NONE, MINS_PER_32, MINS_PER_16 };
typedef struct {
  int8_t q[256];
  float scale[16], min[16];
  int mins;
} unpacked_block;

/* *extra += what sub-block s's mins add to a token's sum with the activations x (`mins` says how they
 * meet them), each term one multiply-add as written here (so clang fuses it alike wherever inlined) */
static inline void add_min_terms(float *extra, const unpacked_block *u, int s, const xblock *x) {
  if (u->mins == MINS_PER_32) *extra += u->min[2 * s] * x->s;
  else if (u->mins == MINS_PER_16) *extra += x->d * (u->min[2 * s] * x->sum16[0] + u->min[2 * s + 1] * x->sum16[1]);
}

/* 16 bytes of nibbles -> the low ones (values 0..15 of a Q4_0 layout) and the high ones (16..31), each
 * minus `offset` */
static inline void unpack_nibbles(const uint8_t *qs, int8_t offset, int8_t *to) {
  const uint8x16_t raw = vld1q_u8(qs);
  vst1q_s8(to, vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(15))), vdupq_n_s8(offset)));
  vst1q_s8(to + 16, vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), vdupq_n_s8(offset)));
}

/* the same through a 16-entry table of int8 levels (IQ4_NL, IQ4_XS, MXFP4) */
static inline void unpack_levels(const uint8_t *qs, const int8_t *table, int8_t *to) {
  const uint8x16_t raw = vld1q_u8(qs);
  const int8x16_t levels = vld1q_s8(table);
  vst1q_s8(to, vqtbl1q_s8(levels, vandq_u8(raw, vdupq_n_u8(15))));
  vst1q_s8(to + 16, vqtbl1q_s8(levels, vshrq_n_u8(raw, 4)));
}

/* byte i: `value` where bit i of the 16 bits two[0] | two[1] << 8 is set, else 0 */
static inline uint8x16_t bytes_of_bits(const uint8_t *two, uint8_t value) {
  static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x16_t spread = vcombine_u8(vdup_n_u8(two[0]), vdup_n_u8(two[1]));
  return vandq_u8(vtstq_u8(spread, vld1q_u8(bit)), vdupq_n_u8(value));
}

/* Q5_0 and Q5_1: the nibbles with the fifth bits over them, minus `offset` */
static inline void unpack_q5(const uint8_t *qh, const uint8_t *qs, int8_t offset, int8_t *to) {
  unpack_nibbles(qs, 0, to);
  for (int half = 0; half < 2; half++) {
    const int8x16_t low = vld1q_s8(to + 16 * half);
    vst1q_s8(to + 16 * half, vsubq_s8(vorrq_s8(low, vreinterpretq_s8_u8(bytes_of_bits(qh + 2 * half, 16))), vdupq_n_s8(offset)));
  }
}

/* sub-block s's 32 values share one scale and one min */
static inline void same_scale(unpacked_block *u, int s, float scale, float min) {
  u->scale[2 * s] = u->scale[2 * s + 1] = scale;
  u->min[2 * s] = u->min[2 * s + 1] = min;
}

/* Q4_K and Q5_K: eight 32-value sub-blocks, a 6-bit scale and min each */
static void unpack_q4_or_q5_k(const uint8_t *w, int five, unpacked_block *u) {
  const float d = fp16(w), dmin = fp16(w + 2);
  const uint8_t *qs = w + (five ? 48 : 16);
  for (int j = 0; j < 8; j += 2, qs += 32) {
    for (int k = 0; k < 2; k++) {
      int scale, min;
      q4k_scale_min(w + 4, j + k, &scale, &min);
      same_scale(u, j + k, d * scale, -dmin * min);
    }
    for (int part = 0; part < 2; part++) {
      const uint8x16_t raw = vld1q_u8(qs + 16 * part);
      uint8x16_t low = vandq_u8(raw, vdupq_n_u8(15)), high = vshrq_n_u8(raw, 4);
      if (five) {
        const uint8x16_t bits = vld1q_u8(w + 16 + 16 * part);
        low = vorrq_u8(low, vandq_u8(vtstq_u8(bits, vdupq_n_u8((uint8_t)(1 << j))), vdupq_n_u8(16)));
        high = vorrq_u8(high, vandq_u8(vtstq_u8(bits, vdupq_n_u8((uint8_t)(2 << j))), vdupq_n_u8(16)));
      }
      vst1q_s8(u->q + 32 * j + 16 * part, vreinterpretq_s8_u8(low));
      vst1q_s8(u->q + 32 * j + 32 + 16 * part, vreinterpretq_s8_u8(high));
    }
  }
  u->mins = MINS_PER_32;
}

/* Q6_K: per half of 128 values, four 32-value sub-blocks of 6-bit values (stored plus 32), a scale per 16 */
static void unpack_q6_k(const uint8_t *w, unpacked_block *u) {
  const float d = fp16(w + 208);
  const uint8x16_t mask4 = vdupq_n_u8(15), mask2 = vdupq_n_u8(3), offset = vdupq_n_u8(32);
  for (int half = 0; half < 2; half++) {
    const uint8_t *ql = w + 64 * half, *qh = w + 128 + 32 * half;
    const int8_t *sc = (const int8_t *)(w + 192) + 8 * half;
    for (int part = 0; part < 2; part++) {
      const uint8x16_t l0 = vld1q_u8(ql + 16 * part), l1 = vld1q_u8(ql + 32 + 16 * part), h = vld1q_u8(qh + 16 * part);
      const uint8x16_t q[4] = {
          vorrq_u8(vandq_u8(l0, mask4), vshlq_n_u8(vandq_u8(h, mask2), 4)),
          vorrq_u8(vandq_u8(l1, mask4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 2), mask2), 4)),
          vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 4), mask2), 4)),
          vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(h, 6), 4)),
      };
      for (int k = 0; k < 4; k++) vst1q_s8(u->q + 128 * half + 32 * k + 16 * part, vreinterpretq_s8_u8(vsubq_u8(q[k], offset)));
    }
    for (int k = 0; k < 8; k++) u->scale[8 * half + k] = d * sc[k], u->min[8 * half + k] = 0.0f;
  }
  u->mins = MINS_NONE;
}

/* Q3_K and Q2_K: the value at 128h + 32j + l is bit pair j of byte 32h + l (Q3_K: and a third bit) */
static void unpack_k_low(const uint8_t *w, int three, unpacked_block *u) {
  const uint8_t *pairs = w + (three ? Q3K_LOW : Q2K_QUANTS);
  const float d = fp16(w + (three ? Q3K_D : Q2K_D)), dmin = three ? 0.0f : fp16(w + Q2K_DMIN);
  for (int h = 0; h < 2; h++)
    for (int part = 0; part < 2; part++) {
      const uint8x16_t raw = vld1q_u8(pairs + 32 * h + 16 * part), high = three ? vld1q_u8(w + Q3K_HIGH + 16 * part) : vdupq_n_u8(0);
      for (int j = 0; j < 4; j++) {
        uint8x16_t q = vandq_u8(vshlq_u8(raw, vdupq_n_s8((int8_t)(-2 * j))), vdupq_n_u8(3));
        if (three) q = vsubq_u8(vorrq_u8(q, vandq_u8(vtstq_u8(high, vdupq_n_u8((uint8_t)(1 << (4 * h + j)))), vdupq_n_u8(4))), vdupq_n_u8(4));
        vst1q_s8(u->q + 128 * h + 32 * j + 16 * part, vreinterpretq_s8_u8(q));
      }
    }
  for (int k = 0; k < 16; k++) {
    const int sm = three ? 0 : w[Q2K_SCALES + k];
    u->scale[k] = three ? d * q3k_scale(w + Q3K_SCALES, k) : d * (sm & 15);
    u->min[k] = -dmin * (sm >> 4);
  }
  u->mins = three ? MINS_NONE : MINS_PER_16;
}

/* W's block at w (of `type`, a GGUF type in the file's layout) unpacked; 0 for a type this file does not
 * unpack */
static int unpack_block(int type, const uint8_t *w, unpacked_block *u) {
  u->mins = MINS_NONE;
  switch (type) {
    case Q4_0: unpack_nibbles(w + 2, 8, u->q), same_scale(u, 0, fp16(w), 0.0f); return 1;
    case Q4_1: unpack_nibbles(w + 4, 0, u->q), same_scale(u, 0, fp16(w), fp16(w + 2)), u->mins = MINS_PER_32; return 1;
    case Q5_0: unpack_q5(w + 2, w + 6, 16, u->q), same_scale(u, 0, fp16(w), 0.0f); return 1;
    case Q5_1: unpack_q5(w + 4, w + 8, 0, u->q), same_scale(u, 0, fp16(w), fp16(w + 2)), u->mins = MINS_PER_32; return 1;
    case Q8_0:
      vst1q_s8(u->q, vld1q_s8((const int8_t *)w + 2)), vst1q_s8(u->q + 16, vld1q_s8((const int8_t *)w + 18));
      same_scale(u, 0, fp16(w), 0.0f);
      return 1;
    case IQ4_NL: unpack_levels(w + 2, IQ4_TABLE, u->q), same_scale(u, 0, fp16(w), 0.0f); return 1;
    case MXFP4: unpack_levels(w + 1, MXFP4_TABLE, u->q), same_scale(u, 0, mxfp4_half_scale(w[0]), 0.0f); return 1;
    case IQ4_XS:
      for (int j = 0; j < 8; j++) unpack_levels(w + IQ4XS_QUANTS + 16 * j, IQ4_TABLE, u->q + 32 * j), same_scale(u, j, fp16(w) * iq4_xs_scale(w, j), 0.0f);
      return 1;
    case Q4_K: unpack_q4_or_q5_k(w, 0, u); return 1;
    case Q5_K: unpack_q4_or_q5_k(w, 1, u); return 1;
    case Q6_K: unpack_q6_k(w, u); return 1;
    case Q3_K: unpack_k_low(w, 1, u); return 1;
    case Q2_K: unpack_k_low(w, 0, u); return 1;
    default: return 0;
  }
}

/* acc[t] += W_row . x[t]: each 32 weights' two integer dots scaled by their halves' scales into a
 * token's four float lanes, its mins' terms summed apart, as x86's row kernels do. */
__attribute__((unused)) static void row_dot_neon(int type, const uint8_t *w, int cols, const xblock *const *xs, int n, float *acc) {
  const int bv = block_values(type), bb = block_bytes(type), sub_blocks = bv / 32;
  unpacked_block u;
  float32x4_t sum[MAX_TOKEN_GROUP];
  float extra[MAX_TOKEN_GROUP] = {0};
  for (int t = 0; t < n; t++) sum[t] = vdupq_n_f32(0.0f);
  if (!unpack_block(type, w, &u)) {
    row_dot_generic(type, w, cols, xs, n, acc);
    return;
  }
  for (int b = 0; b < cols / bv; b++, w += bb) {
    if (b > 0) unpack_block(type, w, &u);
    for (int s = 0; s < sub_blocks; s++) {
      const int8x16_t w0 = vld1q_s8(u.q + 32 * s), w1 = vld1q_s8(u.q + 32 * s + 16);
      const float scale0 = u.scale[2 * s], scale1 = u.scale[2 * s + 1];
      for (int t = 0; t < n; t++) {
        const xblock *x = &xs[t][b * sub_blocks + s];
        const int32x4_t low = dot16(vdupq_n_s32(0), w0, vld1q_s8(x->q)), high = dot16(vdupq_n_s32(0), w1, vld1q_s8(x->q + 16));
        sum[t] = vfmaq_n_f32(sum[t], vcvtq_f32_s32(low), scale0 * x->d);
        sum[t] = vfmaq_n_f32(sum[t], vcvtq_f32_s32(high), scale1 * x->d);
        add_min_terms(&extra[t], &u, s, x);
      }
    }
  }
  for (int t = 0; t < n; t++) acc[t] += vaddvq_f32(sum[t]) + extra[t];
}
