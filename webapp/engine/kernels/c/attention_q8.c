/* The KV cache in Q8_0 rows (tq_attention.kv_type KV_Q8_0): a position's key or value for one kv head
 * is Hd / 32 blocks of GGUF's Q8_0 layout, a float16 scale d then 32 int8 q (value d * q), 34 bytes
 * per 32 values against float16's 64, so a cache holds 1.88x the positions in the same memory.
 *
 * Why a float16 scale (not float32, 36 bytes): on the default model's keys and values, every layer
 * over 4,096 tokens of real text (bench/kv_fidelity.py), the rows' RMS error was all but the same
 * with d in float16 as in float32, and no block's d fell below float16's normal range
 * (bench/RESULTS.md, the 8-bit KV cache); float32 would cost 6% more memory a row for that. The same
 * layout as the Q8_0 weights, so the dequantization is format_32.c's. */

enum { Q8_BLOCK_BYTES = 34 };

/* row = x's Hd values (a multiple of 32) as Q8_0 blocks: d = max |x| / 127 per block, q = x / d
 * rounded to nearest even (as NumPy's rint), d stored as float16. The same bytes in every build,
 * and tinygrad's path writes the same (webapp/engine/model/kv_types.py). */
static void q8_row_from_floats(const float *x, int Hd, uint8_t *row) {
  for (int b = 0; b < Hd / 32; b++, x += 32, row += Q8_BLOCK_BYTES) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const uint16_t half = half_from_float(d);
    memcpy(row, &half, 2);
    for (int i = 0; i < 32; i++) row[2 + i] = (uint8_t)(int8_t)__builtin_rintf(x[i] * inv);
  }
}

/* attend_item over Q8_0 rows, a head at a time: each key and value dequantized, then as the float16
 * version (its runs walked alike). */
GENERIC void attend_item_q8_generic(const float *q, int heads, const key_runs *runs, int n, int Hd, float scale, float *part,
                                    size_t part_stride) {
  const size_t row = (size_t)Hd / 32 * Q8_BLOCK_BYTES;
  float scores[KEY_CHUNK], values[MAX_HEAD_DIM];
  for (int h = 0; h < heads; h++, q += Hd, part += part_stride) {
    float top = -INFINITY;
    for (int r = 0, first = 0; first < n; r++, first += runs->run_keys) {
      const uint8_t *k = runs->keys[r];
      for (int j = 0; j < run_length(runs, first, n); j++) {
        float dot = 0.0f;
        for (int b = 0; b < Hd / 32; b++) {
          dequantize_q8_0(k + j * row + (size_t)b * Q8_BLOCK_BYTES, values);
          for (int i = 0; i < 32; i++) dot += q[32 * b + i] * values[i];
        }
        scores[first + j] = dot * scale;
        top = scores[first + j] > top ? scores[first + j] : top;
      }
    }
    float total = 0.0f;
    for (int j = 0; j < n; j++) total += (scores[j] = expf(scores[j] - top));
    for (int i = 0; i < Hd; i++) part[i] = 0.0f;
    for (int r = 0, first = 0; first < n; r++, first += runs->run_keys) {
      const uint8_t *v = runs->values[r];
      for (int j = 0; j < run_length(runs, first, n); j++) {
        for (int b = 0; b < Hd / 32; b++) dequantize_q8_0(v + j * row + (size_t)b * Q8_BLOCK_BYTES, values + 32 * b);
        for (int i = 0; i < Hd; i++) part[i] += scores[first + j] * values[i];
      }
    }
    part[Hd] = top;
    part[Hd + 1] = total;
  }
}
