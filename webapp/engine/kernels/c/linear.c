typedef struct {
  int type, rows, cols, tokens;
  size_t stride; /* floats from one token's output row to the next: rows, or a stacked matrix's rows */
  float *out;
  const uint8_t *w;
  const xblock *x;
  const float *residual; /* (tokens, rows) added to the product, or null */
} linear_t;

static void run_rows(const void *ctx, int first, int last) {
  const linear_t *j = ctx;
  const int nb = j->cols / 32;
  const size_t row_bytes = (size_t)j->cols / block_values(j->type) * block_bytes(j->type);
  for (int t0 = 0; t0 < j->tokens; t0 += MAX_TOKEN_GROUP) {
    const int n = j->tokens - t0 < MAX_TOKEN_GROUP ? j->tokens - t0 : MAX_TOKEN_GROUP;
    const xblock *xs[MAX_TOKEN_GROUP];
    for (int t = 0; t < n; t++) xs[t] = j->x + (size_t)(t0 + t) * nb;
    float *out = j->out + (size_t)t0 * j->stride;
    int r = tile_rows(j->type, j->w, row_bytes, nb, xs, n, out, j->stride, first, last);
    for (; r < last; r++) {
      float acc[MAX_TOKEN_GROUP] = {0};
      row_dot(j->type, j->w + (size_t)r * row_bytes, j->cols, xs, n, acc);
      for (int t = 0; t < n; t++) out[(size_t)t * j->stride + r] = acc[t];
    }
    if (j->residual)
      for (int t = 0; t < n; t++) {
        const float *add = j->residual + (size_t)(t0 + t) * j->stride;
        float *o = out + (size_t)t * j->stride;
        for (r = first; r < last; r++) o[r] += add[r];
      }
  }
}

/* ---- entry points --------------------------------------------------------------------------- */

/* One allocation of `s` for n pieces of sizes[i] * unit bytes each, every piece 64-byte aligned:
 * piece i starts at the returned base + at[i]. */
static char *pieces_of(scratch_t *s, const size_t *sizes, int n, size_t unit, size_t *at) {
  size_t total = 0;
  for (int i = 0; i < n; i++) at[i] = total, total += (sizes[i] * unit + 63) / 64 * 64;
  return at_least(s, total);
}

/* the transformed activations (a row a token), or attention's queries; a layer's intermediates */
static __thread scratch_t float_rows, layer_intermediates, attend_partials;
/* a product's input as int8 blocks, in each rounding (isa.h's ACT_*) */
static __thread scratch_t int8_activations[ACT_FORMATS];

/* A product's input rows as floats and, each quantized the first time a product asks for it, as int8
 * blocks in the rounding of each format that reads them (a stack of parts or a layer's experts may
 * mix formats). */
typedef struct {
  const float *x; /* (tokens, cols) */
  int tokens, cols;
  scratch_t *space;                /* ACT_FORMATS buffers */
  const xblock *int8[ACT_FORMATS]; /* those quantized so far */
} activations;

static const xblock *int8_rows(activations *a, int type) {
  const int format = activation_of(type);
  if (takes_floats(type)) return 0;
  if (!a->int8[format]) {
    const int nb = a->cols / 32;
    xblock *blocks = at_least(&a->space[format], (size_t)a->tokens * nb * sizeof(xblock));
    for (int t = 0; t < a->tokens; t++) quantize_row(a->x + (size_t)t * a->cols, a->cols, format, blocks + (size_t)t * nb);
    a->int8[format] = blocks;
  }
  return a->int8[format];
}

/* How a token's row of x becomes the product's input, before quantizing. */
enum { AS_IS, RMS_NORM, SWIGLU, GEGLU, SWIGLU_CLAMPED };

/* sums[r] = x[r * n + 0]^2 + ... + x[r * n + n - 1]^2 for `rows` rows, each one float sum in order
 * by fused multiply-adds (as `sum += x[i] * x[i]` compiles here), eight rows' chains interleaved: one
 * row's chain of n dependent steps waits on each step's latency, and eight rows one after another
 * waited eight times in each norm of a B=8 step; interleaved, they take about one row's time, with
 * every sum bit for bit what it was (bench/RESULTS.md, mixed steps: the 61c303f and 38dc629 rows). */
static void square_sums(const float *x, int rows, int n, float *sums) {
  for (int r0 = 0; r0 < rows; r0 += 8) {
    const int g = rows - r0 < 8 ? rows - r0 : 8;
    float s[8] = {0};
    for (int i = 0; i < n; i++)
      SCALAR_LOOP for (int t = 0; t < g; t++) s[t] = fmaf(x[(size_t)(r0 + t) * n + i], x[(size_t)(r0 + t) * n + i], s[t]);
    memcpy(sums + r0, s, g * sizeof(float));
  }
}

/* y = x / sqrt(sum / n + eps) * weight, sum being x's square_sums */
static void rms_scale_row(const float *x, float sum, const float *weight, int n, float eps, float *y) {
  const float inv = 1.0f / sqrtf(sum / n + eps);
  for (int i = 0; i < n; i++) y[i] = x[i] * inv * weight[i];
}

/* y = x / sqrt(mean(x^2) + eps) * weight */
static void rms_norm_row(const float *x, const float *weight, int n, float eps, float *y) {
  float sum;
  square_sums(x, 1, n, &sum);
  rms_scale_row(x, sum, weight, n, eps, y);
}

/* One matrix's product over the pool: out[t * stride + r] = [residual[t * stride + r] +] W[r] . x[t].
 * The float formats' go to float_gemm.c, whose tiles hold several tokens where a step has them. */
static void product(int type, int rows, size_t stride, float *out, const uint8_t *w, activations *x, const float *residual) {
  if (takes_floats(type)) {
    if (residual && residual != out)
      for (int t = 0; t < x->tokens; t++) memcpy(out + (size_t)t * stride, residual + (size_t)t * stride, (size_t)rows * sizeof(float));
    float_gemm(out, x->x, w, 0, type, x->tokens, x->cols, rows, (int)stride, residual != 0);
    return;
  }
  /* ~8 chunks a thread balances load without making the counter hot */
  int chunk = rows / (8 * (n_workers + 1));
  chunk = chunk < 16 ? 16 : chunk - chunk % 16;
  const linear_t lin = {type, rows, x->cols, x->tokens, stride, out, w, int8_rows(x, type), residual};
  const job_t j = {run_rows, &lin, rows, chunk};
  run_job(&j);
}

/* out (tokens, rows) = [residual +] W . f(x) with f one of AS_IS, RMS_NORM (by `norm`, eps),
 * SWIGLU (x holds gate then up, 2 * cols per token: silu(gate) * up), GEGLU (gelu(gate) * up) or
 * SWIGLU_CLAMPED (gpt-oss's: tq.h's FORM_SWIGLU_CLAMPED). */
static void linear(float *out, const uint8_t *w, const float *x, const tq_product *shape, int input, const float *norm, const float *residual) {
  const int type = shape->type, rows = shape->rows, cols = shape->cols, tokens = shape->tokens;
  /* every token's transformed row is kept: the float formats' products read them as they are */
  float *rows_in = input == AS_IS ? 0 : at_least(&float_rows, ((size_t)tokens * cols + tokens) * sizeof(float));
  float *sums = rows_in ? rows_in + (size_t)tokens * cols : 0;
  const float *xf = input == AS_IS ? x : rows_in;
  if (input == RMS_NORM) square_sums(x, tokens, cols, sums);
  if (input != AS_IS)
    for (int t = 0; t < tokens; t++) {
      const float *in = x + (size_t)t * (input == RMS_NORM ? cols : 2 * cols);
      float *row = rows_in + (size_t)t * cols;
      if (input == RMS_NORM) rms_scale_row(in, sums[t], norm, cols, shape->eps, row);
      else if (input == SWIGLU) swiglu_row(in, in + cols, cols, row);
      else if (input == GEGLU) geglu_row(in, in + cols, cols, row);
      else swiglu_clamped_row(in, in + cols, cols, row);
    }
  activations input_rows = {xf, tokens, cols, int8_activations, {0}};
  if (type != STACKED) {
    product(type, rows, rows, out, w, &input_rows, residual);
    return;
  }
  /* a part at a time, each into its rows of every token's output; parts of one rounding share its int8 rows */
  const stack_header *header = (const stack_header *)w;
  const uint8_t *part = w + STACK_HEADER_BYTES;
  for (int p = 0, first = 0; p < header->parts; first += header->rows[p], p++) {
    product(header->types[p], header->rows[p], rows, out + first, part, &input_rows, residual ? residual + first : 0);
    part += (size_t)header->rows[p] * (cols / block_values(header->types[p])) * block_bytes(header->types[p]);
  }
}

void tq_linear(float *out, const uint8_t *w, const float *x, const tq_product *shape) { linear(out, w, x, shape, AS_IS, 0, 0); }
void tq_norm_linear(float *out, const uint8_t *w, const float *x, const float *norm, const tq_product *shape) {
  linear(out, w, x, shape, RMS_NORM, norm, 0);
}
void tq_residual_linear(float *out, const uint8_t *w, const float *x, const float *residual, const tq_product *shape) {
  linear(out, w, x, shape, AS_IS, 0, residual);
}
void tq_swiglu_linear(float *out, const uint8_t *w, const float *gate_up, const float *residual, const tq_product *shape) {
  linear(out, w, gate_up, shape, SWIGLU, 0, residual);
}
