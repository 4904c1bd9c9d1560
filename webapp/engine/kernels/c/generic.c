/* The portable kernels: each name of isa.h as NAME_generic, one value at a time. They are the
 * reference the ISA versions match (the same numbers, where isa.h says so), the ISA versions' path
 * for what those leave out, and, renamed by fallback.h, the kernels of a build without SIMD. */

GENERIC float fp16_generic(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, mant = h & 1023, bits;
  if (exp == 0) {
    float v = ldexpf((float)mant, -24);
    return sign ? -v : v;
  }
  bits = exp == 31 ? sign | 0x7f800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* Without tiles there is nothing to interleave for: matrices keep the file's layout (isa.h's 0). */
GENERIC int interleaves_generic(int type) {
  (void)type;
  return 0;
}

/* No tiles: every row goes through row_dot. */
GENERIC int tile_rows_generic(int type, const uint8_t *w, size_t row_bytes, int nb, const xblock *const *xs, int n, float *out, size_t stride,
                              int first, int last) {
  (void)type, (void)w, (void)row_bytes, (void)nb, (void)xs, (void)n, (void)out, (void)stride, (void)last;
  return first;
}

/* The portable product: the same integer products one value at a time, from dequantized blocks; the
 * SIMD build's path for a type without a row kernel of its own (Q5_K, whose rows come in eights in
 * real files and so are interleaved) */
GENERIC void row_dot_generic(int type, const uint8_t *w, int cols, const xblock *const *xs, int n, float *acc) {
  float row[256];
  const int bv = block_values(type), bb = block_bytes(type);
  for (int b = 0; b < cols / bv; b++, w += bb) {
    dequantize_row(type, w, bv, row);
    /* Q4_1 and Q5_1 (32-value blocks): the block's min meets the activations' own s, as in the SIMD
       tiles and llama.cpp's Q8_1 products */
    const float min = activation_of(type) == ACT_Q8_1 ? fp16(w + 2) : 0.0f;
    for (int t = 0; t < n; t++) {
      float s = 0.0f;
      for (int i = 0; i < bv; i++) s += (row[i] - min) * xs[t][b * bv / 32 + i / 32].q[i % 32] * xs[t][b * bv / 32 + i / 32].d;
      acc[t] += s + min * xs[t][b].s;
    }
  }
}

/* y = silu(gate) * up = gate * sigmoid(gate) * up */
GENERIC void swiglu_row_generic(const float *gate, const float *up, int n, float *y) {
  for (int i = 0; i < n; i++) y[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* gelu by tanh's approximation, as llama.cpp's ggml_gelu: one value */
static inline float gelu_tanh_one(float g) { return 0.5f * g * (1.0f + tanhf(0.79788456080286535588f * g * (1.0f + 0.044715f * g * g))); }

/* y = gelu(gate) * up (Gemma's GeGLU); scalar everywhere: a step spends far longer in the products
 * that read y. */
static void geglu_row(const float *gate, const float *up, int n, float *y) {
  for (int i = 0; i < n; i++) y[i] = gelu_tanh_one(gate[i]) * up[i];
}

/* y = gpt-oss's clamped SwiGLU of gate and up (tq.h's FORM_SWIGLU_CLAMPED), as llama.cpp's swiglu_oai */
static void swiglu_clamped_row(const float *gate, const float *up, int n, float *y) {
  const float alpha = 1.702f, limit = 7.0f;
  for (int i = 0; i < n; i++) {
    const float g = gate[i] < limit ? gate[i] : limit, u = up[i] < -limit ? -limit : up[i] > limit ? limit : up[i];
    y[i] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
  }
}

/* float32 -> float16, rounding to nearest even as a hardware or compiler conversion does, so a key
 * written here equals the same key written by tinygrad's cast during prefill. */
static uint16_t half_from_float(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | 0x7c00 | (x > 0x7f800000u ? 0x200 : 0); /* inf, nan */
  if (x >= 0x477ff000u) return sign | 0x7c00;                                   /* rounds past 65504 */
  if (x < 0x38800000u) { /* below 2^-14: a subnormal half, in units of 2^-24 */
    float magnitude;
    memcpy(&magnitude, &x, 4);
    return sign | (uint16_t)__builtin_rintf(magnitude * 16777216.0f);
  }
  return sign | (uint16_t)((x + 0xfffu + ((x >> 13) & 1u) - 0x38000000u) >> 13);
}

GENERIC void halves_from_floats_generic(const float *x, int n, uint16_t *to) {
  for (int i = 0; i < n; i++) to[i] = half_from_float(x[i]);
}

/* f rounded to the nearest float16, as a float */
static float fp16_rounded(float f) {
  const uint16_t h = half_from_float(f);
  return fp16((const uint8_t *)&h);
}

/* A block's d and s from its scale before rounding (`d`) and its quants' sum, as `format` rounds them. */
static void set_block_scale(xblock *out, int format, float d, int sum) {
  out->d = format == ACT_Q8_F32 ? d : fp16_rounded(d);
  out->s = format == ACT_Q8_1 ? fp16_rounded(d * (float)sum) : out->d * (float)sum;
}

/* The scale of a block of x (isa.h's ACT_*): the multiplier to int8 (127 / max |x|) and the value of
 * one step, which ACT_Q8_F32 takes as the multiplier's inverse and Q8_0 and Q8_1 as max |x| / 127. */
static float step_of(float amax, int format, float *inv) {
  *inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  return format == ACT_Q8_F32 ? (*inv > 0.0f ? 1.0f / *inv : 0.0f) : amax / 127.0f;
}

GENERIC void quantize_row_generic(const float *x, int cols, int format, xblock *out) {
  for (int b = 0; b < cols / 32; b++, x += 32, out++) {
    float amax = 0.0f, inv;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = step_of(amax, format, &inv);
    int sum[2] = {0, 0};
    for (int i = 0; i < 32; i++) {
      const int q = (int)lrintf(x[i] * inv);
      out->q[i] = (int8_t)q;
      sum[i / 16] += q;
    }
    set_block_scale(out, format, d, sum[0] + sum[1]);
    out->sum16[0] = (int16_t)sum[0];
    out->sum16[1] = (int16_t)sum[1];
  }
}

static float half_to_float(uint16_t h) {
  uint8_t b[2];
  memcpy(b, &h, 2);
  return fp16(b);
}

/* A head at a time, its scores in one row. */
GENERIC void attend_item_generic(const float *q, int heads, const key_runs *runs, int n, int Hd, float scale, float *part,
                                 size_t part_stride) {
  float scores[KEY_CHUNK];
  for (int h = 0; h < heads; h++, q += Hd, part += part_stride) {
    float top = -INFINITY;
    for (int r = 0, first = 0; first < n; r++, first += runs->run_keys) {
      const uint16_t *k = (const uint16_t *)runs->keys[r];
      for (int j = 0; j < run_length(runs, first, n); j++) {
        float dot = 0.0f;
        for (int i = 0; i < Hd; i++) dot += q[i] * half_to_float(k[(size_t)j * Hd + i]);
        scores[first + j] = dot * scale;
        top = scores[first + j] > top ? scores[first + j] : top;
      }
    }
    float total = 0.0f;
    for (int j = 0; j < n; j++) total += (scores[j] = expf(scores[j] - top));
    for (int i = 0; i < Hd; i++) part[i] = 0.0f;
    for (int r = 0, first = 0; first < n; r++, first += runs->run_keys) {
      const uint16_t *v = (const uint16_t *)runs->values[r];
      for (int j = 0; j < run_length(runs, first, n); j++)
        for (int i = 0; i < Hd; i++) part[i] += scores[first + j] * half_to_float(v[(size_t)j * Hd + i]);
    }
    part[Hd] = top;
    part[Hd + 1] = total;
  }
}

/* Each lane alone: the numbers attend_lanes must give. */
GENERIC void attend_lanes_generic(const float *q, size_t q_lane_stride, int lanes, int heads, const int *n, const key_runs *runs, int Hd, float scale,
                                  float *part, size_t part_lane_stride, size_t part_stride) {
  for (int l = 0; l < lanes; l++) attend_item(q + l * q_lane_stride, heads, runs, n[l], Hd, scale, part + l * part_lane_stride, part_stride);
}

GENERIC void delta_step_generic(float *M, const float *q, const float *k, const float *v, float decay, float beta, float scale, int S, float *o) {
  for (int c = 0; c < S; c++) {
    float *m = M + (size_t)c * S, recalled = 0.0f, read = 0.0f;
    for (int a = 0; a < S; a++) recalled += m[a] * k[a];
    const float delta = (v[c] - decay * recalled) * beta;
    for (int a = 0; a < S; a++) {
      m[a] = decay * m[a] + delta * k[a];
      read += m[a] * q[a];
    }
    o[c] = read * scale;
  }
}
