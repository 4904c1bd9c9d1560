"""A llama-family transformer on tinygrad, its layers composed from the config (archs/ says what each
architecture's config holds), with a KV cache of many slots.

Contract: `Transformer` holds the model (embedding, `TransformerBlock`s with their KV caches, final
norm, head) and its forward passes, one per way of feeding it: `forward_on_kernels` (lanes of any
slot and position, on the CPU kernels), `forward_prefill` and `forward_decode` (tinygrad's path: a
prefill piece's slot and start as bound symbolic variables, a decode step's lanes' as device tensors). It runs nothing by itself: how a step runs (one
call into the kernels, a jit of them, or a jit of tinygrad's kernels) is a step strategy's, chosen
once at load (`webapp.engine.model.steps.steps_for`). Positions and slots enter the steps as values,
never as shapes, so sequences joining and leaving never trigger a recompile, and each step writes
only the cache rows it produces.

On the CPU device, with the kernels in kernels/ loaded and every matrix in blocks they read, a step
is one direct call into them (`QuantizedCPU.step`, `tq_forward`): the embedding, then per layer norm
+ qkv product, attention (bias, q/k norms, RoPE, the cache write and the softmax), output product +
residual, norm + gate/up product, SwiGLU + down product + residual, then the final norm and the head.
Where some matrix's type has no kernel, a layer is one kernel (`tq_layer`) or, with such a matrix,
five around tinygrad's float16 product. Every other device runs the whole layer on tinygrad's
kernels, float16 weights, with tinygrad's attention over the float16 KV cache. Activations stay
float32 on CPU, which has no float16 arithmetic.

Sliding-window layers (gemma3's five of six) attend their last `window` positions, rotated by the
local layers' own RoPE frequencies (`inv_freq_local`) where the file has them; on the CPU kernels
their caches are rings (kv_types.cache_positions), and `ring_rows` says which cached prefixes a ring still
serves (the engine's kv_cache.RingRows). tinygrad's path masks a whole context instead.
"""

from __future__ import annotations

import logging

import numpy as np

# tinygrad reads HCQ2 at import: webapp.engine.model.tinygrad_setup.prepare_tinygrad() runs before this.
from tinygrad import Device, Tensor, UOp, dtypes

from webapp.engine.device.capabilities import device_capabilities
from webapp.engine.kernels.block_weight import BLOCK_FORMATS
from webapp.engine.kernels.cpu import QuantizedCPU
from webapp.engine.kernels.ggml_types import KERNEL_ONLY_TYPES
from webapp.engine.model.block import TransformerBlock
from webapp.engine.model.config import ModelConfig, check_tensors
from webapp.engine.model.device_blocks import DEVICE_BLOCK_TYPES
from webapp.engine.model.gated_delta import ONLY_ON_KERNELS
from webapp.engine.model.gguf import read_gguf
from webapp.engine.model.kv_types import KV_TYPES, STEP_WRITES_AT_LEAST, KvPool, KvRows, kv_type_named
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.memory import auto_context, pool_plan
from webapp.engine.model.memory import plan as memory_plan
from webapp.engine.model.ops import rms_norm, rotation
from webapp.engine.model.rope import RopeUnsupported, inverse_frequencies
from webapp.engine.model.steps.one_call import OneCallSteps
from webapp.engine.model.weights import WeightSource

log = logging.getLogger(__name__)

# GGUF general.file_type values of unquantized files: all F32, mostly F16, mostly BF16. A quantized
# file's output head on tinygrad's kernels is stored as int8 with a scale per vocabulary row (see
# weights.FloatHead); unquantized files keep an exact float16 head.
FLOAT_FILE_TYPES = (0, 1, 32)


class Transformer:
    def __init__(
        self,
        config: ModelConfig,
        weights: WeightSource,
        slots: int,
        context: int,
        max_chunk: int,
        inv_freq: np.ndarray,
        act_dtype=dtypes.float32,
        int8_head: bool = False,
        kv_type: KvRows = KV_TYPES["f16"],
        inv_freq_local: np.ndarray | None = None,
        pool: KvPool | None = None,
    ):
        """`inv_freq` (head_dim / 2,) float32 are RoPE's inverse frequencies, as the file asks (rope.py),
        `inv_freq_local` the local layers' where they differ; `kv_type` the KV cache's rows (kv_types.py);
        `pool` a paged cache's size, its sequences then the slots (None: slots of the whole context)."""
        self.config, self.slots, self.context, self.act_dtype, self.kv_type = config, slots, context, act_dtype, kv_type
        self.pool = pool
        # the block table the kernels read each step, rewritten in place by serving/paged_slots.py: a
        # row a sequence and one for the warm-up's scratch, every entry the stray-write block at first
        self.block_table = None if pool is None else np.full((pool.rows + 1, pool.table_width), pool.blocks, np.int32)
        self.embed = weights.embedding()  # token ids -> (..., D)
        self.output_norm = weights.vector("output_norm.weight")
        self.head = weights.head(config.vocab_size, int8_head)  # (B, D) -> (B, vocab)
        # a padded prefill chunk may write up to max_chunk - 1 junk positions past the context
        self.step_writes = max(max_chunk, STEP_WRITES_AT_LEAST)  # as load_model's memory plan counts them
        # one layer class: its mixer, feed-forward and norm policy are its components, chosen from the config
        self.blocks = [
            TransformerBlock(config, weights, i, slots, context + max_chunk, kv_type, self.step_writes, pool)
            for i in range(config.n_layers)
        ]
        self.uses_cpu_kernels = weights.uses_kernels  # some matrix runs on the quantized CPU kernels
        # every layer runs on the CPU kernels, or none does (attention always, each product where its
        # type has one)
        self.kernels = self.blocks[0].kernels
        # a symbolic-length arange compiles to a reduce over length x length: slice a stored one instead
        self.key_positions = Tensor.arange(context + max_chunk).contiguous()
        # stored, not rebuilt from a Python list inside the jitted step: tinygrad replays such a constant
        # as a host copy that waits for the device, which was 60 full stalls per decode step
        self.inv_freq = Tensor(np.ascontiguousarray(inv_freq, dtype=np.float32)).contiguous()
        self.inv_freq_local = (
            None if inv_freq_local is None else Tensor(np.ascontiguousarray(inv_freq_local, dtype=np.float32)).contiguous()
        )
        local = [] if self.inv_freq_local is None else [self.inv_freq_local]
        sections = config.rope_sections  # M-RoPE: an image's rows turn by their time, row and column
        self.rope_sections = Tensor(np.array(sections, dtype=np.int32)).contiguous().realize() if sections else None
        # the same as one-hot rows (3, half) for tinygrad's rotation: each pair's row of positions
        one_hot = (np.arange(3)[:, None] == np.array(sections)[None, :]).astype(np.float32) if sections else None
        self.section_rows = Tensor(one_hot).contiguous().realize() if sections else None
        # a realize per layer: 150 separate ones took ~40% of loading, and one for all of them spent
        # 20 s in tinygrad's lowering of one long command list
        Tensor.realize(*self.embed.tensors(), self.output_norm, *self.head.tensors(), self.key_positions, self.inv_freq, *local)
        for block in self.blocks:
            Tensor.realize(*block.tensors())

    @property
    def ring_rows(self) -> tuple[int, int] | None:
        """What the rings keep, as kv_cache.RingRows(keep, whole) takes it: a prefix ending `keep` or
        fewer positions before a slot's furthest still has every ring's window, and a slot that never
        went past `whole` positions never wrapped a ring; None without rings."""
        rings = [(b.positions, b.window) for b in self.blocks if b.ring]
        if not rings:
            return None
        return min(r - w - self.step_writes + 1 for r, w in rings), min(r - self.step_writes for r, _ in rings)

    def _inv_freq_of(self, block: TransformerBlock) -> Tensor:
        return self.inv_freq_local if block.local_rope else self.inv_freq

    def _embedded(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        return x * self.config.embed_scale if self.config.scaled_embedding else x

    def routed_tokens(self) -> np.ndarray | None:
        """A mixture of experts': the lanes each layer sent each expert since load (layers, experts),
        where the kernels count them (routed.RoutedFeedForward.routed_tokens); None elsewhere."""
        counts = [block.routed_tokens() for i, block in enumerate(self.blocks) if self.config.routed(i)]
        return None if not counts or any(c is None for c in counts) else np.stack(counts)

    def _logits(self, x: Tensor) -> Tensor:
        """x (B, D) -> (B, vocab) float32 logits."""
        return self.head(rms_norm(x, self.output_norm, self.config.norm_eps).contiguous()).contiguous()

    def _hidden(self, x: Tensor) -> Tensor:
        """x (..., D) -> the final norm's output, float32: what the head reads, and embeddings pool."""
        return rms_norm(x, self.output_norm, self.config.norm_eps).float().realize()

    def _layers_on_kernels(self, tokens: Tensor, lanes: Tensor) -> Tensor:
        x = self._embedded(tokens)  # (B, D)
        for block in self.blocks:
            # realized layer by layer: the jit records each piece, and scheduling the whole step as
            # one graph cost time quadratic in its layers (tinygrad's store-hazard walk per store)
            x = block.on_kernels(x, lanes, self._inv_freq_of(block)).realize()
        return x

    def forward_on_kernels(self, tokens: Tensor, lanes: Tensor, picks: Tensor) -> Tensor:
        """A step on the CPU kernels, its B lanes a decode step's sequences or a prefill piece's tokens:
        tokens (B,), lanes (2B,) = each lane's slot, then its position, picks (R,) = the lanes whose
        logits are wanted (a decode step's every lane, a prefill piece's last real token). No symbolic
        variables, which tinygrad's replay would bind on every call. -> (R, vocab) logits."""
        return self._logits(self._layers_on_kernels(tokens, lanes)[picks]).realize()

    def hidden_on_kernels(self, tokens: Tensor, lanes: Tensor) -> Tensor:
        """forward_on_kernels' lanes, every one's final norm output -> (B, D) float32 (embeddings)."""
        return self._hidden(self._layers_on_kernels(tokens, lanes))

    def _layers_prefill(
        self, tokens: Tensor, slot: UOp, start: UOp, rows: tuple[Tensor, Tensor, Tensor] | None = None, turned: Tensor | None = None
    ) -> Tensor:
        """`rows`: (inputs (1, T, D x (1 + deepstack)), given (1, T, 1), last keys (T,)): where `given`
        is 1, a row of inputs in place of the token's embedding (an image's; the first layers adding
        its deepstack parts after them), and each position attends keys up to its last key (past its
        own for an image attended both ways). `turned` (T, 3): M-RoPE's positions (None: the tokens')."""
        positions = Tensor.arange(tokens.shape[1]) + start  # (T,)
        keys = self.key_positions[0 : start + tokens.shape[1]]
        last = None if rows is None else rows[2].reshape(-1, 1)
        masks = self._masks(positions.reshape(-1, 1), keys.reshape(1, -1), 0, last)  # (1, T, S) each
        rotary = self._rotations(positions, turned)
        x = self._embedded(tokens)  # (1, T, D)
        dim = x.shape[-1]
        if rows is not None:
            x = (rows[1] > 0).where(rows[0][..., :dim].cast(x.dtype), x)
        for i, block in enumerate(self.blocks):
            x = block.prefill(x, slot, start, rotary[block.local_rope], masks[block.window])
            if rows is not None and i < self.config.deepstack_layers:  # Qwen3-VL: an image row's part for this layer
                x = x + (rows[1] * rows[0][..., (i + 1) * dim : (i + 2) * dim]).cast(x.dtype)
            x = x.realize()  # as in forward_on_kernels
        return x

    def _masks(self, queries: Tensor, keys: Tensor, lead: int, last: Tensor | None = None) -> dict[int, Tensor]:
        """The additive causal mask of query positions over key positions (or over keys up to each
        query's `last` one), by the layers' windows (0: none; a window's masks its keys before it too),
        as prefill's (1, T, S) takes them (lead 0: a leading axis added) and decode's (B, 1, S) (lead 1)."""
        masks = {}
        for window in {block.window for block in self.blocks}:
            masked = keys > (queries if last is None else last)
            if window:
                masked = masked | (keys <= queries - window)
            mask = masked.where(float("-inf"), 0.0)
            masks[window] = (mask if lead else mask.unsqueeze(0)).contiguous()
        return masks

    def _rotations(self, positions: Tensor, turned: Tensor | None = None) -> dict[bool, tuple[Tensor, Tensor]]:
        """RoPE's cos and sin at `positions` for the model's layers (False) and its local ones (True);
        with M-RoPE's `turned` (positions' shape and a last axis of three) at those instead."""
        factor = self.config.rope_attention_factor
        at, sections = (positions, None) if turned is None else (turned, self.section_rows)
        rotary = {False: rotation(at, self.inv_freq, factor, sections)}
        if self.inv_freq_local is not None:
            rotary[True] = rotation(at, self.inv_freq_local, factor, sections)
        return rotary

    def forward_prefill(self, tokens: Tensor, last: Tensor, slot: UOp, start: UOp, turned: Tensor | None = None) -> Tensor:
        """tokens (1, T) at positions start..start+T-1 of `slot`; last (1, T) one-hot picks the token
        whose logits are returned -> (1, vocab). `turned`: _layers_prefill's."""
        x = self._layers_prefill(tokens, slot, start, turned=turned)
        return self._logits(last @ x[0]).realize()  # (1, T) one-hot @ (T, D) -> (1, vocab)

    def forward_prefill_rows(
        self,
        tokens: Tensor,
        last: Tensor,
        inputs: Tensor,
        given: Tensor,
        last_keys: Tensor,
        slot: UOp,
        start: UOp,
        turned: Tensor | None = None,
    ) -> Tensor:
        """forward_prefill with rows in place of some tokens' embeddings (_layers_prefill's `rows`)."""
        x = self._layers_prefill(tokens, slot, start, (inputs, given, last_keys), turned)
        return self._logits(last @ x[0]).realize()

    def hidden_prefill(self, tokens: Tensor, slot: UOp, start: UOp) -> Tensor:
        """forward_prefill's tokens, every one's final norm output -> (T, D) float32 (embeddings)."""
        return self._hidden(self._layers_prefill(tokens, slot, start)[0])

    def forward_decode(self, tokens: Tensor, pos: Tensor, slots: Tensor, length: UOp, turned: Tensor | None = None) -> Tensor:
        """tokens (B,), one per lane; pos (B,) their positions, slots (B,) their slots (int32 device
        tensors: a step's kernels the same at every width, lane_rows.py); keys read up to `length`;
        `turned` (B, 3): M-RoPE's positions (None: pos) -> (B, vocab)."""
        width = tokens.shape[0]
        keys = self.key_positions[0:length].reshape(1, 1, -1)
        masks = self._masks(pos.reshape(-1, 1, 1), keys, 1)  # (B, 1, length) each
        rotary = self._rotations(pos.reshape(-1, 1, 1), None if turned is None else turned.reshape(-1, 1, 1, 3))  # (B, 1, 1, half)
        x = self._embedded(tokens).reshape(width, 1, -1)  # (B, 1, D)
        for block in self.blocks:
            x = block.decode(x, slots, pos, rotary[block.local_rope], length, masks[block.window]).realize()  # as in forward_on_kernels
        return self._logits(x[:, 0, :]).realize()  # (B, vocab)

    def copy_prefix_rows(self, source: UOp, target: UOp, length: UOp) -> None:
        """Every layer's K/V of positions 0..length-1 from slot `source` into slot `target` (a ring's
        every row: it holds the positions before `length` where they are, whatever `length`; a
        recurrent layer's state, which is the source's whole sequence: kv_cache.RecurrentRows)."""
        for block in self.blocks:
            # staged through a buffer of its own: source and target rows live in one cache tensor
            end = block.positions if block.ring or block.recurrent else length
            rows = block.cache[:, source, :, 0:end, :].contiguous()
            block.cache[:, target, :, 0:end, :].assign(rows).realize()  # per layer, as in forward_prefill


def _rope_frequencies(kv: dict, table: dict, config: ModelConfig, context: int) -> np.ndarray:
    """RoPE's inverse frequencies for this file and a slot's `context`, Llama 3's rope_freqs.weight or
    LongRoPE's short or long factors applied (rope.py)."""
    name = "rope_freqs.weight"
    if name not in table and "rope_factors_long.weight" in table:
        original = kv.get(f"{config.arch}.rope.scaling.original_context_length", config.trained_context)
        name = "rope_factors_long.weight" if context > original else "rope_factors_short.weight"
        log.info(
            "rope: LongRoPE's %s factors (a slot's %d positions, the original context %s)",
            name.removeprefix("rope_factors_").removesuffix(".weight"),
            context,
            original,
        )
    factors = table.get(name)
    if factors is not None and (factors.ggml_type != 0 or factors.data is None):
        raise ModelLoadError(f"{name} is stored as GGML type {factors.ggml_type}; float32 expected")
    try:
        return inverse_frequencies(kv, config.arch, config.rotary_dim, None if factors is None else factors.data.view(np.float32)[0])
    except RopeUnsupported as e:
        raise ModelLoadError(str(e)) from e


def load_model(
    path: str,
    slots: int,
    context: int | None,
    max_chunk: int = 64,
    cpu_kernels: bool = True,
    kv_type: str = "f16",
    paging: tuple[int, tuple[str, int] | None] | None = None,
    cpu_isa: str = "auto",
) -> tuple[Transformer, dict]:
    """Read a GGUF file; returns the model and the file's metadata (the tokenizer needs it).
    `context` None sizes each slot from free memory (`memory.auto_context`); `cpu_kernels=False` keeps
    every matrix on tinygrad's float16 path, even where a kernel exists, and `cpu_isa` (`LLM_CPU_ISA`)
    names the rung of the ISA ladder the kernels are built for; `kv_type` names the KV
    cache's rows (`LLM_KV_TYPE`: "f16" or "q8_0", kv_types.py). `paging` = (sequences, LLM_KV_BUDGET)
    asks for a paged cache (`memory.pool_plan`; `context` None: the trained one) where the CPU kernels
    run the whole model in one call and no layer has a sliding window; elsewhere `slots` slots."""
    rows = kv_type_named(kv_type)
    try:
        kv, table = read_gguf(path)
    except FileNotFoundError:
        raise
    except Exception as e:  # a truncated or foreign file fails deep inside the parser
        raise ModelLoadError(f"cannot parse {path} as GGUF: {e}") from e
    config = ModelConfig.from_gguf(kv, table)
    check_tensors(config, table)
    if why := rows.check(config.head_dim):
        raise ModelLoadError(why)
    # float32 where the device has no float16 arithmetic, reading float16 or block weights all the same
    act_dtype = dtypes.float16 if device_capabilities().float16_compute else dtypes.float32
    kernels = QuantizedCPU.load(cpu_isa) if cpu_kernels else None
    kept = set(BLOCK_FORMATS) if kernels is not None else set(DEVICE_BLOCK_TYPES)
    for name, raw in table.items():  # a kernel-only type that would take tinygrad's path: no kernel, or rows not in whole blocks
        if raw.ggml_type in KERNEL_ONLY_TYPES and (raw.ggml_type not in kept or raw.data is None):
            raise ModelLoadError(
                f"tensor {name!r} is stored as {KERNEL_ONLY_TYPES[raw.ggml_type]}, which only the CPU kernels read "
                "(on the CPU device, with LLM_CPU_KERNELS on)"
            )
    # the most positions a step writes to a slot, where the kernels keep sliding-window layers' rings
    step_writes = max(max_chunk, STEP_WRITES_AT_LEAST) if kernels is not None else None
    pageable = paging is not None and kernels is not None and not any(config.window(i) for i in range(config.n_layers))
    pageable = pageable and config.recurrent is None  # a recurrent state has no blocks
    if config.recurrent and kernels is None:
        raise ModelLoadError(ONLY_ON_KERNELS)
    asked = (slots, context)  # for slots instead, should the pool not fit the model (below)
    if pageable:
        memory, why = pool_plan(config, table, kept, rows, paging[0], context, paging[1])
        slots, context = paging[0], memory.positions
        log.info("KV cache: paged, %d blocks (%s); context %d positions (LLM_MAX_CONTEXT sets it)", memory.pool.blocks, why, context)
    else:
        if context is None:
            context, why = auto_context(config, table, slots, kept, Device.DEFAULT, rows, step_writes)
            log.info("context: %d positions a slot (%s; LLM_MAX_CONTEXT sets it)", context, why)
        context = min(context, config.trained_context)
        memory = memory_plan(config, table, slots, context + max_chunk, kept, rows, step_writes)
    memory.check()  # before any weight is read
    log.info("%s", memory.describe())
    weights = WeightSource(path, table, config.rope_rows(), act_dtype, kernels)
    int8_head = kv.get("general.file_type") not in (None, *FLOAT_FILE_TYPES)
    inv_freq = _rope_frequencies(kv, table, config, context)
    # the local layers' own base, unscaled (llama.cpp's rope_freq_base_train_swa and its scale 1)
    local = {f"{config.arch}.rope.freq_base": config.local_rope_theta}
    inv_freq_local = inverse_frequencies(local, config.arch, config.rotary_dim) if config.local_rope_theta else None
    model = Transformer(
        config,
        weights,
        slots,
        context,
        max_chunk,
        inv_freq,
        act_dtype=act_dtype,
        int8_head=int8_head,
        kv_type=rows,
        inv_freq_local=inv_freq_local,
        pool=memory.pool,
    )
    if config.recurrent and not OneCallSteps.fits(model):
        raise ModelLoadError(f"{ONLY_ON_KERNELS}; some matrix of {path} has no kernel")
    if memory.pool is not None and not OneCallSteps.fits(model):  # a block only the kernels' whole-model call pages
        log.warning("KV cache: some product of %s runs outside the CPU kernels' whole-model step; slots instead of a pool", path)
        del model
        return load_model(path, *asked, max_chunk, cpu_kernels, kv_type, cpu_isa=cpu_isa)
    log.info(
        "loaded %s: %s, %d layers, dim %d, %d "
        + ("sequences" if memory.pool else "slots")
        + " x %d positions of %s keys and values; weights: %s",
        path,
        config.arch,
        config.n_layers,
        config.dim,
        slots,
        context,
        rows.name,
        weights.describe(),
    )
    return model, kv
