/* The K-quants of Q4_K_M and Q5_K_M files: 256-value blocks of eight (Q6_K: sixteen) sub-blocks, each
 * with its own scale. Q4_K: float16 d and dmin, 12 bytes packing eight 6-bit scales and mins, 128 bytes
 * of nibbles (32 per pair of sub-blocks: 2p in the low nibbles, 2p + 1 in the high); a value is
 * d * scale * q - dmin * min. Q5_K: the same with 32 bytes of fifth bits after the scales (bit j of
 * byte i: value i of sub-block j). Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8
 * scales, then float16 d; a value is d * scale * (q - 32). */

/* Q4_K packs eight 6-bit scales and mins into 12 bytes. */
static void q4k_scale_min(const uint8_t *s, int j, int *scale, int *min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

static void dequantize_q4_or_q5_k(const uint8_t *w, int five, float *y) {
  const float d = fp16(w), dmin = fp16(w + 2);
  const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
  for (int j = 0; j < 8; j += 2, qs += 32) {
    int sc0, m0, sc1, m1;
    q4k_scale_min(w + 4, j, &sc0, &m0);
    q4k_scale_min(w + 4, j + 1, &sc1, &m1);
    for (int i = 0; i < 32; i++) {
      const int h0 = five ? ((qh[i] >> j) & 1) << 4 : 0, h1 = five ? ((qh[i] >> (j + 1)) & 1) << 4 : 0;
      y[32 * j + i] = d * sc0 * ((qs[i] & 15) | h0) - dmin * m0;
      y[32 * j + 32 + i] = d * sc1 * ((qs[i] >> 4) | h1) - dmin * m1;
    }
  }
}
static void dequantize_q4_k(const uint8_t *w, float *y) { dequantize_q4_or_q5_k(w, 0, y); }
static void dequantize_q5_k(const uint8_t *w, float *y) { dequantize_q4_or_q5_k(w, 1, y); }

static void dequantize_q6_k(const uint8_t *w, float *y) {
  const uint8_t *ql = w, *qh = w + 128;
  const int8_t *sc = (const int8_t *)(w + 192);
  const float d = fp16(w + 208);
  for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8) {
    float *yh = y + 128 * half;
    for (int l = 0; l < 32; l++) {
      const int is = l / 16;
      yh[l] = d * sc[is] * (((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
      yh[l + 32] = d * sc[is + 2] * (((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
      yh[l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      yh[l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
  }
}
