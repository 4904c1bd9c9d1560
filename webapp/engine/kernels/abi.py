"""The C kernels' interface (c/tq.h) mirrored once in Python: block types, attention flags, limits,
the model table's order and the argument structs that cpu.py fills.

Contract: each name here stands for its twin in tq.h (`STRUCTS` and `ENUMS` pair them), and
`mismatches(library)` compares this mirror with what a built library says of itself (`tq_abi`: each
constant's value, each struct's size, each field's offset, size and kind). A field or value changed on
one side only is then a listed difference, which fails tests/test_abi.py and the kernels' load,
rather than a silent shift of every argument after it.
"""

from __future__ import annotations

import ctypes
import enum


class BlockType(enum.IntEnum):
    """GGUF block types with a kernel, by their GGML type ids."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q2_K = 10
    Q3_K = 11
    IQ4_XS = 23
    Q5_0 = 6
    Q5_1 = 7
    IQ4_NL = 20
    MXFP4 = 39
    F32 = 0
    F16 = 1
    BF16 = 30


# tq_repack's types: a GGUF type plus one of these, for matrices stored with eight rows' blocks side by
# side, or those groups of eight in pairs block by block (the AVX-512 tiles' layout)
ROWS_X8, ROWS_X16 = 100, 200
# a matrix stacked from parts of different types, its bytes opening with a StackHeader (STACK_HEADER_BYTES)
STACKED, MAX_PARTS, STACK_HEADER_BYTES = 1000, 7, 64
MAX_HEAD_DIM = 576  # the largest head tq_attend rotates (DeepSeek-V2's latent row)
KEY_CHUNK = 256  # attention's keys an item (isa.h): a sliding-window layer's ring holds whole chunks
# a paged cache's block_positions: a power of two from this to KEY_CHUNK (an item's keys are whole blocks)
MIN_BLOCK_POSITIONS = 16
SPIN_US = 100  # how long idle pool threads spin before sleeping (tq.h says why)
CONSTANTS = {"ROWS_X8": ROWS_X8, "ROWS_X16": ROWS_X16, "STACKED": STACKED, "MAX_PARTS": MAX_PARTS, "STACK_HEADER_BYTES": STACK_HEADER_BYTES}
MAX_EXPERTS, MAX_EXPERTS_USED = 512, 32  # the most experts a layer has, and a token uses
LAYER_KERNEL_MATRICES = 8  # the matrices tq_layer takes: qkv .. shared_down
LAYER_MATRICES = 11  # a layer's first table entries are its matrices (LayerEntry.QKV .. V_B)
# tq_forward's layer_info: each layer's LAYER_MATRICES matrix types, then its attention's flags, its
# form, its attention's window and its cache's positions
LAYER_INFO_FLAGS, LAYER_INFO_FORM, LAYER_INFO_WINDOW, LAYER_INFO_POSITIONS = range(LAYER_MATRICES, LAYER_MATRICES + 4)
LAYER_INFO = LAYER_MATRICES + 4
CONSTANTS |= {
    "MAX_HEAD_DIM": MAX_HEAD_DIM,
    "KEY_CHUNK": KEY_CHUNK,
    "MIN_BLOCK_POSITIONS": MIN_BLOCK_POSITIONS,
    "SPIN_US": SPIN_US,
    "MAX_EXPERTS": MAX_EXPERTS,
    "MAX_EXPERTS_USED": MAX_EXPERTS_USED,
}
CONSTANTS |= {"LAYER_MATRICES": LAYER_MATRICES, "LAYER_INFO_FLAGS": LAYER_INFO_FLAGS, "LAYER_INFO_FORM": LAYER_INFO_FORM}
CONSTANTS |= {"LAYER_INFO_WINDOW": LAYER_INFO_WINDOW, "LAYER_INFO_POSITIONS": LAYER_INFO_POSITIONS, "LAYER_INFO": LAYER_INFO}
# a LoRA table (tq.h's MODEL_LORA), uint64: the addresses of a step's lane adapters (int32, -1: none)
# and lane scales (float32), then from LORA_WEIGHTS for each adapter, layer and product (its first
# LORA_MATRICES) LORA_ENTRY numbers: A's address, its type, its rank (0: none), then LORA_PARTS parts
# of LORA_PART_SIZE numbers: B's address (0: none), its rows, its rank, its scale's float32 bits
LORA_LANE_ADAPTERS, LORA_LANE_SCALES, LORA_WEIGHTS = range(3)
LORA_A, LORA_TYPE, LORA_RANK, LORA_PART = range(4)
LORA_PART_B, LORA_PART_ROWS, LORA_PART_RANK, LORA_PART_SCALE, LORA_PART_SIZE = range(5)
LORA_PARTS = 3
LORA_ENTRY = LORA_PART + LORA_PARTS * LORA_PART_SIZE
LORA_MATRICES, LORA_MAX_ADAPTERS = 4, 64
CONSTANTS |= {"LORA_LANE_ADAPTERS": LORA_LANE_ADAPTERS, "LORA_LANE_SCALES": LORA_LANE_SCALES, "LORA_WEIGHTS": LORA_WEIGHTS}
CONSTANTS |= {"LORA_A": LORA_A, "LORA_TYPE": LORA_TYPE, "LORA_RANK": LORA_RANK, "LORA_PART": LORA_PART, "LORA_ENTRY": LORA_ENTRY}
CONSTANTS |= {"LORA_PART_B": LORA_PART_B, "LORA_PART_ROWS": LORA_PART_ROWS, "LORA_PART_RANK": LORA_PART_RANK}
CONSTANTS |= {"LORA_PART_SCALE": LORA_PART_SCALE, "LORA_PART_SIZE": LORA_PART_SIZE, "LORA_PARTS": LORA_PARTS}
CONSTANTS |= {"LORA_MATRICES": LORA_MATRICES, "LORA_MAX_ADAPTERS": LORA_MAX_ADAPTERS}


class Isa(enum.IntEnum):
    """The rung of the instruction-set ladder a build was compiled for (tq_isa; build.py's RUNGS give
    each one's flags): a higher id of an architecture runs what a lower one does. ARM's ladder
    starts at 16."""

    GENERIC = 0
    AVX2 = 1
    AVX2_VNNI = 2  # AVX2 with the 256-bit VNNI dot product (AVX-VNNI, or AVX512-VNNI with VL)
    AVX512 = 3  # AVX-512 F, BW and VL
    AVX512_VNNI = 4
    NEON = 16  # every aarch64 core
    NEON_DOTPROD = 17  # NEON with ARMv8.2's dot product (sdot)
    NEON_I8MM = 18  # those with ARMv8.6's int8 matrix multiply (smmla)


class StepOutput(enum.IntEnum):
    """What tq_forward writes for each pick: the head's logits, or the final norm's output (embeddings)."""

    LOGITS = 0
    HIDDEN = 1


class AttendFlag(enum.IntFlag):
    """Which of the qkv bias and the q/k norm weights tq_attend's `extras` hold, in that order."""

    BIAS = 1
    QK_NORM = 2
    NO_ROPE = 4  # q and k are not rotated (SmolLM3's every fourth layer)
    LOCAL_ROPE = 8  # rotated by the model's second frequencies (Gemma 3's sliding-window layers)
    SINKS = 16  # extras end with a logit a query head (gpt-oss's attention sinks)
    QK_NORM_WHOLE = 32  # the q/k norms over all of q and all of k, not a head at a time (OLMoE)
    LATENT = 64  # no value heads, a key row its own value (multi-head latent attention, mla.c)
    KEYS_AHEAD = 128  # a step's lanes say the last key each attends (Gemma 3's image positions see the whole image)
    ROPE_POSITIONS = 256  # a step's lanes carry three rows of positions RoPE turns by (M-RoPE: Qwen2-VL's images)


class LayerForm(enum.IntFlag):
    """How a layer's sublayers join the residual stream (tq_layer_shape.form): Gemma 3's norms on each
    sublayer's output before it is added and its gelu(gate) * up feed-forward; gpt-oss's biases on the
    output product, the router and every expert's products, and its clamped SwiGLU (tq.h says how)."""

    POST_NORMS = 1
    GEGLU = 2
    BIASES = 4
    SWIGLU_CLAMPED = 8
    LATENT = 16  # the attention is multi-head latent attention (mla.c), Latent's sizes
    RECURRENT = 32  # Gated DeltaNet in place of attention (gated_delta.c), Recurrent's sizes
    GATED_ATTENTION = 64  # the attention's output times sigmoid of a gate q's rows carry (Qwen3.5)
    UNNORMED_INPUTS = 128  # the sublayers read the residual stream as it is: post-norms only (OLMo 2)


class ExpertsFlag(enum.IntFlag):
    """How a mixture of experts weighs the experts a token chose."""

    NORM_WEIGHTS = 1  # divided by their sum (Qwen3-MoE's norm_topk_prob)
    SIGMOID = 2  # the router's probabilities by sigmoid, not softmax (GLM-4.5)
    SELECTION_BIAS = 4  # chosen by probs + LayerEntry.SELECTION_BIAS, weighted by probs
    SHARED_UNGATED = 8  # the shared expert's output added as it is (LayerEntry.SHARED_GATE unread)


class KvType(enum.IntEnum):
    """How the KV cache's rows hold their values (tq_attention.kv_type): float16, or GGUF's Q8_0 blocks."""

    F16 = 0
    Q8_0 = 1


Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34  # a Q8_0 row's values, and bytes (a float16 scale, 32 int8), per block


class LaneRows(enum.IntEnum):
    """Where a step's lanes keep a recurrent layer's state (tq_recurrent.lane_rows): each in its slot's
    row; in a row given per lane, the first of a sequence taking its slot's state (drafted tokens
    being verified); or in a row given per lane that already holds the state it goes on from (a
    draft model's one-token steps, each after the last)."""

    SLOTS = 0
    GIVEN = 1
    RESUME = 2


class ModelEntry(enum.IntEnum):
    """tq_forward's model table: the model's tensors, then each layer's LayerEntry ones from LAYERS."""

    EMBED = 0
    NORM = 1
    HEAD = 2
    INV_FREQ = 3
    INV_FREQ_LOCAL = 4  # LOCAL_ROPE layers' frequencies, or 0
    BLOCK_TABLES = 5  # a paged cache's block tables (int32, rows x table_width), or 0
    LORA = 6  # a LoRA table (LORA_* below), or 0
    ROPE_SECTIONS = 7  # M-RoPE: the row of positions each rotary pair turns by (int32), or 0
    LAYERS = 8


class LayerEntry(enum.IntEnum):
    """A layer's tensors in the model table; the first LAYER_MATRICES are its matrices (LayerShape.types'
    order). A mixture of experts' layer has a ROUTER, its GATE_UP, UP and DOWN are every expert's gate,
    up and down matrices, and EXPERT_TOKENS counts the lanes each expert took; a dense layer's are 0.
    A shared expert (Qwen2-MoE) has its SHARED_GATE_UP (gate over up) and SHARED_DOWN matrices and its
    SHARED_GATE (D floats); a layer without one has 0 there."""

    QKV = 0
    O = 1  # noqa: E741 (tq.h's LAYER_O)
    GATE_UP = 2
    DOWN = 3
    ROUTER = 4
    UP = 5
    SHARED_GATE_UP = 6
    SHARED_DOWN = 7
    Q_B = 8  # LayerForm.LATENT's q_b (0 without a q_a), every head's k_b and every head's v_b, or 0
    K_B = 9
    V_B = 10
    ATTN_NORM = 11
    FFN_NORM = 12
    CACHE = 13
    EXTRAS = 14
    EXPERT_TOKENS = 15
    POST_NORMS = 16  # LayerForm.POST_NORMS' two norm weights (D floats each), or 0
    BIASES = 17  # LayerForm.BIASES' biases (tq.h's order), or 0
    SHARED_GATE = 18  # a shared expert's gate (D floats), or 0
    SELECTION_BIAS = 19  # the experts' selection bias (count floats) with ExpertsFlag.SELECTION_BIAS, or 0


def in_table_order(model: dict[ModelEntry, object], layers: list[dict[LayerEntry, object]]) -> list:
    """tq_forward's model table from the model's entries and each layer's, every one of them given."""
    assert set(model) == set(ModelEntry) - {ModelEntry.LAYERS} and all(set(layer) == set(LayerEntry) for layer in layers)
    return [model[e] for e in sorted(model)] + [layer[e] for layer in layers for e in sorted(layer)]


class StackHeader(ctypes.Structure):
    """A stacked matrix's parts: their count, stored types and rows."""

    _fields_ = [
        ("parts", ctypes.c_int32),
        ("types", ctypes.c_int32 * MAX_PARTS),
        ("rows", ctypes.c_int32 * MAX_PARTS),
        ("unused", ctypes.c_int32),
    ]


class Product(ctypes.Structure):
    """A matrix (rows x cols, stored as `type`) against `tokens` rows of activations; eps for tq_norm_linear."""

    _fields_ = [
        ("type", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("cols", ctypes.c_int32),
        ("tokens", ctypes.c_int32),
        ("eps", ctypes.c_float),
    ]


class Attention(ctypes.Structure):
    """A layer's attention for `lanes` lanes over the KV cache (2, slots, kv_heads, positions, a row of head_dim values),
    or with block_positions > 0 over a pool of blocks (2, slots = blocks, kv_heads, block_positions, a row) that
    each lane's row of the block tables (rows, table_width) maps its positions to (tq.h says how)."""

    _fields_ = [
        ("lanes", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("slots", ctypes.c_int32),
        ("positions", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("flags", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),  # on q . k: 1 / sqrt(head_dim)
        ("rotary_dim", ctypes.c_int32),  # RoPE turns a head's first rotary_dim values; the rest pass
        ("rope_scale", ctypes.c_float),  # on RoPE's cos and sin: YaRN's or LongRoPE's attention factor
        ("kv_type", ctypes.c_int32),  # KvType: how the cache's rows hold their values
        ("window", ctypes.c_int32),  # a query attends its last `window` positions (0: all); row = position % positions
        ("block_positions", ctypes.c_int32),  # a paged cache's positions a block (0: not paged); window 0 then
        ("table_width", ctypes.c_int32),  # a paged cache's blocks a row of the block tables
    ]


class Experts(ctypes.Structure):
    """A mixture of experts: `count` a layer, `used` a token, each expert's feed-forward width; ExpertsFlag;
    a shared expert's feed-forward width (0: none); a scale on the chosen experts' weights (0 or 1: none)."""

    _fields_ = [("count", ctypes.c_int32), ("used", ctypes.c_int32), ("ffn_dim", ctypes.c_int32), ("flags", ctypes.c_int32)]
    _fields_ += [("shared_ffn_dim", ctypes.c_int32), ("weights_scale", ctypes.c_float)]


class Latent(ctypes.Structure):
    """A LayerForm.LATENT layer's sizes (tq.h's tq_latent): q's low rank (0: none), the latent's width,
    a query head's values without and with RoPE, a head's output before W_o."""

    _fields_ = [(name, ctypes.c_int32) for name in ("q_lora", "kv_lora", "nope", "rope", "v_dim")]


class Recurrent(ctypes.Structure):
    """A LayerForm.RECURRENT layer's sizes (tq.h's tq_recurrent): the conv's kernel, a head's state (its
    keys' and values' size), the key heads and the value heads; `lane_rows`, a step's: a LaneRows."""

    _fields_ = [(name, ctypes.c_int32) for name in ("conv_kernel", "state", "k_heads", "v_heads", "lane_rows")]


class LayerShape(ctypes.Structure):
    """A whole layer: its attention, the widths D and F, its matrices' stored types, its experts (count 0: dense)."""

    _fields_ = [
        ("attention", Attention),
        ("dim", ctypes.c_int32),
        ("ffn_dim", ctypes.c_int32),
        ("types", ctypes.c_int32 * LAYER_MATRICES),
        ("experts", Experts),
        ("form", ctypes.c_int32),  # LayerForm
        ("latent", Latent),
        ("recurrent", Recurrent),
    ]


class Step(ctypes.Structure):
    """A whole step of attention.lanes lanes and `picks` rows of logits (each layer's types apart)."""

    _fields_ = [
        ("attention", Attention),
        ("dim", ctypes.c_int32),
        ("ffn_dim", ctypes.c_int32),
        ("layers", ctypes.c_int32),
        ("vocab", ctypes.c_int32),
        ("embed_type", ctypes.c_int32),
        ("head_type", ctypes.c_int32),
        ("picks", ctypes.c_int32),
        ("outputs", ctypes.c_int32),  # STEP_LOGITS or STEP_HIDDEN
        ("experts", Experts),  # of the layers with a router
        ("embed_scale", ctypes.c_float),  # on the embedding's rows (Gemma's sqrt(dim); 1: none)
        ("latent", Latent),  # of LayerForm.LATENT layers
        ("recurrent", Recurrent),  # of LayerForm.RECURRENT layers
        ("deepstack", ctypes.c_int32),  # an inputs row: (1 + deepstack) x dim, what the first layers add after the embedding
    ]


class AbiEntry(ctypes.Structure):
    """tq_abi_entry: a name and its value (a struct's size, a field's offset), a field's size and kind."""

    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64), ("size", ctypes.c_int32), ("kind", ctypes.c_char)]


STRUCTS = {"stack_header": StackHeader, "tq_product": Product, "tq_attention": Attention, "tq_experts": Experts}
STRUCTS |= {"tq_layer_shape": LayerShape, "tq_step": Step, "tq_latent": Latent, "tq_recurrent": Recurrent}
ENUMS = {
    "": BlockType,
    "ISA_": Isa,
    "STEP_": StepOutput,
    "ATTEND_": AttendFlag,
    "FORM_": LayerForm,
    "EXPERTS_": ExpertsFlag,
    "KV_": KvType,
    "LANE_ROWS_": LaneRows,
    "MODEL_": ModelEntry,
    "LAYER_": LayerEntry,
}  # tq.h's prefix for each
Description = dict[str, tuple[int, int, str]]  # name -> (value, size, kind), as tq_abi lists it


def expected() -> Description:
    """This mirror, described as tq_abi describes the library."""
    entries = {name: (value, 0, "") for name, value in CONSTANTS.items()}
    for prefix, members in ENUMS.items():
        entries.update({prefix + m.name: (int(m), 0, "") for m in members})
    entries["LAYER_ENTRIES"] = (len(LayerEntry), 0, "")
    for c_name, struct in STRUCTS.items():
        entries[c_name] = (ctypes.sizeof(struct), 0, "")
        for name, ctype in struct._fields_:
            entries[f"{c_name}.{name}"] = (getattr(struct, name).offset, ctypes.sizeof(ctype), _kind(ctype))
    return entries


def described(library: ctypes.CDLL) -> Description:
    """What a built library says of its interface (tq_abi)."""
    table = ctypes.POINTER(AbiEntry)()
    count = library.tq_abi(ctypes.byref(table))
    return {e.name.decode(): (e.value, e.size, e.kind.decode().strip("\0")) for e in (table[i] for i in range(count))}


def mismatches(library: ctypes.CDLL) -> list[str]:
    """Every name whose description differs between tq.h and this mirror, or that one side lacks."""
    ours, theirs = expected(), described(library)
    return [
        f"{name}: C {theirs.get(name)}, Python {ours.get(name)}"
        for name in sorted(ours.keys() | theirs.keys())
        if ours.get(name) != theirs.get(name)
    ]


def _kind(ctype) -> str:
    element = ctype._type_ if issubclass(ctype, ctypes.Array) else ctype
    if issubclass(element, ctypes.Structure):
        return "s"
    return {ctypes.c_int32: "i", ctypes.c_float: "f"}.get(element, "?")
