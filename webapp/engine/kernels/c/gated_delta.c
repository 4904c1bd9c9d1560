/* ---- Qwen3.5's layers: Gated DeltaNet (FORM_RECURRENT) and gated attention (FORM_GATED_ATTENTION) -- */
/* gated_delta_net(out, x, w, attn_norm, extras, states, lanes, shape): a FORM_RECURRENT layer's token
 * mixer for B lanes, from the layer's input x (B, D) to out (B, Hv S), the input of its output product.
 * With S = state, Hk = k_heads, Hv = v_heads (tq_recurrent), C = (2 Hk + Hv) S and n = rms_norm(x) * attn_norm:
 *   [mixed (C) | z (Hv S) | beta (Hv) | alpha (Hv)] = W_qkv . n
 *   [q | k | v] = silu(causal depthwise conv of mixed over this and the kernel - 1 tokens before it)
 *   q, k: each head over its l2 norm;  beta = sigmoid(beta);  decay = exp(softplus(alpha + dt_bias) * a)
 *   per v head h (its q and k those of k head h % Hk, llama.cpp's broadcast), the state M (S x S):
 *     M = decay M;  M += k (beta (v - M^T k))^T;  o = M^T q / sqrt(S)
 *   out_h = rms_norm(o_h) * norm * silu(z_h)
 * extras: the conv's weights (C x kernel, float32), dt_bias and a (Hv each; a = -exp(A_log)), the
 * norm (S). A lane's state is its slot's row of `states`: kernel - 1 past inputs of the conv (oldest
 * first), then Hv matrices M stored a value row at a time (row c holds M[.][c], so both products read
 * rows). A lane at position 0 starts its sequence: its slot's row is zeroed first. The lanes of one
 * slot run in the order given (their positions rising), each sequence's heads spread over the pool;
 * a lane's numbers depend on its own sequence alone. With r->lane_rows, lane b runs in row
 * lanes[2B + b] instead: a row other than its sequence's lane before it (or, for the first, other than
 * its slot's) first takes that lane's state. So speculation's drafted tokens each leave their state
 * in a row of their own, and a refused draft leaves the rows before it as the confirmed tokens made them.
 * With r->lane_rows == LANE_ROWS_RESUME a sequence's first lane goes on from the state its own row holds
 * already (a draft model's one-token steps, each after the one before, in a row that is not the slot's). */
static __thread scratch_t qwen35_rows; /* both layers' intermediates */

static size_t recurrent_state_floats(const tq_recurrent *r) {
  return (size_t)(r->conv_kernel - 1) * (2 * r->k_heads + r->v_heads) * r->state + (size_t)r->v_heads * r->state * r->state;
}

typedef struct {
  float *out;                       /* (B, Hv S): each head's o */
  const float *mixed;               /* (B, C): q, k and v after the conv, q and k normed */
  const float *decay, *beta;        /* (B, Hv) each */
  float *states;                    /* a row of recurrent_state_floats a slot */
  const int32_t *order, *starts, *slots; /* sequence i: lanes order[starts[i] .. starts[i + 1]), in slot slots[i] */
  const int32_t *rows, *positions;  /* each lane's row of state, and its position */
  int resume;                       /* a sequence's first lane goes on from its own row (LANE_ROWS_RESUME) */
  const tq_recurrent *r;
} recurrence_job;

static void run_recurrence(const void *ctx, int first, int last) {
  const recurrence_job *j = ctx;
  const tq_recurrent *r = j->r;
  const int S = r->state, Hk = r->k_heads, Hv = r->v_heads, C = (2 * Hk + Hv) * S;
  const float scale = 1.0f / sqrtf((float)S);
  const size_t row_floats = recurrent_state_floats(r), offset = (size_t)(r->conv_kernel - 1) * C;
  for (int item = first; item < last; item++) {
    const int seq = item / Hv, h = item % Hv, kh = h % Hk;
    const int from = j->resume ? j->rows[j->order[j->starts[seq]]] : j->slots[seq];
    const float *before = j->states + (size_t)from * row_floats + offset + (size_t)h * S * S;
    for (int i = j->starts[seq]; i < j->starts[seq + 1]; i++) {
      const int b = j->order[i];
      float *M = j->states + (size_t)j->rows[b] * row_floats + offset + (size_t)h * S * S;
      /* a lane at position 0 found its row zeroed */
      if (M != before && j->positions[b] != 0) memcpy(M, before, (size_t)S * S * sizeof(float));
      before = M;
      const float *row = j->mixed + (size_t)b * C, *q = row + (size_t)kh * S, *k = row + (size_t)(Hk + kh) * S;
      const float *v = row + (size_t)(2 * Hk + h) * S, decay = j->decay[(size_t)b * Hv + h], beta = j->beta[(size_t)b * Hv + h];
      delta_step(M, q, k, v, decay, beta, scale, S, j->out + (size_t)b * Hv * S + (size_t)h * S);
    }
  }
}

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* y (C) = silu(conv of x over the past inputs in `past`), which then take x in their turn */
static void convolve(float *y, const float *x, float *past, const float *weights, int C, int kernel) {
  for (int ch = 0; ch < C; ch++) {
    const float *w = weights + (size_t)ch * kernel;
    float sum = 0.0f;
    for (int i = 0; i < kernel - 1; i++) sum += past[(size_t)i * C + ch] * w[i];
    sum += x[ch] * w[kernel - 1];
    y[ch] = sum / (1.0f + expf(-sum));
  }
  memmove(past, past + C, (size_t)(kernel - 2) * C * sizeof(float));
  memcpy(past + (size_t)(kernel - 2) * C, x, C * sizeof(float));
}

static void l2_normalize(float *x, int n, float eps) {
  float sum = 0.0f;
  for (int i = 0; i < n; i++) sum += x[i] * x[i];
  const float inv = 1.0f / sqrtf(sum + eps);
  for (int i = 0; i < n; i++) x[i] *= inv;
}

static void gated_delta_net(float *out, const float *x, const layer_matrices *w, const float *attn_norm, const float *extras, float *states,
                            const int32_t *lanes, const tq_layer_shape *shape) {
  const tq_recurrent *r = &shape->recurrent;
  const int B = shape->attention.lanes, D = shape->dim, S = r->state, Hk = r->k_heads, Hv = r->v_heads, K = r->conv_kernel;
  const int C = (2 * Hk + Hv) * S, V = Hv * S, width = C + V + 2 * Hv;
  const float eps = shape->attention.eps;
  const float *conv_weights = extras, *dt_bias = extras + (size_t)C * K, *a = dt_bias + Hv, *norm = a + Hv;
  const size_t pieces[] = {(size_t)B * width, (size_t)B * C, (size_t)B * V, (size_t)B * Hv, (size_t)B * Hv, (size_t)B, (size_t)B + 1, (size_t)B};
  enum { PIECES = sizeof pieces / sizeof *pieces };
  size_t at[PIECES];
  char *base = pieces_of(&qwen35_rows, pieces, PIECES, sizeof(float), at);
  float *projected = (float *)(base + at[0]), *mixed = (float *)(base + at[1]), *o = (float *)(base + at[2]);
  float *decay = (float *)(base + at[3]), *beta = (float *)(base + at[4]);
  int32_t *order = (int32_t *)(base + at[5]), *starts = (int32_t *)(base + at[6]), *slots = (int32_t *)(base + at[7]);

  const tq_product shape_in = {shape->types[LAYER_QKV], width, D, B, eps};
  linear(projected, w->qkv, x, &shape_in, RMS_NORM, attn_norm, 0);
  /* the lanes by sequence, each sequence's in the order given */
  int sequences = 0;
  for (int b = 0; b < B; b++) {
    int seq = 0;
    while (seq < sequences && slots[seq] != lanes[b]) seq++;
    if (seq == sequences) slots[sequences++] = lanes[b];
  }
  starts[0] = 0;
  for (int seq = 0; seq < sequences; seq++) {
    int n = starts[seq];
    for (int b = 0; b < B; b++)
      if (lanes[b] == slots[seq]) order[n++] = b;
    starts[seq + 1] = n;
  }
  const int32_t *rows = r->lane_rows ? lanes + 2 * B : lanes;
  const size_t row_floats = recurrent_state_floats(r);
  for (int i = 0; i < B; i++) {
    const int b = order[i];
    float *state = states + (size_t)rows[b] * row_floats;
    /* the row that holds the state this lane goes on from: its sequence's lane before it, else its slot's */
    const int first_lane = i == 0 || lanes[order[i - 1]] != lanes[b];
    const int before = !first_lane ? rows[order[i - 1]] : r->lane_rows == LANE_ROWS_RESUME ? rows[b] : lanes[b];
    if (lanes[B + b] == 0) memset(state, 0, row_floats * sizeof(float));
    else if (rows[b] != before) memcpy(state, states + (size_t)before * row_floats, (size_t)(K - 1) * C * sizeof(float)); /* the conv's inputs */
    const float *p = projected + (size_t)b * width;
    float *y = mixed + (size_t)b * C;
    convolve(y, p, state, conv_weights, C, K);
    for (int head = 0; head < 2 * Hk; head++) l2_normalize(y + (size_t)head * S, S, eps);
    for (int h = 0; h < Hv; h++) {
      beta[(size_t)b * Hv + h] = 1.0f / (1.0f + expf(-p[C + V + h]));
      decay[(size_t)b * Hv + h] = expf(softplus(p[C + V + Hv + h] + dt_bias[h]) * a[h]);
    }
  }
  const recurrence_job job = {o, mixed, decay, beta, states, order, starts, slots, rows, lanes + B, r->lane_rows == LANE_ROWS_RESUME, r};
  const job_t j = {run_recurrence, &job, sequences * Hv, 1};
  run_job(&j);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < Hv; h++) {
      float *head = out + (size_t)b * V + (size_t)h * S;
      const float *z = projected + (size_t)b * width + C + (size_t)h * S;
      rms_norm_row(o + (size_t)b * V + (size_t)h * S, norm, S, eps, head);
      for (int c = 0; c < S; c++) head[c] *= z[c] / (1.0f + expf(-z[c]));
    }
}

/* gated_attention(out, qkv, x, w_qkv, attn_norm, cache, lanes, rotations, extras, tables, shape): a
 * FORM_GATED_ATTENTION layer's attention (Qwen3.5's full layers): W_qkv's rows give each head's query
 * then its gate (head after head), then the keys and values; out = attention (as attend) times
 * sigmoid(gate), a value at a time. qkv: room for B rows of the attention's (H + 2 KvH) Hd values. */
static void gated_attention(float *out, float *qkv, const float *x, const uint8_t *w_qkv, const float *attn_norm, void *cache,
                            const int32_t *lanes, const float *rotations, const float *extras, const int32_t *tables,
                            const tq_layer_shape *shape) {
  const tq_attention *a = &shape->attention;
  const int B = a->lanes, H = a->heads, KvH = a->kv_heads, Hd = a->head_dim, width = (H + 2 * KvH) * Hd, raw_width = width + H * Hd;
  float *raw = at_least(&qwen35_rows, ((size_t)B * raw_width + (size_t)B * H * Hd) * sizeof(float)), *gate = raw + (size_t)B * raw_width;
  const tq_product raw_shape = {shape->types[LAYER_QKV], raw_width, shape->dim, B, a->eps};
  linear(raw, w_qkv, x, &raw_shape, RMS_NORM, attn_norm, 0);
  for (int b = 0; b < B; b++) {
    const float *from = raw + (size_t)b * raw_width;
    for (int h = 0; h < H; h++) {
      memcpy(qkv + (size_t)b * width + (size_t)h * Hd, from + (size_t)h * 2 * Hd, Hd * sizeof(float));
      memcpy(gate + ((size_t)b * H + h) * Hd, from + (size_t)h * 2 * Hd + Hd, Hd * sizeof(float));
    }
    memcpy(qkv + (size_t)b * width + (size_t)H * Hd, from + (size_t)2 * H * Hd, (size_t)2 * KvH * Hd * sizeof(float));
  }
  attend(out, qkv, cache, lanes, rotations, extras, tables, a);
  for (size_t i = 0; i < (size_t)B * H * Hd; i++) out[i] /= 1.0f + expf(-gate[i]);
}
