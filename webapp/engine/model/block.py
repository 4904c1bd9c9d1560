"""A llama-family layer: attention with a KV cache of many slots, then the feed-forward it holds
(`self.ffn`: dense or routed experts, feed_forward.py), each sublayer's output joining the residual
stream as the norm policy it holds says (`self.norm_policy`: pre-norms, or pre + post norms,
norm_policy.py).

Contract: `TransformerBlock(config, weights, layer, slots, context, kv_type, step_writes)` holds the
layer's products in the form `WeightSource` chose and its KV cache (2, slots + 1, kv_heads, context,
a row of head_dim values in `kv_type`'s rows: float16 or Q8_0, kv_types.py); the extra last slot is
scratch for padding lanes; with a `pool` (kv_types.KvPool, on the CPU kernels' whole-model steps)
the cache is the pool's blocks instead, (2, blocks + 1, kv_heads, block_positions, a row), the last
block taking stray writes. A sliding-window layer (`window`) on the CPU kernels keeps a ring of
`kv_types.ring_positions(window, step_writes)` positions instead of the context: position p in row p % ring,
`step_writes` being the most positions one step writes to a slot. The step strategies
(`webapp.engine.model.steps`) call `prefill` / `decode` on tinygrad's path and `on_kernels` on the
CPU kernels' path; `layer_tensors` is set when every product is in blocks, so the layer runs as one
kernel (and, for the whole model, inside one call).
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor, UOp

from webapp.engine.device.buffers import device_array
from webapp.engine.device.capabilities import device_capabilities
from webapp.engine.kernels import abi
from webapp.engine.kernels.abi import MAX_HEAD_DIM, AttendFlag
from webapp.engine.kernels.layer_tables import LayerMatrices, LayerTensors
from webapp.engine.model.config import ModelConfig
from webapp.engine.model.feed_forward import feed_forward_for
from webapp.engine.model.kv_types import KvPool, KvRows, cache_positions
from webapp.engine.model.norm_policy import norm_policy_for
from webapp.engine.model.ops import rms_norm, rope
from webapp.engine.model.products import after_norm, float32_buffer, float32_values
from webapp.engine.model.weights import BlockLinear, WeightSource


def _zero_pages(shape: tuple[int, ...], dtype) -> Tensor:
    """A zeroed cache tensor. The CPU allocator maps fresh zero pages: no kernel writes 0.9 GB of zeros
    at load, and memory is only committed as positions fill."""
    if device_capabilities().zeroed_allocations:
        cache = Tensor.empty(*shape, dtype=dtype).realize()
        cache.uop.base.buffer.ensure_allocated()
        return cache
    return Tensor.zeros(*shape, dtype=dtype).contiguous()


class TransformerBlock:
    """One pre-norm attention + SwiGLU layer (llama, qwen2, qwen3): its weights, its slice of the KV
    cache, and its computation on tinygrad (`prefill`, `decode`) and on the CPU kernels (`on_kernels`)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: WeightSource,
        layer: int,
        slots: int,
        context: int,
        kv_type: KvRows,
        step_writes: int = 0,
        pool: KvPool | None = None,
    ):
        self.c = config
        self.rotates = config.rotates(layer)
        self.window = config.window(layer)  # a query's positions back to itself included (0: all)
        self.local_rope = bool(self.window and config.local_rope_theta)  # rotated by the local layers' base
        p = f"blk.{layer}."
        # by their usual names, the feed-forward's norm whatever the file calls it
        stored = {"attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": config.ffn_norm_name}
        stored |= {name: name for name in ("attn_q_norm.weight", "attn_k_norm.weight", "attn_sinks.weight", "attn_output.bias")}
        self.w = {name: weights.vector(p + file_name) for name, file_name in stored.items() if weights.has(p + file_name)}
        self._bias_values = {name: weights.vector_values(p + name) for name in ("attn_output.bias",) if config.output_bias}
        self._load_attention(weights, p)
        # the whole layer runs on the CPU kernels when they are loaded and can rotate its heads
        head_dim_ok = config.head_dim % 2 == 0 and config.head_dim <= MAX_HEAD_DIM
        self.kernels = weights.kernels if head_dim_ok else None
        self.ffn = feed_forward_for(config, weights, layer, self.kernels is not None and self._attention_in_blocks)
        self.norm_policy = norm_policy_for(config, weights, p)
        self.qkv_bias = None  # added by tinygrad's product; on the kernels, by the attention kernel
        self.attend_extras = self.layer_tensors = None
        matrices = None
        if self.kernels is None:
            self._load_tinygrad_attention(weights, p)
        else:
            self.attend_extras, self.attend_flags = self._kernel_attention(weights, p)
            # every product in blocks: the layer runs as one kernel; else five, tinygrad's products among them
            feed_forward, attention = self.ffn.blocks(), self._attention_blocks()
            if attention is not None and feed_forward is not None:
                matrices = LayerMatrices(**attention, **feed_forward)
        self.kv_type = kv_type
        self._make_cache(slots, context, step_writes, pool)
        if matrices is not None:
            norms = (self.w["attn_norm.weight"], self.w["ffn_norm.weight"])
            self.layer_tensors = LayerTensors(
                matrices,
                *norms,
                self.cache,
                self.attend_extras,
                config.n_heads,
                self.attend_flags,
                config.score_scale,
                config.rotary_dim,
                config.rope_attention_factor,
                *self.ffn.kernel_experts(),
                window=self.window,
                kv_type=self.kv_type.abi,
                **self._kernel_form(),
            )
        # views into the file's memory map: kept, they would keep every page of it read at load resident
        # (a gpt-oss file's resident memory after warm-up was twice its size)
        self._bias_values = {}
        self.ffn.drop_file_views()

    recurrent = False  # a recurrent layer's cache is a state a slot, not rows a position (delta_block.py)

    def _make_cache(self, slots: int, context: int, step_writes: int, pool: KvPool | None) -> None:
        """self.cache: (k|v, slot, kv_head, position, a row of head_dim values); the extra last slot is
        scratch for padding lanes; config.cache_rows is 1 where a key's row is also its value (multi-head
        latent attention). A ring where it is smaller than the context; tinygrad's path masks a whole
        context instead."""
        config, kv_type = self.c, self.kv_type
        self.positions = cache_positions(self.window, context, step_writes if self.kernels is not None else None)
        self.ring = self.positions < context
        row, kinds = kv_type.row_width(config.head_dim), config.cache_rows
        shape = (kinds, slots + 1, config.n_kv_heads, self.positions, row)
        if pool is not None:  # a paged cache (kv_types.KvPool): its blocks, and one more that takes stray writes
            shape = (kinds, pool.blocks + 1, config.n_kv_heads, pool.block_positions, row)
        self.cache = _zero_pages(shape, kv_type.dtype)

    # The attention's hooks: q, k and v as one product here; multi-head latent attention (mla_block.py)
    # fills them its own way.
    def _load_attention(self, weights: WeightSource, p: str) -> None:
        # one product for q, k and v and one for gate and up: fewer, larger kernels run faster here
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

    def _attention_blocks(self) -> dict | None:
        """LayerMatrices' attention fields when every one of its matrices is in blocks, else None."""
        return {"qkv": self.qkv.weight, "o": self.attn_output.weight} if self._attention_in_blocks else None

    @property
    def _attention_in_blocks(self) -> bool:
        return isinstance(self.qkv, BlockLinear) and isinstance(self.attn_output, BlockLinear)

    def routed_tokens(self) -> np.ndarray | None:
        """A mixture of experts' lanes per expert since load, where the kernels count them (routed.py)."""
        return self.ffn.routed_tokens()

    def _kernel_form(self) -> dict:
        """LayerTensors' form and what it reads: the biases (the output product's, then the
        feed-forward's), the feed-forward's own entries and the norm policy's."""
        biases = self._biases()
        form = self.ffn.form | self.norm_policy.form | (int(abi.LayerForm.BIASES) if biases else 0)
        own = {"form": form} if form else {}
        own |= {"biases": device_array(np.concatenate(biases))} if biases else {}
        return own | self.ffn.kernel_extras() | self.norm_policy.kernel_extras()

    def _biases(self) -> list[np.ndarray]:
        """LayerForm.BIASES' values in order, float32 as the file stores them."""
        return float32_values(self._bias_values, ["attn_output.bias"] if self.c.output_bias else []) + self.ffn.biases()

    def _feed_forward_on_kernels(self, h: Tensor) -> Tensor:
        """h joined by the feed-forward of rms_norm(h), on the kernels around any product they cannot run."""
        return self.norm_policy.feed_forward_plus(self.ffn, h, self.w["ffn_norm.weight"], self.c.norm_eps)

    def tensors(self) -> list[Tensor]:
        own = [*self.qkv.tensors(), *self.attn_output.tensors(), *self.ffn.tensors(), *self.norm_policy.tensors(), self.cache]
        optional = [t for t in (self.qkv_bias, self.attend_extras) if t is not None]
        return own + optional + list(self.w.values())

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c, w = self.c, self.w
        B, T, _ = x.shape
        qkv = self.qkv(x, self.qkv_bias).contiguous()  # (B, T, H*Hd + 2*KvH*Hd)
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
        """q (B, H, T, Hd) over k, v (B, KvH, S, Hd) with an additive mask (B or 1, T, S).

        Query heads sharing a kv head get their own axis and k, v broadcast over it: no reshape
        ever touches the symbolic S axis, which tinygrad would index with a division and a modulo
        by S on every load (the product with v ran 14x slower that way).
        """
        c = self.c
        B, H, T, Hd = q.shape
        group = c.n_heads // c.n_kv_heads
        q = q.reshape(B, c.n_kv_heads, group, T, Hd)
        scores = q @ k.unsqueeze(2).transpose(-1, -2) * c.score_scale  # (B, KvH, group, T, S)
        scores = scores + mask.unsqueeze(1).unsqueeze(1)
        if c.sinks:  # one more score a head, weighing no value
            sinks = self.w["attn_sinks.weight"].float().reshape(1, c.n_kv_heads, group, 1, 1).expand(B, c.n_kv_heads, group, T, 1)
            probs = scores.cat(sinks, dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out = (probs @ v.unsqueeze(2)).reshape(B, H, T, Hd)
        return out.transpose(1, 2).reshape(B, T, H * Hd)

    def _ffn_and_out(self, x: Tensor, attn: Tensor) -> Tensor:
        h = self.norm_policy.attention_joined(x, self.attn_output(attn), self._output_bias)
        n = rms_norm(h, self.w["ffn_norm.weight"], self.c.norm_eps)
        return self.norm_policy.feed_forward_joined(h, self.ffn(n))

    @property
    def _output_bias(self) -> Tensor | None:
        return self.w["attn_output.bias"] if self.c.output_bias else None

    def on_kernels(self, x: Tensor, lanes: Tensor, inv_freq: Tensor) -> Tensor:
        """The layer on the CPU kernels, as one or five of them: x (B, D) for B lanes, each a decode step's
        sequence or a prefill piece's token, lane b at position lanes[B + b] of slot lanes[b]. Prefill
        and decode thus compute a position identically, so prompt scoring equals generation."""
        c, w = self.c, self.w
        if self.layer_tensors is not None:  # every product in blocks: one kernel
            return self.kernels.layer(x, self.layer_tensors, lanes, inv_freq, c.norm_eps)
        attention = (self.cache, lanes, inv_freq, self.attend_extras, c.n_heads, self.attend_flags)
        qkv = after_norm(self.qkv, x, w["attn_norm.weight"], c.norm_eps)
        attn = self.kernels.attend(
            qkv, *attention, c.norm_eps, c.score_scale, c.rotary_dim, c.rope_attention_factor, self.window, kv_type=self.kv_type.abi
        )
        return self._feed_forward_on_kernels(self._attention_plus(attn, x))

    def _attention_plus(self, attn: Tensor, x: Tensor) -> Tensor:
        """The residual stream x joined by the attention's output product, on the kernels."""
        return self.norm_policy.attention_plus(self.attn_output, attn, x, self._output_bias)

    def prefill(self, x: Tensor, slot: UOp, start: UOp, rotary: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """x (1, T, D) for positions start..start+T-1 of the sequence in `slot`."""
        T = x.shape[1]
        q, k, v = self._qkv(rms_norm(x, self.w["attn_norm.weight"], self.c.norm_eps))
        # contiguous after RoPE: fusing RoPE into symbolic-length attention overflows tinygrad's rewriter
        if self.rotates:
            q, k = rope(q, *rotary), rope(k, *rotary)
        q = q.contiguous()
        kv = self.kv_type.store(Tensor.stack(k[0], v[0]))  # (2, KvH, T, row)
        store = self.cache[:, slot, :, start : start + T, :].uop.store(kv.uop)
        cache = Tensor(self.cache.uop.after(store))
        keys = self.kv_type.load(cache[0, slot, :, 0 : start + T, :]).unsqueeze(0)  # (1, KvH, start+T, Hd)
        values = self.kv_type.load(cache[1, slot, :, 0 : start + T, :]).unsqueeze(0)
        return self._ffn_and_out(x, self._attend(q, keys, values, mask))

    def decode(self, x: Tensor, slots: list[UOp], positions: list[UOp], rotary: tuple[Tensor, Tensor], length: UOp, mask: Tensor) -> Tensor:
        """x (B, 1, D): lane b is at position positions[b] of the sequence in slots[b]; keys read up to `length`."""
        q, k, v = self._qkv(rms_norm(x, self.w["attn_norm.weight"], self.c.norm_eps))
        if self.rotates:
            q, k = rope(q, *rotary), rope(k, *rotary)
        q = q.contiguous()
        kv = self.kv_type.store(Tensor.stack(k, v))  # (2, B, KvH, 1, row)
        stores = [self.cache[:, s, :, p : p + 1, :].uop.store(kv[:, b].contiguous().uop) for b, (s, p) in enumerate(zip(slots, positions))]
        cache = Tensor(self.cache.uop.after(*stores))
        keys = self.kv_type.load(Tensor.stack(*[cache[0, s, :, 0:length, :] for s in slots]))  # (B, KvH, length, Hd)
        values = self.kv_type.load(Tensor.stack(*[cache[1, s, :, 0:length, :] for s in slots]))
        return self._ffn_and_out(x, self._attend(q, keys, values, mask))
