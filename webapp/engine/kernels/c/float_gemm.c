/* Many rows of float activations by a float matrix stored as a GGUF file has it, (outs, cols) in
 * F32, F16 or BF16: out[r][o] = bias[o] + x[r] . w[o], added to what out holds where the caller
 * accumulates (a residual). A vision encoder's products over hundreds to thousands of patches
 * (tq_float_gemm) and the language model's products by its float matrices (linear.c's `product`),
 * read from the matrix in its own type: no widened copy of it is ever written out.
 *
 * The register tile is GEMM_ROWS rows by GEMM_OUTS outputs, one accumulator vector each running
 * along the columns a vector (vectors.h's VEC) at a time: a weight vector is widened once and
 * meets every row of the tile, an activation vector every output. A tile's GEMM_ROWS x GEMM_OUTS
 * accumulators are exactly VEC vectors, summed across their lanes all at once into one vector of
 * sums (lanes_summed). Each item of the pool's job is a block of rows against a block of outputs,
 * the two about half of a core's L2 cache, so the tiles reread them from there. */

#if VEC == 16
enum { GEMM_ROWS = 4 };
#else
enum { GEMM_ROWS = 2 };
#endif
/* GEMM_PREFETCH_BYTES: how far ahead along a weight row its lines are fetched, as the one-token
 * products' are (a step's few rows stream the matrix from memory) */
enum { GEMM_OUTS = 4, GEMM_COLS = 1024, GEMM_PREFETCH_BYTES = 2048 };

typedef uint16_t vu16 __attribute__((vector_size(VEC * 2), aligned(2)));
typedef uint32_t vu32 __attribute__((vector_size(VEC * 4), aligned(4)));

/* VEC consecutive weights of a row as floats */
static inline __attribute__((always_inline)) vf gemm_weights(int type, const uint8_t *w) {
  if (type == F32) return vf_load((const float *)w);
  if (type == BF16) return (vf)(__builtin_convertvector(*(const vu16 *)w, vu32) << 16);
#if TQ_AVX512
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
#elif TQ_AVX2
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
#elif defined(__aarch64__)
  typedef _Float16 vh __attribute__((vector_size(VEC * 2), aligned(2)));
  return __builtin_convertvector(*(const vh *)w, vf);
#else
  vf v;
  for (int i = 0; i < VEC; i++) v[i] = fp16(w + 2 * i);
  return v;
#endif
}

static inline float gemm_weight(int type, const uint8_t *w, int c) {
  if (type == F32) return ((const float *)w)[c];
  if (type == BF16) {
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[c] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
  }
  return fp16(w + 2 * (size_t)c);
}

/* v[0..VEC-1] -> one vector whose lane k is the sum of v[k]'s lanes: each level adds the two halves
 * of every vector's partial sums, two vectors' halves packed into one, so VEC vectors take VEC - 1
 * additions of whole vectors. */
static inline vf lanes_summed(vf *v) {
#if VEC == 16
  vf t[8], u[4], s[2];
  for (int i = 0; i < 8; i++)
    t[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; i++)
    u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; i++)
    s[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(s[0], s[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(s[0], s[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vf t[4], u[2];
  for (int i = 0; i < 4; i++)
    t[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; i++)
    u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* acc[r * GEMM_OUTS + o] += xs[r] . ws[o] over columns c0..c1 - 1, whole vectors of them */
static inline __attribute__((always_inline)) void gemm_tile(int type, const float *const *xs, const uint8_t *const *ws, int c0, int c1, vf *acc) {
  const size_t weight_bytes = type == F32 ? 4 : 2;
  for (int c = c0; c < c1; c += VEC) {
    vf xv[GEMM_ROWS];
    for (int r = 0; r < GEMM_ROWS; r++) xv[r] = vf_load(xs[r] + c);
    for (int o = 0; o < GEMM_OUTS; o++) {
      if ((c * weight_bytes) % 64 == 0) __builtin_prefetch(ws[o] + (size_t)c * weight_bytes + GEMM_PREFETCH_BYTES);
      const vf wv = gemm_weights(type, ws[o] + (size_t)c * weight_bytes);
      for (int r = 0; r < GEMM_ROWS; r++) acc[r * GEMM_OUTS + o] += xv[r] * wv;
    }
  }
}

typedef struct {
  float *out;
  const float *x, *bias;
  const uint8_t *w;
  int type, rows, cols, outs, out_stride, accumulate;
  int row_block, out_block, row_blocks; /* an item's rows and outputs; items go row block first */
  int col_block;                        /* columns at a time, a multiple of VEC: a tile's rows of x stay in the L1 cache */
} gemm_t;

/* a tile's running sums between pieces of the columns: a thread's own, grown as needed */
static __thread scratch_t gemm_sums;

/* Rows r0..r1 - 1 against outputs o0..o1 - 1, the columns a piece at a time, every tile of the
 * block through one piece before the next. A tile's sums wait in gemm_sums between pieces as the
 * vectors they are, so each sum's additions come in one order, the columns' (then the lanes', then
 * the columns past whole vectors, one by one): a row's products are the same bits however many rows
 * the call has and however its columns are cut. */
static inline __attribute__((always_inline)) void gemm_block(const gemm_t *g, int type, int r0, int r1, int o0, int o1) {
  const size_t row_bytes = (size_t)g->cols * (type == F32 ? 4 : 2);
  const int whole = g->cols / VEC * VEC, tiles_o = (o1 - o0 + GEMM_OUTS - 1) / GEMM_OUTS;
  const int tiles = (r1 - r0 + GEMM_ROWS - 1) / GEMM_ROWS * tiles_o, pieces = whole > g->col_block;
  vf *waiting = pieces ? at_least(&gemm_sums, (size_t)tiles * GEMM_ROWS * GEMM_OUTS * sizeof(vf)) : 0;
  for (int c0 = 0; c0 < whole || c0 == 0; c0 += g->col_block) {
    const int c1 = c0 + g->col_block < whole ? c0 + g->col_block : whole, last = c1 == whole;
    for (int r = r0, tile = 0; r < r1; r += GEMM_ROWS) {
      const float *xs[GEMM_ROWS];
      for (int i = 0; i < GEMM_ROWS; i++) xs[i] = g->x + (size_t)(r + i < r1 ? r + i : r1 - 1) * g->cols; /* past the last: it again, unstored */
      for (int o = o0; o < o1; o += GEMM_OUTS, tile++) {
        const uint8_t *ws[GEMM_OUTS];
        for (int i = 0; i < GEMM_OUTS; i++) ws[i] = g->w + (size_t)(o + i < o1 ? o + i : o1 - 1) * row_bytes;
        vf acc[GEMM_ROWS * GEMM_OUTS], *kept = waiting ? waiting + (size_t)tile * GEMM_ROWS * GEMM_OUTS : 0;
        for (int k = 0; k < GEMM_ROWS * GEMM_OUTS; k++) acc[k] = c0 == 0 ? vf_splat(0.0f) : kept[k];
        gemm_tile(type, xs, ws, c0, c1, acc);
        if (!last) {
          for (int k = 0; k < GEMM_ROWS * GEMM_OUTS; k++) kept[k] = acc[k];
          continue;
        }
        vf sums = lanes_summed(acc);
        for (int c = whole; c < g->cols; c++) /* the columns past a whole vector, one at a time */
          for (int i = 0; i < GEMM_ROWS; i++)
            for (int j = 0; j < GEMM_OUTS; j++) sums[i * GEMM_OUTS + j] += xs[i][c] * gemm_weight(type, ws[j], c);
        for (int i = 0; i < GEMM_ROWS && r + i < r1; i++) {
          float *out = g->out + (size_t)(r + i) * g->out_stride;
          for (int j = 0; j < GEMM_OUTS && o + j < o1; j++) {
            const float value = sums[i * GEMM_OUTS + j] + (g->bias ? g->bias[o + j] : 0.0f);
            out[o + j] = g->accumulate ? out[o + j] + value : value;
          }
        }
      }
    }
  }
}

static void run_gemm(const void *ctx, int first, int last) {
  const gemm_t *g = ctx;
  for (int item = first; item < last; item++) {
    const int r0 = item % g->row_blocks * g->row_block, o0 = item / g->row_blocks * g->out_block;
    const int r1 = r0 + g->row_block < g->rows ? r0 + g->row_block : g->rows;
    const int o1 = o0 + g->out_block < g->outs ? o0 + g->out_block : g->outs;
    if (g->type == F16) gemm_block(g, F16, r0, r1, o0, o1);
    else if (g->type == BF16) gemm_block(g, BF16, r0, r1, o0, o1);
    else gemm_block(g, F32, r0, r1, o0, o1);
  }
}

/* What a block of rows and a block of outputs take together: half a core's L2 cache, as sysconf reads
 * it from the CPU (512 KiB where it says nothing credible). Blocks sized for a 1 MiB L2 overflow a
 * 512 KiB one, and the tiles then reread them from L3 (bench/RESULTS.md). Which rows and outputs
 * share an item never changes a sum's order: the bits are the same whatever the size. */
static size_t gemm_block_bytes(void) {
  static size_t known; /* 0 until the first plan; every thread finds the same value */
  size_t bytes = __atomic_load_n(&known, __ATOMIC_RELAXED);
  if (!bytes) {
#ifdef _SC_LEVEL2_CACHE_SIZE
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
    const long l2 = 0; /* a C library without glibc's cache queries */
#endif
    bytes = l2 >= 128 * 1024 && l2 <= 64L << 20 ? (size_t)l2 / 2 : 512 * 1024;
    __atomic_store_n(&known, bytes, __ATOMIC_RELAXED);
  }
  return bytes;
}

/* A block's count of rows or outputs: about half of gemm_block_bytes of them, whole tiles, at least one tile. */
static int gemm_block_of(size_t row_bytes, int tile) {
  const size_t fit = gemm_block_bytes() / 2 / (row_bytes ? row_bytes : 1);
  return fit < (size_t)tile ? tile : (int)(fit / tile * tile);
}

/* g planned for out = [out +] bias + x . w^T (the arguments as tq_float_gemm's); returns its items, for a job of run_gemm */
static int gemm_plan(gemm_t *g, float *out, const float *x, const uint8_t *w, const float *bias, int type, int rows, int cols, int outs,
                     int out_stride, int accumulate) {
  *g = (gemm_t){out, x, bias, w, type, rows, cols, outs, out_stride, accumulate != 0, 0, 0, 0, 0};
  /* the columns in pieces of about equal size, whole vectors; one piece where one tile holds every row */
  const int pieces = rows <= GEMM_ROWS ? 1 : (cols + GEMM_COLS - 1) / GEMM_COLS;
  g->col_block = ((cols + pieces - 1) / pieces + VEC - 1) / VEC * VEC;
  g->row_block = gemm_block_of((size_t)g->col_block * 4, GEMM_ROWS);
  g->out_block = gemm_block_of((size_t)g->col_block * (type == F32 ? 4 : 2), GEMM_OUTS);
  g->row_blocks = (rows + g->row_block - 1) / g->row_block;
  return g->row_blocks * ((outs + g->out_block - 1) / g->out_block);
}

static void float_gemm(float *out, const float *x, const uint8_t *w, const float *bias, int type, int rows, int cols, int outs, int out_stride,
                       int accumulate) {
  gemm_t g;
  const job_t j = {run_gemm, &g, gemm_plan(&g, out, x, w, bias, type, rows, cols, outs, out_stride, accumulate), 1};
  run_job(&j);
}

int tq_float_gemm(float *out, const float *x, const uint8_t *w, const float *bias, int type, int rows, int cols, int outs, int out_stride,
                  int accumulate) {
  if ((type != F32 && type != F16 && type != BF16) || rows <= 0 || cols <= 0 || outs <= 0 || out_stride < outs) return -1;
  float_gemm(out, x, w, bias, type, rows, cols, outs, out_stride, accumulate);
  return 0;
}
