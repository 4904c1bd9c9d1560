/* AVX2 delta_step (isa.h): a state row at a time, eight values a register; the row stays in L1
 * between its product with k and its update and product with q. */
static void delta_step_avx2(float *M, const float *q, const float *k, const float *v, float decay, float beta, float scale, int S, float *o) {
  const __m256 decays = _mm256_set1_ps(decay);
  for (int c = 0; c < S; c++) {
    float *m = M + (size_t)c * S;
    __m256 recalled = _mm256_setzero_ps(), read = _mm256_setzero_ps();
    for (int a = 0; a < S; a += 8) recalled = _mm256_fmadd_ps(_mm256_loadu_ps(m + a), _mm256_loadu_ps(k + a), recalled);
    const __m256 delta = _mm256_set1_ps((v[c] - decay * hsum(recalled)) * beta);
    for (int a = 0; a < S; a += 8) {
      const __m256 row = _mm256_fmadd_ps(decays, _mm256_loadu_ps(m + a), _mm256_mul_ps(delta, _mm256_loadu_ps(k + a)));
      _mm256_storeu_ps(m + a, row);
      read = _mm256_fmadd_ps(row, _mm256_loadu_ps(q + a), read);
    }
    o[c] = hsum(read) * scale;
  }
}
