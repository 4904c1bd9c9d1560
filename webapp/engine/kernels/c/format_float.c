/* The plain float types: F32, F16 and BF16 (a float32's upper 16 bits), one value each in GGUF, read
 * here in blocks of 32 (the activations' block, so a row is still whole blocks): 128, 64 and 64 bytes.
 * Their products take the activations as floats (block_format.floats), not rounded to int8: the
 * weights are exact, and rounding x would be the product's only error. */

static void dequantize_f32(const uint8_t *w, float *y) { memcpy(y, w, 32 * sizeof(float)); }
static void dequantize_f16(const uint8_t *w, float *y) {
  for (int i = 0; i < 32; i++) y[i] = fp16(w + 2 * i);
}
static void dequantize_bf16(const uint8_t *w, float *y) {
  for (int i = 0; i < 32; i++) {
    const uint32_t bits = (uint32_t)(w[2 * i] | w[2 * i + 1] << 8) << 16;
    memcpy(y + i, &bits, 4);
  }
}
