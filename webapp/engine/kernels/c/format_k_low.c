/* The K-quants of Q3_K_M and Q2_K_M files: 256-value blocks of sixteen 16-value sub-blocks, the low
 * bits of value i at bit pair 2j of byte 32h + l, where i = 128h + 32j + l (h the half, j 0..3).
 * Q3_K: 32 bytes of high bits (bit 4h + j of byte l), those 64 bytes of low pairs, 12 bytes packing
 * sixteen 6-bit scales, a float16 d; a value is d * (scale - 32) * (low + 4 * high - 4), so -4..3.
 * Q2_K: sixteen bytes of a 4-bit scale (low nibble) and a 4-bit min (high nibble) per sub-block, the
 * 64 bytes of pairs, float16 d and dmin; a value is d * scale * q - dmin * min, q 0..3. */

enum { Q3K_HIGH = 0, Q3K_LOW = 32, Q3K_SCALES = 96, Q3K_D = 108 };
enum { Q2K_SCALES = 0, Q2K_QUANTS = 16, Q2K_D = 80, Q2K_DMIN = 82 };

/* Q3_K's sub-block k scale, minus 32 (-32..31): low nibble from byte k % 8 (its high nibble for k >=
 * 8), the top two bits from byte 8 + k % 4 at pair k / 4 */
static int q3k_scale(const uint8_t *s, int k) {
  return (((s[k % 8] >> 4 * (k / 8)) & 15) | ((s[8 + k % 4] >> 2 * (k / 4)) & 3) << 4) - 32;
}

static void dequantize_q3_k(const uint8_t *w, float *y) {
  const float d = fp16(w + Q3K_D);
  for (int i = 0; i < 256; i++) {
    const int h = i / 128, j = (i / 32) % 4, l = i % 32;
    const int low = (w[Q3K_LOW + 32 * h + l] >> 2 * j) & 3, high = (w[Q3K_HIGH + l] >> (4 * h + j)) & 1;
    y[i] = d * q3k_scale(w + Q3K_SCALES, i / 16) * (low + 4 * high - 4);
  }
}

static void dequantize_q2_k(const uint8_t *w, float *y) {
  const float d = fp16(w + Q2K_D), dmin = fp16(w + Q2K_DMIN);
  for (int i = 0; i < 256; i++) {
    const int h = i / 128, j = (i / 32) % 4, l = i % 32, sm = w[Q2K_SCALES + i / 16];
    y[i] = d * (sm & 15) * ((w[Q2K_QUANTS + 32 * h + l] >> 2 * j) & 3) - dmin * (sm >> 4);
  }
}

/* Where an interleaved group (formats.c) of eight rows' blocks keeps each field. Q3_K: the eight d,
 * the 12 scale bytes as twelve 8-byte rows (byte k of each row's 12), then 4-byte slices of the high
 * bits and of the low pairs. Q2_K: the eight d, the eight dmin, the 16 scale bytes as sixteen 8-byte
 * rows, then 4-byte slices of the pairs. */
enum { Q3K_GROUP_D = 0, Q3K_GROUP_SCALES = 16, Q3K_GROUP_HIGH = 16 + 96, Q3K_GROUP_LOW = 16 + 96 + 256 };
enum { Q2K_GROUP_D = 0, Q2K_GROUP_DMIN = 16, Q2K_GROUP_SCALES = 32, Q2K_GROUP_QUANTS = 32 + 128 };
