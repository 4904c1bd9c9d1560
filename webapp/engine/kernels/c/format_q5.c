/* Q5_0 and Q5_1: Q4_0 and Q4_1 with a fifth bit per value. Q5_0: a float16 scale d, 4 bytes of fifth
 * bits, 16 bytes of nibbles: value d * (q - 16), q = nibble | bit << 4 in 0..31. Q5_1: d, a float16
 * min m, the bits, the nibbles: d * q + m. The bits are one little-endian 32-bit word, bit i for value
 * i; the nibbles are placed as Q4_0's (low nibbles values 0..15, high nibbles 16..31). */

static void dequantize_q5(const uint8_t *qh, const uint8_t *qs, float d, float m, float *y) {
  const uint32_t high = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
  for (int i = 0; i < 16; i++) {
    y[i] = d * (int)((qs[i] & 15) | ((high >> i) & 1) << 4) + m;
    y[i + 16] = d * (int)((qs[i] >> 4) | ((high >> (i + 16)) & 1) << 4) + m;
  }
}
static void dequantize_q5_0(const uint8_t *w, float *y) { dequantize_q5(w + 2, w + 6, fp16(w), -16.0f * fp16(w), y); }
static void dequantize_q5_1(const uint8_t *w, float *y) { dequantize_q5(w + 4, w + 8, fp16(w), fp16(w + 2), y); }
