/* The AVX2 products of MXFP4 (format_mxfp4.c): a row kernel and a tile of eight interleaved rows
 * (MXFP4x8: the eight rows' scale bytes, then Q4_0x8's nibble slices).
 *
 * pshufb looks the codes up in MXFP4_TABLE, giving the doubled E2M1 values as signed bytes. The row
 * kernel moves their signs onto the activations (IQ4_NL's way, x86_avx2_iq4_nl.c). The tile instead
 * adds 12 to every level, making them unsigned (0..24), so a token's broadcast activations enter
 * maddubs as they are, as Q4_0's tile does, and takes 12 times the activations' sum back off the
 * integer dot: the same integers, without a sign per slice per token (at 8 tokens that brought the
 * product to Q4_0's time: bench/block_products.py; bench/RESULTS.md, MXFP4 on the kernels). */

static inline __m256i mxfp4_table(void) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_TABLE)); }

/* eight E8M0 bytes -> their 2^(e - 128) as floats: mxfp4_half_scale's bits, eight at a time */
static inline __m256 mxfp4_half_scales(const uint8_t *e8) {
  const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e8));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

static void row_dot_mxfp4(const uint8_t *w, int nb, const xblock *const *xs, int n, float *acc) {
  const __m256i levels = mxfp4_table();
  __m256 sum[MAX_TOKEN_GROUP];
  for (int t = 0; t < n; t++) sum[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++, w += 17) {
    const float d = mxfp4_half_scale(w[0]);
    const __m256i q = _mm256_shuffle_epi8(levels, nibbles(w + 1)), magnitude = _mm256_sign_epi8(q, q);
    for (int t = 0; t < n; t++) {
      const xblock *x = &xs[t][b];
      const __m256i dot = dot_u8(magnitude, _mm256_sign_epi8(xq(x), q));
      sum[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(dot), sum[t]);
    }
  }
  for (int t = 0; t < n; t++) acc[t] += hsum(sum[t]);
}

/* what the tile adds to every level: the largest magnitude, 12 */
enum { OFFSET = 12 };

/* Eight interleaved rows times N tokens: a row a lane, as tile_x8's Q4_0. */
static inline __attribute__((always_inline)) void tile_mxfp4_x8(const uint8_t *g, const xblock *const *xs, int N, int nb, float *out,
                                                                size_t out_stride) {
  const int group_bytes = 8 * 17;
  const __m256i levels = _mm256_add_epi8(mxfp4_table(), _mm256_set1_epi8(OFFSET)), low = _mm256_set1_epi8(15);
  __m256 acc[MAX_TOKEN_GROUP];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++, g += group_bytes) {
    for (int ahead = 0; ahead < group_bytes; ahead += 64) _mm_prefetch((const char *)(g + PREFETCH_BYTES + ahead), _MM_HINT_T0);
    const __m256 d = mxfp4_half_scales(g);
    __m256i q[8];
    for (int k = 0; k < 4; k++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i *)(g + 8 + 32 * k));
      q[k] = _mm256_shuffle_epi8(levels, _mm256_and_si256(raw, low));
      q[4 + k] = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
    }
    for (int t = 0; t < N; t++) {
      const xblock *x = &xs[t][b];
      int32_t four[8];
      memcpy(four, x->q, 32);
      /* four slices' pair sums of at most 2 * 24 * 127 each stay within int16; eight would not */
      const __m256i dot = _mm256_add_epi32(dot_u8_quads(q, four, 4), dot_u8_quads(q + 4, four + 4, 4));
      const __m256i exact = _mm256_sub_epi32(dot, _mm256_set1_epi32(OFFSET * (x->sum16[0] + x->sum16[1])));
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&x->d)), _mm256_cvtepi32_ps(exact), acc[t]);
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}
