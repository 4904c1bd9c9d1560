"""A layer's token mixer, a component the layer holds (block.py): attention over a KV cache of many
slots, windowed where `ModelConfig.window(layer)` says. Latent attention (latent_attention.py) and a
hybrid's gated attention and Gated DeltaNet recurrence (gated_delta.py) are the other mixers.

Contract: a mixer `Mixer(config, weights, layer, kernels)` holds its products (`qkv`, the output
product `attn_output` and its bias), takes the attention-normed input n to what the output product
reads: (B, T, H*Hd) on tinygrad's path (`prefill`, `decode`), (B, H*Hd) on the CPU kernels
(`on_kernels`, the norm its first kernel's); its tensors are `matrix_tensors` and `tensors`. For
the kernels' one-kernel layer it gives LayerMatrices' attention fields (`blocks`, None where some matrix is outside blocks), tq_attend's
`extras` and `flags`, its `form` bits and `kernel_extras`, and the float32 biases it adds (`biases`).
`make_cache(slots, context, step_writes, pool, kv_type)` makes its cache: (k|v, slots + 1, kv_heads,
context, a row of head_dim values in `kv_type`'s rows: float16 or Q8_0, kv_types.py); the extra last
slot is scratch for padding lanes; with a `pool` (kv_types.KvPool, on the CPU kernels' whole-model
steps) the pool's blocks instead, (k|v, blocks + 1, kv_heads, block_positions, a row), the last block
taking stray writes. A sliding-window layer on the CPU kernels keeps a ring of
`kv_types.ring_positions(window, step_writes)` positions instead of the context: position p in row
p % ring, `step_writes` being the most positions one step writes to a slot.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor, UOp

from webapp.engine.device.capabilities import device_capabilities
from webapp.engine.kernels.abi import AttendFlag
from webapp.engine.model.config import ModelConfig
from webapp.engine.model.kv_types import KvPool, KvRows, cache_positions
from webapp.engine.model.lane_rows import lane_rows, write_lane_rows
from webapp.engine.model.ops import attended, rms_norm, rope
from webapp.engine.model.products import after_norm, float32_buffer, float32_values
from webapp.engine.model.weights import BlockLinear, WeightSource


def zero_pages(shape: tuple[int, ...], dtype) -> Tensor:
    """A zeroed cache tensor. The CPU allocator maps fresh zero pages: no kernel writes the cache's zeros
    at load, and memory is only committed as positions fill."""
    if device_capabilities().zeroed_allocations:
        cache = Tensor.empty(*shape, dtype=dtype).realize()
        cache.uop.base.buffer.ensure_allocated()
        return cache
    return Tensor.zeros(*shape, dtype=dtype).contiguous()


class Attention:
    """Full attention (llama, qwen2, qwen3 and the rest), windowed in a sliding-window layer: q, k and v
    one product of the normed input, q/k norms, biases and sinks as the config has them."""

    recurrent = False  # a recurrent mixer's cache is a state a slot, not rows a position (gated_delta.py)
    form = 0

    def __init__(self, config: ModelConfig, weights: WeightSource, layer: int, kernels):
        self.c = config
        self.rotates = config.rotates(layer)
        self.window = config.window(layer)  # a query's positions back to itself included (0: all)
        self.local_rope = bool(self.window and config.local_rope_theta)  # rotated by the local layers' base
        p = f"blk.{layer}."
        stored = ("attn_q_norm.weight", "attn_k_norm.weight", "attn_sinks.weight", "attn_output.bias")
        self.w = {name: weights.vector(p + name) for name in stored if weights.has(p + name)}
        self._bias_values = {name: weights.vector_values(p + name) for name in ("attn_output.bias",) if config.output_bias}
        self.output_bias = self.w["attn_output.bias"] if config.output_bias else None
        self._load_products(weights, p)
        self.kernels = kernels
        self.qkv_bias = None  # added by tinygrad's product; on the kernels, by the attention kernel
        self.extras, self.flags = None, 0
        if kernels is None:
            self._load_tinygrad_attention(weights, p)
        else:
            self.extras, self.flags = self._kernel_attention(weights, p)

    def _load_products(self, weights: WeightSource, p: str) -> None:
        # one product for q, k and v: fewer, larger kernels run faster here
        self.qkv = weights.linear(*self.c.qkv_names(p))  # D -> H*Hd + 2*KvH*Hd
        self.attn_output = weights.linear(p + "attn_output.weight")  # H*Hd -> D

    def _load_tinygrad_attention(self, weights: WeightSource, p: str) -> None:
        """What tinygrad's path adds to the attention's products (q/k/v biases, which the kernels add)."""
        if self.c.qkv_bias:
            self.qkv_bias = Tensor.cat(*(weights.vector(p + f"attn_{n}.bias") for n in "qkv")).contiguous()

    def _kernel_attention(self, weights: WeightSource, p: str) -> tuple[Tensor, int]:
        """tq_attend's extras and flags: the qkv bias, then the q and k norm weights, then the sinks, as
        the model has them."""
        config = self.c
        names = [p + f"attn_{n}.bias" for n in "qkv"] if config.qkv_bias else []
        names += [p + "attn_q_norm.weight", p + "attn_k_norm.weight"] if config.qk_norm else []
        names += [p + "attn_sinks.weight"] if config.sinks else []
        flags = int(
            (AttendFlag.BIAS if config.qkv_bias else 0)
            | (AttendFlag.QK_NORM if config.qk_norm else 0)
            | (0 if self.rotates else AttendFlag.NO_ROPE)
            | (AttendFlag.LOCAL_ROPE if self.local_rope else 0)
            | (AttendFlag.SINKS if config.sinks else 0)
            | (AttendFlag.QK_NORM_WHOLE if config.qk_norm_whole else 0)
        )
        return float32_buffer(weights, names), flags

    @property
    def in_blocks(self) -> bool:
        """Every matrix of the mixer in blocks: the layer may run as one kernel."""
        return isinstance(self.qkv, BlockLinear) and isinstance(self.attn_output, BlockLinear)

    def blocks(self) -> dict | None:
        """LayerMatrices' attention fields when every one of its matrices is in blocks, else None."""
        return {"qkv": self.qkv.weight, "o": self.attn_output.weight} if self.in_blocks else None

    def kernel_extras(self) -> dict:
        return {}

    def biases(self) -> list[np.ndarray]:
        """The output product's float32 bias, as LayerForm.BIASES reads it first."""
        return float32_values(self._bias_values, ["attn_output.bias"] if self.c.output_bias else [])

    def drop_file_views(self) -> None:
        # views into the file's memory map: kept, they would keep every page of it read at load resident
        self._bias_values = {}

    def make_cache(self, slots: int, context: int, step_writes: int, pool: KvPool | None, kv_type: KvRows) -> None:
        """self.cache: (k|v, slot, kv_head, position, a row of head_dim values); config.cache_rows is 1
        where a key's row is also its value (multi-head latent attention). A ring where it is smaller
        than the context; tinygrad's path masks a whole context instead."""
        config, self.kv_type = self.c, kv_type
        self.positions = cache_positions(self.window, context, step_writes if self.kernels is not None else None)
        self.ring = self.positions < context
        row, kinds = kv_type.row_width(config.head_dim), config.cache_rows
        shape = (kinds, slots + 1, config.n_kv_heads, self.positions, row)
        if pool is not None:  # a paged cache (kv_types.KvPool): its blocks, and one more that takes stray writes
            shape = (kinds, pool.blocks + 1, config.n_kv_heads, pool.block_positions, row)
        self.cache = zero_pages(shape, kv_type.dtype)

    def matrix_tensors(self) -> list[Tensor]:
        """Its input and output products' tensors, which the layer lists before everything else."""
        return [*self.qkv.tensors(), *self.attn_output.tensors()]

    def tensors(self) -> list[Tensor]:
        """Every other tensor it holds, its cache first."""
        optional = [t for t in (self.qkv_bias, self.extras) if t is not None]
        return [self.cache] + optional + list(self.w.values())

    def _qkv(self, n: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c, w = self.c, self.w
        B, T, _ = n.shape
        qkv = self.qkv(n, self.qkv_bias).contiguous()  # (B, T, H*Hd + 2*KvH*Hd)
        q_end, k_end = c.n_heads * c.head_dim, (c.n_heads + c.n_kv_heads) * c.head_dim
        q, k, v = qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
        if c.qk_norm_whole:  # over all of q and all of k (OLMoE), before they become heads
            q, k = rms_norm(q, w["attn_q_norm.weight"], c.norm_eps), rms_norm(k, w["attn_k_norm.weight"], c.norm_eps)
        q = q.reshape(B, T, c.n_heads, c.head_dim).transpose(1, 2)  # (B, H, T, Hd)
        k = k.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, KvH, T, Hd)
        v = v.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, KvH, T, Hd)
        if c.qk_norm and not c.qk_norm_whole:
            q, k = rms_norm(q, w["attn_q_norm.weight"], c.norm_eps), rms_norm(k, w["attn_k_norm.weight"], c.norm_eps)
        return q, k, v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """q (B, H, T, Hd) over k, v (B, KvH, group or 1, S, Hd) with an additive mask (B or 1, T, S).

        Query heads sharing a kv head get their own axis and k, v broadcast over it (or come
        repeated over it: lane_rows.py): no reshape ever touches the symbolic S axis, which tinygrad
        would index with a division and a modulo by S on every load, slowing the product with v.
        """
        c = self.c
        B, H, T, Hd = q.shape
        group = c.n_heads // c.n_kv_heads
        q = q.reshape(B, c.n_kv_heads, group, T, Hd)
        scores = q @ k.transpose(-1, -2) * c.score_scale  # (B, KvH, group, T, S)
        scores = scores + mask.unsqueeze(1).unsqueeze(1)
        sinks = self.w["attn_sinks.weight"].float().reshape(1, c.n_kv_heads, group, 1, 1) if c.sinks else None
        out = attended(scores, v, sinks).reshape(B, H, T, Hd)
        return out.transpose(1, 2).reshape(B, T, H * Hd)

    def on_kernels(self, x: Tensor, norm: Tensor, lanes: Tensor, inv_freq: Tensor) -> Tensor:
        """x (B, D) for B lanes, lane b at position lanes[B + b] of slot lanes[b] -> the attention of
        rms_norm(x) * norm, through the kernels' attention."""
        c = self.c
        attention = (self.cache, lanes, inv_freq, self.extras, c.n_heads, self.flags)
        qkv = after_norm(self.qkv, x, norm, c.norm_eps)
        return self.kernels.attend(
            qkv, *attention, c.norm_eps, c.score_scale, c.rotary_dim, c.rope_attention_factor, self.window, kv_type=self.kv_type.abi
        )

    def prefill(self, n: Tensor, slot: UOp, start: UOp, rotary: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """n (1, T, D) normed, for positions start..start+T-1 of the sequence in `slot`."""
        T = n.shape[1]
        q, k, v = self._qkv(n)
        # contiguous after RoPE: fusing RoPE into symbolic-length attention overflows tinygrad's rewriter
        if self.rotates:
            q, k = rope(q, *rotary), rope(k, *rotary)
        q = q.cast(n.dtype).contiguous()  # the stream's dtype: RoPE's float32 angles made it float32
        kv = self.kv_type.store(Tensor.stack(k[0], v[0]))  # (2, KvH, T, row)
        store = self.cache[:, slot, :, start : start + T, :].uop.store(kv.uop)
        cache = Tensor(self.cache.uop.after(store))
        keys = self.kv_type.load(cache[0, slot, :, 0 : start + T, :]).unsqueeze(0).unsqueeze(2)  # (1, KvH, 1, start+T, Hd)
        values = self.kv_type.load(cache[1, slot, :, 0 : start + T, :]).unsqueeze(0).unsqueeze(2)
        return self._attend(q, keys, values, mask)

    def decode(self, n: Tensor, slots: Tensor, positions: Tensor, rotary: tuple[Tensor, Tensor], length: UOp, mask: Tensor) -> Tensor:
        """n (B, 1, D) normed: lane b is at position positions[b] of the sequence in slots[b] ((B,)
        int32 device tensors, lane_rows.py); keys read up to `length`."""
        q, k, v = self._qkv(n)
        if self.rotates:
            q, k = rope(q, *rotary), rope(k, *rotary)
        q = q.cast(n.dtype)  # its rotation computed where the scores read it: no kernel of its own
        rows = self.kv_type.store(Tensor.stack(k[:, :, 0], v[:, :, 0]))  # (2, B, KvH, row)
        cache = write_lane_rows(self.cache, rows, slots, positions)
        group = self.c.n_heads // self.c.n_kv_heads
        keys = self.kv_type.load(lane_rows(cache, 0, slots, length, group))  # (B, KvH, group, length, Hd)
        values = self.kv_type.load(lane_rows(cache, 1, slots, length, group))
        return self._attend(q, keys, values, mask)
