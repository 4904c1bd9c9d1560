/* The ARM versions of isa.h's names (NAME_neon; every aarch64 core has NEON) other than the products'
 * rows (arm_neon_products.c) and attention (arm_neon_attention.c), and the integer dot those are made
 * of. tq.c includes them for every ARM rung of the ladder (build.py's RUNGS): neon as written,
 * neon_dotprod with dot16's sdot, neon_i8mm with the row pairs of arm_neon_i8mm.c over them. The names
 * they leave out (attend_lanes' rows read once for several lanes, the recurrent step, swiglu) are
 * generic.c's on ARM. */

/* acc + the products of w's and x's sixteen int8 values, values 4i..4i + 3 summed into acc's lane i:
 * one sdot (ARMv8.2's dot product), or with NEON alone the widened products added in pairs, then the
 * pairs in pairs. Both are exact integer sums into the same lanes, so the two rungs give the same bits
 * and differ from x86 only in the float sums around them. */
static inline int32x4_t dot16(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, w, x);
#else
  const int32x4_t low = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(x))), high = vpaddlq_s16(vmull_high_s8(w, x));
  return vaddq_s32(acc, vpaddq_s32(low, high));
#endif
}

static float fp16_neon(const uint8_t *p) {
  __fp16 h;
  memcpy(&h, p, 2);
  return (float)h;
}

/* The same numbers as quantize_row_generic sixteen values at a time: maxNum ignores NaN as fmaxf does,
 * and the conversion rounds to nearest even as lrintf does. */
static void quantize_row_neon(const float *x, int cols, int format, xblock *out) {
  for (int b = 0; b < cols / 32; b++, out++) {
    float32x4_t top = vdupq_n_f32(0.0f);
    for (int i = 0; i < 32; i += 4) top = vmaxnmq_f32(top, vabsq_f32(vld1q_f32(x + 32 * b + i)));
    float inv;
    const float d = step_of(vmaxnmvq_f32(top), format, &inv);
    int sum[2];
    for (int half = 0; half < 2; half++) {
      const float *v = x + 32 * b + 16 * half;
      int32x4_t q[4];
      for (int k = 0; k < 4; k++) q[k] = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(v + 4 * k), inv));
      const int16x8_t q01 = vcombine_s16(vqmovn_s32(q[0]), vqmovn_s32(q[1])), q23 = vcombine_s16(vqmovn_s32(q[2]), vqmovn_s32(q[3]));
      vst1q_s8(out->q + 16 * half, vcombine_s8(vqmovn_s16(q01), vqmovn_s16(q23)));
      sum[half] = vaddvq_s32(vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3])));
    }
    set_block_scale(out, format, d, (int)((unsigned)sum[0] + (unsigned)sum[1]));
    out->sum16[0] = (int16_t)sum[0];
    out->sum16[1] = (int16_t)sum[1];
  }
}

/* the same rounding as half_from_float (to nearest even), four at a time */
static void halves_from_floats_neon(const float *x, int n, uint16_t *to) {
  int i = 0;
  for (; i + 4 <= n; i += 4) vst1_u16(to + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(x + i))));
  halves_from_floats_generic(x + i, n - i, to + i);
}

