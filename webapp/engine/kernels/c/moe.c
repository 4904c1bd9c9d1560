/* ---- a mixture of experts' feed-forward ------------------------------------------------------ */
/* moe_feed_forward(out, h, ...): out = h + sum_j weight_j * expert_j(rms_norm(h) * ffn_norm) for each
 * of B lanes, over the `used` experts its router picks (Qwen3-MoE):
 *   probs = softmax(W_router . n);  the `used` largest (ties: the lower expert), their probs as
 *   weights (divided by their sum with EXPERTS_NORM_WEIGHTS);  expert e: W_down[e] . swiglu(W_gate[e] . n | W_up[e] . n)
 * With `biases` (FORM_BIASES: the router's, then every expert's gate, up and down biases) each
 * product adds its own, and FORM_SWIGLU_CLAMPED takes gpt-oss's clamped SwiGLU for swiglu (gpt-oss's
 * softmax over the chosen logits is their probs divided by their sum: EXPERTS_NORM_WEIGHTS). With
 * experts.shared_ffn_dim, a shared expert's gated output (shared_expert.c) joins the routed sum before
 * the residual: out = h + (sum_j ... + shared), as llama.cpp adds them (Qwen2-MoE; GLM-4.5's ungated,
 * its experts chosen by sigmoid probabilities plus a selection bias: choose_experts).
 * The step's lanes are grouped by expert, so each chosen expert's blocks are read once a step however
 * many lanes chose it (a B=8 decode step of Qwen3-30B-A3B names ~52 of 128 experts with an even
 * router, where lane by lane would read 64), each expert's products spread over the pool like any
 * product. A lane's numbers never depend on
 * which other lanes share its experts: a product's row for one token is the same whatever tokens
 * run beside it, and a lane sums its experts in its own order (by weight, as chosen). */

/* `used` experts of a lane's router logits and their weights: probabilities by softmax, or by sigmoid
 * (EXPERTS_SIGMOID); the `used` largest of probs + selection_bias (where it is given, else of probs;
 * ties: the lower expert) chosen, the largest first, each weighted by its probability without the
 * bias (as llama.cpp's exp_probs_b: DeepSeek-V3's and GLM-4.5's balancing bias only steers the
 * choice); divided by their sum with EXPERTS_NORM_WEIGHTS, then times `scale` (0 or 1: none). */
static void choose_experts(const float *logits, const float *selection_bias, int count, int used, int flags, float scale, int32_t *chosen,
                           float *weights) {
  float probs[MAX_EXPERTS], ranked[MAX_EXPERTS];
  unsigned char taken[MAX_EXPERTS] = {0};
  if (flags & EXPERTS_SIGMOID) {
    for (int e = 0; e < count; e++) probs[e] = 1.0f / (1.0f + expf(-logits[e]));
  } else {
    float top = logits[0], sum = 0.0f;
    for (int e = 1; e < count; e++) top = logits[e] > top ? logits[e] : top;
    for (int e = 0; e < count; e++) sum += probs[e] = expf(logits[e] - top);
    for (int e = 0; e < count; e++) probs[e] /= sum;
  }
  for (int e = 0; e < count; e++) ranked[e] = selection_bias ? probs[e] + selection_bias[e] : probs[e];
  float picked = 0.0f;
  for (int j = 0; j < used; j++) {
    int best = -1;
    for (int e = 0; e < count; e++)
      if (!taken[e] && (best < 0 || ranked[e] > ranked[best])) best = e;
    chosen[j] = best;
    taken[best] = 1;
    picked += weights[j] = probs[best];
  }
  if (flags & EXPERTS_NORM_WEIGHTS) {
    const float total = picked > 6.103515625e-5f ? picked : 6.103515625e-5f; /* as llama.cpp clamps it */
    for (int j = 0; j < used; j++) weights[j] /= total;
  }
  if (scale != 0.0f && scale != 1.0f)
    for (int j = 0; j < used; j++) weights[j] *= scale;
}

/* A layer's matrices and what a mixture of experts adds, by address (tq.h's LAYER_* entries). */
typedef struct {
  const uint8_t *qkv, *o, *gate_up, *down, *router, *up, *shared_gate_up, *shared_down;
  const uint8_t *q_b, *k_b, *v_b; /* FORM_LATENT's (mla.c) */
  int64_t *expert_tokens;
  const float *shared_gate, *selection_bias;
} layer_matrices;

static __thread scratch_t moe_buffers, normed_int8[ACT_FORMATS], gathered_int8[ACT_FORMATS];

/* rows (n, width, `stride` floats apart) += bias */
static void add_bias(float *rows, int n, int width, size_t stride, const float *bias) {
  for (int i = 0; i < n; i++)
    for (int j = 0; j < width; j++) rows[(size_t)i * stride + j] += bias[j];
}

static void moe_feed_forward(float *out, const float *h, const layer_matrices *w, const float *ffn_norm, const float *biases,
                             const tq_layer_shape *shape) {
  const uint8_t *w_router = w->router, *w_gate = w->gate_up, *w_up = w->up, *w_down = w->down;
  int64_t *expert_tokens = w->expert_tokens;
  const int B = shape->attention.lanes, D = shape->dim, E = shape->experts.count, K = shape->experts.used, F = shape->experts.ffn_dim;
  const int nb = D / 32;
  const int t_router = shape->types[LAYER_ROUTER], t_gate = shape->types[LAYER_GATE_UP], t_up = shape->types[LAYER_UP],
            t_down = shape->types[LAYER_DOWN];
  /* one allocation, its pieces 64-byte aligned */
  const size_t pieces[] = {
      (size_t)B * D * sizeof(float),            /* 0: every lane's normed row */
      (size_t)B * D * sizeof(float),            /* 1: the lanes of one expert, gathered */
      (size_t)B * E * sizeof(float),            /* 2: router logits */
      (size_t)B * K * (sizeof(int32_t) + 4),    /* 3: each lane's experts, then their weights */
      (size_t)(E + 1 + B * K) * sizeof(int32_t), /* 4: lanes by expert: offsets, then (lane, rank) pairs */
      (size_t)B * 2 * F * sizeof(float),        /* 5: one expert's gate | up rows */
      (size_t)B * D * sizeof(float),            /* 6: one expert's outputs */
      (size_t)B * K * D * sizeof(float),        /* 7: every (lane, rank)'s expert output */
      (size_t)B * D * sizeof(float),            /* 8: the shared expert's output, if any */
  };
  enum { PIECES = sizeof pieces / sizeof *pieces };
  size_t at[PIECES];
  char *base = pieces_of(&moe_buffers, pieces, PIECES, 1, at);
  float *normed = (float *)(base + at[0]), *gathered = (float *)(base + at[1]), *logits = (float *)(base + at[2]);
  int32_t *chosen = (int32_t *)(base + at[3]);
  float *weights = (float *)(chosen + (size_t)B * K);
  int32_t *starts = (int32_t *)(base + at[4]), *members = starts + E + 1;
  float *gate_up = (float *)(base + at[5]), *expert_out = (float *)(base + at[6]), *outputs = (float *)(base + at[7]);
  float *shared = shape->experts.shared_ffn_dim ? (float *)(base + at[8]) : 0;

  float *sums = expert_out; /* free until the first expert runs */
  square_sums(h, B, D, sums);
  for (int b = 0; b < B; b++) rms_scale_row(h + (size_t)b * D, sums[b], ffn_norm, D, shape->attention.eps, normed + (size_t)b * D);
  activations normed_rows = {normed, B, D, normed_int8, {0}};
  product(t_router, E, E, logits, w_router, &normed_rows, 0);
  /* quantized once for all the experts, each expert's lanes gathered from them */
  int8_rows(&normed_rows, t_gate);
  int8_rows(&normed_rows, t_up);
  const float *gate_bias = biases ? biases + E : 0, *up_bias = biases ? biases + E + (size_t)E * F : 0;
  const float *down_bias = biases ? biases + E + (size_t)2 * E * F : 0;
  if (biases) add_bias(logits, B, E, E, biases);
  const int flags = shape->experts.flags;
  const float *selection_bias = flags & EXPERTS_SELECTION_BIAS ? w->selection_bias : 0;
  for (int b = 0; b < B; b++)
    choose_experts(logits + (size_t)b * E, selection_bias, E, K, flags, shape->experts.weights_scale, chosen + (size_t)b * K,
                   weights + (size_t)b * K);

  /* counting sort of (lane, rank) by expert: each expert's lanes in lane order */
  memset(starts, 0, (E + 1) * sizeof(int32_t));
  for (int i = 0; i < B * K; i++) starts[chosen[i] + 1]++;
  for (int e = 0; e < E; e++) starts[e + 1] += starts[e];
  for (int e = 0; e < E; e++)
    if (expert_tokens) expert_tokens[e] += starts[e + 1] - starts[e];
  int32_t fill[MAX_EXPERTS];
  memcpy(fill, starts, E * sizeof(int32_t));
  for (int i = 0; i < B * K; i++) members[fill[chosen[i]]++] = i;

  const size_t gate_bytes = (size_t)F * (D / block_values(t_gate)) * block_bytes(t_gate);
  const size_t up_bytes = (size_t)F * (D / block_values(t_up)) * block_bytes(t_up);
  const size_t down_bytes = (size_t)D * (F / block_values(t_down)) * block_bytes(t_down);
  const tq_product down_shape_of = {t_down, D, F, 0, 0.0f};
  for (int e = 0; e < E; e++) {
    const int n = starts[e + 1] - starts[e];
    if (!n) continue;
    activations expert_rows = {gathered, n, D, gathered_int8, {0}};
    for (int f = 0; f < ACT_FORMATS; f++)
      if (normed_rows.int8[f]) expert_rows.int8[f] = at_least(&gathered_int8[f], (size_t)n * nb * sizeof(xblock));
    for (int i = 0; i < n; i++) {
      const int lane = members[starts[e] + i] / K;
      for (int f = 0; f < ACT_FORMATS; f++)
        if (normed_rows.int8[f])
          memcpy((xblock *)expert_rows.int8[f] + (size_t)i * nb, normed_rows.int8[f] + (size_t)lane * nb, nb * sizeof(xblock));
      memcpy(gathered + (size_t)i * D, normed + (size_t)lane * D, D * sizeof(float));
    }
    product(t_gate, F, 2 * F, gate_up, w_gate + e * gate_bytes, &expert_rows, 0);
    product(t_up, F, 2 * F, gate_up + F, w_up + e * up_bytes, &expert_rows, 0);
    if (biases) {
      add_bias(gate_up, n, F, 2 * F, gate_bias + (size_t)e * F);
      add_bias(gate_up + F, n, F, 2 * F, up_bias + (size_t)e * F);
    }
    tq_product down_shape = down_shape_of;
    down_shape.tokens = n;
    linear(expert_out, w_down + e * down_bytes, gate_up, &down_shape, shape->form & FORM_SWIGLU_CLAMPED ? SWIGLU_CLAMPED : SWIGLU, 0, 0);
    if (biases) add_bias(expert_out, n, D, D, down_bias + (size_t)e * D);
    for (int i = 0; i < n; i++) memcpy(outputs + (size_t)members[starts[e] + i] * D, expert_out + (size_t)i * D, D * sizeof(float));
  }
  if (shared) shared_expert(shared, normed, w->shared_gate_up, w->shared_down, flags & EXPERTS_SHARED_UNGATED ? 0 : w->shared_gate, shape);
  for (int b = 0; b < B; b++) {
    float *o = out + (size_t)b * D;
    const float *hb = h + (size_t)b * D;
    for (int i = 0; i < D; i++) {
      float mixed = 0.0f;
      for (int j = 0; j < K; j++) mixed += weights[(size_t)b * K + j] * outputs[((size_t)b * K + j) * D + i];
      o[i] = hb[i] + (shared ? mixed + shared[(size_t)b * D + i] : mixed);
    }
  }
}
