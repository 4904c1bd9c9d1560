/* ---- attention ------------------------------------------------------------------------------ */
/* tq_attend(out, qkv, cache, lanes, inv_freq, extras, tables, shape) runs a layer's attention for B lanes (a
 * decode step's sequences, or a prefill piece's tokens, each a lane of the same slot), from the qkv
 * product's rows (B, (H + 2 KvH) Hd) float32 to out (B, H Hd) float32:
 *   1. on the calling thread, per lane: add the bias, rms-normalize each q and k head (qwen3), rotate
 *      q and k by RoPE at the lane's position (half-split pairs, angle = pos * inv_freq[i]; not with
 *      ATTEND_NO_ROPE), and write k and v at that position of the lane's slot in the KV cache (2,
 *      slots, KvH, positions, a row; paged: the row of the slot's block, below), a row being Hd
 *      float16 values or, with shape->kv_type KV_Q8_0, Hd / 32 Q8_0 blocks (attention_q8.c);
 *   2. over the pool: softmax(q . K[first..last] * scale) . V[first..last] for every (lane, query head),
 *      first being 0, or pos - window + 1 for a sliding-window layer (shape->window), last being pos
 *      (with ATTEND_KEYS_AHEAD, the lane's last key: tq.h),
 *      reading the cache in place, in chunks of KEY_CHUNK keys; an item is a chunk of keys for a
 *      lane's query heads that share a kv head (up to MAX_SHARED_HEADS of them), or for a single head
 *      when that leaves a thread fewer than two items. Each chunk keeps its own max, sum and
 *      unnormalized output; 3. the calling thread combines a lane's chunks in order. The chunks are
 *      fixed by position alone, so a lane's numbers never depend on the other lanes, and one long
 *      sequence spreads over every core (a single lane at position 1,000 had 3 items for 2 threads,
 *      each streaming a whole kv head). An item reads its chunk as runs of adjacent rows (key_runs of
 *      isa.h): one run in an unpaged cache, a run per block in a paged one, the sums kept in the
 *      same order either way, so a paged cache gives the bits of an unpaged one holding its rows.
 * shape: tq_attention (B lanes, H heads, KvH kv heads, S slots, C positions, Hd); lanes = {slot_0..,
 * pos_0..}; with ATTEND_LATENT qkv has no value heads, the cache no value rows (mla.c);
 * extras holds the qkv bias (ATTEND_BIAS), then the q and k norm weights (ATTEND_QK_NORM),
 * then a sink logit a query head (ATTEND_SINKS); the norms are a head's, or all of q's and of k's
 * (ATTEND_QK_NORM_WHOLE).
 * Position p lives in row p % positions of its slot (see tq_attention.window: a ring for a window);
 * in a paged cache (shape->block_positions > 0: a pool of blocks, no window), in row
 * p % block_positions of block tables[slot * table_width + p / block_positions]. `tables` is unread
 * (may be NULL) when block_positions is 0.
 * Writing and reading in one kernel keeps their order inside it, where tinygrad cannot reorder them. */
/* Bytes of one cache row: a position's key or value for one kv head. */
static size_t kv_row_bytes(const tq_attention *shape) {
  return shape->kv_type == KV_Q8_0 ? (size_t)shape->head_dim / 32 * Q8_BLOCK_BYTES : (size_t)shape->head_dim * 2;
}

/* The row of (k or v, slot, kv head, position) in the cache: row pos % positions of the slot's rows,
 * or in a paged cache row pos % block_positions of the block that the slot's row of `tables` names
 * for pos (shape->slots then counts the pool's blocks). */
static uint8_t *kv_row(const void *cache, const int32_t *tables, const tq_attention *shape, int is_v, int slot, int kvh, int pos) {
  int block = slot, rows = shape->positions;
  if (shape->block_positions > 0) {
    block = tables[(size_t)slot * shape->table_width + pos / shape->block_positions];
    rows = shape->block_positions;
  }
  const size_t row = (((size_t)is_v * shape->slots + block) * shape->kv_heads + kvh) * rows + pos % rows;
  return (uint8_t *)cache + row * kv_row_bytes(shape);
}

/* The first key a query at pos attends, the last (pos, or with ATTEND_KEYS_AHEAD the lanes' fourth
 * row's: tq.h), and the chunks of keys it spans (from its first key's). */
static int first_key(int pos, int window) { return window > 0 && pos >= window ? pos - window + 1 : 0; }
static int last_key(const int32_t *lanes, int B, int b, int flags) { return flags & ATTEND_KEYS_AHEAD ? lanes[3 * B + b] : lanes[B + b]; }
static int key_chunks(const int32_t *lanes, int B, int b, const tq_attention *shape) {
  return last_key(lanes, B, b, shape->flags) / KEY_CHUNK - first_key(lanes[B + b], shape->window) / KEY_CHUNK + 1;
}

typedef struct {
  const float *q;
  const uint8_t *cache;
  const int32_t *tables; /* a paged cache's block tables (tq_attention.block_positions > 0) */
  const tq_attention *shape;
  const int32_t *lanes;
  const int *groups; /* lane groups: group g is lanes groups[g] .. groups[g + 1] - 1 (lane_groups) */
  int shared; /* query heads an item attends together over their kv head's keys */
  int chunks; /* chunks of KEY_CHUNK keys of the lane with the most (counted from each lane's first) */
  float *partials; /* (B, H, chunks, Hd + 2): each chunk's unnormalized output, its scores' max and sum */
} attend_t;

static void run_attend(const void *ctx, int first, int last) {
  const attend_t *a = ctx;
  const int B = a->shape->lanes, H = a->shape->heads, KvH = a->shape->kv_heads, Hd = a->shape->head_dim;
  const int group = H / KvH, shared = a->shared, parts = (group + shared - 1) / shared, chunks = a->chunks;
  const size_t part_stride = (size_t)chunks * (Hd + 2);
  const float scale = a->shape->scale;
  for (int item = first; item < last; item++) {
    /* item = ((lane group, kv head, part of its query heads), chunk of keys), the part `shared` heads wide */
    const int chunk = item % chunks, rest = item / chunks;
    const int g = rest / (KvH * parts), kvh = rest / parts % KvH, h0 = kvh * group + rest % parts * shared;
    const int heads = group - (h0 - kvh * group) < shared ? group - (h0 - kvh * group) : shared;
    const int b0 = a->groups[g], lanes = a->groups[g + 1] - b0, slot = a->lanes[b0];
    /* each lane's keys in this chunk: lo .. lo + n[l] - 1 (a group's lanes have no window, so one lo;
       later lanes see more keys); lanes before the first with any sit this chunk out */
    int n[MAX_ITEM_LANES], lo = 0, active = lanes;
    for (int l = lanes - 1; l >= 0; l--) {
      const int first = first_key(a->lanes[B + b0 + l], a->shape->window), last = last_key(a->lanes, B, b0 + l, a->shape->flags);
      const int j0 = (first / KEY_CHUNK + chunk) * KEY_CHUNK;
      lo = j0 > first ? j0 : first;
      n[l] = last + 1 - lo < j0 + KEY_CHUNK - lo ? last + 1 - lo : j0 + KEY_CHUNK - lo;
      if (n[l] > 0) active = l;
    }
    if (active == lanes) continue; /* past every lane's position */
    const int most = n[lanes - 1];
    /* keys lo .. lo + most - 1 are one chunk's: adjacent rows (also in a ring of whole chunks), or in a
       paged cache a run of adjacent rows per block, each starting at a multiple of block_positions
       (lo is a chunk's first key: a paged layer has no window) */
    key_runs runs; /* only its first runs are set: no zeroing of all MAX_KEY_RUNS an item */
    runs.run_keys = a->shape->block_positions > 0 ? a->shape->block_positions : KEY_CHUNK;
    const int latent = a->shape->flags & ATTEND_LATENT; /* a key row is its own value row */
    for (int r = 0, first = 0; first < most; r++, first += runs.run_keys) {
      runs.keys[r] = kv_row(a->cache, a->tables, a->shape, 0, slot, kvh, lo + first);
      runs.values[r] = latent ? runs.keys[r] : kv_row(a->cache, a->tables, a->shape, 1, slot, kvh, lo + first);
    }
    const size_t head = (size_t)(b0 + active) * H + h0;
    float *part = a->partials + head * part_stride + (size_t)chunk * (Hd + 2);
    if (lanes > 1) attend_lanes(a->q + head * Hd, (size_t)H * Hd, lanes - active, heads, n + active, &runs, Hd, scale, part, H * part_stride, part_stride);
    else if (a->shape->kv_type == KV_Q8_0) attend_item_q8(a->q + head * Hd, heads, &runs, most, Hd, scale, part, part_stride);
    else attend_item(a->q + head * Hd, heads, &runs, most, Hd, scale, part, part_stride);
  }
}

/* Lanes into items' groups (groups[g] the first lane of group g, groups[count] = B; returns count):
 * runs of up to `most` lanes of one slot at consecutive positions, which share their keys
 * (attend_lanes). */
static int lane_groups(const int32_t *lanes, int B, int most, int *groups) {
  int count = 0;
  for (int b = 0; b < B; b++)
    if (b == 0 || b - groups[count - 1] >= most || lanes[b] != lanes[b - 1] || lanes[B + b] != lanes[B + b - 1] + 1) groups[count++] = b;
  groups[count] = B;
  return count;
}

/* out = the lane's chunks' outputs, each weighted by e^(its max - the overall max), over their sums
 * weighted alike: the softmax over all the keys, whatever the chunks; a sink (-INFINITY: none) is one
 * more score in the softmax, with no value. */
static void combine_chunks(const float *parts, int chunks, int Hd, float sink, float *out) {
  float top = sink, total = 0.0f;
  for (int c = 0; c < chunks; c++) top = parts[c * (Hd + 2) + Hd] > top ? parts[c * (Hd + 2) + Hd] : top;
  if (sink > -INFINITY) total = expf(sink - top);
  for (int i = 0; i < Hd; i++) out[i] = 0.0f;
  for (int c = 0; c < chunks; c++) {
    const float *part = parts + (size_t)c * (Hd + 2), weight = expf(part[Hd] - top);
    total += weight * part[Hd + 1];
    for (int i = 0; i < Hd; i++) out[i] += weight * part[i];
  }
  const float inv = 1.0f / total;
  for (int i = 0; i < Hd; i++) out[i] *= inv;
}

/* (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for the half-split pairs of a head's first `rotary`
 * values; the others (partial rotary: Phi-4-mini turns 96 of 128) are copied as they are. */
static void rotate_half_pairs(const float *x, const float *cos_sin, int rotary, int head_dim, float *y) {
  const int half = rotary / 2;
  for (int i = 0; i < half; i++) {
    const float c = cos_sin[i], s = cos_sin[half + i];
    y[i] = x[i] * c - x[half + i] * s;
    y[half + i] = x[half + i] * c + x[i] * s;
  }
  for (int i = rotary; i < head_dim; i++) y[i] = x[i];
}

static __thread scratch_t rotation_rows, attend_groups;

/* In `scratch` (a thread's): rotations[b * Hd ..] = the cosines, then the sines, of lane b's RoPE
 * angles (position * inv_freq[i], i < rotary / 2), times `scale`, for B lanes: the rotated values
 * grow by the attention factor, the values a partial rotary passes do not (as llama.cpp's rope does).
 * Pair i of lane b turns by positions[sections[i] * B + b] (M-RoPE's time, row and column: rows of B
 * positions), or with sections NULL by positions[b]. */
static const float *rotations_by(scratch_t *scratch, const int32_t *positions, const int32_t *sections, int B, const float *inv_freq, int Hd,
                                 int rotary, float scale) {
  float *rotations = at_least(scratch, (size_t)B * Hd * sizeof(float));
  const int half = rotary / 2;
  for (int b = 0; b < B; b++)
    for (int i = 0; i < half; i++) {
      const float angle = (float)positions[(sections ? (size_t)sections[i] * B : 0) + b] * inv_freq[i];
      rotations[(size_t)b * Hd + i] = cosf(angle) * scale;
      rotations[(size_t)b * Hd + half + i] = sinf(angle) * scale;
    }
  return rotations;
}

/* Each lane's rotations at its position (lanes[B + b]). */
static const float *rope_rotations(scratch_t *scratch, const int32_t *lanes, int B, const float *inv_freq, int Hd, int rotary, float scale) {
  return rotations_by(scratch, lanes + B, NULL, B, inv_freq, Hd, rotary, scale);
}

/* tq_attend with each lane's rotations already computed (rope_rotations): a step computes them once
 * for all its layers, 64 cosines and sines a lane that each layer computing its own paid again in
 * every layer (bench/RESULTS.md, figures moved out of code comments). */
static void attend(float *out, const float *qkv, void *cache, const int32_t *lanes, const float *rotations, const float *extras,
                   const int32_t *tables, const tq_attention *shape) {
  const int B = shape->lanes, H = shape->heads, KvH = shape->kv_heads, Hd = shape->head_dim;
  const int flags = shape->flags, rotates = !(flags & ATTEND_NO_ROPE), row_heads = H + (flags & ATTEND_LATENT ? 1 : 2) * KvH;
  const float eps = shape->eps;
  const int width = row_heads * Hd, rotary = shape->rotary_dim;
  const float *bias = flags & ATTEND_BIAS ? extras : 0;
  const float *q_norm = flags & ATTEND_QK_NORM ? extras + (bias ? width : 0) : 0;
  const int whole = flags & ATTEND_QK_NORM_WHOLE; /* q_norm then holds H Hd weights, then KvH Hd for k */
  const float *sinks = flags & ATTEND_SINKS ? extras + (bias ? width : 0) + (q_norm ? (whole ? (H + KvH) * Hd : 2 * Hd) : 0) : 0;
  float *queries = at_least(&float_rows, ((size_t)B * H * Hd + width) * sizeof(float));
  float *row = queries + (size_t)B * H * Hd, rotated[MAX_HEAD_DIM];
  for (int b = 0; b < B; b++) {
    const int slot = lanes[b], pos = lanes[B + b];
    const float *cos_sin = rotations + (size_t)b * Hd;
    /* the test outside the loop: inside it, clang read the bias with masked loads (vmaskmovps), most
       of this thread's share of attention on AMD's Zen 3 (bench/RESULTS.md, cheaper verification
       lanes) */
    if (bias)
      for (int i = 0; i < width; i++) row[i] = qkv[(size_t)b * width + i] + bias[i];
    else
      memcpy(row, qkv + (size_t)b * width, width * sizeof(float));
    if (q_norm && whole) {
      rms_norm_row(row, q_norm, H * Hd, eps, row);
      rms_norm_row(row + (size_t)H * Hd, q_norm + (size_t)H * Hd, KvH * Hd, eps, row + (size_t)H * Hd);
    }
    for (int h = 0; h < row_heads; h++) {
      float *x = row + (size_t)h * Hd;
      const int is_v = h >= H + KvH;
      if (q_norm && !whole && !is_v) rms_norm_row(x, h < H ? q_norm : q_norm + Hd, Hd, eps, x);
      if (h < H) {
        if (rotates) rotate_half_pairs(x, cos_sin, rotary, Hd, queries + ((size_t)b * H + h) * Hd);
        else memcpy(queries + ((size_t)b * H + h) * Hd, x, Hd * sizeof(float));
        continue;
      }
      const float *value = x;
      if (!is_v && rotates) {
        rotate_half_pairs(x, cos_sin, rotary, Hd, rotated);
        value = rotated;
      }
      const int kvh = is_v ? h - H - KvH : h - H;
      uint8_t *to = kv_row(cache, tables, shape, is_v, slot, kvh, pos);
      if (shape->kv_type == KV_Q8_0) q8_row_from_floats(value, Hd, to);
      else halves_from_floats(value, Hd, (uint16_t *)to);
    }
  }
  /* Query heads sharing a kv head read its keys and values once as one item, up to MAX_SHARED_HEADS
   * of them, and so do lanes of one sequence at consecutive positions, up to MAX_ITEM_LANES of them
   * (float16 rows, no window), while that leaves every thread two items or more; else a head, and
   * then fewer lanes, per item. A lane's numbers are the same either way. */
  const int group = H / KvH;
  int shared = group < MAX_SHARED_HEADS ? group : MAX_SHARED_HEADS;
  const int parts = (group + shared - 1) / shared;
  shared = (group + parts - 1) / parts; /* parts of equal width: 4 = 2 + 2, not 3 + 1 */
  int chunks = 1;
  for (int b = 0; b < B; b++) chunks = key_chunks(lanes, B, b, shape) > chunks ? key_chunks(lanes, B, b, shape) : chunks;
  int *groups = at_least(&attend_groups, (size_t)(B + 1) * sizeof(int));
  int item_lanes = shape->kv_type == KV_F16 && shape->window == 0 ? MAX_ITEM_LANES : 1;
  int count = lane_groups(lanes, B, item_lanes, groups);
  while (count * KvH * ((group + shared - 1) / shared) * chunks < 2 * (n_workers + 1) && (shared > 1 || item_lanes > 1)) {
    if (shared > 1) shared = 1;
    else count = lane_groups(lanes, B, item_lanes /= 2, groups);
  }
  float *partials = at_least(&attend_partials, (size_t)B * H * chunks * (Hd + 2) * sizeof(float));
  const attend_t a = {queries, cache, tables, shape, lanes, groups, shared, chunks, partials};
  const job_t j = {run_attend, &a, count * KvH * ((group + shared - 1) / shared) * chunks, 1};
  run_job(&j);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < H; h++)
      combine_chunks(partials + ((size_t)b * H + h) * chunks * (Hd + 2), key_chunks(lanes, B, b, shape), Hd,
                     sinks ? sinks[h] : -INFINITY, out + ((size_t)b * H + h) * Hd);
}

void tq_attend(float *out, const float *qkv, void *cache, const int32_t *lanes, const float *inv_freq, const float *extras,
               const int32_t *tables, const tq_attention *shape) {
  attend(out, qkv, cache, lanes, rope_rotations(&rotation_rows, lanes, shape->lanes, inv_freq, shape->head_dim, shape->rotary_dim, shape->rope_scale),
         extras, tables, shape);
}
