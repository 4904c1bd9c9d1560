/* ---- block formats: the table of every type with a kernel ---------------------------------- */
/* Each format's file (format_*.c, included before this one) dequantizes one block of its type; this
 * table names them by GGML type id, so a new format is its file and one line here (and its id in tq.h
 * and abi.py). */

typedef struct {
  int values, bytes;                                /* per block */
  void (*dequantize)(const uint8_t *block, float *y); /* one block's `values` values */
  int floats;                                       /* its products take the activations as floats, not int8 */
  int activation;                                   /* else how they round them (isa.h's ACT_*) */
} block_format;

enum { TYPE_IDS = 64 }; /* GGML type ids below this */
static const block_format FORMATS[TYPE_IDS] = {
    [Q4_0] = {32, 18, dequantize_q4_0}, [Q4_1] = {32, 20, dequantize_q4_1, 0, ACT_Q8_1}, [Q8_0] = {32, 34, dequantize_q8_0},
    [Q4_K] = {256, 144, dequantize_q4_k, 0, ACT_Q8_F32}, [Q5_K] = {256, 176, dequantize_q5_k, 0, ACT_Q8_F32},
    [Q6_K] = {256, 210, dequantize_q6_k, 0, ACT_Q8_F32}, [Q2_K] = {256, 84, dequantize_q2_k, 0, ACT_Q8_F32},
    [Q3_K] = {256, 110, dequantize_q3_k, 0, ACT_Q8_F32}, [IQ4_XS] = {256, 136, dequantize_iq4_xs, 0, ACT_Q8_F32},
    [Q5_0] = {32, 22, dequantize_q5_0}, [Q5_1] = {32, 24, dequantize_q5_1, 0, ACT_Q8_1},
    [IQ4_NL] = {32, 18, dequantize_iq4_nl}, [MXFP4] = {32, 17, dequantize_mxfp4},
    [F32] = {32, 128, dequantize_f32, 1}, [F16] = {32, 64, dequantize_f16, 1}, [BF16] = {32, 64, dequantize_bf16, 1},
};

/* A type's format, interleaved or not (0 for none). */
static const block_format *format_of(int type) {
  const int base = type >= ROWS_X8 && type < STACKED ? type % ROWS_X8 : type; /* STACKED % ROWS_X8 is F32 */
  return base >= 0 && base < TYPE_IDS && FORMATS[base].dequantize ? &FORMATS[base] : 0;
}
static int block_values(int type) { return format_of(type)->values; }
static int block_bytes(int type) { return format_of(type)->bytes; }
static int takes_floats(int type) { return format_of(type) && format_of(type)->floats; }
static int activation_of(int type) { return format_of(type) ? format_of(type)->activation : ACT_Q8_0; }

/* Dequantize one row of `cols` values (the reference the tests check the products against, and the
 * embedding lookup). */
static void dequantize_row(int type, const uint8_t *w, int cols, float *y) {
  const block_format *f = format_of(type);
  for (int b = 0; b < cols / f->values; b++, w += f->bytes, y += f->values) f->dequantize(w, y);
}

/* ---- interleaved rows ------------------------------------------------------------------------ */
/* A matrix whose rows come in eights is stored with each group of eight rows' blocks side by side,
 * the same bytes in another order. A block's bytes are a few fields (its scale, its min, packed
 * sub-scales, quants); each field is laid out as the eight rows' pieces of `width` bytes in turn:
 * piece k of every row, then piece k + 1. For 32-value blocks: the eight rows' scales (float16), for
 * Q4_1 their eight mins, then slices of 32 bytes, slice k holding bytes 4k..4k+3 of each row's quant
 * bytes: four slices of nibbles, eight of Q8_0's bytes. A Q4 slice's low nibbles are values 4k..4k+3
 * of the eight rows, its high nibbles values 16+4k..19+4k. One load (masked and shifted) thus gives
 * 8 rows x 4 values, each row a lane of a register, which maddubs multiplies with 4 activations
 * broadcast to every lane. A block's 256 multiply-adds for eight rows then take eight maddubs and one
 * madd (Q8_0: eight of each), where a row at a time took eight of each and a horizontal sum per row;
 * and as a lane is a row, no horizontal sums at all. The K-quants' 256-value blocks follow the same
 * plan: Q4_K and Q5_K keep their 12 packed 6-bit scale bytes as twelve 8-byte rows (byte k of each
 * row's 12), so one 64-bit word unpacks a sub-block's scales or mins for all eight rows; their quants
 * (32 bytes per pair of sub-blocks: 2p in the low nibbles, 2p + 1 in the high) and Q5_K's fifth bits
 * (bit j of byte i: value i of sub-block j) come as 4-byte slices, as do Q6_K's low nibbles and high
 * pairs, with its sixteen int8 sub-scales as sixteen 8-byte rows. */

typedef struct {
  int from, bytes, width, to; /* its place in a row's block, its size, its pieces' size (1, 2 or 4), its place in the group */
} field;
typedef struct {
  int type, fields;
  field field[5];
} interleaving;

enum { Q4K_D = 0, Q4K_DMIN = 16, Q4K_SCALES = 32, Q4K_QUANTS = 128 };
enum { Q5K_HIGH = 128, Q5K_QUANTS = 128 + 256 };
enum { Q6K_D = 0, Q6K_SCALES = 16, Q6K_LOW = 144, Q6K_HIGH = 144 + 1024 };
static const interleaving INTERLEAVINGS[] = {
    {Q4_0, 2, {{0, 2, 2, 0}, {2, 16, 4, 16}}},
    {Q4_1, 3, {{0, 2, 2, 0}, {2, 2, 2, 16}, {4, 16, 4, 32}}},
    {Q8_0, 2, {{0, 2, 2, 0}, {2, 32, 4, 16}}},
    {Q4_K, 4, {{0, 2, 2, Q4K_D}, {2, 2, 2, Q4K_DMIN}, {4, 12, 1, Q4K_SCALES}, {16, 128, 4, Q4K_QUANTS}}},
    {Q5_K, 5, {{0, 2, 2, Q4K_D}, {2, 2, 2, Q4K_DMIN}, {4, 12, 1, Q4K_SCALES}, {16, 32, 4, Q5K_HIGH}, {48, 128, 4, Q5K_QUANTS}}},
    {Q6_K, 4, {{208, 2, 2, Q6K_D}, {192, 16, 1, Q6K_SCALES}, {0, 128, 4, Q6K_LOW}, {128, 64, 4, Q6K_HIGH}}},
    {Q2_K, 4, {{80, 2, 2, Q2K_GROUP_D}, {82, 2, 2, Q2K_GROUP_DMIN}, {0, 16, 1, Q2K_GROUP_SCALES}, {16, 64, 4, Q2K_GROUP_QUANTS}}},
    {Q3_K, 4, {{108, 2, 2, Q3K_GROUP_D}, {96, 12, 1, Q3K_GROUP_SCALES}, {0, 32, 4, Q3K_GROUP_HIGH}, {32, 64, 4, Q3K_GROUP_LOW}}},
    {IQ4_XS, 4, {{0, 2, 2, IQ4XS_GROUP_D}, {2, 2, 2, IQ4XS_GROUP_SCALES_HIGH}, {4, 4, 4, IQ4XS_GROUP_SCALES_LOW}, {8, 128, 4, IQ4XS_GROUP_QUANTS}}},
    {Q5_0, 3, {{0, 2, 2, 0}, {2, 4, 4, 16}, {6, 16, 4, 48}}},
    {Q5_1, 4, {{0, 2, 2, 0}, {2, 2, 2, 16}, {4, 4, 4, 32}, {8, 16, 4, 64}}},
    {IQ4_NL, 2, {{0, 2, 2, 0}, {2, 16, 4, 16}}},
    {MXFP4, 2, {{0, 1, 1, 0}, {1, 16, 4, 8}}}, /* the eight scale bytes, then Q4_0's nibble slices */
};

static const interleaving *interleaving_of(int type) {
  for (size_t i = 0; i < sizeof INTERLEAVINGS / sizeof *INTERLEAVINGS; i++)
    if (INTERLEAVINGS[i].type == type % ROWS_X8) return &INTERLEAVINGS[i];
  return 0;
}

/* Row `lane`'s block into its group's block (into_group: from a row's block to the group), or back. */
static void move_block(const interleaving *layout, const uint8_t *from, uint8_t *to, int lane, int into_group) {
  for (int f = 0; f < layout->fields; f++) {
    const field *x = &layout->field[f];
    for (int k = 0; k < x->bytes / x->width; k++) {
      const size_t in_group = x->to + 8 * x->width * k + x->width * lane, in_row = x->from + x->width * k;
      uint8_t *dst = to + (into_group ? in_group : in_row);
      const uint8_t *src = from + (into_group ? in_row : in_group);
      /* sizes the compiler knows: a load and a store each, not a call (calls made loading slower:
         bench/RESULTS.md, figures moved out of code comments) */
      if (x->width == 4) memcpy(dst, src, 4);
      else if (x->width == 2) memcpy(dst, src, 2);
      else *dst = *src;
    }
  }
}

/* Where group g (rows 8g .. 8g + 7) of a matrix of `rows` rows, nb blocks of bb bytes a row, stored in
 * groups of eight (geometry 8) or in pairs of them (16), has its first block (bytes from the matrix's
 * start), and the bytes from one of its blocks to the next. In pairs, pair p's block b is group 2p's block b then group 2p + 1's,
 * so a tile reading both reads one stream; a last group without a partner (rows % 16 == 8) is stored
 * as in groups of eight. */
static size_t group_place(int geometry, int g, int rows, int nb, int bb, size_t *block_stride) {
  const size_t group_bytes = (size_t)nb * 8 * bb;
  const int paired = geometry == 16 && 8 * (g | 1) + 8 <= rows;
  *block_stride = (size_t)(paired ? 16 : 8) * bb;
  return (size_t)g * group_bytes - (paired && g % 2 ? group_bytes - (size_t)8 * bb : 0);
}

int tq_repack(uint8_t *dst, const uint8_t *src, const tq_product *shape) {
  const int type = shape->type, rows = shape->rows, cols = shape->cols, bb = block_bytes(type), nb = cols / block_values(type);
  /* a row is cols / block_values blocks: Q4_K and Q6_K hold 256 values a block, and counting 32 here
   * copied eight times each matrix's size, past both buffers' ends */
  const size_t row_bytes = (size_t)nb * bb;
  const interleaving *layout = interleaving_of(type);
  const int geometry = layout ? interleaves(type) : 0;
  if (!geometry || rows % 8 != 0) {
    memcpy(dst, src, (size_t)rows * row_bytes);
    return type;
  }
  for (int g = 0; g < rows / 8; g++) {
    size_t block_stride;
    uint8_t *group = dst + group_place(geometry, g, rows, nb, bb, &block_stride);
    for (int b = 0; b < nb; b++)
      for (int i = 0; i < 8; i++)
        move_block(layout, src + (size_t)(8 * g + i) * row_bytes + (size_t)b * bb, group + (size_t)b * block_stride, i, 1);
  }
  return (geometry == 16 ? ROWS_X16 : ROWS_X8) + type;
}

/* Row r of a matrix of `type` (`rows` rows) dequantized, whatever its layout. */
static void row_values(int type, const uint8_t *w, int r, int rows, int cols, float *y) {
  const size_t row_bytes = (size_t)cols / block_values(type) * block_bytes(type);
  if (type < ROWS_X8) {
    dequantize_row(type, w + (size_t)r * row_bytes, cols, y);
    return;
  }
  const int bb = block_bytes(type), bv = block_values(type);
  const interleaving *layout = interleaving_of(type);
  size_t block_stride;
  const uint8_t *group = w + group_place(type >= ROWS_X16 ? 16 : 8, r / 8, rows, cols / bv, bb, &block_stride);
  uint8_t own[256];
  for (int b = 0; b < cols / bv; b++, group += block_stride, y += bv) {
    move_block(layout, group, own, r % 8, 0);
    dequantize_row(type % ROWS_X8, own, bv, y);
  }
}


void tq_embed(float *out, const uint8_t *w, const int32_t *ids, const tq_product *shape) {
  const int type = shape->type, rows = shape->rows, cols = shape->cols, tokens = shape->tokens;
  for (int t = 0; t < tokens; t++) {
    const int id = ids[t] < 0 || ids[t] >= rows ? 0 : ids[t];
    row_values(type, w, id, rows, cols, out + (size_t)t * cols);
  }
}

void tq_dequantize(float *out, const uint8_t *w, const tq_product *shape) {
  const int type = shape->type, rows = shape->rows, cols = shape->cols;
  for (int r = 0; r < rows; r++) row_values(type, w, r, rows, cols, out + (size_t)r * cols);
}
