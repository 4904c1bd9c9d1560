/* The kernels as a program, for tests/integration/test_arm_kernels.py: built for aarch64 (a rung's
 * flags, or none: the portable rung) and run under qemu-aarch64, where no Python of that architecture
 * can load the library. It writes tq_isa() as an int32, then answers each request on stdin until stdin
 * ends. A request opens with five int32: kind, then for kinds 0 and 1 the GGUF type, rows, cols and
 * tokens, unused (0) for kind 2.
 *   0 tq_linear: the matrix's bytes in the file's layout, the float32 activations (tokens x cols);
 *     answered with the products (tokens x rows float32).
 *   1 tq_swiglu_linear: the same with activations of 2 cols a token (gate then up).
 *   2 tq_attend: a tq_attention, the qkv rows (lanes x (heads + 2 kv_heads) x head_dim float32), the
 *     cache's bytes, the lanes' slots then positions (int32), head_dim / 2 inverse frequencies (float32);
 *     answered with the output (lanes x heads x head_dim float32), then the cache's bytes after. */
#include <stdio.h>
#include "tq.c"

static void *read_exactly(size_t bytes) {
  void *data = calloc(bytes ? bytes : 1, 1);
  if (!data || fread(data, 1, bytes, stdin) != bytes) exit(2);
  return data;
}

static void answer_product(int kind, int type, int rows, int cols, int tokens) {
  const size_t row_bytes = (size_t)cols / block_values(type) * block_bytes(type), outputs = (size_t)tokens * rows;
  uint8_t *raw = read_exactly(rows * row_bytes), *packed = malloc(rows * row_bytes);
  float *x = read_exactly((size_t)tokens * cols * (kind ? 2 : 1) * 4), *out = calloc(outputs, 4), *residual = calloc(outputs, 4);
  tq_product shape = {type, rows, cols, tokens, 0.0f};
  shape.type = tq_repack(packed, raw, &shape);
  if (kind) tq_swiglu_linear(out, packed, x, residual, &shape);
  else tq_linear(out, packed, x, &shape);
  fwrite(out, 4, outputs, stdout);
  free(raw), free(packed), free(x), free(out), free(residual);
}

static void answer_attention(void) {
  tq_attention *shape = read_exactly(sizeof(tq_attention));
  const int lanes = shape->lanes, Hd = shape->head_dim;
  const size_t row = shape->kv_type == KV_Q8_0 ? (size_t)Hd / 32 * 34 : (size_t)Hd * 2;
  const size_t cache_bytes = 2 * (size_t)shape->slots * shape->kv_heads * shape->positions * row, outputs = (size_t)lanes * shape->heads * Hd;
  float *qkv = read_exactly((size_t)lanes * (shape->heads + 2 * shape->kv_heads) * Hd * 4);
  uint8_t *cache = read_exactly(cache_bytes);
  int32_t *lane_rows = read_exactly((size_t)2 * lanes * 4);
  float *inv_freq = read_exactly((size_t)Hd / 2 * 4), extras[1] = {0.0f}, *out = calloc(outputs, 4);
  tq_attend(out, qkv, cache, lane_rows, inv_freq, extras, 0, shape);
  fwrite(out, 4, outputs, stdout);
  fwrite(cache, 1, cache_bytes, stdout);
  free(shape), free(qkv), free(cache), free(lane_rows), free(inv_freq), free(out);
}

int main(void) {
  const int32_t isa = tq_isa();
  fwrite(&isa, 4, 1, stdout);
  tq_start(2, 0);
  int32_t request[5];
  while (fread(request, 4, 5, stdin) == 5) {
    if (request[0] == 2) answer_attention();
    else answer_product(request[0], request[1], request[2], request[3], request[4]);
    fflush(stdout);
  }
  return 0;
}
