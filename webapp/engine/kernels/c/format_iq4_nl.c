/* IQ4_NL: a float16 scale d and 16 bytes of nibbles placed as Q4_0's, each nibble an index into one
 * fixed table of 16 int8 levels, spaced more closely near zero than a uniform grid (where most weights
 * lie): value d * IQ4_TABLE[nibble] (format_iq4_table.c, shared with IQ4_XS). */

static void dequantize_iq4_nl(const uint8_t *w, float *y) {
  const float d = fp16(w);
  for (int i = 0; i < 16; i++) {
    y[i] = d * IQ4_TABLE[w[2 + i] & 15];
    y[i + 16] = d * IQ4_TABLE[w[2 + i] >> 4];
  }
}
