/* MXFP4 (OCP microscaling FP4, gpt-oss's expert weights): 17 bytes for 32 values, an E8M0 scale byte e
 * (a bare power of two, 2^(e - 127)) then 16 bytes of 4-bit E2M1 codes placed as Q4_0's nibbles (the
 * low nibbles are values 0..15, the high ones 16..31). A code is a sign bit over the eight magnitudes
 * 0, 0.5, 1, 1.5, 2, 3, 4, 6; MXFP4_TABLE holds them doubled, as integers, so the products stay integer
 * dots, and the scale is halved to match: value MXFP4_TABLE[code] * 2^(e - 128) (GGUF's own convention,
 * which llama.cpp's files are written for). */

static const int8_t MXFP4_TABLE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128) built from its bits (a row kernel takes one a block: no libm call): the exponent field
 * e - 1, or for e < 2 the float32 subnormals 2^-128 and 2^-127 */
static float mxfp4_half_scale(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float d;
  memcpy(&d, &bits, 4);
  return d;
}

static void dequantize_mxfp4(const uint8_t *w, float *y) {
  const float d = mxfp4_half_scale(w[0]);
  for (int i = 0; i < 16; i++) {
    y[i] = d * MXFP4_TABLE[w[1 + i] & 15];
    y[i + 16] = d * MXFP4_TABLE[w[1 + i] >> 4];
  }
}
