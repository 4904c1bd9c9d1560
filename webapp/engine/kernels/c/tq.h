/* The kernels' interface: what cpu.py calls, and what abi.py mirrors once in Python.
 *
 * Every exported function takes 64-bit words (pointers, or integers as tq_start), as tinygrad's CPU
 * worker passes them to a program; a call's sizes travel in one of the structs below, whose bytes
 * cpu.py writes from abi.py's ctypes twins. tq_abi() lists each constant here, each struct's size and
 * each field's offset, size and kind, and tests/test_abi.py checks the mirror against it: a field
 * added on one side only fails that test (and the kernels' load) instead of shifting what follows.
 * out and x are float32, row-major. */
#pragma once
#include <stdint.h>

/* GGUF block types with a kernel, by their GGML type ids. */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
enum { Q2_K = 10, Q3_K = 11, IQ4_XS = 23 };
enum { F32 = 0, F16 = 1, BF16 = 30 }; /* plain floats, read in blocks of 32 values (format_float.c) */
/* Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K with eight rows' blocks side by side (see "interleaved rows" in
 * formats.c): not GGUF types, made from them at load by tq_repack. A layout is named by its geometry:
 * ROWS_X8 + a GGUF type is that type's eight-row interleave; ROWS_X16 + a GGUF type the same groups in
 * pairs, block by block (the AVX-512 tiles'); another geometry would be another offset below STACKED. */
enum { ROWS_X8 = 100, Q4_0x8 = ROWS_X8 + Q4_0, Q4_1x8 = ROWS_X8 + Q4_1, Q8_0x8 = ROWS_X8 + Q8_0, Q4_Kx8 = ROWS_X8 + Q4_K,
       Q5_Kx8 = ROWS_X8 + Q5_K,
       Q6_Kx8 = ROWS_X8 + Q6_K };
enum { Q2_Kx8 = ROWS_X8 + Q2_K, Q3_Kx8 = ROWS_X8 + Q3_K, IQ4_XSx8 = ROWS_X8 + IQ4_XS }; /* the same for these */
/* more GGUF types with a kernel, each beside its interleaved twin (a line a format) */
enum { Q5_0 = 6, Q5_0x8 = ROWS_X8 + Q5_0 };
enum { Q5_1 = 7, Q5_1x8 = ROWS_X8 + Q5_1 };
enum { IQ4_NL = 20, IQ4_NLx8 = ROWS_X8 + IQ4_NL };
enum { MXFP4 = 39, MXFP4x8 = ROWS_X8 + MXFP4 };
enum { ROWS_X16 = 200 };
/* A matrix stacked by rows from parts of different types (a Q4_K_M layer's q and k in Q4_K over its v in
 * Q6_K), made at load by cpu.py: its bytes open with a stack_header (STACK_HEADER_BYTES), then each
 * part's blocks in turn, each in its own layout (interleaved or not). Products run a part at a time. */
enum { STACKED = 1000, MAX_PARTS = 7, STACK_HEADER_BYTES = 64 };
typedef struct {
  int32_t parts, types[MAX_PARTS], rows[MAX_PARTS], unused;
} stack_header;
_Static_assert(sizeof(stack_header) == STACK_HEADER_BYTES, "the header cpu.py writes");

/* tq_attend's flags: which of the qkv bias and the q/k norm weights its `extras` hold, in that order;
 * ATTEND_NO_ROPE: q and k are not rotated (SmolLM3's every fourth layer); ATTEND_LOCAL_ROPE: rotated
 * by the model's second RoPE frequencies, MODEL_INV_FREQ_LOCAL (Gemma 3's sliding-window layers);
 * ATTEND_SINKS: `extras` then holds a logit a query head (gpt-oss's attention sinks), a score every
 * query has beside its keys' that weighs no value; ATTEND_QK_NORM_WHOLE: with ATTEND_QK_NORM, the norms
 * run over all of q (H Hd weights) and all of k (KvH Hd) rather than a head at a time (OLMoE). */
enum { ATTEND_BIAS = 1, ATTEND_QK_NORM = 2, ATTEND_NO_ROPE = 4, ATTEND_LOCAL_ROPE = 8, ATTEND_SINKS = 16, ATTEND_QK_NORM_WHOLE = 32 };
/* ATTEND_LATENT: multi-head latent attention after absorption (DeepSeek-V2's MLA, mla.c): qkv holds H
 * query heads and one key head (no value head), and a key's row is also its value (the value a query
 * reads is the whole row); the cache is (1, slots, 1, positions, a row): no value rows. */
enum { ATTEND_LATENT = 64 };
/* ATTEND_KEYS_AHEAD: the lanes carry a fourth row of B values (lanes[3B + b]; the third, lane_rows',
 * is then present, read or not): the last key lane b attends, its position or a later one of its
 * slot that this step writes (Gemma 3's image positions attend the whole image, as llama.cpp decodes
 * an image in one non-causal batch). A step's flag (tq_forward's step->attention.flags), which every
 * layer takes. */
enum { ATTEND_KEYS_AHEAD = 128 };
/* ATTEND_ROPE_POSITIONS: the lanes carry, after a third and a fourth row (present, read or not),
 * three rows of B positions (lanes[4B + s * B + b]), and rotary pair i of lane b turns by row
 * model[MODEL_ROPE_SECTIONS][i] of them (M-RoPE: a Qwen2-VL image's rows turn by its time, row and
 * column, not by their places in the sequence). A step's flag; without it, or without the model's
 * sections, each pair turns by the lane's position. */
enum { ATTEND_ROPE_POSITIONS = 256 };
/* How a layer's sublayers join the residual stream (tq_layer_shape.form). FORM_POST_NORMS: the
 * attention's and the feed-forward's outputs are rms-normalized (by the layer's LAYER_POST_NORMS, D
 * floats each) before they are added (Gemma 3); FORM_GEGLU: the feed-forward is gelu(gate) * up
 * (tanh's approximation) where it is silu(gate) * up. FORM_BIASES: the layer's LAYER_BIASES hold the
 * output product's bias (D floats), then a mixture of experts' router bias (count floats) and every
 * expert's gate, up and down biases (count x ffn_dim, count x ffn_dim, count x D), added after each
 * product (gpt-oss); FORM_SWIGLU_CLAMPED: the experts' activation is gpt-oss's clamped SwiGLU,
 * min(gate, 7) * sigmoid(1.702 min(gate, 7)) * (clamp(up, -7, 7) + 1). */
enum { FORM_POST_NORMS = 1, FORM_GEGLU = 2, FORM_BIASES = 4, FORM_SWIGLU_CLAMPED = 8 };
/* FORM_LATENT: the layer's attention is multi-head latent attention (mla.c, tq_latent's sizes): its
 * QKV matrix is q's (or q_a's) rows over the latent's, and LAYER_Q_B, LAYER_K_B and LAYER_V_B hold
 * q_b (0 without a q_a), every head's absorbing k_b and every head's v_b, head after head. */
enum { FORM_LATENT = 16 };
/* FORM_RECURRENT: the layer mixes tokens by Gated DeltaNet instead of attention (Qwen3.5's linear
 * layers, gated_delta.c; tq_recurrent's sizes): its QKV matrix is the conv's input rows over z's, beta's
 * and alpha's, its O the output product (D x v_heads state), its EXTRAS the conv's weights, dt_bias, a
 * and the output norm (float32), its CACHE every slot's state (float32: gated_delta.c says how).
 * FORM_GATED_ATTENTION: q's rows are each head's query then its gate, and the attention's output is
 * times sigmoid(gate) (Qwen3.5's full attention layers). */
enum { FORM_RECURRENT = 32, FORM_GATED_ATTENTION = 64 };
/* FORM_UNNORMED_INPUTS: the attention's q/k/v product and the feed-forward's gate/up product read the
 * residual stream as it is, not rms-normalized (LAYER_ATTN_NORM and LAYER_FFN_NORM unread); with
 * FORM_POST_NORMS the layer's norms are its outputs' only (OLMo 2, EXAONE 4). A dense attention and a
 * dense feed-forward only: no other mixer or feed-forward reads this bit. */
enum { FORM_UNNORMED_INPUTS = 128 };
/* The KV cache's element types (tq_attention.kv_type). KV_F16: a row of Hd float16 values. KV_Q8_0: a row
 * of Hd / 32 blocks of GGUF's Q8_0 layout (a float16 scale d, then 32 int8 q: value d * q), 34 bytes per
 * 32 values, Hd a multiple of 32 (see attention_q8.c). */
enum { KV_F16 = 0, KV_Q8_0 = 1 };
/* the largest head tq_attend rotates (its rotation buffer): DeepSeek-V2's latent row is 576 */
enum { MAX_HEAD_DIM = 576 };
/* The instruction-set ladder (build.py's RUNGS: each rung's compiler flags and the CPU flags it needs).
 * Within an architecture a higher id runs everything a lower one does not lack: x86's AVX2 (with FMA
 * and F16C), AVX2 with the 256-bit VNNI dot product (AVX-VNNI or AVX512-VNNI+VL), AVX-512 (F, BW, VL),
 * AVX-512 with VNNI. ISA_GENERIC is the portable C every CPU runs. ARM's ladder from 16: NEON (every
 * aarch64 core), NEON with ARMv8.2's dot product (sdot), those with ARMv8.6's int8 matrix multiply (smmla). */
enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX2_VNNI = 2, ISA_AVX512 = 3, ISA_AVX512_VNNI = 4 };
enum { ISA_NEON = 16, ISA_NEON_DOTPROD = 17, ISA_NEON_I8MM = 18 };
/* Idle pool threads spin this long before sleeping: a decode step's ~150 jobs come microseconds
 * apart, and a sleeping thread takes tens of microseconds to wake. */
enum { SPIN_US = 100 };

/* tq_forward's model table: the tensors' addresses (uint64) in this order, then LAYER_ENTRIES for each
 * layer in turn. A layer's first LAYER_MATRICES entries are its matrices (tq_layer_shape.types' order).
 * A mixture-of-experts layer (moe.c) has a router, and its GATE_UP, UP and DOWN entries hold every
 * expert's gate, up and down matrices, expert after expert; a dense layer's GATE_UP holds gate over up,
 * and its ROUTER, UP and EXPERT_TOKENS are 0. EXPERT_TOKENS: where a step adds how many of its lanes
 * chose each expert (int64 an expert), or 0 for none. POST_NORMS: FORM_POST_NORMS' two norm weights
 * (D floats each), or 0; BIASES: FORM_BIASES' biases, or 0. A mixture with a shared expert (Qwen2-MoE,
 * tq_experts.shared_ffn_dim > 0) has its SHARED_GATE_UP (gate over up) and SHARED_DOWN matrices and
 * its SHARED_GATE, the D floats whose product with a lane's normed row, through a sigmoid, scales the
 * shared expert's output (shared_expert.c), or 0 with EXPERTS_SHARED_UNGATED (GLM-4.5: added as it
 * is); else the three are 0. SELECTION_BIAS: with EXPERTS_SELECTION_BIAS, a number an expert (count
 * floats) added to its probability to choose the experts, not to weigh them; else 0. INV_FREQ_LOCAL: ATTEND_LOCAL_ROPE
 * layers' RoPE frequencies, or 0 for none. BLOCK_TABLES: a paged cache's block tables (int32, rows x
 * tq_step.attention.table_width, which every layer's cache shares), or 0 for an unpaged one.
 * ROPE_SECTIONS: 0, or rotary / 2 int32, the row of ATTEND_ROPE_POSITIONS' three each rotary pair
 * turns by (0, 1 or 2). */
enum { MODEL_EMBED, MODEL_NORM, MODEL_HEAD, MODEL_INV_FREQ, MODEL_INV_FREQ_LOCAL, MODEL_BLOCK_TABLES, MODEL_LORA, MODEL_ROPE_SECTIONS, MODEL_LAYERS };
/* MODEL_LORA: 0, or the address of a LoRA table (uint64, lora.c): LORA_LANE_ADAPTERS, the address of
 * a step's B int32 (each lane's adapter, -1: none, else below LORA_MAX_ADAPTERS), LORA_LANE_SCALES, of
 * its B floats (each lane's scale on its adapter), then from LORA_WEIGHTS, for each adapter, each layer
 * and each of its first LORA_MATRICES products (qkv, o, gate_up, down), LORA_ENTRY numbers: A's address
 * (rank x cols values: the parts' A's one under another), its type (F32 or F16), the rank (0: the
 * adapter leaves that product as it is), then LORA_PARTS parts, the matrices stacked in the product
 * (q, k, v; gate, up; or one), LORA_PART_SIZE numbers each: the address of B transposed (rank x rows
 * F32 values; 0: the part is unchanged), its rows, its rank, and its scale (alpha / rank) as a float's
 * bits. The lane's product then gains, in each part's rows, lane scale * part scale * B (A x), x the
 * product's input as it multiplied it.
 * Read in dense attention layers only (not FORM_LATENT, FORM_RECURRENT, FORM_GATED_ATTENTION, nor a
 * mixture's feed-forward). */
enum { LORA_LANE_ADAPTERS, LORA_LANE_SCALES, LORA_WEIGHTS };
enum { LORA_A, LORA_TYPE, LORA_RANK, LORA_PART };
enum { LORA_PART_B, LORA_PART_ROWS, LORA_PART_RANK, LORA_PART_SCALE, LORA_PART_SIZE };
enum { LORA_PARTS = 3, LORA_ENTRY = LORA_PART + LORA_PARTS * LORA_PART_SIZE };
enum { LORA_MATRICES = 4, LORA_MAX_ADAPTERS = 64 };
enum { LAYER_QKV, LAYER_O, LAYER_GATE_UP, LAYER_DOWN, LAYER_ROUTER, LAYER_UP, LAYER_SHARED_GATE_UP, LAYER_SHARED_DOWN };
enum { LAYER_Q_B = LAYER_SHARED_DOWN + 1, LAYER_K_B, LAYER_V_B, LAYER_MATRICES }; /* FORM_LATENT's (else 0) */
enum {
  LAYER_ATTN_NORM = LAYER_MATRICES,
  LAYER_FFN_NORM,
  LAYER_CACHE,
  LAYER_EXTRAS,
  LAYER_EXPERT_TOKENS,
  LAYER_POST_NORMS,
  LAYER_BIASES,
  LAYER_SHARED_GATE,
  LAYER_SELECTION_BIAS,
  LAYER_ENTRIES
};
/* tq_forward's layer_info: each layer's LAYER_MATRICES matrix types, then its attention's flags, its
 * form, its attention's window and its cache's positions (tq_attention's; unread in a paged step,
 * whose layers all take the step's positions). */
enum { LAYER_INFO_FLAGS = LAYER_MATRICES, LAYER_INFO_FORM, LAYER_INFO_WINDOW, LAYER_INFO_POSITIONS, LAYER_INFO };
/* tq_experts' flags: the chosen experts' weights divided by their sum (Qwen3-MoE's norm_topk_prob);
 * EXPERTS_SIGMOID: the router's probabilities are sigmoid(logits), not their softmax (GLM-4.5);
 * EXPERTS_SELECTION_BIAS: the experts are chosen by probs + the layer's LAYER_SELECTION_BIAS, their
 * weights still the probs alone; EXPERTS_SHARED_UNGATED: the shared expert's output is added as it
 * is, without a gate (LAYER_SHARED_GATE unread). */
enum { EXPERTS_NORM_WEIGHTS = 1, EXPERTS_SIGMOID = 2, EXPERTS_SELECTION_BIAS = 4, EXPERTS_SHARED_UNGATED = 8 };
/* the most experts a layer has, and a token uses (moe.c's per-lane buffers) */
enum { MAX_EXPERTS = 512, MAX_EXPERTS_USED = 32 };

/* A matrix W (rows x cols) stored as blocks of `type` (one of the above, an interleaved one, or STACKED)
 * against `tokens` rows of activations (tq_embed: ids). */
typedef struct {
  int32_t type, rows, cols, tokens;
  float eps; /* tq_norm_linear's rms_norm epsilon */
} tq_product;

/* A layer's attention for `lanes` lanes (a decode step's sequences, or a prefill piece's tokens). */
typedef struct {
  int32_t lanes, heads, kv_heads;
  int32_t slots, positions, head_dim; /* the KV cache: (2, slots, kv_heads, positions, a row of head_dim values) */
  int32_t flags;                      /* ATTEND_BIAS | ATTEND_QK_NORM | ATTEND_NO_ROPE | ATTEND_LOCAL_ROPE */
  float eps;                          /* the norms' epsilon: the q/k norms', and the layer's (tq_layer, tq_forward) */
  float scale;                        /* on q . k: 1 / sqrt(head_dim) */
  int32_t rotary_dim;                 /* RoPE turns a head's first rotary_dim values (half-split pairs); the rest pass */
  float rope_scale;                   /* on RoPE's cos and sin: YaRN's or LongRoPE's attention factor (1: none) */
  int32_t kv_type;                    /* KV_F16 or KV_Q8_0: how the cache's rows hold their values */
  /* A query at pos attends keys pos - window + 1 .. pos (0: keys 0 .. pos). Position p's row is row
   * p % positions of its slot: a sliding-window layer's cache can be a ring of fewer positions than
   * the context, a multiple of KEY_CHUNK holding window - 1 past keys and every key a step writes. */
  int32_t window;
  /* A paged cache (block_positions > 0; 0: the layout above): a pool (2, slots, kv_heads,
   * block_positions, a row), `slots` counting its blocks. A lane's slot is a row of tq_attend's int32
   * block tables (rows x table_width); position p of its sequence is row p % block_positions of block
   * tables[slot * table_width + p / block_positions], so sequences can share blocks (a common prefix)
   * and take blocks as they grow. positions stays the most a sequence reaches (at most table_width x
   * block_positions). block_positions is a power of two, MIN_BLOCK_POSITIONS (isa.h) .. KEY_CHUNK, so
   * a chunk of keys is whole blocks; a paged layer has no window (window 0: no rings). */
  int32_t block_positions, table_width;
} tq_attention;

/* A mixture of experts' sizes: `count` experts a layer, `used` of them a token, each with a
 * feed-forward of ffn_dim; flags EXPERTS_*; a shared expert's feed-forward width, which every token
 * runs beside its chosen ones (0: none); weights_scale on the chosen experts' weights after any
 * division by their sum (0 or 1: none, as llama.cpp reads expert_weights_scale). count 0: the layers
 * are dense. */
typedef struct {
  int32_t count, used, ffn_dim, flags, shared_ffn_dim;
  float weights_scale;
} tq_experts;

/* A FORM_LATENT layer's sizes (DeepSeek-V2): q_lora, the rank of q's low-rank product (0: q is one
 * product of x); kv_lora, the latent's width; nope and rope, a query head's values without and with
 * RoPE; v_dim, a head's output before W_o. The attention's head_dim is then rope + kv_lora. */
typedef struct {
  int32_t q_lora, kv_lora, nope, rope, v_dim;
} tq_latent;

/* A FORM_RECURRENT layer's sizes (Qwen3.5's Gated DeltaNet): the conv's kernel (past inputs + 1), a
 * head's state (its keys' and its values' size), the key heads and the value heads (a multiple of them).
 * lane_rows (a step's, not a layer's): LANE_ROWS_GIVEN when the lanes carry a third row of B values, each
 * lane's row of state (gated_delta.c); LANE_ROWS_RESUME: the same, each sequence's first lane going on
 * from the state in its own row rather than its slot's; LANE_ROWS_SLOTS: every lane in its slot's row. */
enum { LANE_ROWS_SLOTS = 0, LANE_ROWS_GIVEN = 1, LANE_ROWS_RESUME = 2 };
typedef struct {
  int32_t conv_kernel, state, k_heads, v_heads;
  int32_t lane_rows;
} tq_recurrent;

/* A whole layer: its attention, the model's width D and the feed-forward's F, its matrices' types,
 * its experts (count 0: a dense layer). */
typedef struct {
  tq_attention attention;
  int32_t dim, ffn_dim;
  int32_t types[LAYER_MATRICES]; /* of LAYER_QKV .. LAYER_V_B, in that order */
  tq_experts experts;
  int32_t form; /* FORM_POST_NORMS | FORM_GEGLU | FORM_BIASES | FORM_SWIGLU_CLAMPED | FORM_LATENT | FORM_RECURRENT ... */
  tq_latent latent;
  tq_recurrent recurrent;
} tq_layer_shape;

/* What tq_forward writes for each pick: the head's logits (vocab floats), or the final norm's output
 * (dim floats: the hidden state that embeddings pool). */
enum { STEP_LOGITS = 0, STEP_HIDDEN = 1 };

/* A whole step: attention.lanes lanes of every layer (each layer's types apart), then `picks` rows of
 * logits. */
typedef struct {
  tq_attention attention;
  int32_t dim, ffn_dim, layers, vocab, embed_type, head_type;
  int32_t picks;
  int32_t outputs;    /* STEP_LOGITS or STEP_HIDDEN */
  tq_experts experts; /* of the layers with a router */
  float embed_scale;  /* on the embedding's rows (Gemma's sqrt(dim); 1: none) */
  tq_latent latent;   /* of FORM_LATENT layers */
  tq_recurrent recurrent; /* of FORM_RECURRENT layers */
  /* a row of `inputs` holds (1 + deepstack) x dim floats: the embedding, then what the first
   * `deepstack` layers each add to their output at that position (Qwen3-VL's deepstack features) */
  int32_t deepstack;
} tq_step;

/* tq_abi's description of one name: a constant (its value), a struct (its size) or a field
 * ("struct.field": its offset, size and kind: 'i' int32, 'f' float32, 's' a struct). */
typedef struct {
  const char *name;
  int64_t value;
  int32_t size;
  char kind;
} tq_abi_entry;

/* Sizes the thread pool (threads, counting the caller; spin_us as SPIN_US); called once before any product. */
void tq_start(long threads, long spin_us);
/* The rung of the instruction-set ladder this build was compiled for (ISA_*; tq.c reads it from the
 * compiler's target macros, so it is what the flags gave, whatever build.py meant to ask for). */
int tq_isa(void);
/* The entries tq_abi_entry describes, and how many there are. */
int tq_abi(const tq_abi_entry **entries);
/* dst = src's rows (shape: type, rows, cols) in the interleaved layout its products use; returns the
 * type written: the interleaved one where the build's kernels read it and rows % 8 == 0, else the
 * same type (a plain copy). */
int tq_repack(uint8_t *dst, const uint8_t *src, const tq_product *shape);
/* out (rows, cols) = W dequantized, whatever its layout (for the tests). */
void tq_dequantize(float *out, const uint8_t *w, const tq_product *shape);
/* out[t] = W[ids[t]] dequantized, for t < tokens (an id out of range reads row 0). */
void tq_embed(float *out, const uint8_t *w, const int32_t *ids, const tq_product *shape);
/* out[t][r] = sum_i W[r][i] * x[t][i] for t < tokens, r < rows. */
void tq_linear(float *out, const uint8_t *w, const float *x, const tq_product *shape);
/* the same over rms_norm(x) * norm */
void tq_norm_linear(float *out, const uint8_t *w, const float *x, const float *norm, const tq_product *shape);
/* residual + the product */
void tq_residual_linear(float *out, const uint8_t *w, const float *x, const float *residual, const tq_product *shape);
/* residual + W . (silu(gate) * up), x = gate | up (2 cols a token) */
void tq_swiglu_linear(float *out, const uint8_t *w, const float *gate_up, const float *residual, const tq_product *shape);
/* A layer's attention from its qkv rows: bias, q/k norm, RoPE, the new keys and values into the
 * KV cache (float16 or Q8_0 rows, as shape->kv_type says), then softmax attention over it (see
 * attention.c). `cache` is the cache's first byte, whatever its type; `tables` a paged cache's block
 * tables (int32, rows x shape->table_width), unread (NULL) when shape->block_positions is 0. */
void tq_attend(float *out, const float *qkv, void *cache, const int32_t *lanes, const float *inv_freq, const float *extras,
               const int32_t *tables, const tq_attention *shape);
/* A vision encoder's attention for one head, no mask: out[r] (row stride out_stride) = softmax(q[r] . k)
 * . v for the `rows` queries q (rows x hd, already scaled) over n keys given transposed, kt (hd x n),
 * and their values v (n x hd). hd a multiple of 8, at most MAX_HEAD_DIM; -1 (nothing written) otherwise. */
int tq_encoder_attention(float *out, const float *q, const float *kt, const float *v, int n, int rows, int hd, int out_stride);
/* x[i] = gelu(x[i]) in its tanh form (ggml's gelu), for n values; n / 4096 must fit an int. */
void tq_gelu_tanh(float *x, long n);
/* out[r * out_stride + o] = bias[o] (0 where bias is NULL) + x[r] . w[o] (+ out's value where
 * `accumulate`), for `rows` rows of x (rows x cols, contiguous) and the `outs` rows of w (outs x
 * cols in `type`: F32, F16 or BF16). -1 (nothing written) for another type or sizes that make no
 * product. */
int tq_float_gemm(float *out, const float *x, const uint8_t *w, const float *bias, int type, int rows, int cols, int outs, int out_stride,
                  int accumulate);
/* A whole layer: those five in a row (see step.c), or a mixture of experts' feed-forward after the
 * attention, over an unpaged cache (shape->attention.block_positions must be 0: no block tables here) (shape->experts.count > 0; a dense layer's w_router, w_up and expert_tokens are unread, and
 * the shared expert's w_shared_gate_up, w_shared_down and shared_gate where it has none, selection_bias
 * without EXPERTS_SELECTION_BIAS). */
void tq_layer(float *out, const float *x, const uint8_t *w_qkv, const uint8_t *w_o, const uint8_t *w_gate_up, const uint8_t *w_down,
              const uint8_t *w_router, const uint8_t *w_up, const uint8_t *w_shared_gate_up, const uint8_t *w_shared_down,
              const float *attn_norm, const float *ffn_norm, uint16_t *cache, const int32_t *lanes, const float *inv_freq, const float *extras,
              int64_t *expert_tokens, const float *post_norms, const float *biases, const float *shared_gate, const float *selection_bias,
              const tq_layer_shape *shape);
/* A whole step: embedding, every layer, the final norm and the head, the model's tensors passed by
 * address (model, in MODEL_* and LAYER_* order), each layer's LAYER_INFO numbers in layer_info; a
 * token -1 - k embedded as row k of `inputs` (0 where no token is negative). */
void tq_forward(float *logits, const int32_t *tokens, const int32_t *lanes, const int32_t *picks, const uint64_t *model, const tq_step *step,
                const int32_t *layer_info, const float *inputs);
