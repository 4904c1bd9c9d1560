/* The 32-value formats: Q4_0 (a float16 scale d, 16 bytes of nibbles: value d * (q - 8)), Q4_1 (d, a
 * float16 min m, the nibbles: d * q + m) and Q8_0 (d, 32 int8: d * q). A block's low nibbles are its
 * values 0..15, its high nibbles 16..31. */

static void dequantize_q4(const uint8_t *qs, float d, float m, float *y) {
  for (int i = 0; i < 16; i++) {
    y[i] = d * (qs[i] & 15) + m;
    y[i + 16] = d * (qs[i] >> 4) + m;
  }
}
static void dequantize_q4_0(const uint8_t *w, float *y) { dequantize_q4(w + 2, fp16(w), -8.0f * fp16(w), y); }
static void dequantize_q4_1(const uint8_t *w, float *y) { dequantize_q4(w + 4, fp16(w), fp16(w + 2), y); }
static void dequantize_q8_0(const uint8_t *w, float *y) {
  const float d = fp16(w);
  for (int i = 0; i < 32; i++) y[i] = d * (int8_t)w[2 + i];
}
