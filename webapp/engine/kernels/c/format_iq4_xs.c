/* IQ4_XS: 256-value blocks of eight 32-value sub-blocks. A float16 d, 16 bits of high scale bits (two
 * per sub-block), 4 bytes of low scale nibbles (sub-block j in byte j / 2, low nibble first), then 128
 * bytes of 4-bit indices into IQ4_TABLE, 16 per sub-block as Q4_0 packs them (values 0..15 in the low
 * nibbles, 16..31 in the high). A value is d * (scale - 32) * IQ4_TABLE[index], scale 6 bits. */

enum { IQ4XS_D = 0, IQ4XS_SCALES_HIGH = 2, IQ4XS_SCALES_LOW = 4, IQ4XS_QUANTS = 8 };

/* sub-block j's scale, minus 32 (-32..31) */
static int iq4_xs_scale(const uint8_t *w, int j) {
  const int high = w[IQ4XS_SCALES_HIGH] | w[IQ4XS_SCALES_HIGH + 1] << 8;
  return (((w[IQ4XS_SCALES_LOW + j / 2] >> 4 * (j % 2)) & 15) | ((high >> 2 * j) & 3) << 4) - 32;
}

static void dequantize_iq4_xs(const uint8_t *w, float *y) {
  const float d = fp16(w + IQ4XS_D);
  const uint8_t *qs = w + IQ4XS_QUANTS;
  for (int j = 0; j < 8; j++, qs += 16, y += 32) {
    const float dl = d * iq4_xs_scale(w, j);
    for (int i = 0; i < 16; i++) {
      y[i] = dl * IQ4_TABLE[qs[i] & 15];
      y[i + 16] = dl * IQ4_TABLE[qs[i] >> 4];
    }
  }
}

/* Where an interleaved group (formats.c) of eight rows' blocks keeps each field: the eight d, the
 * eight 16-bit high scale bits, the eight 4-byte low nibbles, then 32 slices of 4 bytes per row */
enum { IQ4XS_GROUP_D = 0, IQ4XS_GROUP_SCALES_HIGH = 16, IQ4XS_GROUP_SCALES_LOW = 32, IQ4XS_GROUP_QUANTS = 64 };
