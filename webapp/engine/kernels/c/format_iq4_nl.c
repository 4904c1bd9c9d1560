/* IQ4_NL: a float16 scale d and 16 bytes of nibbles placed as Q4_0's, each nibble an index into one
 * fixed table of 16 int8 levels, spaced more closely near zero than a uniform grid (where most weights
 * lie): value d * IQ4_NL_LEVELS[nibble]. The table is GGML's (kvalues_iq4nl), as every file uses it. */

static const int8_t IQ4_NL_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static void dequantize_iq4_nl(const uint8_t *w, float *y) {
  const float d = fp16(w);
  for (int i = 0; i < 16; i++) {
    y[i] = d * IQ4_NL_LEVELS[w[2 + i] & 15];
    y[i + 16] = d * IQ4_NL_LEVELS[w[2 + i] >> 4];
  }
}
