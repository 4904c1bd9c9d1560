/* The AVX2 products of Q5_0 and Q5_1 (format_q5.c): a row kernel, and a tile of eight interleaved
 * rows (tq_repack's Q5_0x8, Q5_1x8), which real files get since their rows come in eights.
 *
 * A value is q = nibble | fifth bit << 4, 0..31, so a block is Q4_0's or Q4_1's product with the
 * nibbles ORed with 16 where a bit is set: d * dx * sum(q * xq) + m * dx * sum(xq), m = -16d for
 * Q5_0 and the block's min for Q5_1. maddubs's pair sums reach 2 * 31 * 127 = 7,874, so four of them
 * add up within an int16 lane, not eight as for Q4_0. */

/* A row block's 32 fifth bits (a little-endian word at qh) as 32 bytes, 16 where bit i is set: byte i
 * of the word's copies takes word byte i / 8 (pshufb), then its own bit of that byte. */
static inline __m256i q5_fifth_bits(const uint8_t *qh) {
  uint32_t bits;
  memcpy(&bits, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                             _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

static inline __attribute__((always_inline)) void row_dot_q5_of(const int type, const uint8_t *w, int nb, const xblock *const *xs, int n,
                                                                 float *acc) {
  const int with_min = type == Q5_1, bb = with_min ? 24 : 22, qh = with_min ? 4 : 2;
  __m256 sum[MAX_TOKEN_GROUP];
  float extra[MAX_TOKEN_GROUP] = {0};
  for (int t = 0; t < n; t++) sum[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++, w += bb) {
    const float d = fp16(w), m = with_min ? fp16(w + 2) : -16.0f * d;
    const __m256i q = _mm256_or_si256(nibbles(w + qh + 4), q5_fifth_bits(w + qh));
    for (int t = 0; t < n; t++) {
      const xblock *x = &xs[t][b];
      sum[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(dot_u8(q, xq(x))), sum[t]);
      extra[t] += m * x->s;
    }
  }
  for (int t = 0; t < n; t++) acc[t] += hsum(sum[t]) + extra[t];
}

static void row_dot_q5(int type, const uint8_t *w, int nb, const xblock *const *xs, int n, float *acc) {
  if (type == Q5_1) row_dot_q5_of(Q5_1, w, nb, xs, n, acc);
  else row_dot_q5_of(Q5_0, w, nb, xs, n, acc);
}

/* Eight interleaved rows times N tokens, as tile_x8 multiplies Q4_0x8: a group block holds the eight
 * scales (and mins), the eight rows' fifth-bit words side by side (row i's word in 32-bit lane i),
 * then the four nibble slices, slice k holding quant bytes 4k..4k+3 of each row (values 4k..4k+3 in
 * the low nibbles, 16 + 4k.. in the high). Those values' fifth bits are bits 4k.. and 16 + 4k.. of the
 * lane's word: four bits of its byte k / 2 and of its byte 2 + k / 2, which pshufb copies to the
 * lane's four bytes, each then testing its own bit. */
static inline __attribute__((always_inline)) void tile_q5_x8(const uint8_t *g, const xblock *const *xs, int N, int nb, float *out,
                                                             size_t out_stride, const int with_min) {
  const int group_bytes = with_min ? 8 * 24 : 8 * 22, bits_at = with_min ? 32 : 16, quants_at = bits_at + 32;
  const __m256i low = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
  const __m256i lane_bytes = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404, 0x08080808, 0x0c0c0c0c);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++, g += group_bytes) {
    for (int ahead = 0; ahead < group_bytes; ahead += 64) _mm_prefetch((const char *)(g + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    const __m256 m = with_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16))) : _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
    const __m256i words = _mm256_loadu_si256((const __m256i *)(g + bits_at));
    __m256i q[8];
    for (int k = 0; k < 4; k++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i *)(g + quants_at + 32 * k));
      const __m256i bit = _mm256_set1_epi32(k % 2 ? (int)0x80402010 : 0x08040201);
      const __m256i lo_bits = _mm256_shuffle_epi8(words, _mm256_add_epi8(lane_bytes, _mm256_set1_epi8((char)(k / 2))));
      const __m256i hi_bits = _mm256_shuffle_epi8(words, _mm256_add_epi8(lane_bytes, _mm256_set1_epi8((char)(2 + k / 2))));
      const __m256i lo_fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(lo_bits, bit), bit), sixteen);
      const __m256i hi_fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hi_bits, bit), bit), sixteen);
      q[k] = _mm256_or_si256(_mm256_and_si256(raw, low), lo_fifth);
      q[4 + k] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), hi_fifth);
    }
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      int32_t four[8];
      memcpy(four, x->q, 32);
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(dot_u8_quads(q, four, 4), dot_u8_quads(q + 4, four + 4, 4)));
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&x->d)), dot, acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(&x->s), acc[t]);
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}
