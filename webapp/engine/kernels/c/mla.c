/* ---- multi-head latent attention (DeepSeek-V2's MLA, FORM_LATENT) ---------------------------- */
/* latent_attention(out, x, w, attn_norm, norms, cache, lanes, rotations, tables, shape): a FORM_LATENT
 * layer's attention for B lanes, from the layer's input x (B, D) to out (B, H v_dim), the input of
 * W_o. With L = kv_lora, R = rope, N = nope (tq_latent) and n = rms_norm(x) * attn_norm:
 *   [q_a | c | k_pe] = W_qkv . n  (q_a: q_lora values; without q_lora, q itself: H (N + R) values)
 *   q = W_q_b . rms_norm(q_a) * q_a_norm;  each head's q = [q_nope (N) | q_pe (R)]
 *   key row = [RoPE(k_pe) | rms_norm(c) * kv_a_norm]  (R + L values, one for all heads: the cache row)
 *   query h = [RoPE(q_pe_h) | W_k_b[h] . q_nope_h]  (the key's product with W_k_b absorbed into q)
 *   a_h = softmax(query h . key rows * scale) . key rows' last L values;  out_h = W_v_b[h] . a_h
 * which is llama.cpp's absorbed MLA. The rotated values lead the row so that tq_attend's RoPE (a
 * head's first rotary_dim values) turns them; the cache holds the latent row once (ATTEND_LATENT: a
 * key row is its own value row), L + R values a position where full keys and values would take
 * H (N + R + v_dim). norms: q_a_norm's q_lora floats (with q_lora), then kv_a_norm's L.
 * The per-head products read each head's matrix at head times its bytes (cpu.py's expert_weight
 * stores them so); a lane's numbers depend on its own rows only. */
static __thread scratch_t latent_buffers;

/* to (B, n) = columns first .. first + n - 1 of `from`'s rows, `width` floats apart */
static void gather_columns(float *to, const float *from, int B, size_t width, size_t first, int n) {
  for (int b = 0; b < B; b++) memcpy(to + (size_t)b * n, from + (size_t)b * width + first, n * sizeof(float));
}

/* rows (B) of `width` floats apart, from column `first`: = from (B, n) */
static void scatter_columns(float *to, const float *from, int B, size_t width, size_t first, int n) {
  for (int b = 0; b < B; b++) memcpy(to + (size_t)b * width + first, from + (size_t)b * n, n * sizeof(float));
}

static size_t matrix_bytes(int type, int rows, int cols) { return (size_t)rows * (cols / block_values(type)) * block_bytes(type); }

static void latent_attention(float *out, const float *x, const layer_matrices *w, const float *attn_norm, const float *norms, uint16_t *cache,
                             const int32_t *lanes, const float *rotations, const int32_t *tables, const tq_layer_shape *shape) {
  const tq_attention *a = &shape->attention;
  const tq_latent *m = &shape->latent;
  const int B = a->lanes, H = a->heads, D = shape->dim, L = m->kv_lora, R = m->rope, N = m->nope, V = m->v_dim, QA = m->q_lora;
  const int Q = H * (N + R), first = QA ? QA : Q, width = first + L + R, Hd = R + L, widest = L > V ? L : V;
  const size_t pieces[] = {
      (size_t)B * width,          /* 0: the qkv product */
      (size_t)B * (QA ? Q : 0),   /* 1: q from q_a */
      (size_t)B * (QA ? QA : 0),  /* 2: q_a, gathered */
      (size_t)B * (H + 1) * Hd,   /* 3: tq_attend's rows: every query head, then the key */
      (size_t)B * (N > L ? N : L), /* 4: one head's input to a per-head product */
      (size_t)B * widest,         /* 5: one head's output of it */
      (size_t)B * H * Hd,         /* 6: the attention's output */
  };
  enum { PIECES = sizeof pieces / sizeof *pieces };
  size_t at[PIECES];
  char *base = pieces_of(&latent_buffers, pieces, PIECES, sizeof(float), at);
  float *projected = (float *)(base + at[0]), *q = (float *)(base + at[1]), *q_a = (float *)(base + at[2]);
  float *rows = (float *)(base + at[3]), *head_in = (float *)(base + at[4]), *head_out = (float *)(base + at[5]);
  float *attended = (float *)(base + at[6]);

  const tq_product qkv_shape = {shape->types[LAYER_QKV], width, D, B, a->eps};
  linear(projected, w->qkv, x, &qkv_shape, RMS_NORM, attn_norm, 0);
  const float *query = projected, *kv_a_norm = norms + QA;
  size_t query_width = width;
  if (QA) {
    gather_columns(q_a, projected, B, width, 0, QA);
    const tq_product q_shape = {shape->types[LAYER_Q_B], Q, QA, B, a->eps};
    linear(q, w->q_b, q_a, &q_shape, RMS_NORM, norms, 0);
    query = q, query_width = Q;
  }
  const size_t row_width = (size_t)(H + 1) * Hd;
  for (int b = 0; b < B; b++) {
    float *key = rows + (size_t)b * row_width + (size_t)H * Hd;
    const float *latent = projected + (size_t)b * width + first;
    memcpy(key, latent + L, R * sizeof(float));
    rms_norm_row(latent, kv_a_norm, L, a->eps, key + R);
    for (int h = 0; h < H; h++) memcpy(rows + (size_t)b * row_width + (size_t)h * Hd, query + (size_t)b * query_width + (size_t)h * (N + R) + N, R * sizeof(float));
  }
  const int t_k = shape->types[LAYER_K_B], t_v = shape->types[LAYER_V_B];
  const tq_product k_shape = {t_k, L, N, B, 0.0f}, v_shape = {t_v, V, L, B, 0.0f};
  for (int h = 0; h < H; h++) {
    for (int b = 0; b < B; b++) memcpy(head_in + (size_t)b * N, query + (size_t)b * query_width + (size_t)h * (N + R), N * sizeof(float));
    linear(head_out, w->k_b + h * matrix_bytes(t_k, L, N), head_in, &k_shape, AS_IS, 0, 0);
    scatter_columns(rows, head_out, B, row_width, (size_t)h * Hd + R, L);
  }
  attend(attended, rows, cache, lanes, rotations, 0, tables, a);
  for (int h = 0; h < H; h++) {
    gather_columns(head_in, attended, B, (size_t)H * Hd, (size_t)h * Hd + R, L);
    linear(head_out, w->v_b + h * matrix_bytes(t_v, V, L), head_in, &v_shape, AS_IS, 0, 0);
    scatter_columns(out, head_out, B, (size_t)H * V, (size_t)h * V, V);
  }
}
