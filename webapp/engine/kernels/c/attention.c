/* ---- attention ------------------------------------------------------------------------------ */
/* tq_attend(out, qkv, cache, lanes, inv_freq, extras, shape) runs a layer's attention for B lanes (a
 * decode step's sequences, or a prefill piece's tokens, each a lane of the same slot), from the qkv
 * product's rows (B, (H + 2 KvH) Hd) float32 to out (B, H Hd) float32:
 *   1. on the calling thread, per lane: add the bias, rms-normalize each q and k head (qwen3), rotate
 *      q and k by RoPE at the lane's position (half-split pairs, angle = pos * inv_freq[i]), and write
 *      k and v as float16 at that position of the lane's slot in the KV cache (2, slots, KvH,
 *      positions, Hd);
 *   2. over the pool: softmax(q . K[0..pos] / sqrt(Hd)) . V[0..pos] for every (lane, query head),
 *      reading the cache in place, in chunks of KEY_CHUNK keys; an item is a chunk of keys for a
 *      lane's query heads that share a kv head (up to MAX_SHARED_HEADS of them), or for a single head
 *      when that leaves a thread fewer than two items. Each chunk keeps its own max, sum and
 *      unnormalized output; 3. the calling thread combines a lane's chunks in order. The chunks are
 *      fixed by position alone, so a lane's numbers never depend on the other lanes, and one long
 *      sequence spreads over every core (a single lane at position 1,000 had 3 items for 2 threads,
 *      each streaming a whole kv head).
 * shape = {B, H, KvH, slots, positions, Hd, flags, eps bits}; lanes = {slot_0.., pos_0..}; extras holds
 * the qkv bias (flag 1), then the q and k norm weights (flag 2). Writing and reading in one kernel
 * keeps their order inside it, where tinygrad cannot reorder them. */
enum { HAS_BIAS = 1, HAS_QK_NORM = 2, MAX_HEAD_DIM = 512, MAX_SHARED_HEADS = 3, KEY_CHUNK = 256 };

/* float32 -> float16, rounding to nearest even as a hardware or compiler conversion does, so a key
 * written here equals the same key written by tinygrad's cast during prefill. */
static uint16_t half_from_float(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | 0x7c00 | (x > 0x7f800000u ? 0x200 : 0); /* inf, nan */
  if (x >= 0x477ff000u) return sign | 0x7c00;                                   /* rounds past 65504 */
  if (x < 0x38800000u) { /* below 2^-14: a subnormal half, in units of 2^-24 */
    float magnitude;
    memcpy(&magnitude, &x, 4);
    return sign | (uint16_t)__builtin_rintf(magnitude * 16777216.0f);
  }
  return sign | (uint16_t)((x + 0xfffu + ((x >> 13) & 1u) - 0x38000000u) >> 13);
}

typedef struct {
  const float *q;
  const uint16_t *cache;
  const int32_t *shape, *lanes;
  int shared; /* query heads an item attends together over their kv head's keys */
  int chunks; /* chunks of KEY_CHUNK keys of the lane with the most */
  float *partials; /* (B, H, chunks, Hd + 2): each chunk's unnormalized output, its scores' max and sum */
} attend_t;

static float half_to_float(uint16_t h) {
  uint8_t b[2];
  memcpy(b, &h, 2);
  return fp16(b);
}

#if TQ_AVX2
static inline __m256 load_half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* For the S query heads (1..MAX_SHARED_HEADS) that share one kv head, held contiguously in q:
 * scores[h * stride + j] = q_h . k_j * scale for j < n. Each key is converted once for all S heads,
 * four keys at a time (one horizontal sum per four keys). A head's numbers are the same whatever S
 * is: every (head, key) pair sums its products in the same order. */
static inline __attribute__((always_inline)) void attend_scores(const float *q, const int S, const uint16_t *k, int n, int Hd, float scale,
                                                                float *scores, size_t stride) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 acc[MAX_SHARED_HEADS][4];
    for (int h = 0; h < S; h++)
      for (int kk = 0; kk < 4; kk++) acc[h][kk] = _mm256_setzero_ps();
    const uint16_t *kj = k + (size_t)j * Hd;
    for (int i = 0; i < Hd; i += 8)
      for (int kk = 0; kk < 4; kk++) {
        const __m256 key = load_half8(kj + kk * Hd + i);
        for (int h = 0; h < S; h++) acc[h][kk] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * Hd + i), key, acc[h][kk]);
      }
    for (int h = 0; h < S; h++) {
      const __m256 sums8 = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]), _mm256_hadd_ps(acc[h][2], acc[h][3])); /* per 128-bit half */
      const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(sums8), _mm256_extractf128_ps(sums8, 1));
      _mm_storeu_ps(scores + h * stride + j, _mm_mul_ps(sums, _mm_set1_ps(scale)));
    }
  }
  for (; j < n; j++) {
    __m256 acc[MAX_SHARED_HEADS];
    for (int h = 0; h < S; h++) acc[h] = _mm256_setzero_ps();
    for (int i = 0; i < Hd; i += 8) {
      const __m256 key = load_half8(k + (size_t)j * Hd + i);
      for (int h = 0; h < S; h++) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * Hd + i), key, acc[h]);
    }
    for (int h = 0; h < S; h++) scores[h * stride + j] = hsum(acc[h]) * scale;
  }
}

/* scores[0..n) <- e^(scores - max); returns their sum, and the max in *top_out. */
static float attend_softmax(float *scores, int n, float *top_out) {
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int j = 0;
  for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(scores + j));
  float top = -INFINITY, lanes[8];
  _mm256_storeu_ps(lanes, top8);
  for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
  for (; j < n; j++) top = scores[j] > top ? scores[j] : top;
  __m256 total8 = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
    _mm256_storeu_ps(scores + j, e);
    total8 = _mm256_add_ps(total8, e);
  }
  if (j < n) { /* the tail through the same polynomial, so a score's weight never depends on where it falls */
    float tail[8] = {0};
    for (int i = j; i < n; i++) tail[i - j] = scores[i] - top;
    __m256 e = exp_nonpositive(_mm256_loadu_ps(tail));
    e = _mm256_blendv_ps(_mm256_setzero_ps(), e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
    _mm256_storeu_ps(tail, e);
    for (int i = j; i < n; i++) scores[i] = tail[i - j];
    total8 = _mm256_add_ps(total8, e);
  }
  *top_out = top;
  return hsum(total8);
}

/* o_h[i0..i0 + 8 W) = sum_j w[h * stride + j] v_j[i0..i0 + 8 W) for the S heads (head h's at o + h *
 * o_stride), the S x W sums held in registers; W is a constant in each use, so they stay there. */
static inline __attribute__((always_inline)) void attend_value_columns(const float *w, size_t stride, const int S, const uint16_t *v, int n, int Hd,
                                                                       int i0, const int W, float *o, size_t o_stride) {
  __m256 acc[MAX_SHARED_HEADS][4];
  for (int h = 0; h < S; h++)
    for (int c = 0; c < W; c++) acc[h][c] = _mm256_setzero_ps();
  for (int j = 0; j < n; j++) {
    __m256 p[MAX_SHARED_HEADS];
    for (int h = 0; h < S; h++) p[h] = _mm256_broadcast_ss(w + h * stride + j);
    const uint16_t *vj = v + (size_t)j * Hd + i0;
    for (int c = 0; c < W; c++) {
      const __m256 value = load_half8(vj + 8 * c);
      for (int h = 0; h < S; h++) acc[h][c] = _mm256_fmadd_ps(p[h], value, acc[h][c]);
    }
  }
  for (int h = 0; h < S; h++)
    for (int c = 0; c < W; c++) _mm256_storeu_ps(o + h * o_stride + i0 + 8 * c, acc[h][c]);
}

/* o_h = sum_j w[h * stride + j] v_j for the S heads: 32 dimensions at a time, then 8 at a time;
 * each value vector is converted once for all S heads. */
static inline __attribute__((always_inline)) void attend_values(const float *w, size_t stride, const int S, const uint16_t *v, int n, int Hd,
                                                                float *o, size_t o_stride) {
  int i0 = 0;
  for (; i0 + 32 <= Hd; i0 += 32) attend_value_columns(w, stride, S, v, n, Hd, i0, 4, o, o_stride);
  for (; i0 < Hd; i0 += 8) attend_value_columns(w, stride, S, v, n, Hd, i0, 1, o, o_stride);
}

/* The S heads of one item over n keys, S a constant in each instance below: head h's unnormalized
 * output at part + h * part_stride, then its scores' max and its sum of e^(score - max). */
static inline __attribute__((always_inline)) void attend_heads(const float *q, const int S, const uint16_t *k, const uint16_t *v, int n, int Hd,
                                                               float scale, float *scores, size_t stride, float *part, size_t part_stride) {
  attend_scores(q, S, k, n, Hd, scale, scores, stride);
  for (int h = 0; h < S; h++) part[h * part_stride + Hd + 1] = attend_softmax(scores + h * stride, n, &part[h * part_stride + Hd]);
  attend_values(scores, stride, S, v, n, Hd, part, part_stride);
}
#endif

static void run_attend(const void *ctx, int first, int last) {
  const attend_t *a = ctx;
  const int B = a->shape[0], H = a->shape[1], KvH = a->shape[2], C = a->shape[4], Hd = a->shape[5];
  const int group = H / KvH, shared = a->shared, parts = (group + shared - 1) / shared, chunks = a->chunks;
  const size_t plane = (size_t)a->shape[3] * KvH * C * Hd, stride = KEY_CHUNK + 8, part_stride = (size_t)chunks * (Hd + 2);
  const float scale = 1.0f / sqrtf((float)Hd);
  float scores[MAX_SHARED_HEADS * (KEY_CHUNK + 8)];
  (void)stride; /* the portable path keeps one head's scores at a time */
  for (int item = first; item < last; item++) {
    /* item = ((lane, kv head, part of its query heads), chunk of keys), the part `shared` heads wide */
    const int chunk = item % chunks, rest = item / chunks;
    const int b = rest / (KvH * parts), kvh = rest / parts % KvH, h0 = kvh * group + rest % parts * shared;
    const int heads = group - (h0 - kvh * group) < shared ? group - (h0 - kvh * group) : shared;
    const int slot = a->lanes[b], j0 = chunk * KEY_CHUNK, n = a->lanes[B + b] + 1 - j0 < KEY_CHUNK ? a->lanes[B + b] + 1 - j0 : KEY_CHUNK;
    if (n <= 0) continue; /* past this lane's position */
    const uint16_t *k = a->cache + (((size_t)slot * KvH + kvh) * C + j0) * Hd, *v = k + plane;
#if TQ_AVX2
    /* An item's keys and values are a few KB to 64 KB each: ask for all of them at once rather than
       wait for the hardware prefetcher to notice each stream. The B=8 step's attention at position
       100 went from 6.1-7.0 to 5.0-5.6 ms (4 alternating pairs, every layer's cache from DRAM). */
    for (size_t at = 0; at < (size_t)n * Hd * 2; at += 64) {
      _mm_prefetch((const char *)k + at, _MM_HINT_T0);
      _mm_prefetch((const char *)v + at, _MM_HINT_T0);
    }
#endif
    for (int h = h0; h < h0 + heads; h++) {
      const float *q = a->q + ((size_t)b * H + h) * Hd;
      float *part = a->partials + ((size_t)b * H + h) * part_stride + (size_t)chunk * (Hd + 2);
#if TQ_AVX2
      if (Hd % 8 == 0) {
        if (heads == 3) attend_heads(q, 3, k, v, n, Hd, scale, scores, stride, part, part_stride);
        else if (heads == 2) attend_heads(q, 2, k, v, n, Hd, scale, scores, stride, part, part_stride);
        else attend_heads(q, 1, k, v, n, Hd, scale, scores, stride, part, part_stride);
        break; /* all of the item's heads at once */
      }
#endif
      float top = -INFINITY;
      for (int j = 0; j < n; j++) {
        float dot = 0.0f;
        for (int i = 0; i < Hd; i++) dot += q[i] * half_to_float(k[(size_t)j * Hd + i]);
        scores[j] = dot * scale;
        top = scores[j] > top ? scores[j] : top;
      }
      float total = 0.0f;
      for (int j = 0; j < n; j++) total += (scores[j] = expf(scores[j] - top));
      for (int i = 0; i < Hd; i++) part[i] = 0.0f;
      for (int j = 0; j < n; j++)
        for (int i = 0; i < Hd; i++) part[i] += scores[j] * half_to_float(v[(size_t)j * Hd + i]);
      part[Hd] = top;
      part[Hd + 1] = total;
    }
  }
}

/* The chunks of keys a lane at position pos attends (keys 0..pos). */
static int key_chunks(int pos) { return (pos + KEY_CHUNK) / KEY_CHUNK; }

/* out = the lane's chunks' outputs, each weighted by e^(its max - the overall max), over their sums
 * weighted alike: the softmax over all the keys, whatever the chunks. */
static void combine_chunks(const float *parts, int chunks, int Hd, float *out) {
  float top = -INFINITY, total = 0.0f;
  for (int c = 0; c < chunks; c++) top = parts[c * (Hd + 2) + Hd] > top ? parts[c * (Hd + 2) + Hd] : top;
  for (int i = 0; i < Hd; i++) out[i] = 0.0f;
  for (int c = 0; c < chunks; c++) {
    const float *part = parts + (size_t)c * (Hd + 2), weight = expf(part[Hd] - top);
    total += weight * part[Hd + 1];
    for (int i = 0; i < Hd; i++) out[i] += weight * part[i];
  }
  const float inv = 1.0f / total;
  for (int i = 0; i < Hd; i++) out[i] *= inv;
}

/* (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for the half-split pairs of one head */
static void rotate_half_pairs(const float *x, const float *cos_sin, int half, float *y) {
  for (int i = 0; i < half; i++) {
    const float c = cos_sin[i], s = cos_sin[half + i];
    y[i] = x[i] * c - x[half + i] * s;
    y[half + i] = x[half + i] * c + x[i] * s;
  }
}

static __thread scratch_t rotation_rows;

/* In this thread's scratch: rotations[b * Hd ..] = the cosines, then the sines, of lane b's RoPE
 * angles (pos * inv_freq[i]), for B lanes. */
static const float *rope_rotations(const int32_t *lanes, int B, const float *inv_freq, int Hd) {
  float *rotations = at_least(&rotation_rows, (size_t)B * Hd * sizeof(float));
  const int half = Hd / 2;
  for (int b = 0; b < B; b++)
    for (int i = 0; i < half; i++) {
      const float angle = (float)lanes[B + b] * inv_freq[i];
      rotations[(size_t)b * Hd + i] = cosf(angle);
      rotations[(size_t)b * Hd + half + i] = sinf(angle);
    }
  return rotations;
}

/* tq_attend with each lane's rotations already computed (rope_rotations): a step computes them once
 * for all its layers, 64 cosines and sines a lane that took ~0.4 ms of a B=8 step when each layer
 * computed its own. */
static void attend(float *out, const float *qkv, uint16_t *cache, const int32_t *lanes, const float *rotations, const float *extras, const int32_t *shape) {
  const int B = shape[0], H = shape[1], KvH = shape[2], S = shape[3], C = shape[4], Hd = shape[5], flags = shape[6];
  const float eps = int_bits_float(shape[7]);
  const int width = (H + 2 * KvH) * Hd, half = Hd / 2;
  const float *bias = flags & HAS_BIAS ? extras : 0;
  const float *q_norm = flags & HAS_QK_NORM ? extras + (bias ? width : 0) : 0;
  float *queries = at_least(&float_rows, ((size_t)B * H * Hd + width) * sizeof(float));
  float *row = queries + (size_t)B * H * Hd, rotated[MAX_HEAD_DIM];
  for (int b = 0; b < B; b++) {
    const int slot = lanes[b], pos = lanes[B + b];
    const float *cos_sin = rotations + (size_t)b * Hd;
    for (int i = 0; i < width; i++) row[i] = qkv[(size_t)b * width + i] + (bias ? bias[i] : 0.0f);
    for (int h = 0; h < H + 2 * KvH; h++) {
      float *x = row + (size_t)h * Hd;
      const int is_v = h >= H + KvH;
      if (q_norm && !is_v) rms_norm_row(x, h < H ? q_norm : q_norm + Hd, Hd, eps, x);
      if (h < H) {
        rotate_half_pairs(x, cos_sin, half, queries + ((size_t)b * H + h) * Hd);
        continue;
      }
      const float *value = x;
      if (!is_v) {
        rotate_half_pairs(x, cos_sin, half, rotated);
        value = rotated;
      }
      const int kvh = is_v ? h - H - KvH : h - H;
      uint16_t *to = cache + ((((size_t)is_v * S + slot) * KvH + kvh) * C + pos) * Hd;
      int i = 0;
#if TQ_AVX2 /* the same rounding as half_from_float, 8 at a time */
      for (; i + 8 <= Hd; i += 8) _mm_storeu_si128((__m128i *)(to + i), _mm256_cvtps_ph(_mm256_loadu_ps(value + i), _MM_FROUND_TO_NEAREST_INT));
#endif
      for (; i < Hd; i++) to[i] = half_from_float(value[i]);
    }
  }
  /* Query heads sharing a kv head read its keys and values once as one item, up to MAX_SHARED_HEADS
   * of them, when that still leaves every thread two items or more; else a head per item. A head's
   * numbers are the same either way. */
  const int group = H / KvH;
  int shared = group < MAX_SHARED_HEADS ? group : MAX_SHARED_HEADS;
  const int parts = (group + shared - 1) / shared;
  shared = (group + parts - 1) / parts; /* parts of equal width: 4 = 2 + 2, not 3 + 1 */
  int chunks = 1;
  for (int b = 0; b < B; b++) chunks = key_chunks(lanes[B + b]) > chunks ? key_chunks(lanes[B + b]) : chunks;
  if (B * KvH * parts * chunks < 2 * (n_workers + 1)) shared = 1;
  float *partials = at_least(&attend_partials, (size_t)B * H * chunks * (Hd + 2) * sizeof(float));
  const attend_t a = {queries, cache, shape, lanes, shared, chunks, partials};
  const job_t j = {run_attend, &a, B * KvH * ((group + shared - 1) / shared) * chunks, 1};
  run_job(&j);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < H; h++)
      combine_chunks(partials + ((size_t)b * H + h) * chunks * (Hd + 2), key_chunks(lanes[B + b]), Hd, out + ((size_t)b * H + h) * Hd);
}

void tq_attend(float *out, const float *qkv, uint16_t *cache, const int32_t *lanes, const float *inv_freq, const float *extras, const int32_t *shape) {
  attend(out, qkv, cache, lanes, rope_rotations(lanes, shape[0], inv_freq, shape[5]), extras, shape);
}
