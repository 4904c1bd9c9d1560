/* tq_abi: tq.h's constants, struct sizes and fields by name, for abi.py's check (tests/test_abi.py).
 * A struct's fields are listed here by hand, but its size too: a field added to tq.h alone changes
 * that and fails the check as well. */

#define CONSTANT(name) {#name, name, 0, 0}
#define STRUCT(type) {#type, sizeof(type), 0, 0}
#define KIND(member) _Generic((member), int32_t: 'i', int32_t *: 'i', float: 'f', default: 's')
#define FIELD(type, field) {#type "." #field, offsetof(type, field), sizeof(((type *)0)->field), KIND(((type *)0)->field)}

static const tq_abi_entry ABI[] = {
    CONSTANT(Q4_0), CONSTANT(Q4_1), CONSTANT(Q8_0), CONSTANT(Q4_K), CONSTANT(Q5_K), CONSTANT(Q6_K),
    CONSTANT(Q2_K), CONSTANT(Q3_K), CONSTANT(IQ4_XS),
    CONSTANT(Q5_0), CONSTANT(Q5_1), CONSTANT(IQ4_NL), CONSTANT(MXFP4),
    CONSTANT(F32), CONSTANT(F16), CONSTANT(BF16),
    CONSTANT(ISA_GENERIC), CONSTANT(ISA_AVX2), CONSTANT(ISA_AVX2_VNNI), CONSTANT(ISA_AVX512), CONSTANT(ISA_AVX512_VNNI), CONSTANT(ISA_NEON), CONSTANT(ISA_NEON_DOTPROD), CONSTANT(ISA_NEON_I8MM),
    CONSTANT(ROWS_X8), CONSTANT(ROWS_X16), CONSTANT(STACKED), CONSTANT(MAX_PARTS), CONSTANT(STACK_HEADER_BYTES),
    CONSTANT(STEP_LOGITS), CONSTANT(STEP_HIDDEN), CONSTANT(ATTEND_BIAS), CONSTANT(ATTEND_QK_NORM), CONSTANT(ATTEND_NO_ROPE), CONSTANT(ATTEND_LOCAL_ROPE), CONSTANT(ATTEND_SINKS), CONSTANT(ATTEND_QK_NORM_WHOLE), CONSTANT(ATTEND_LATENT), CONSTANT(ATTEND_KEYS_AHEAD), CONSTANT(ATTEND_ROPE_POSITIONS), CONSTANT(FORM_POST_NORMS), CONSTANT(FORM_GEGLU), CONSTANT(FORM_BIASES),
    CONSTANT(FORM_SWIGLU_CLAMPED), CONSTANT(FORM_LATENT), CONSTANT(FORM_RECURRENT), CONSTANT(FORM_GATED_ATTENTION), CONSTANT(FORM_UNNORMED_INPUTS), CONSTANT(KV_F16), CONSTANT(KV_Q8_0), CONSTANT(LANE_ROWS_SLOTS), CONSTANT(LANE_ROWS_GIVEN), CONSTANT(LANE_ROWS_RESUME), CONSTANT(MAX_HEAD_DIM), CONSTANT(KEY_CHUNK), CONSTANT(MIN_BLOCK_POSITIONS), CONSTANT(SPIN_US),
    CONSTANT(MODEL_EMBED), CONSTANT(MODEL_NORM), CONSTANT(MODEL_HEAD), CONSTANT(MODEL_INV_FREQ), CONSTANT(MODEL_INV_FREQ_LOCAL), CONSTANT(MODEL_BLOCK_TABLES), CONSTANT(MODEL_LORA), CONSTANT(MODEL_ROPE_SECTIONS), CONSTANT(MODEL_LAYERS),
    CONSTANT(LORA_LANE_ADAPTERS), CONSTANT(LORA_LANE_SCALES), CONSTANT(LORA_WEIGHTS), CONSTANT(LORA_A), CONSTANT(LORA_TYPE), CONSTANT(LORA_RANK),
    CONSTANT(LORA_PART), CONSTANT(LORA_PART_B), CONSTANT(LORA_PART_ROWS), CONSTANT(LORA_PART_RANK), CONSTANT(LORA_PART_SCALE), CONSTANT(LORA_PART_SIZE),
    CONSTANT(LORA_PARTS), CONSTANT(LORA_ENTRY), CONSTANT(LORA_MATRICES), CONSTANT(LORA_MAX_ADAPTERS),
    CONSTANT(LAYER_QKV), CONSTANT(LAYER_O), CONSTANT(LAYER_GATE_UP), CONSTANT(LAYER_DOWN), CONSTANT(LAYER_ROUTER), CONSTANT(LAYER_UP),
    CONSTANT(LAYER_SHARED_GATE_UP), CONSTANT(LAYER_SHARED_DOWN), CONSTANT(LAYER_Q_B), CONSTANT(LAYER_K_B), CONSTANT(LAYER_V_B), CONSTANT(LAYER_SHARED_GATE), CONSTANT(LAYER_SELECTION_BIAS),
    CONSTANT(LAYER_MATRICES), CONSTANT(LAYER_ATTN_NORM), CONSTANT(LAYER_FFN_NORM), CONSTANT(LAYER_CACHE), CONSTANT(LAYER_EXTRAS),
    CONSTANT(LAYER_EXPERT_TOKENS), CONSTANT(LAYER_POST_NORMS), CONSTANT(LAYER_BIASES), CONSTANT(LAYER_ENTRIES), CONSTANT(LAYER_INFO_FLAGS), CONSTANT(LAYER_INFO_FORM),
    CONSTANT(LAYER_INFO_WINDOW), CONSTANT(LAYER_INFO_POSITIONS), CONSTANT(LAYER_INFO),
    CONSTANT(EXPERTS_NORM_WEIGHTS), CONSTANT(EXPERTS_SIGMOID), CONSTANT(EXPERTS_SELECTION_BIAS), CONSTANT(EXPERTS_SHARED_UNGATED), CONSTANT(MAX_EXPERTS), CONSTANT(MAX_EXPERTS_USED),
    STRUCT(tq_experts), FIELD(tq_experts, count), FIELD(tq_experts, used), FIELD(tq_experts, ffn_dim), FIELD(tq_experts, flags), FIELD(tq_experts, shared_ffn_dim),
    FIELD(tq_experts, weights_scale),
    STRUCT(stack_header), FIELD(stack_header, parts), FIELD(stack_header, types), FIELD(stack_header, rows), FIELD(stack_header, unused),
    STRUCT(tq_product), FIELD(tq_product, type), FIELD(tq_product, rows), FIELD(tq_product, cols), FIELD(tq_product, tokens),
    FIELD(tq_product, eps),
    STRUCT(tq_attention), FIELD(tq_attention, lanes), FIELD(tq_attention, heads), FIELD(tq_attention, kv_heads),
    FIELD(tq_attention, slots), FIELD(tq_attention, positions), FIELD(tq_attention, head_dim), FIELD(tq_attention, flags),
    FIELD(tq_attention, eps), FIELD(tq_attention, scale), FIELD(tq_attention, rotary_dim), FIELD(tq_attention, rope_scale), FIELD(tq_attention, kv_type), FIELD(tq_attention, window),
    FIELD(tq_attention, block_positions), FIELD(tq_attention, table_width),
    STRUCT(tq_layer_shape), FIELD(tq_layer_shape, attention), FIELD(tq_layer_shape, dim), FIELD(tq_layer_shape, ffn_dim),
    FIELD(tq_layer_shape, types), FIELD(tq_layer_shape, experts), FIELD(tq_layer_shape, form), FIELD(tq_layer_shape, latent),
    FIELD(tq_layer_shape, recurrent),
    STRUCT(tq_latent), FIELD(tq_latent, q_lora), FIELD(tq_latent, kv_lora), FIELD(tq_latent, nope), FIELD(tq_latent, rope), FIELD(tq_latent, v_dim),
    STRUCT(tq_step), FIELD(tq_step, attention), FIELD(tq_step, dim), FIELD(tq_step, ffn_dim), FIELD(tq_step, layers),
    FIELD(tq_step, vocab), FIELD(tq_step, embed_type), FIELD(tq_step, head_type), FIELD(tq_step, picks),
    FIELD(tq_step, outputs), FIELD(tq_step, experts), FIELD(tq_step, embed_scale), FIELD(tq_step, latent), FIELD(tq_step, recurrent), FIELD(tq_step, deepstack),
    STRUCT(tq_recurrent), FIELD(tq_recurrent, conv_kernel), FIELD(tq_recurrent, state), FIELD(tq_recurrent, k_heads), FIELD(tq_recurrent, v_heads), FIELD(tq_recurrent, lane_rows),
};

int tq_abi(const tq_abi_entry **entries) {
  *entries = ABI;
  return sizeof ABI / sizeof *ABI;
}
