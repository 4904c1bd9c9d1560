"""What the CPU kernels read of a layer and of a whole model, gathered once at load.

Contract: `LayerMatrices` are a layer's products in blocks, `LayerTensors` everything its kernel
(tq_layer) reads besides its input, `WholeModel` the table of every tensor's address that a whole
step (tq_forward) reads, built by `QuantizedCPU.whole_model`. Their field orders are tq.h's.
`layer_attention` and `page_attention` make the attention shape (abi.Attention) that a layer's kernel
or a whole step reads, refusing one the kernels cannot read.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
from tinygrad import Tensor, dtypes

from webapp.engine.kernels import abi
from webapp.engine.kernels.block_weight import BlockWeight


def cache_layout(cache: Tensor, kv_type: abi.KvType) -> tuple[int, int, int, int]:
    """A cache tensor's slots, kv heads, positions and head size, as the kernels take them, its rows of
    `kv_type`; ValueError where the tensor cannot hold such rows (the kernels trust every size)."""
    _, slots, kv_heads, positions, width = cache.shape
    if kv_type == abi.KvType.Q8_0 and cache.dtype == dtypes.uint8 and width % abi.Q8_BLOCK_BYTES == 0:
        return slots, kv_heads, positions, width // abi.Q8_BLOCK_BYTES * abi.Q8_BLOCK
    if kv_type == abi.KvType.F16 and cache.dtype == dtypes.float16:
        return slots, kv_heads, positions, width
    raise ValueError(f"a {cache.dtype} cache of rows {width} wide does not hold {kv_type.name} rows")


@dataclass(frozen=True)
class LayerMatrices:
    """A layer's products in blocks, for `QuantizedCPU.layer`: a dense layer's four, or with a router a
    mixture of experts' (gate_up, up and down then hold every expert's gate, up and down matrices), and
    a shared expert's gate over up and down where it has one."""

    qkv: BlockWeight
    o: BlockWeight
    gate_up: BlockWeight
    down: BlockWeight
    router: BlockWeight | None = None
    up: BlockWeight | None = None
    shared_gate_up: BlockWeight | None = None
    shared_down: BlockWeight | None = None
    q_b: BlockWeight | None = None  # multi-head latent attention's (LayerForm.LATENT): q_b, where q has a q_a...
    k_b: BlockWeight | None = None  # ...and every head's k_b and v_b, head after head (QuantizedCPU.expert_weight)
    v_b: BlockWeight | None = None

    @property
    def in_order(self) -> tuple[BlockWeight | None, ...]:
        """The matrices as the kernels take them (abi.LayerEntry's first LAYER_MATRICES)."""
        routed = (self.router, self.up, self.shared_gate_up, self.shared_down)
        return (self.qkv, self.o, self.gate_up, self.down, *routed, self.q_b, self.k_b, self.v_b)

    @property
    def types(self):
        """Their stored types, as LayerShape.types (0 where a dense layer has none)."""
        return (ctypes.c_int32 * abi.LAYER_MATRICES)(*(0 if w is None else w.ggml_type for w in self.in_order))


@dataclass(frozen=True)
class LayerTensors:
    """What a layer's kernel reads besides its input: its matrices, norms, KV cache and attention's
    extras (as `QuantizedCPU.attend` takes them: heads and flags too), and a mixture of experts' sizes
    and token counts (int64, one an expert, which every step adds to)."""

    matrices: LayerMatrices
    attn_norm: Tensor | None  # None: LayerForm.UNNORMED_INPUTS
    ffn_norm: Tensor | None
    cache: Tensor
    extras: Tensor
    heads: int
    flags: int
    score_scale: float  # on q . k (ModelConfig.score_scale)
    rotary: int  # RoPE turns each head's first `rotary` values (ModelConfig.rotary_dim)...
    rope_scale: float  # ...its cos and sin times this (ModelConfig.rope_attention_factor)
    experts: abi.Experts = field(default_factory=abi.Experts)  # count 0: a dense layer
    expert_tokens: Tensor | None = None
    window: int = 0  # a sliding-window layer's positions a query sees (0: all)
    form: int = 0  # abi.LayerForm
    post_norms: Tensor | None = None  # LayerForm.POST_NORMS' two weights, one after the other
    biases: Tensor | None = None  # LayerForm.BIASES': the output product's, then a mixture of experts'
    shared_gate: Tensor | None = None  # a shared expert's gate (float32, D), with experts.shared_ffn_dim
    selection_bias: Tensor | None = None  # the experts' selection bias (float32, count), with ExpertsFlag.SELECTION_BIAS
    latent: abi.Latent = field(default_factory=abi.Latent)  # LayerForm.LATENT's sizes
    recurrent: abi.Recurrent = field(default_factory=abi.Recurrent)  # LayerForm.RECURRENT's sizes
    kv_type: abi.KvType = abi.KvType.F16  # how `cache`'s rows hold their values

    @property
    def info(self) -> list[int]:
        """tq_forward's layer_info for this layer (abi.LAYER_INFO numbers). A paged cache's positions
        here are a block's, which tq_forward leaves unread: a paged step's layers take the step's."""
        positions = self.cache.shape[3]
        return [*self.matrices.types, self.flags, self.form, self.window, positions]

    @property
    def table_entries(self) -> dict[abi.LayerEntry, Tensor | None]:
        """This layer's tensors under their entries in tq_forward's model table (None: a null address)."""
        E, m = abi.LayerEntry, self.matrices
        matrices = {entry: None if w is None else w.raw for entry, w in zip(list(E)[: abi.LAYER_MATRICES], m.in_order, strict=True)}
        own = {E.ATTN_NORM: self.attn_norm, E.FFN_NORM: self.ffn_norm, E.CACHE: self.cache, E.EXTRAS: self.extras}
        optional = {E.EXPERT_TOKENS: self.expert_tokens, E.POST_NORMS: self.post_norms, E.BIASES: self.biases}
        return matrices | own | optional | {E.SHARED_GATE: self.shared_gate, E.SELECTION_BIAS: self.selection_bias}


@dataclass(frozen=True, eq=False)
class WholeModel:
    """A model for `QuantizedCPU.step`: the table of its tensors' addresses, what tq_forward's step says
    that no step changes, and the tensors themselves, which it keeps alive."""

    table: np.ndarray  # uint64, in abi.ModelEntry order, then abi.LayerEntry's for each layer
    dims: abi.Step  # every field but attention.lanes, picks and outputs
    layer_info: np.ndarray  # int32 (layers, abi.LAYER_INFO): LayerTensors.info of each layer
    tensors: tuple[Tensor, ...]
    block_tables: np.ndarray | None = None  # a paged cache's (rows, table_width) int32, read by address each step
    _steps: dict = field(default_factory=dict, compare=False)

    def step(
        self,
        lanes: int,
        picks: int,
        outputs: int = 0,
        lane_rows: abi.LaneRows = abi.LaneRows.SLOTS,
        keys_ahead: bool = False,
        rope_positions: bool = False,
    ) -> abi.Step:
        """tq_forward's step for `lanes` lanes and `picks` rows of `outputs` (abi.StepOutput); `lane_rows`:
        where the lanes keep their recurrent state (abi.LaneRows); `keys_ahead`: the lanes say the
        last key each attends (abi.AttendFlag.KEYS_AHEAD); `rope_positions`: they carry the
        positions RoPE turns them by (abi.AttendFlag.ROPE_POSITIONS)."""
        key = (lanes, picks, outputs, lane_rows, keys_ahead, rope_positions)
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = abi.Step.from_buffer_copy(self.dims)
            step.attention.lanes, step.picks, step.outputs = lanes, picks, outputs
            flags = (abi.AttendFlag.KEYS_AHEAD if keys_ahead else 0) | (abi.AttendFlag.ROPE_POSITIONS if rope_positions else 0)
            step.attention.flags = flags
            step.recurrent.lane_rows = int(lane_rows)
        return step


def layer_attention(layer: LayerTensors, lanes: int, eps: float) -> abi.Attention:
    """The attention shape of a layer's kernel (tq_layer), or of every layer of a whole step (tq_forward)."""
    slots, kv_heads, positions, head_dim = cache_layout(layer.cache, layer.kv_type)
    flags, scale = layer.flags, layer.score_scale
    return abi.Attention(
        lanes,
        layer.heads,
        kv_heads,
        slots,
        positions,
        head_dim,
        flags,
        eps,
        scale,
        layer.rotary,
        layer.rope_scale,
        layer.kv_type,
        layer.window,
    )


def page_attention(attention: abi.Attention, table_shape: tuple[int, ...], block_positions: int, positions: int | None = None) -> None:
    """Make `attention` (its slots the pool's blocks) paged over block tables of `table_shape`, or
    ValueError where the kernels cannot read it so: they trust the shape, and a block of another size
    would run an item's keys past its runs."""
    bp = block_positions
    if not (abi.MIN_BLOCK_POSITIONS <= bp <= abi.KEY_CHUNK and bp & (bp - 1) == 0):
        raise ValueError(f"a block holds a power of two of {abi.MIN_BLOCK_POSITIONS} to {abi.KEY_CHUNK} positions, not {bp}")
    if attention.positions != bp or attention.window:
        raise ValueError(
            f"a paged cache is blocks of {bp} positions without a window, not {attention.positions} (window {attention.window})"
        )
    if len(table_shape) != 2:
        raise ValueError(f"block tables are (rows, table_width), not {table_shape}")
    width = table_shape[1]
    positions = width * bp if positions is None else positions
    if not 0 < positions <= width * bp:
        raise ValueError(f"{positions} positions do not fit a table row of {width} blocks of {bp}")
    attention.block_positions, attention.table_width, attention.positions = bp, width, positions
