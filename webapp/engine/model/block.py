"""A layer, by composition: the token mixer it holds (`self.mixer`: attention, windowed where the
config says, latent attention, or a hybrid's gated attention or Gated DeltaNet recurrence; attention.py,
latent_attention.py, gated_delta.py), then the feed-forward it holds (`self.ffn`: dense or routed
experts, feed_forward.py), each sublayer's output joining the residual stream as the norm policy it
holds says (`self.norm_policy`: pre-norms, or post norms, norm_policy.py); the sublayers' inputs are
rms-normed first unless the config says the layer has no input norms (OLMo 2). `mixer_for` and
`feed_forward_for` choose from the config; there is one layer class.

Contract: `TransformerBlock(config, weights, layer, slots, context, kv_type, step_writes, pool)` holds
the layer's components, the mixer's cache among them (attention.py states its shapes; a recurrent
mixer's is a state a slot). The step strategies (`webapp.engine.model.steps`) call `prefill` /
`decode` on tinygrad's path and `on_kernels` on the CPU kernels' path; `layer_tensors` is set when
every product is in blocks, so the layer runs as one kernel (and, for the whole model, inside one
call), its LayerTensors gathered from the components (kernels/layer_tables.py's contract).
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor, UOp

from webapp.engine.device.buffers import device_array
from webapp.engine.kernels import abi
from webapp.engine.kernels.abi import MAX_HEAD_DIM
from webapp.engine.kernels.layer_tables import LayerMatrices, LayerTensors
from webapp.engine.model.attention import Attention
from webapp.engine.model.config import ModelConfig
from webapp.engine.model.feed_forward import feed_forward_for
from webapp.engine.model.gated_delta import GatedAttention, GatedDeltaNet
from webapp.engine.model.kv_types import KvPool, KvRows
from webapp.engine.model.latent_attention import LatentAttention
from webapp.engine.model.norm_policy import norm_policy_for
from webapp.engine.model.ops import rms_norm
from webapp.engine.model.weights import WeightSource


def mixer_for(config: ModelConfig, weights: WeightSource, layer: int, kernels) -> Attention:
    """Layer `layer`'s token mixer: a hybrid's Gated DeltaNet recurrence or gated attention (by
    Recurrent.pattern), latent attention, or attention (windowed where the config says)."""
    if config.recurrent:
        kind = GatedDeltaNet if config.recurrent_layer(layer) else GatedAttention
    else:
        kind = LatentAttention if config.latent else Attention
    return kind(config, weights, layer, kernels)


def _of_mixer(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.mixer, name), doc=doc)


class TransformerBlock:
    """One layer: its components' weights, the mixer's cache, and its computation on tinygrad
    (`prefill`, `decode`) and on the CPU kernels (`on_kernels`)."""

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
        p = f"blk.{layer}."
        # by their usual names, the feed-forward's norm whatever the file calls it
        stored = {"attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": config.ffn_norm_name}
        self.w = {name: weights.vector(p + file_name) for name, file_name in stored.items() if weights.has(p + file_name)}
        # the whole layer runs on the CPU kernels when they are loaded and can rotate its heads
        head_dim_ok = config.head_dim % 2 == 0 and config.head_dim <= MAX_HEAD_DIM
        self.kernels = weights.kernels if head_dim_ok else None
        self.mixer = mixer_for(config, weights, layer, self.kernels)
        self.ffn = feed_forward_for(config, weights, layer, self.kernels is not None and self.mixer.in_blocks)
        self.norm_policy = norm_policy_for(config, weights, p)
        self.layer_tensors = matrices = None
        if self.kernels is not None:
            # every product in blocks: the layer runs as one kernel; else five, tinygrad's products among them
            feed_forward, attention = self.ffn.blocks(), self.mixer.blocks()
            if attention is not None and feed_forward is not None:
                matrices = LayerMatrices(**attention, **feed_forward)
        self.mixer.make_cache(slots, context, step_writes, pool, kv_type)
        if matrices is not None:
            norms = (self.w.get("attn_norm.weight"), self.w.get("ffn_norm.weight"))
            self.layer_tensors = LayerTensors(
                matrices,
                *norms,
                self.cache,
                self.mixer.extras,
                config.n_heads,
                self.mixer.flags,
                config.score_scale,
                config.rotary_dim,
                config.rope_attention_factor,
                *self.ffn.kernel_experts(),
                window=self.window,
                kv_type=kv_type.abi,
                **self._kernel_form(),
            )
        # views into the file's memory map: kept, they would keep every page of it read at load resident
        self.mixer.drop_file_views()
        self.ffn.drop_file_views()

    # what the model and its step strategies read of a layer's mixer
    cache = _of_mixer("cache", "the mixer's cache: KV rows a position, or a recurrent state a slot")
    positions = _of_mixer("positions", "the cache's positions a slot (a ring's, a state's 1)")
    ring = _of_mixer("ring", "whether the cache is a ring smaller than the context")
    window = _of_mixer("window", "a query's positions back to itself included (0: all)")
    local_rope = _of_mixer("local_rope", "rotated by the local layers' RoPE base")
    recurrent = _of_mixer("recurrent", "a state a slot, not rows a position")
    qkv = _of_mixer("qkv", "the mixer's product of the normed input")
    attn_output = _of_mixer("attn_output", "the mixer's output product")
    attend_flags = _of_mixer("flags", "tq_attend's flags")

    def routed_tokens(self) -> np.ndarray | None:
        """A mixture of experts' lanes per expert since load, where the kernels count them (routed.py)."""
        return self.ffn.routed_tokens()

    def _kernel_form(self) -> dict:
        """LayerTensors' form and what it reads: the biases (the mixer's output product's, then the
        feed-forward's) and each component's own entries."""
        biases = self.mixer.biases() + self.ffn.biases()
        form = self.mixer.form | self.ffn.form | self.norm_policy.form | (int(abi.LayerForm.BIASES) if biases else 0)
        form |= 0 if self.c.input_norms else int(abi.LayerForm.UNNORMED_INPUTS)
        own = {"form": form} if form else {}
        own |= {"biases": device_array(np.concatenate(biases))} if biases else {}
        return own | self.mixer.kernel_extras() | self.ffn.kernel_extras() | self.norm_policy.kernel_extras()

    def tensors(self) -> list[Tensor]:
        """The layer's matrices first (the mixer's products, then the feed-forward's), then the rest."""
        own = [*self.mixer.matrix_tensors(), *self.ffn.tensors(), *self.mixer.tensors(), *self.norm_policy.tensors()]
        return own + list(self.w.values())

    def _input(self, x: Tensor, norm: str) -> Tensor:
        """A sublayer's input: x rms-normed by the layer's `norm`, or as it is in a layer without input norms."""
        return rms_norm(x, self.w[norm], self.c.norm_eps) if self.c.input_norms else x

    def _ffn_and_out(self, x: Tensor, attn: Tensor) -> Tensor:
        # the attention reads its keys and values in float32; its output returns to the stream's dtype
        h = self.norm_policy.attention_joined(x, self.mixer.attn_output(attn.cast(x.dtype)), self.mixer.output_bias)
        return self.norm_policy.feed_forward_joined(h, self.ffn(self._input(h, "ffn_norm.weight")))

    def on_kernels(self, x: Tensor, lanes: Tensor, inv_freq: Tensor) -> Tensor:
        """The layer on the CPU kernels, as one or five of them: x (B, D) for B lanes, each a decode step's
        sequence or a prefill piece's token, lane b at position lanes[B + b] of slot lanes[b]. Prefill
        and decode thus compute a position identically, so prompt scoring equals generation."""
        c, w = self.c, self.w
        if self.layer_tensors is not None:  # every product in blocks: one kernel
            return self.kernels.layer(x, self.layer_tensors, lanes, inv_freq, c.norm_eps)
        attn = self.mixer.on_kernels(x, w.get("attn_norm.weight"), lanes, inv_freq)
        h = self.norm_policy.attention_plus(self.mixer.attn_output, attn, x, self.mixer.output_bias)
        return self.norm_policy.feed_forward_plus(self.ffn, h, w.get("ffn_norm.weight"), c.norm_eps)

    def prefill(self, x: Tensor, slot: UOp, start: UOp, rotary: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """x (1, T, D) for positions start..start+T-1 of the sequence in `slot`."""
        return self._ffn_and_out(x, self.mixer.prefill(self._input(x, "attn_norm.weight"), slot, start, rotary, mask))

    def decode(self, x: Tensor, slots: Tensor, positions: Tensor, rotary: tuple[Tensor, Tensor], length: UOp, mask: Tensor) -> Tensor:
        """x (B, 1, D): lane b is at position positions[b] of the sequence in slots[b] ((B,) int32
        device tensors); keys read up to `length`."""
        return self._ffn_and_out(x, self.mixer.decode(self._input(x, "attn_norm.weight"), slots, positions, rotary, length, mask))
