/* ---- LoRA adapters -------------------------------------------------------------------------- */
/* A layer's view of the LoRA table (tq.h's MODEL_LORA): the table, or 0 for a step without one. */
typedef struct {
  const uint64_t *table;
  int layer, layers;
} lora_view;

static __thread scratch_t lora_rows;

/* multiply-adds below which a job runs on the calling thread: waking the pool costs more than it
 * shares (a lane's low-rank products are this small; many lanes' are not) */
enum { LORA_INLINE_WORK = 1 << 17 };

static void run_small_or_pooled(const job_t *job, size_t work) {
  if (work < LORA_INLINE_WORK) job->run(job->ctx, 0, job->items);
  else run_job(job);
}

/* One part's B added into its lanes' rows: out row lane[i], from first_row, gains
 * sum_k coefs[i][k] * Bt[k] (Bt: rank rows of `rows` floats, B transposed). A rank is small: as a
 * row-by-row product this would be a short dot product a row, its sum across a register costing more
 * than its multiplies; a row of Bt at a time is multiply-adds along the output rows instead. */
typedef struct {
  const float *bt, *coefs;
  const int *lanes;
  float *out;
  int rows, rank, n, out_rows, first_row;
} lora_up_t;

static void run_lora_up(const void *ctx, int first, int last) {
  const lora_up_t *j = ctx;
  for (int i = 0; i < j->n; i++) {
    float *row = j->out + (size_t)j->lanes[i] * j->out_rows + j->first_row;
    for (int k = 0; k < j->rank; k++) {
      const float c = j->coefs[(size_t)i * j->rank + k], *w = j->bt + (size_t)k * j->rows;
      for (int r = first; r < last; r++) row[r] += c * w[r];
    }
  }
}

/* out (B, rows) += scale_b * part scale * B (A x_b), in each part's rows, for every lane b whose
 * adapter changes `matrix` of this layer, x (B, cols) being the product's input as the product took it
 * (normed, or SwiGLU's rows). Each adapter's lanes are gathered and run through A once (its parts' A's
 * stacked; a float product, float_gemm.c's), then through each part's B (run_lora_up),
 * each over the pool unless small: a lane's numbers are its own, whatever lanes and adapters share the step. */
static void add_lora(float *out, const float *x, int cols, int rows, const lora_view *lora, int matrix, int B) {
  if (!lora->table) return;
  const int32_t *adapters = (const int32_t *)(uintptr_t)lora->table[LORA_LANE_ADAPTERS];
  const float *scales = (const float *)(uintptr_t)lora->table[LORA_LANE_SCALES];
  uint64_t done = 0; /* the adapters run so far, a bit each (LORA_MAX_ADAPTERS) */
  for (int first = 0; first < B; first++) {
    const int a = adapters[first];
    if (a < 0 || a >= LORA_MAX_ADAPTERS || done >> a & 1) continue;
    done |= 1ull << a;
    const uint64_t *entry = lora->table + LORA_WEIGHTS + (((size_t)a * lora->layers + lora->layer) * LORA_MATRICES + matrix) * LORA_ENTRY;
    const int rank = (int)entry[LORA_RANK];
    if (!rank) continue;
    int n = 0;
    for (int b = first; b < B; b++) n += adapters[b] == a;
    float *gathered = at_least(&lora_rows, ((size_t)n * (cols + 2 * rank) + 2 * (size_t)B) * sizeof(float));
    float *low = gathered + (size_t)n * cols, *coefs = low + (size_t)n * rank, *lane_scales = coefs + (size_t)n * rank;
    int *lanes = (int *)(lane_scales + B);
    for (int b = first, i = 0; b < B; b++)
      if (adapters[b] == a) {
        memcpy(gathered + (size_t)i * cols, x + (size_t)b * cols, cols * sizeof(float));
        lane_scales[i] = scales[b];
        lanes[i++] = b;
      }
    /* low (n, rank) = A x: a float product (float_gemm.c's) */
    gemm_t down;
    const uint8_t *a_rows = (const uint8_t *)(uintptr_t)entry[LORA_A];
    const job_t down_job = {run_gemm, &down, gemm_plan(&down, low, gathered, a_rows, 0, (int)entry[LORA_TYPE], n, cols, rank, rank, 0), 1};
    run_small_or_pooled(&down_job, (size_t)n * rank * cols);
    for (int p = 0, column = 0, first_row = 0; p < LORA_PARTS; p++) {
      const uint64_t *part = entry + LORA_PART + p * LORA_PART_SIZE;
      const int part_rows = (int)part[LORA_PART_ROWS], part_rank = (int)part[LORA_PART_RANK];
      if (part[LORA_PART_B] && part_rank) {
        const uint32_t bits = (uint32_t)part[LORA_PART_SCALE];
        float part_scale;
        memcpy(&part_scale, &bits, sizeof part_scale);
        for (int i = 0; i < n; i++)
          for (int k = 0; k < part_rank; k++) coefs[(size_t)i * part_rank + k] = low[(size_t)i * rank + column + k] * lane_scales[i] * part_scale;
        const lora_up_t up = {(const float *)(uintptr_t)part[LORA_PART_B], coefs, lanes, out, part_rows, part_rank, n, rows, first_row};
        int chunk = part_rows / (8 * (n_workers + 1));
        chunk = chunk < 64 ? 64 : chunk - chunk % 16;
        const job_t up_job = {run_lora_up, &up, part_rows, chunk};
        run_small_or_pooled(&up_job, (size_t)n * part_rank * part_rows);
      }
      column += part_rank;
      first_row += part_rows;
    }
  }
}

/* the rows a product with input mode `input` multiplied: x itself, or the transformed rows linear()
 * keeps in this thread's float_rows until its next call */
static const float *product_input(const float *x, int input) { return input == AS_IS ? x : float_rows.data; }
