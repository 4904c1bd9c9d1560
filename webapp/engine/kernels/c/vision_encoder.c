/* A vision encoder's attention (tq_encoder_attention: one head's queries against every patch's key
 * and value, no mask) and its feed-forward's gelu (tq_gelu_tanh), on every core (tq.h).
 *
 * Each item is a block of ENC_QUERIES queries, taken by whichever core is free. It walks the keys a
 * tile of ENC_KEYS at a time, keeping the tile's scores, the queries' running maximum and sum, and
 * their (queries x head_dim) outputs in the core's own cache (the softmax of "online" attention: a
 * new maximum rescales what was summed before it), so the keys and values stream through once per
 * block and no (queries x patches) matrix is ever written out. The products hold a 6 x 16 (scores)
 * or 4 x 24 (outputs) tile in registers; written with the compiler's vector types, so every rung of
 * the ladder builds it, as wide as the rung's registers allow. The exponential is a polynomial on
 * those vectors (libm's expf would run one value at a time); its relative error is a few float32
 * ulps, as llama.cpp's vectorized softmax has. */

enum { ENC_QUERIES = 48, ENC_KEYS = 128, SCORE_ROWS = 6, VALUE_ROWS = 4, PAD_ROWS = 12 };

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

static inline v8f v8_splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
static inline v8f v8_load(const float *p) { return *(const v8f *)p; }
static inline void v8_store(float *p, v8f x) { *(v8f *)p = x; }
static inline v8f v8_select(v8i mask, v8f a, v8f b) { return (v8f)((mask & (v8i)a) | (~mask & (v8i)b)); }
static inline v8f v8_max(v8f a, v8f b) { return v8_select(a > b, a, b); }
static inline float v8_hmax(v8f x) {
  float m = x[0];
  for (int i = 1; i < 8; i++) m = x[i] > m ? x[i] : m;
  return m;
}
static inline float v8_hsum(v8f x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* e^x as 2^n e^r, r = x - n ln2 (ln2 in two parts, so r keeps its low bits), e^r by its degree-6
 * Taylor polynomial (Horner) and 2^n through the exponent's bits: for n the nearest integer to
 * x log2(e), |r| <= ln2 / 2 and the error is a few float32 ulps. */
static inline v8f v8_exp_parts(v8f x, v8i n) {
  const v8f nf = __builtin_convertvector(n, v8f);
  const v8f r = x - nf * v8_splat(0.693359375f) + nf * v8_splat(2.12194440e-4f);
  v8f p = v8_splat(1.0f / 720.0f);
  p = p * r + v8_splat(1.0f / 120.0f);
  p = p * r + v8_splat(1.0f / 24.0f);
  p = p * r + v8_splat(1.0f / 6.0f);
  p = p * r + v8_splat(0.5f);
  p = p * r + v8_splat(1.0f);
  p = p * r + v8_splat(1.0f);
  return (v8f)((v8i)p + (n << 23));
}

/* e^x for x <= 0 (scores less their maximum); 0 below -87 (and for NaN: none reaches the conversion
 * to integers). n by truncation, which is the nearest integer here as x log2(e) - 0.5 <= -0.5. */
static inline v8f v8_exp_nonpositive(v8f x) {
  const v8i tiny = ~(x >= v8_splat(-87.0f));
  x = v8_select(tiny, v8_splat(0.0f), x);
  const v8i n = __builtin_convertvector(x * v8_splat(1.44269504088896341f) - v8_splat(0.5f), v8i);
  return (v8f)((v8i)v8_exp_parts(x, n) & ~tiny);
}

/* e^x for any x: +inf past 88 (where float32's e^x overflows, as expf's does), e^-87 below -87, 1 for
 * NaN (no NaN reaches the conversion to integers; x / (1 + 1) keeps gelu's). n by a floor. */
static inline v8f v8_exp(v8f x) {
  const v8i overflows = x > v8_splat(88.0f);
  x = v8_select(overflows, v8_splat(0.0f), x);
  x = v8_select(x < v8_splat(-87.0f), v8_splat(-87.0f), x);
  x = v8_select(x != x, v8_splat(0.0f), x);
  const v8f t = x * v8_splat(1.44269504088896341f) + v8_splat(0.5f);
  v8i n = __builtin_convertvector(t, v8i);
  n += (v8i)(__builtin_convertvector(n, v8f) > t); /* toward zero -> floor: -1 where it rounded up */
  return v8_select(overflows, v8_splat(INFINITY), v8_exp_parts(x, n));
}

typedef struct {
  const float *q, *kt, *v; /* q (rows, hd), scaled; kt (hd, n): the keys transposed; v (n, hd) */
  float *out;              /* (rows, out_stride), the first hd of each row written */
  int n, rows, hd, out_stride;
} encoder_attend_t;

/* scores (SCORE_ROWS x 16) = q rows . keys [j, j + 16) */
static inline void enc_scores_tile(const float *q, const float *kt, int n, int hd, int j, float *scores) {
  v8f acc[SCORE_ROWS][2] = {{0}};
  for (int d = 0; d < hd; d++) {
    const v8f k0 = v8_load(kt + (size_t)d * n + j), k1 = v8_load(kt + (size_t)d * n + j + 8);
    for (int r = 0; r < SCORE_ROWS; r++) {
      const v8f qv = v8_splat(q[(size_t)r * hd + d]);
      acc[r][0] += qv * k0;
      acc[r][1] += qv * k1;
    }
  }
  for (int r = 0; r < SCORE_ROWS; r++) {
    v8_store(scores + r * ENC_KEYS, acc[r][0]);
    v8_store(scores + r * ENC_KEYS + 8, acc[r][1]);
  }
}

/* acc (VALUE_ROWS x 8 WIDTH, row stride hd) += probs (VALUE_ROWS x keys) . v rows, WIDTH a constant */
static inline __attribute__((always_inline)) void enc_values_tile(const float *probs, const float *v, int keys, int hd, float *acc,
                                                                   const int width) {
  v8f sum[VALUE_ROWS][3];
  for (int r = 0; r < VALUE_ROWS; r++)
    for (int w = 0; w < width; w++) sum[r][w] = v8_load(acc + (size_t)r * hd + 8 * w);
  for (int j = 0; j < keys; j++) {
    v8f vv[3];
    for (int w = 0; w < width; w++) vv[w] = v8_load(v + (size_t)j * hd + 8 * w);
    for (int r = 0; r < VALUE_ROWS; r++) {
      const v8f p = v8_splat(probs[r * ENC_KEYS + j]);
      for (int w = 0; w < width; w++) sum[r][w] += p * vv[w];
    }
  }
  for (int r = 0; r < VALUE_ROWS; r++)
    for (int w = 0; w < width; w++) v8_store(acc + (size_t)r * hd + 8 * w, sum[r][w]);
}

static void run_encoder_attend(const void *ctx, int first, int last) {
  const encoder_attend_t *a = ctx;
  const int n = a->n, hd = a->hd;
  float scores[ENC_QUERIES * ENC_KEYS] __attribute__((aligned(32)));
  float acc[ENC_QUERIES * MAX_HEAD_DIM] __attribute__((aligned(32)));
  float top[ENC_QUERIES], total[ENC_QUERIES], qpad[ENC_QUERIES * MAX_HEAD_DIM];
  for (int item = first; item < last; item++) {
    const int q0 = item * ENC_QUERIES;
    const int count = a->rows - q0 < ENC_QUERIES ? a->rows - q0 : ENC_QUERIES;
    const int span = (count + PAD_ROWS - 1) / PAD_ROWS * PAD_ROWS; /* queries past `count` are zeros */
    memset(qpad, 0, sizeof(float) * (size_t)span * hd);
    memcpy(qpad, a->q + (size_t)q0 * hd, sizeof(float) * (size_t)count * hd);
    memset(acc, 0, sizeof(float) * (size_t)span * hd);
    for (int r = 0; r < span; r++) top[r] = -INFINITY, total[r] = 0.0f;
    for (int k0 = 0; k0 < n; k0 += ENC_KEYS) {
      const int keys = n - k0 < ENC_KEYS ? n - k0 : ENC_KEYS, whole = keys & ~15, padded = (keys + 15) & ~15;
      for (int r0 = 0; r0 < span; r0 += SCORE_ROWS) {
        const float *qb = qpad + (size_t)r0 * hd;
        float *sb = scores + r0 * ENC_KEYS;
        for (int j = 0; j < whole; j += 16) enc_scores_tile(qb, a->kt, n, hd, k0 + j, sb + j);
        for (int r = 0; r < SCORE_ROWS; r++) /* the last keys past a multiple of 16, one at a time; none past n */
          for (int j = whole; j < padded; j++) {
            float s = -INFINITY;
            if (j < keys) {
              s = 0.0f;
              for (int d = 0; d < hd; d++) s += qb[(size_t)r * hd + d] * a->kt[(size_t)d * n + k0 + j];
            }
            sb[r * ENC_KEYS + j] = s;
          }
      }
      for (int r = 0; r < span; r++) {
        float *row = scores + r * ENC_KEYS;
        v8f m = v8_load(row);
        for (int j = 8; j < padded; j += 8) m = v8_max(m, v8_load(row + j));
        const float tile_top = v8_hmax(m), new_top = tile_top > top[r] ? tile_top : top[r];
        v8f sum = v8_splat(0.0f);
        for (int j = 0; j < padded; j += 8) { /* a padded key's -inf gives 0 */
          const v8f e = v8_exp_nonpositive(v8_load(row + j) - v8_splat(new_top));
          v8_store(row + j, e);
          sum += e;
        }
        const float rescale = top[r] == -INFINITY ? 0.0f : expf(top[r] - new_top);
        total[r] = total[r] * rescale + v8_hsum(sum);
        top[r] = new_top;
        if (rescale != 1.0f)
          for (int d = 0; d < hd; d++) acc[(size_t)r * hd + d] *= rescale;
      }
      for (int r0 = 0; r0 < span; r0 += VALUE_ROWS) {
        const float *probs = scores + r0 * ENC_KEYS, *v = a->v + (size_t)k0 * hd;
        float *to = acc + (size_t)r0 * hd;
        int w = 0;
        for (; w + 3 <= hd / 8; w += 3) enc_values_tile(probs, v + 8 * w, keys, hd, to + 8 * w, 3);
        if (hd / 8 - w == 2) enc_values_tile(probs, v + 8 * w, keys, hd, to + 8 * w, 2);
        if (hd / 8 - w == 1) enc_values_tile(probs, v + 8 * w, keys, hd, to + 8 * w, 1);
      }
    }
    for (int r = 0; r < count; r++) {
      const float inverse = 1.0f / total[r];
      float *out = a->out + (size_t)(q0 + r) * a->out_stride;
      for (int d = 0; d < hd; d++) out[d] = acc[(size_t)r * hd + d] * inverse;
    }
  }
}

int tq_encoder_attention(float *out, const float *q, const float *kt, const float *v, int n, int rows, int hd, int out_stride) {
  if (n <= 0 || rows <= 0 || hd <= 0 || hd % 8 || hd > MAX_HEAD_DIM || out_stride < hd) return -1;
  const encoder_attend_t a = {q, kt, v, out, n, rows, hd, out_stride};
  const job_t j = {run_encoder_attend, &a, (rows + ENC_QUERIES - 1) / ENC_QUERIES, 1};
  run_job(&j);
  return 0;
}

/* gelu's tanh form, 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), is x / (1 + e^-2u):
 * one exponential and a division a value. */
enum { GELU_CHUNK = 4096, WIDEN_CHUNK = 1 << 16 };

/* A pool job over n values a chunk an item: `run` takes each item's values from .. to - 1. */
typedef struct {
  float *out;
  const void *in;
  long n, chunk;
  void (*run)(float *out, const void *in, long from, long to);
} values_t;

static void run_values(const void *ctx, int first, int last) {
  const values_t *v = ctx;
  v->run(v->out, v->in, (long)first * v->chunk, (long)last * v->chunk < v->n ? (long)last * v->chunk : v->n);
}

static void over_values(void (*run)(float *, const void *, long, long), float *out, const void *in, long n, long chunk) {
  if (n <= 0) return;
  const values_t v = {out, in, n, chunk, run};
  const job_t j = {run_values, &v, (int)((n + chunk - 1) / chunk), 1};
  run_job(&j);
}

static void gelu_values(float *x, const void *unused, long from, long to) {
  (void)unused;
  long i = from;
  for (; i + 8 <= to; i += 8) {
    const v8f v = v8_load(x + i);
    const v8f u = v * (v8_splat(0.7978845608028654f) + v8_splat(0.7978845608028654f * 0.044715f) * v * v);
    v8_store(x + i, v / (v8_splat(1.0f) + v8_exp(v8_splat(-2.0f) * u)));
  }
  for (; i < to; i++) x[i] = gelu_tanh_one(x[i]);
}

void tq_gelu_tanh(float *x, long n) { over_values(gelu_values, x, x, n, GELU_CHUNK); }

/* out[i] = in[i] (float16 to float32) for n values, on every core: an encoder layer's float16
 * matrices (an F16 file's, kept so in memory) widened for its products as an encode reaches it.
 * NumPy's conversion ran one core at a fraction of the memory's speed. */
static void widen_values(float *out, const void *in, long from, long to) {
  const uint16_t *halves = in;
  long i = from;
#if TQ_AVX2
  for (; i + 8 <= to; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + i))));
#endif
  for (; i < to; i++) out[i] = fp16((const uint8_t *)(halves + i));
}

void tq_widen_halves(float *out, const uint16_t *in, long n) { over_values(widen_values, out, in, n, WIDEN_CHUNK); }
