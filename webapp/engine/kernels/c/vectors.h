/* Float vectors of the compiler's vector types, for the kernels written once for every rung (the
 * vision encoder's, the float formats' products): a vector is the rung's register, 16 floats on the
 * AVX-512 rungs, 8 elsewhere (the generic build lowers it to what the machine has), and their tiles
 * scale with it. */
#if TQ_AVX512
#define VEC 16
#else
#define VEC 8
#endif

typedef float vf __attribute__((vector_size(VEC * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VEC * 4), aligned(4)));

static inline vf vf_splat(float x) {
  vf v;
  for (int i = 0; i < VEC; i++) v[i] = x;
  return v;
}
static inline vf vf_load(const float *p) { return *(const vf *)p; }
static inline void vf_store(float *p, vf x) { *(vf *)p = x; }
static inline vf vf_select(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf vf_max(vf a, vf b) { return vf_select(a > b, a, b); }
static inline float vf_hmax(vf x) {
  float m = x[0];
  for (int i = 1; i < VEC; i++) m = x[i] > m ? x[i] : m;
  return m;
}
static inline float vf_hsum(vf x) {
  float s = 0.0f;
  for (int i = 0; i < VEC; i++) s += x[i];
  return s;
}

/* e^x as 2^n e^r, r = x - n ln2 (ln2 in two parts, so r keeps its low bits), e^r by its degree-6
 * Taylor polynomial (Horner) and 2^n through the exponent's bits: for n the nearest integer to
 * x log2(e), |r| <= ln2 / 2 and the error is a few float32 ulps. */
static inline vf vf_exp_parts(vf x, vi n) {
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * vf_splat(0.693359375f) + nf * vf_splat(2.12194440e-4f);
  vf p = vf_splat(1.0f / 720.0f);
  p = p * r + vf_splat(1.0f / 120.0f);
  p = p * r + vf_splat(1.0f / 24.0f);
  p = p * r + vf_splat(1.0f / 6.0f);
  p = p * r + vf_splat(0.5f);
  p = p * r + vf_splat(1.0f);
  p = p * r + vf_splat(1.0f);
  return (vf)((vi)p + (n << 23));
}

/* e^x for x <= 0 (scores less their maximum); 0 below -87 (and for NaN: none reaches the conversion
 * to integers). n by truncation, which is the nearest integer here as x log2(e) - 0.5 <= -0.5. */
static inline vf vf_exp_nonpositive(vf x) {
  const vi tiny = ~(x >= vf_splat(-87.0f));
  x = vf_select(tiny, vf_splat(0.0f), x);
  const vi n = __builtin_convertvector(x * vf_splat(1.44269504088896341f) - vf_splat(0.5f), vi);
  return (vf)((vi)vf_exp_parts(x, n) & ~tiny);
}

/* e^x for any x: +inf past 88 (where float32's e^x overflows, as expf's does), e^-87 below -87, 1 for
 * NaN (no NaN reaches the conversion to integers; x / (1 + 1) keeps gelu's). n by a floor. */
static inline vf vf_exp(vf x) {
  const vi overflows = x > vf_splat(88.0f);
  x = vf_select(overflows, vf_splat(0.0f), x);
  x = vf_select(x < vf_splat(-87.0f), vf_splat(-87.0f), x);
  x = vf_select(x != x, vf_splat(0.0f), x);
  const vf t = x * vf_splat(1.44269504088896341f) + vf_splat(0.5f);
  vi n = __builtin_convertvector(t, vi);
  n += (vi)(__builtin_convertvector(n, vf) > t); /* toward zero -> floor: -1 where it rounded up */
  return vf_select(overflows, vf_splat(INFINITY), vf_exp_parts(x, n));
}
