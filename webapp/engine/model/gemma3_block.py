"""Gemma 3's layer: the attention of `TransformerBlock` (q/k norms; five of six layers a sliding
window with their own RoPE base, set by the config), each sublayer's output rms-normed before it
joins the residual stream, and a GeGLU feed-forward.

Contract: `Gemma3Block` fills TransformerBlock's hooks, per layer:
    h = x + rms_norm(W_o . attention(rms_norm(x) * attn_norm)) * post_attention_norm
    out = h + rms_norm(W_down . (gelu(gate) * up)) * post_ffw_norm,  gate | up = W_gate_up . rms_norm(h) * ffn_norm
gelu by tanh's approximation, as llama.cpp computes it. On the CPU kernels with every product in
blocks the layer is one kernel (tq_layer's FORM_POST_NORMS | FORM_GEGLU); elsewhere tinygrad's
operations join the products. The embedding's sqrt(dim) scale is the transformer's.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor

from webapp.engine.device.buffers import device_array
from webapp.engine.kernels import abi
from webapp.engine.model.block import TransformerBlock
from webapp.engine.model.ops import rms_norm
from webapp.engine.model.products import after_norm
from webapp.engine.model.weights import WeightSource

POST_NORMS = ("post_attention_norm.weight", "post_ffw_norm.weight")


class Gemma3Block(TransformerBlock):
    def _load_norm_policy(self, weights: WeightSource, p: str) -> None:
        self.post = {name: weights.vector(p + name) for name in POST_NORMS}
        values = [weights.vector_values(p + name) for name in POST_NORMS]
        # the kernels read both as one float32 buffer: the attention's norm, then the feed-forward's
        if all(v is not None for v in values):
            self.post_norms = device_array(np.concatenate(values))
        else:
            self.post_norms = Tensor.cat(*self.post.values()).float().contiguous()

    def _kernel_form(self) -> dict:
        return {"form": int(abi.LayerForm.POST_NORMS | abi.LayerForm.GEGLU), "post_norms": self.post_norms}

    def tensors(self) -> list[Tensor]:
        return super().tensors() + [*self.post.values(), self.post_norms]

    def _post_normed(self, y: Tensor, name: str) -> Tensor:
        return rms_norm(y, self.post[name], self.c.norm_eps)

    def _attention_plus(self, attn: Tensor, x: Tensor) -> Tensor:
        return (x + self._post_normed(self.attn_output(attn), POST_NORMS[0])).contiguous()

    def _feed_forward_on_kernels(self, h: Tensor) -> Tensor:
        return self._post_plus(h, after_norm(self.ffn.gate_up, h, self.w["ffn_norm.weight"], self.c.norm_eps))

    def _post_plus(self, h: Tensor, gate_up: Tensor) -> Tensor:
        hidden = self.c.hidden_dim
        out = self.ffn.down((gate_up[..., :hidden].gelu() * gate_up[..., hidden:]).contiguous())
        return (h + self._post_normed(out, POST_NORMS[1])).contiguous()

    def _ffn_and_out(self, x: Tensor, attn: Tensor) -> Tensor:
        h = self._attention_plus(attn, x)
        return self._post_plus(h, self.ffn.gate_up(rms_norm(h, self.w["ffn_norm.weight"], self.c.norm_eps)).contiguous())
