/* The ARM rungs' attention over float16 and Q8_0 cache rows: generic.c's a head at a time, its dots
 * and its value sums in NEON (eight of a row's values widened to float32 a load), the exponentials by
 * expf one score at a time. A lane's numbers depend on its own keys only, as every rung's. */

/* values i..i + 7 of a cache row as floats (Q8_0: each times its block's float16 scale) */
static inline __attribute__((always_inline)) void eight_cached(const uint8_t *row, int i, int q8, float32x4_t *low, float32x4_t *high) {
  if (q8) {
    const uint8_t *block = row + (size_t)(i / 32) * Q8_BLOCK_BYTES;
    const int16x8_t q = vmovl_s8(vld1_s8((const int8_t *)block + 2 + i % 32));
    const float d = fp16(block);
    *low = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(q))), d);
    *high = vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(q)), d);
  } else {
    const uint16x8_t h = vld1q_u16((const uint16_t *)row + i);
    *low = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h)));
    *high = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h)));
  }
}

/* value i of a float16 row, for the tail past the last eight (a Q8_0 row's Hd is a multiple of 32) */
static inline float one_cached(const uint8_t *row, int i) { return fp16(row + 2 * (size_t)i); }

static inline __attribute__((always_inline)) void attend_heads_neon(const float *q, int heads, const key_runs *runs, int n, int Hd, float scale,
                                                                    float *part, size_t part_stride, const int q8) {
  const size_t row = q8 ? (size_t)Hd / 32 * Q8_BLOCK_BYTES : (size_t)Hd * 2;
  float scores[KEY_CHUNK];
  for (int h = 0; h < heads; h++, q += Hd, part += part_stride) {
    float top = -INFINITY;
    for (int r = 0, first = 0; first < n; r++, first += runs->run_keys)
      for (int j = 0; j < run_length(runs, first, n); j++) {
        const uint8_t *k = runs->keys[r] + j * row;
        float32x4_t sum[2] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}, low, high;
        int i = 0;
        for (; i + 8 <= Hd; i += 8) {
          eight_cached(k, i, q8, &low, &high);
          sum[0] = vfmaq_f32(sum[0], vld1q_f32(q + i), low), sum[1] = vfmaq_f32(sum[1], vld1q_f32(q + i + 4), high);
        }
        float dot = vaddvq_f32(vaddq_f32(sum[0], sum[1]));
        for (; i < Hd; i++) dot += q[i] * one_cached(k, i);
        scores[first + j] = dot * scale;
        top = scores[first + j] > top ? scores[first + j] : top;
      }
    float total = 0.0f;
    for (int j = 0; j < n; j++) total += (scores[j] = expf(scores[j] - top));
    memset(part, 0, (size_t)Hd * sizeof(float));
    for (int r = 0, first = 0; first < n; r++, first += runs->run_keys)
      for (int j = 0; j < run_length(runs, first, n); j++) {
        const uint8_t *v = runs->values[r] + j * row;
        const float weight = scores[first + j];
        float32x4_t low, high;
        int i = 0;
        for (; i + 8 <= Hd; i += 8) {
          eight_cached(v, i, q8, &low, &high);
          vst1q_f32(part + i, vfmaq_n_f32(vld1q_f32(part + i), low, weight));
          vst1q_f32(part + i + 4, vfmaq_n_f32(vld1q_f32(part + i + 4), high, weight));
        }
        for (; i < Hd; i++) part[i] += weight * one_cached(v, i);
      }
    part[Hd] = top;
    part[Hd + 1] = total;
  }
}

static void attend_item_neon(const float *q, int heads, const key_runs *runs, int n, int Hd, float scale, float *part, size_t part_stride) {
  attend_heads_neon(q, heads, runs, n, Hd, scale, part, part_stride, 0);
}

static void attend_item_q8_neon(const float *q, int heads, const key_runs *runs, int n, int Hd, float scale, float *part, size_t part_stride) {
  attend_heads_neon(q, heads, runs, n, Hd, scale, part, part_stride, 1);
}
