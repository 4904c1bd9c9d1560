/* ---- a mixture of experts' shared expert ------------------------------------------------------ */
/* shared_expert(out, normed, w_gate_up, w_down, gate, shape): for each of B lanes' normed rows n,
 *   out = sigmoid(gate . n) * W_down . swiglu(W_gate_up . n)
 * the feed-forward every token runs beside its routed experts (Qwen2-MoE's ffn_*_shexp, of width
 * shape->experts.shared_ffn_dim; W_gate_up holds gate over up, as a dense layer's), scaled by its own
 * gate: one number a lane from the D floats of ffn_gate_inp_shexp, or 1 where `gate` is 0 (GLM-4.5's
 * shared experts, ungated). moe.c adds it to the routed sum.
 * A lane's numbers depend on its row alone: the products' rows as for any product, the gate's dot
 * product summed in one fixed order. */
static __thread scratch_t shared_gate_up_rows;

static void shared_expert(float *out, const float *normed, const uint8_t *w_gate_up, const uint8_t *w_down, const float *gate,
                          const tq_layer_shape *shape) {
  const int B = shape->attention.lanes, D = shape->dim, F = shape->experts.shared_ffn_dim;
  float *gate_up = at_least(&shared_gate_up_rows, (size_t)B * 2 * F * sizeof(float));
  const tq_product gate_up_shape = {shape->types[LAYER_SHARED_GATE_UP], 2 * F, D, B, 0.0f};
  const tq_product down_shape = {shape->types[LAYER_SHARED_DOWN], D, F, B, 0.0f};
  linear(gate_up, w_gate_up, normed, &gate_up_shape, AS_IS, 0, 0);
  linear(out, w_down, gate_up, &down_shape, SWIGLU, 0, 0);
  if (!gate) return;
  for (int b = 0; b < B; b++) {
    const float *n = normed + (size_t)b * D;
    float logit = 0.0f;
    for (int i = 0; i < D; i++) logit += gate[i] * n[i];
    const float scale = 1.0f / (1.0f + expf(-logit));
    for (int i = 0; i < D; i++) out[(size_t)b * D + i] *= scale;
  }
}
