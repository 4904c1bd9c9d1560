/* The seam between the shared files and an instruction set's kernels.
 *
 * The functions declared here do the work whose fastest form depends on the instruction set; the
 * shared files (formats, linear, attention, step) call these names only, so they follow one control
 * flow in every build. generic.c defines each as NAME_generic, the portable reference. A rung's files
 * (x86_avx2*.c: NAME_avx2) define the names they have a version of, which may hand what it does not
 * cover (a type, a tail of values) to the rung below (NAME_generic); fallback.h gives each name the
 * highest version the build has. A new rung adds its files and its list there. */
#pragma once

/* generic.c's definitions: unused where the build's ISA has versions of its own */
#define GENERIC static __attribute__((unused))

/* Before a loop whose index strides across rows: built with AVX-512's flags, clang vectorizes such a
 * loop with gathers and masked stores, slower than the scalar loop it keeps on AVX2 (a one-lane step's
 * norms were: bench/RESULTS.md, 2026-12-05). What the loop computes is unchanged: each result's
 * operations stay in their order. */
#define SCALAR_LOOP _Pragma("clang loop vectorize(disable)")

/* how many tokens' activations a row product takes at once: eight, so that a verification of up to 8
 * lanes reads each matrix once (with four, a fifth lane began a second pass over every matrix:
 * bench/RESULTS.md, cheaper verification lanes) */
enum { MAX_TOKEN_GROUP = 8 };
/* attention's items (see attention.c): up to MAX_SHARED_HEADS query heads against KEY_CHUNK keys */
enum { MAX_SHARED_HEADS = 3, KEY_CHUNK = 256 };
/* attend_lanes' items: up to MAX_ITEM_LANES lanes of one sequence (a prefill piece's, a verification's) */
enum { MAX_ITEM_LANES = 8, MAX_LANE_ROWS = MAX_ITEM_LANES * MAX_SHARED_HEADS };
/* A paged cache's blocks hold MIN_BLOCK_POSITIONS .. KEY_CHUNK positions (a power of two: see
 * tq_attention.block_positions), so an item's keys are at most MAX_KEY_RUNS runs of adjacent rows. */
enum { MIN_BLOCK_POSITIONS = 16, MAX_KEY_RUNS = KEY_CHUNK / MIN_BLOCK_POSITIONS };

/* An item's n keys and values as runs of adjacent cache rows: run r holds the item's keys
 * r * run_keys .. (every run but the last holds run_keys of them), its first key's row at keys[r] and
 * its first value's at values[r]. An unpaged cache's item is one run (run_keys KEY_CHUNK); a paged
 * one's is a run per block (run_keys = block_positions). The kernels walk the runs in order and keep
 * every sum as over one run: a score is per key, written at the key's place in the item, and the
 * value sums carry on from run to run in the same registers. The scores' groups of four keys never
 * straddle two runs (run_keys is a multiple of 16), so the numbers are bit for bit an unpaged item's. */
typedef struct {
  const uint8_t *keys[MAX_KEY_RUNS], *values[MAX_KEY_RUNS];
  int run_keys;
} key_runs;

/* How many of an item's n keys the run starting at key `first` holds. */
static inline int run_length(const key_runs *runs, int first, int n) { return n - first < runs->run_keys ? n - first : runs->run_keys; }

/* How a format's products round their activations to int8, 32 values a scale. ACT_Q8_0: max |x| / 127
 * in float16 (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4); ACT_Q8_1: the same with d * sum(q) in float16 too
 * (Q4_1, Q5_1): both as llama.cpp's CPU backend rounds them for the same weights (its vec_dot_type).
 * ACT_Q8_F32: a float32 scale, the multiplier's inverse (the K-quants, IQ4_XS), where llama.cpp's Q8_K
 * takes one scale for 256 values: judged against a float64 forward pass, the finer scale is closer
 * to the model on every file measured (bench/RESULTS.md, 2026-12-07), so it is kept. */
enum { ACT_Q8_0, ACT_Q8_1, ACT_Q8_F32, ACT_FORMATS };

/* One quantized block of 32 activations: x[i] ~ d * q[i]; s = d * sum(q); sum16 = the sums of q over each half. */
typedef struct {
  float d, s;
  int16_t sum16[2];
  int8_t q[32];
} xblock;

/* The float16 at p. */
static float fp16(const uint8_t *p);
/* x's cols values (a multiple of 32) as int8 blocks rounded as `format` says: the same numbers in
 * every build. */
static void quantize_row(const float *x, int cols, int format, xblock *out);
/* How this ISA's products read a matrix of GGUF type `type` (tq_repack stores it so): 0, as the file
 * has it; 8, its rows interleaved in eights (ROWS_X8); 16, those groups of eight in pairs (ROWS_X16). */
static int interleaves(int type);
/* The rows first..last - 1 of W (of `type`, row_bytes and nb 32-value blocks a row) that this ISA's
 * tiles multiply: out[t * stride + r] = W[r] . xs[t] for t < n; returns the first row left to row_dot. */
static int tile_rows(int type, const uint8_t *w, size_t row_bytes, int nb, const xblock *const *xs, int n, float *out, size_t stride,
                     int first, int last);
/* acc[t] += W_row . x[t] for t < n; xs[t] points at token t's blocks (cols / 32 of them). */
static void row_dot(int type, const uint8_t *w, int cols, const xblock *const *xs, int n, float *acc);
/* y = silu(gate) * up. */
static void swiglu_row(const float *gate, const float *up, int n, float *y);
/* to[i] = x[i] as float16 for i < n, rounded to nearest even. */
static void halves_from_floats(const float *x, int n, uint16_t *to);
/* One attention item: `heads` query heads (q, Hd floats apart) against n float16 keys and values
 * (rows of Hd, in `runs`), scores scaled by `scale`; head h's unnormalized output at part + h *
 * part_stride, then its scores' max and its sum of e^(score - max). */
static void attend_item(const float *q, int heads, const key_runs *runs, int n, int Hd, float scale, float *part, size_t part_stride);
/* attend_item for `lanes` lanes of one sequence at consecutive positions over their kv head's keys:
 * lane l's `heads` query heads at q + l * q_lane_stride (Hd apart), its keys 0 .. n[l] - 1 of `runs`
 * (n ascending, n[0] > 0), its heads' outputs at part + l * part_lane_stride (part_stride apart), each
 * bit for bit what attend_item gives the lane alone. lanes * heads <= MAX_LANE_ROWS. */
static void attend_lanes(const float *q, size_t q_lane_stride, int lanes, int heads, const int *n, const key_runs *runs, int Hd, float scale,
                         float *part, size_t part_lane_stride, size_t part_stride);
/* attend_item over Q8_0 cache rows (attention_q8.c): rows of Hd / 32 blocks each, Hd a multiple of 32. */
static void attend_item_q8(const float *q, int heads, const key_runs *runs, int n, int Hd, float scale, float *part, size_t part_stride);
/* One token of one value head's delta rule (gated_delta.c): M, S rows of S floats (row c holds the
 * state's column c), decays by `decay` and learns v from k at rate beta; then o = M^T q * scale:
 *   for each c: d = (v[c] - decay M[c] . k) beta;  M[c] = decay M[c] + d k;  o[c] = M[c] . q * scale
 * S a multiple of 8. */
static void delta_step(float *M, const float *q, const float *k, const float *v, float decay, float beta, float scale, int S, float *o);
