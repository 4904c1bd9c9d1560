"""A layer's norm policy, a component the layer holds: how each sublayer's output joins the residual
stream. `PreNorms` (every architecture but Gemma 3 and OLMo 2): as it is, its input normed before the
sublayer; `PostNorms` (Gemma 3, OLMo 2): rms-normed on its way out. `norm_policy_for` chooses from the
config. Whether a sublayer's input is normed is the layer's (ModelConfig.input_norms: OLMo 2's are not).

Contract: with x the residual stream, o = the attention's output product (its bias included) and
f = the feed-forward of rms_norm(h) * ffn_norm (of h itself where the layer has no input norms),
    pre-norms:        h = x + o,                          out = h + f
    (pre +) post norms: h = x + rms_norm(o) * post_attn,  out = h + rms_norm(f) * post_ffw
`attention_plus` / `feed_forward_plus` compute h and out on the CPU kernels (the add fused into the
product where the policy lets it); `attention_joined` / `feed_forward_joined` on tinygrad's path.
`form` and `kernel_extras` are the policy's share of the one-kernel layer's LayerTensors.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor

from webapp.engine.device.buffers import device_array
from webapp.engine.kernels import abi
from webapp.engine.model.config import ModelConfig
from webapp.engine.model.ops import rms_norm
from webapp.engine.model.products import plus
from webapp.engine.model.weights import WeightSource

POST_NORMS = ("post_attention_norm.weight", "post_ffw_norm.weight")


class PreNorms:
    """A sublayer's output joins the residual stream as it is: the kernels add it inside its product."""

    form = 0

    def kernel_extras(self) -> dict:
        return {}

    def tensors(self) -> list[Tensor]:
        return []

    def attention_plus(self, output, attn: Tensor, x: Tensor, bias: Tensor | None) -> Tensor:
        out = plus(output, attn, x)
        return (out + bias).contiguous() if bias is not None else out

    def feed_forward_plus(self, ffn, h: Tensor, norm: Tensor, eps: float) -> Tensor:
        return ffn.on_kernels(h, norm, eps, residual=h)

    def attention_joined(self, x: Tensor, out: Tensor, bias: Tensor | None) -> Tensor:
        return x + out + (bias if bias is not None else 0)

    def feed_forward_joined(self, h: Tensor, out: Tensor) -> Tensor:
        return (h + out).contiguous()


class PostNorms:
    """Each sublayer's output rms-normed by its own weight before it joins the residual stream."""

    form = int(abi.LayerForm.POST_NORMS)

    def __init__(self, config: ModelConfig, weights: WeightSource, p: str):
        self.eps = config.norm_eps
        self.post = [weights.vector(p + name) for name in POST_NORMS]
        values = [weights.vector_values(p + name) for name in POST_NORMS]
        # the kernels read both as one float32 buffer: the attention's norm, then the feed-forward's
        if all(v is not None for v in values):
            self.post_norms = device_array(np.concatenate(values))
        else:
            self.post_norms = Tensor.cat(*self.post).float().contiguous()

    def kernel_extras(self) -> dict:
        return {"post_norms": self.post_norms}

    def tensors(self) -> list[Tensor]:
        return [*self.post, self.post_norms]

    def _normed(self, out: Tensor, bias: Tensor | None) -> Tensor:
        return rms_norm(out if bias is None else out + bias, self.post[0], self.eps)

    def attention_plus(self, output, attn: Tensor, x: Tensor, bias: Tensor | None) -> Tensor:
        return (x + self._normed(output(attn), bias)).contiguous()

    def feed_forward_plus(self, ffn, h: Tensor, norm: Tensor, eps: float) -> Tensor:
        return self.feed_forward_joined(h, ffn.on_kernels(h, norm, eps))

    def attention_joined(self, x: Tensor, out: Tensor, bias: Tensor | None) -> Tensor:
        return (x + self._normed(out, bias)).contiguous()

    def feed_forward_joined(self, h: Tensor, out: Tensor) -> Tensor:
        return (h + rms_norm(out, self.post[1], self.eps)).contiguous()


def norm_policy_for(config: ModelConfig, weights: WeightSource, p: str) -> PreNorms | PostNorms:
    """The layer's norm policy: post norms where the config says so (Gemma 3, OLMo 2), else pre-norms."""
    return PostNorms(config, weights, p) if config.post_norms else PreNorms()
