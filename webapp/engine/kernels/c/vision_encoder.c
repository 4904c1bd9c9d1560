/* A vision encoder's attention (tq_encoder_attention: one head's queries against every patch's key
 * and value, no mask) and its feed-forward's gelu (tq_gelu_tanh), on every core (tq.h).
 *
 * Each item is a block of ENC_QUERIES queries, taken by whichever core is free. It walks the keys a
 * tile of ENC_KEYS at a time, keeping the tile's scores, the queries' running maximum and sum, and
 * their (queries x head_dim) outputs in the core's own cache (the softmax of "online" attention: a
 * new maximum rescales what was summed before it), so the keys and values stream through once per
 * block and no (queries x patches) matrix is ever written out. The products hold a tile of scores
 * and one of outputs in registers; written with the compiler's vector types, so every rung of the
 * ladder builds it, as wide as the rung's registers allow (vectors.h): AVX-512's 32 registers hold a
 * 12 x 32 tile of scores and a 4 x 80 one of outputs. The exponential is a polynomial on
 * those vectors (libm's expf would run one value at a time); its relative error is a few float32
 * ulps, as llama.cpp's vectorized softmax has. */

#if VEC == 16
enum { SCORE_ROWS = 12, VALUE_WIDTH = 5 };
#else
enum { SCORE_ROWS = 6, VALUE_WIDTH = 3 };
#endif
enum { ENC_QUERIES = 48, ENC_KEYS = 128, SCORE_KEYS = 2 * VEC, VALUE_ROWS = 4, PAD_ROWS = 12 };
typedef float v8f __attribute__((vector_size(32), aligned(4))); /* the outputs' last 8 of a head 8 past a whole vector */

typedef struct {
  const float *q, *kt, *v; /* q (rows, hd), scaled; kt (hd, n): the keys transposed; v (n, hd) */
  float *out;              /* (rows, out_stride), the first hd of each row written */
  int n, rows, hd, out_stride;
} encoder_attend_t;

/* scores (SCORE_ROWS x SCORE_KEYS) = q rows . keys [j, j + SCORE_KEYS) */
static inline void enc_scores_tile(const float *q, const float *kt, int n, int hd, int j, float *scores) {
  vf acc[SCORE_ROWS][2] = {{0}};
  for (int d = 0; d < hd; d++) {
    const vf k0 = vf_load(kt + (size_t)d * n + j), k1 = vf_load(kt + (size_t)d * n + j + VEC);
    for (int r = 0; r < SCORE_ROWS; r++) {
      const vf qv = vf_splat(q[(size_t)r * hd + d]);
      acc[r][0] += qv * k0;
      acc[r][1] += qv * k1;
    }
  }
  for (int r = 0; r < SCORE_ROWS; r++) {
    vf_store(scores + r * ENC_KEYS, acc[r][0]);
    vf_store(scores + r * ENC_KEYS + VEC, acc[r][1]);
  }
}

/* acc (VALUE_ROWS x WIDTH vectors, row stride hd) += probs (VALUE_ROWS x keys) . v rows, WIDTH a constant */
static inline __attribute__((always_inline)) void enc_values_tile(const float *probs, const float *v, int keys, int hd, float *acc,
                                                                   const int width) {
  vf sum[VALUE_ROWS][VALUE_WIDTH];
  for (int r = 0; r < VALUE_ROWS; r++)
    for (int w = 0; w < width; w++) sum[r][w] = vf_load(acc + (size_t)r * hd + VEC * w);
  for (int j = 0; j < keys; j++) {
    vf vv[VALUE_WIDTH];
    for (int w = 0; w < width; w++) vv[w] = vf_load(v + (size_t)j * hd + VEC * w);
    for (int r = 0; r < VALUE_ROWS; r++) {
      const vf p = vf_splat(probs[r * ENC_KEYS + j]);
      for (int w = 0; w < width; w++) sum[r][w] += p * vv[w];
    }
  }
  for (int r = 0; r < VALUE_ROWS; r++)
    for (int w = 0; w < width; w++) vf_store(acc + (size_t)r * hd + VEC * w, sum[r][w]);
}

/* the same for a head's last 8 outputs where hd is 8 past a whole number of 16-wide vectors (SigLIP-so400m's 72) */
static void enc_values_eight(const float *probs, const float *v, int keys, int hd, float *acc) {
  v8f sum[VALUE_ROWS];
  for (int r = 0; r < VALUE_ROWS; r++) sum[r] = *(const v8f *)(acc + (size_t)r * hd);
  for (int j = 0; j < keys; j++) {
    const v8f vv = *(const v8f *)(v + (size_t)j * hd);
    for (int r = 0; r < VALUE_ROWS; r++) sum[r] += probs[r * ENC_KEYS + j] * vv;
  }
  for (int r = 0; r < VALUE_ROWS; r++) *(v8f *)(acc + (size_t)r * hd) = sum[r];
}

/* one block of VALUE_ROWS queries' outputs: the head's hd values in tiles of up to VALUE_WIDTH vectors */
static void enc_values_rows(const float *probs, const float *v, int keys, int hd, float *acc) {
  int w = 0;
  const int whole = hd / VEC;
  for (; w + VALUE_WIDTH <= whole; w += VALUE_WIDTH) enc_values_tile(probs, v + VEC * w, keys, hd, acc + VEC * w, VALUE_WIDTH);
  switch (whole - w) {
  case 4: enc_values_tile(probs, v + VEC * w, keys, hd, acc + VEC * w, 4 < VALUE_WIDTH ? 4 : VALUE_WIDTH); break;
  case 3: enc_values_tile(probs, v + VEC * w, keys, hd, acc + VEC * w, 3 < VALUE_WIDTH ? 3 : VALUE_WIDTH); break;
  case 2: enc_values_tile(probs, v + VEC * w, keys, hd, acc + VEC * w, 2); break;
  case 1: enc_values_tile(probs, v + VEC * w, keys, hd, acc + VEC * w, 1); break;
  default: break;
  }
  if (hd % VEC) enc_values_eight(probs, v + VEC * whole, keys, hd, acc + VEC * whole);
}

static void run_encoder_attend(const void *ctx, int first, int last) {
  const encoder_attend_t *a = ctx;
  const int n = a->n, hd = a->hd;
  float scores[ENC_QUERIES * ENC_KEYS] __attribute__((aligned(64)));
  float acc[ENC_QUERIES * MAX_HEAD_DIM] __attribute__((aligned(64)));
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
      const int keys = n - k0 < ENC_KEYS ? n - k0 : ENC_KEYS;
      const int whole = keys / SCORE_KEYS * SCORE_KEYS, padded = (keys + VEC - 1) / VEC * VEC;
      for (int r0 = 0; r0 < span; r0 += SCORE_ROWS) {
        const float *qb = qpad + (size_t)r0 * hd;
        float *sb = scores + r0 * ENC_KEYS;
        for (int j = 0; j < whole; j += SCORE_KEYS) enc_scores_tile(qb, a->kt, n, hd, k0 + j, sb + j);
        for (int r = 0; r < SCORE_ROWS; r++) /* the last keys past a whole tile, one at a time; none past n */
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
        vf m = vf_load(row);
        for (int j = VEC; j < padded; j += VEC) m = vf_max(m, vf_load(row + j));
        const float tile_top = vf_hmax(m), new_top = tile_top > top[r] ? tile_top : top[r];
        vf sum = vf_splat(0.0f);
        for (int j = 0; j < padded; j += VEC) { /* a padded key's -inf gives 0 */
          const vf e = vf_exp_nonpositive(vf_load(row + j) - vf_splat(new_top));
          vf_store(row + j, e);
          sum += e;
        }
        const float rescale = top[r] == -INFINITY ? 0.0f : expf(top[r] - new_top);
        total[r] = total[r] * rescale + vf_hsum(sum);
        top[r] = new_top;
        if (rescale != 1.0f)
          for (int d = 0; d < hd; d++) acc[(size_t)r * hd + d] *= rescale;
      }
      for (int r0 = 0; r0 < span; r0 += VALUE_ROWS)
        enc_values_rows(scores + r0 * ENC_KEYS, a->v + (size_t)k0 * hd, keys, hd, acc + (size_t)r0 * hd);
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
enum { GELU_CHUNK = 4096 }; /* values an item of the pool's job */

typedef struct {
  float *x;
  long n;
} gelu_t;

static void run_gelu(const void *ctx, int first, int last) {
  const gelu_t *g = ctx;
  float *x = g->x;
  const long to = (long)last * GELU_CHUNK < g->n ? (long)last * GELU_CHUNK : g->n;
  long i = (long)first * GELU_CHUNK;
  for (; i + VEC <= to; i += VEC) {
    const vf v = vf_load(x + i);
    const vf u = v * (vf_splat(0.7978845608028654f) + vf_splat(0.7978845608028654f * 0.044715f) * v * v);
    vf_store(x + i, v / (vf_splat(1.0f) + vf_exp(vf_splat(-2.0f) * u)));
  }
  for (; i < to; i++) x[i] = gelu_tanh_one(x[i]);
}

void tq_gelu_tanh(float *x, long n) {
  if (n <= 0) return;
  const gelu_t g = {x, n};
  const job_t j = {run_gelu, &g, (int)((n + GELU_CHUNK - 1) / GELU_CHUNK), 1};
  run_job(&j);
}
