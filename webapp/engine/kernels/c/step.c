/* ---- a whole layer ---------------------------------------------------------------------------- */
/* tq_layer(out, x, w_qkv, w_o, w_gate_up, w_down, w_router, w_up, w_shared_gate_up, w_shared_down,
 * attn_norm, ffn_norm, cache, lanes, inv_freq, extras, expert_tokens, post_norms, biases, shared_gate,
 * selection_bias, shape): one transformer layer for B lanes, the five kernels above in a row with
 * their intermediates in this thread's scratch:
 *   qkv = W_qkv . rms_norm(x) * attn_norm;  a = attention(qkv);  h = x + W_o . a;
 *   out = h + W_down . swiglu(W_gate_up . rms_norm(h) * ffn_norm)
 * or, in a mixture-of-experts layer, the last line as moe.c's feed-forward. shape->form changes two
 * things (Gemma 3's layer): FORM_POST_NORMS adds rms_norm(W_o . a) * post_norms[0..D) and
 * rms_norm(W_down . ...) * post_norms[D..2D) in place of the products themselves, FORM_GEGLU takes
 * gelu(gate) * up for swiglu; FORM_BIASES adds the output product's bias (biases[0..D)) and a mixture
 * of experts' (moe.c); FORM_LATENT's attention is mla.c's (its matrices from the model table only:
 * tq_layer has none of them); FORM_UNNORMED_INPUTS takes x and h as they are for the two rms_norms.
 * One kernel a layer keeps a captured step at ~30 kernels: tinygrad's capture and replay cost grows
 * with their count. shape: tq_layer_shape. */
/* Ask for the cache lines that attend() will write (each lane's new keys and values) before the qkv
 * product, which hides their misses: written cold, they took most of a B=8 step's RoPE and cache
 * writes (every layer's cache from DRAM; bench/RESULTS.md, mixed steps: the c94574b row, and figures
 * moved out of code comments). */
static void prefetch_new_entries(const uint16_t *cache, const int32_t *lanes, const int32_t *tables, const tq_attention *shape) {
  const int B = shape->lanes, KvH = shape->kv_heads;
  for (int b = 0; b < B; b++)
    for (int is_v = 0; is_v < (shape->flags & ATTEND_LATENT ? 1 : 2); is_v++)
      for (int kvh = 0; kvh < KvH; kvh++) {
        const char *entry = (const char *)kv_row(cache, tables, shape, is_v, lanes[b], kvh, lanes[B + b]);
        for (size_t at = 0; at < kv_row_bytes(shape); at += 64) __builtin_prefetch(entry + at, 1, 3);
      }
}

/* rows (B, n) = residual + rms_norm(rows) * weight, a row at a time */
static void add_normed(float *rows, const float *residual, const float *weight, int B, int n, float eps) {
  for (int b = 0; b < B; b++) {
    float *row = rows + (size_t)b * n;
    rms_norm_row(row, weight, n, eps, row);
    for (int i = 0; i < n; i++) row[i] += residual[(size_t)b * n + i];
  }
}

static void layer(float *out, const float *x, const layer_matrices *w, const float *attn_norm, const float *ffn_norm, const float *post_norms,
                  const float *biases, uint16_t *cache, const int32_t *lanes, const float *rotations, const float *extras,
                  const int32_t *tables, const lora_view *lora, const tq_layer_shape *shape) {
  const tq_attention *attention = &shape->attention;
  const int B = attention->lanes, H = attention->heads, KvH = attention->kv_heads, Hd = attention->head_dim, D = shape->dim, F = shape->ffn_dim;
  const int moe = shape->experts.count > 0, post = shape->form & FORM_POST_NORMS, latent = shape->form & FORM_LATENT;
  const int recurrent = shape->form & FORM_RECURRENT, input = shape->form & FORM_UNNORMED_INPUTS ? AS_IS : RMS_NORM;
  const float eps = attention->eps;
  const int width = (H + 2 * KvH) * Hd;
  const int attended = recurrent ? shape->recurrent.v_heads * shape->recurrent.state : latent ? H * shape->latent.v_dim : H * Hd;
  const int attn_width = attended > H * Hd ? attended : H * Hd;
  float *qkv = at_least(&layer_intermediates, (size_t)B * (width + attn_width + D + (moe ? 0 : 2 * F)) * sizeof(float)),
        *attn = qkv + (size_t)B * width, *h = attn + (size_t)B * attn_width, *gate_up = h + (size_t)B * D;
  const tq_product qkv_shape = {shape->types[LAYER_QKV], width, D, B, eps}, o_shape = {shape->types[LAYER_O], D, attended, B, eps};
  if (!recurrent) prefetch_new_entries(cache, lanes, tables, attention);
  if (recurrent) {
    gated_delta_net(attn, x, w, attn_norm, extras, (float *)cache, lanes, shape);
  } else if (shape->form & FORM_GATED_ATTENTION) {
    gated_attention(attn, qkv, x, w->qkv, attn_norm, cache, lanes, rotations, extras, tables, shape);
  } else if (latent) {
    latent_attention(attn, x, w, attn_norm, extras, cache, lanes, rotations, tables, shape);
  } else {
    linear(qkv, w->qkv, x, &qkv_shape, input, attn_norm, 0);
    add_lora(qkv, product_input(x, input), D, width, lora, LAYER_QKV, B);
    attend(attn, qkv, cache, lanes, rotations, extras, tables, attention);
  }
  linear(h, w->o, attn, &o_shape, AS_IS, 0, post ? 0 : x);
  add_lora(h, attn, attended, D, lora, LAYER_O, B);
  if (post) add_normed(h, x, post_norms, B, D, eps);
  if (shape->form & FORM_BIASES)
    for (int b = 0; b < B; b++)
      for (int i = 0; i < D; i++) h[(size_t)b * D + i] += biases[i];
  if (moe) {
    moe_feed_forward(out, h, w, ffn_norm, shape->form & FORM_BIASES ? biases + D : 0, shape);
    return;
  }
  const tq_product gate_up_shape = {shape->types[LAYER_GATE_UP], 2 * F, D, B, eps}, down_shape = {shape->types[LAYER_DOWN], D, F, B, eps};
  linear(gate_up, w->gate_up, h, &gate_up_shape, input, ffn_norm, 0);
  add_lora(gate_up, product_input(h, input), D, 2 * F, lora, LAYER_GATE_UP, B);
  linear(out, w->down, gate_up, &down_shape, shape->form & FORM_GEGLU ? GEGLU : SWIGLU, 0, post ? 0 : h);
  add_lora(out, product_input(gate_up, SWIGLU), F, D, lora, LAYER_DOWN, B);
  if (post) add_normed(out, h, post_norms + D, B, D, eps);
}

void tq_layer(float *out, const float *x, const uint8_t *w_qkv, const uint8_t *w_o, const uint8_t *w_gate_up, const uint8_t *w_down,
              const uint8_t *w_router, const uint8_t *w_up, const uint8_t *w_shared_gate_up, const uint8_t *w_shared_down,
              const float *attn_norm, const float *ffn_norm, uint16_t *cache, const int32_t *lanes, const float *inv_freq, const float *extras,
              int64_t *expert_tokens, const float *post_norms, const float *biases, const float *shared_gate, const float *selection_bias,
              const tq_layer_shape *shape) {
  const float *rotations = rope_rotations(&rotation_rows, lanes, shape->attention.lanes, inv_freq, shape->attention.head_dim,
                                          shape->attention.rotary_dim, shape->attention.rope_scale);
  const layer_matrices w = {w_qkv, w_o, w_gate_up, w_down, w_router, w_up, w_shared_gate_up, w_shared_down, 0, 0, 0,
                            expert_tokens, shared_gate, selection_bias};
  const lora_view no_lora = {0};
  layer(out, x, &w, attn_norm, ffn_norm, post_norms, biases, cache, lanes, rotations, extras, 0, &no_lora, shape); /* unpaged (tq.h) */
}

/* ---- a whole step --------------------------------------------------------------------------- */
/* tq_forward(logits, tokens, lanes, picks, model, step, layer_info, inputs): a whole step for B lanes, from token ids to
 * the logits of the lanes in `picks` (R of them: every lane of a decode step, a prefill piece's last
 * real token): embedding, every layer as tq_layer, then the final norm and the output head (or, with
 * step->outputs STEP_HIDDEN, the final norm's rows alone: `logits` then holds R x dim floats).
 * `model` holds the model's tensors by address (uint64): the embedding matrix, the final norm, the
 * head matrix, the RoPE inverse frequencies (global, then local), a paged cache's block tables, a LoRA table, M-RoPE's sections (tq.h), then per layer its qkv, o, gate_up and down matrices, its
 * two norms, its KV cache and its attention extras, and a mixture of experts' router, up matrices and
 * token counts, a post-normed layer's norms, a layer's biases, a shared expert's gate and the experts'
 * selection bias (the order of tq.h's MODEL_* and LAYER_* entries; a shared expert's matrices follow the up matrices). step:
 * tq_step (B = step->attention.lanes, R = step->picks); layer_info: each layer's LAYER_INFO numbers in
 * turn (its matrices' types, its attention's flags, form, window and cache positions; a paged step,
 * step->attention.block_positions > 0, takes step->attention.positions for every layer and leaves
 * info's positions unread). cpu.py calls it directly, on the model thread, which then works through
 * the pool's jobs itself: replayed inside a TinyJit, the same one-kernel step took longer (Python
 * before it started, tinygrad's worker thread running it, noticing its end; bench/RESULTS.md, one
 * call a step: the second 56cc4f0 row). A negative token -1 - k takes row k of `inputs` (rows of dim
 * floats, an image's projected rows) for its embedding, unscaled: no token id gave it; with
 * step->deepstack > 0 a row is that many more dim floats wide, and layer l < deepstack adds part l + 1
 * of it to its output at that position. */
static __thread scratch_t step_rows, local_rotation_rows;

void tq_forward(float *logits, const int32_t *tokens, const int32_t *lanes, const int32_t *picks, const uint64_t *model, const tq_step *step,
                const int32_t *layer_info, const float *inputs) {
  const int B = step->attention.lanes, D = step->dim, R = step->picks;
  float *x = at_least(&step_rows, (size_t)(B + R) * D * sizeof(float)), *picked = x + (size_t)B * D;
  const tq_attention *a = &step->attention;
  const int32_t *tables = (const int32_t *)(uintptr_t)model[MODEL_BLOCK_TABLES]; /* 0 unless a->block_positions > 0 */
  /* with ATTEND_ROPE_POSITIONS each rotary pair turns by one of the lanes' three rows of positions */
  const int sectioned = (a->flags & ATTEND_ROPE_POSITIONS) && model[MODEL_ROPE_SECTIONS];
  const int32_t *positions = sectioned ? lanes + 4 * B : lanes + B, *sections = sectioned ? (const int32_t *)(uintptr_t)model[MODEL_ROPE_SECTIONS] : NULL;
  const float *rotations = rotations_by(&rotation_rows, positions, sections, B, (const float *)(uintptr_t)model[MODEL_INV_FREQ], a->head_dim,
                                        a->rotary_dim, a->rope_scale);
  const float *local_rotations = model[MODEL_INV_FREQ_LOCAL] ? rotations_by(&local_rotation_rows, positions, sections, B,
                                                                            (const float *)(uintptr_t)model[MODEL_INV_FREQ_LOCAL],
                                                                            a->head_dim, a->rotary_dim, a->rope_scale)
                                                             : rotations;
  const tq_product embed_shape = {step->embed_type, step->vocab, D, B, 0.0f};
  tq_embed(x, (const uint8_t *)(uintptr_t)model[MODEL_EMBED], tokens, &embed_shape);
  if (step->embed_scale != 1.0f)
    for (size_t i = 0; i < (size_t)B * D; i++) x[i] *= step->embed_scale;
  const size_t input_width = (size_t)(1 + step->deepstack) * D; /* an inputs row: the embedding, then each deepstack layer's part */
  for (int b = 0; b < B && inputs; b++)
    if (tokens[b] < 0) memcpy(x + (size_t)b * D, inputs + (size_t)(-1 - (int64_t)tokens[b]) * input_width, D * sizeof(float));
  tq_layer_shape layer_shape = {step->attention, D, step->ffn_dim, {0}, {0}, 0, step->latent, step->recurrent};
  for (int l = 0; l < step->layers; l++) {
    const uint64_t *m = model + MODEL_LAYERS + (size_t)l * LAYER_ENTRIES;
    const lora_view lora = {(const uint64_t *)(uintptr_t)model[MODEL_LORA], l, step->layers};
    const int32_t *info = layer_info + LAYER_INFO * (size_t)l;
    memcpy(layer_shape.types, info, sizeof layer_shape.types);
    layer_shape.attention.flags = info[LAYER_INFO_FLAGS] | (a->flags & ATTEND_KEYS_AHEAD);
    layer_shape.attention.window = info[LAYER_INFO_WINDOW];
    /* a paged model's layers share one block table and so one positions a sequence, the step's */
    if (!a->block_positions) layer_shape.attention.positions = info[LAYER_INFO_POSITIONS];
    layer_shape.form = info[LAYER_INFO_FORM];
#define AT(type, entry) ((type)(uintptr_t)m[entry])
    const tq_experts dense = {0};
    layer_shape.experts = m[LAYER_ROUTER] ? step->experts : dense;
    const layer_matrices w = {AT(const uint8_t *, LAYER_QKV),    AT(const uint8_t *, LAYER_O), AT(const uint8_t *, LAYER_GATE_UP),
                              AT(const uint8_t *, LAYER_DOWN),   AT(const uint8_t *, LAYER_ROUTER), AT(const uint8_t *, LAYER_UP),
                              AT(const uint8_t *, LAYER_SHARED_GATE_UP), AT(const uint8_t *, LAYER_SHARED_DOWN),
                              AT(const uint8_t *, LAYER_Q_B),    AT(const uint8_t *, LAYER_K_B), AT(const uint8_t *, LAYER_V_B),
                              AT(int64_t *, LAYER_EXPERT_TOKENS), AT(const float *, LAYER_SHARED_GATE),
                              AT(const float *, LAYER_SELECTION_BIAS)};
    /* in place: layer() reads x for the last time (the attention's residual) before it writes out */
    layer(x, x, &w, AT(const float *, LAYER_ATTN_NORM), AT(const float *, LAYER_FFN_NORM), AT(const float *, LAYER_POST_NORMS),
          AT(const float *, LAYER_BIASES), AT(uint16_t *, LAYER_CACHE), lanes, layer_shape.attention.flags & ATTEND_LOCAL_ROPE ? local_rotations : rotations,
          AT(const float *, LAYER_EXTRAS), tables, &lora, &layer_shape);
#undef AT
    for (int b = 0; b < B && inputs && l < step->deepstack; b++)
      if (tokens[b] < 0) {
        const float *part = inputs + (size_t)(-1 - (int64_t)tokens[b]) * input_width + (size_t)(l + 1) * D;
        for (int i = 0; i < D; i++) x[(size_t)b * D + i] += part[i];
      }
  }
  for (int r = 0; r < R; r++) memcpy(picked + (size_t)r * D, x + (size_t)(picks[r] < 0 || picks[r] >= B ? 0 : picks[r]) * D, D * sizeof(float));
  if (step->outputs == STEP_HIDDEN) {
    for (int r = 0; r < R; r++)
      rms_norm_row(picked + (size_t)r * D, (const float *)(uintptr_t)model[MODEL_NORM], D, step->attention.eps, logits + (size_t)r * D);
    return;
  }
  const tq_product head_shape = {step->head_type, step->vocab, D, R, step->attention.eps};
  linear(logits, (const uint8_t *)(uintptr_t)model[MODEL_HEAD], picked, &head_shape, RMS_NORM, (const float *)(uintptr_t)model[MODEL_NORM], 0);
}
