/* AVX2 attention for lanes of one sequence at consecutive positions (attend_lanes of isa.h): a prefill
 * piece's tokens, or a verification's drafted lanes. Each lane alone (attend_item) reads and converts
 * the same float16 keys and values again, so each lane after the first added its own pass over them
 * to a step's attention (bench/RESULTS.md: cheaper verification lanes, and figures moved out of code
 * comments). Here an item's
 * keys and values are converted to float32 once, and every (lane, head) row multiplies them from
 * there, with each row's sums taken in attend_item's order: the same bits as the lane alone. */

/* a thread's float32 copy of an item's keys, then its values (grown when an item needs more) */
static __thread float *lane_floats;
static __thread size_t lane_floats_size;

/* rows x[0..n) of runs (keys or values) as float32, n rows of Hd, into `to` */
static void float_rows_of(const uint8_t *const *run_rows, const key_runs *runs, int n, int Hd, float *to) {
  for (int first = 0, r = 0; first < n; first += runs->run_keys, r++) {
    const uint16_t *from = (const uint16_t *)run_rows[r];
    const int count = run_length(runs, first, n);
    for (size_t i = 0; i < (size_t)count * Hd; i += 8) _mm256_storeu_ps(to + (size_t)first * Hd + i, load_half8(from + i));
  }
}

/* scores[j] = q . k_j * scale for keys j = from .. run_end - 1 of one row (k: float keys, Hd apart),
 * in attend_scores' order for the run they end: groups of four keys from the run's start by
 * store_four_scores while a group ends within the run, the rest one by one by hsum. */
static void row_scores(const float *q, const float *k, int from, int run_end, int Hd, float scale, float *scores) {
  int j = from;
  /* `from` is a group's first key: the run's start, or a multiple of four past it */
  for (; j + 4 <= run_end; j += 4) {
    __m256 acc[4];
    for (int kk = 0; kk < 4; kk++) acc[kk] = _mm256_setzero_ps();
    for (int i = 0; i < Hd; i += 8)
      for (int kk = 0; kk < 4; kk++) acc[kk] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + (size_t)(j + kk) * Hd + i), acc[kk]);
    store_four_scores(acc, scale, scores + j);
  }
  for (; j < run_end; j++) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < Hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + (size_t)j * Hd + i), acc);
    scores[j] = hsum(acc) * scale;
  }
}

/* Two rows' scores for keys 0 .. J - 1 (J a multiple of four, within every row's keys), four keys a
 * group: each key loaded once for both rows. */
static void two_rows_scores(const float *q0, const float *q1, const float *k, int J, int Hd, float scale, float *s0, float *s1) {
  for (int j = 0; j < J; j += 4) {
    __m256 a0[4], a1[4];
    for (int kk = 0; kk < 4; kk++) a0[kk] = a1[kk] = _mm256_setzero_ps();
    for (int i = 0; i < Hd; i += 8) {
      const __m256 x0 = _mm256_loadu_ps(q0 + i), x1 = _mm256_loadu_ps(q1 + i);
      for (int kk = 0; kk < 4; kk++) {
        const __m256 key = _mm256_loadu_ps(k + (size_t)(j + kk) * Hd + i);
        a0[kk] = _mm256_fmadd_ps(x0, key, a0[kk]);
        a1[kk] = _mm256_fmadd_ps(x1, key, a1[kk]);
      }
    }
    store_four_scores(a0, scale, s0 + j);
    store_four_scores(a1, scale, s1 + j);
  }
}

/* o_r[i0 .. i0 + 8 W) = sum_j w_r[j] v_j for R rows (1 or 2; R and W constants where called): keys
 * 0 .. shared - 1 for both together, then each row's own keys on to n[r], its sums carried on in the
 * same registers, so each row adds in attend_value_columns' order. */
static inline __attribute__((always_inline)) void rows_value_columns(const float *const *w, const int *n, const int R, int shared, const float *v,
                                                                     int Hd, int i0, const int W, float *const *o) {
  __m256 acc[2][4];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < W; c++) acc[r][c] = _mm256_setzero_ps();
  for (int j = 0; j < shared; j++) {
    __m256 p[2];
    for (int r = 0; r < R; r++) p[r] = _mm256_broadcast_ss(w[r] + j);
    for (int c = 0; c < W; c++) {
      const __m256 value = _mm256_loadu_ps(v + (size_t)j * Hd + i0 + 8 * c);
      for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(p[r], value, acc[r][c]);
    }
  }
  for (int r = 0; r < R; r++) {
    for (int j = shared; j < n[r]; j++) {
      const __m256 p = _mm256_broadcast_ss(w[r] + j);
      for (int c = 0; c < W; c++) acc[r][c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + (size_t)j * Hd + i0 + 8 * c), acc[r][c]);
    }
    for (int c = 0; c < W; c++) _mm256_storeu_ps(o[r] + i0 + 8 * c, acc[r][c]);
  }
}

static inline __attribute__((always_inline)) void rows_values(const float *const *w, const int *n, const int R, int shared, const float *v, int Hd,
                                                              float *const *o) {
  int i0 = 0;
  for (; i0 + 32 <= Hd; i0 += 32) rows_value_columns(w, n, R, shared, v, Hd, i0, 4, o);
  for (; i0 < Hd; i0 += 8) rows_value_columns(w, n, R, shared, v, Hd, i0, 1, o);
}

static void attend_lanes_avx2(const float *q, size_t q_lane_stride, int lanes, int heads, const int *n, const key_runs *runs, int Hd, float scale,
                              float *part, size_t part_lane_stride, size_t part_stride) {
  const int rows = lanes * heads, n_max = n[lanes - 1], J = n[0] / 4 * 4;
  if (Hd % 8 != 0 || rows > MAX_LANE_ROWS) {
    attend_lanes_generic(q, q_lane_stride, lanes, heads, n, runs, Hd, scale, part, part_lane_stride, part_stride);
    return;
  }
  const size_t stride = KEY_CHUNK + 8, floats = 2 * (size_t)n_max * Hd + (size_t)rows * stride;
  if (floats > lane_floats_size) {
    free(lane_floats);
    lane_floats = malloc(floats * sizeof(float));
    lane_floats_size = floats;
  }
  float *k = lane_floats, *v = k + (size_t)n_max * Hd, *scores = v + (size_t)n_max * Hd;
  float_rows_of(runs->keys, runs, n_max, Hd, k);
  if (runs->values[0] == runs->keys[0]) v = k; /* latent attention: a key row is its own value row */
  else float_rows_of(runs->values, runs, n_max, Hd, v);
  const float *row_q[MAX_LANE_ROWS];
  float *row_part[MAX_LANE_ROWS], *row_scores_at[MAX_LANE_ROWS];
  int row_n[MAX_LANE_ROWS];
  for (int r = 0; r < rows; r++) {
    row_q[r] = q + r / heads * q_lane_stride + (size_t)(r % heads) * Hd;
    row_part[r] = part + r / heads * part_lane_stride + (r % heads) * part_stride;
    row_scores_at[r] = scores + r * stride;
    row_n[r] = n[r / heads];
  }
  /* the keys every row has in whole groups of four, two rows at a time; then each row's own */
  int r = 0;
  for (; r + 2 <= rows; r += 2) two_rows_scores(row_q[r], row_q[r + 1], k, J, Hd, scale, row_scores_at[r], row_scores_at[r + 1]);
  if (r < rows) row_scores(row_q[r], k, 0, J, Hd, scale, row_scores_at[r]);
  for (r = 0; r < rows; r++)
    for (int first = J / runs->run_keys * runs->run_keys; first < row_n[r]; first += runs->run_keys) {
      const int run_end = first + run_length(runs, first, row_n[r]);
      row_scores(row_q[r], k, first > J ? first : J, run_end, Hd, scale, row_scores_at[r]);
    }
  for (r = 0; r < rows; r++) row_part[r][Hd + 1] = attend_softmax(row_scores_at[r], row_n[r], &row_part[r][Hd]);
  for (r = 0; r + 2 <= rows; r += 2)
    rows_values((const float *const *)row_scores_at + r, row_n + r, 2, n[0], v, Hd, row_part + r);
  if (r < rows) rows_values((const float *const *)row_scores_at + r, row_n + r, 1, n[0], v, Hd, row_part + r);
}
