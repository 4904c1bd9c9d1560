"""gpt-oss's layer: the attention of `TransformerBlock` (q/k/v and output biases, a sink logit a head,
every other layer a 128-position sliding window: set by the config), then `MoeBlock`'s mixture of
experts with biases on the router and on every expert's products, and a clamped SwiGLU.

Contract: `GptOssBlock` fills MoeBlock's hooks. A token's router logits W_router . n + b_router pick
the `used` largest; their softmax (the chosen probabilities divided by their sum) weighs the experts'
outputs, expert e's being
    W_down[e] . act(W_gate[e] . n + b_gate[e], W_up[e] . n + b_up[e]) + b_down[e],
    act(g, u) = min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1)
as llama.cpp's swiglu_oai computes it; n is the residual stream normed by the file's
post_attention_norm (gpt-oss's name for the feed-forward's input norm). On the CPU kernels the layer
is one kernel (FORM_BIASES | FORM_SWIGLU_CLAMPED, its biases float32 as the file stores them).
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor

from webapp.engine.kernels import abi
from webapp.engine.model.block import _float32_values
from webapp.engine.model.moe_block import MoeBlock
from webapp.engine.model.weights import WeightSource

EXPERT_BIASES = ("ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")
ALPHA, LIMIT = 1.702, 7.0  # the clamped SwiGLU's


class GptOssBlock(MoeBlock):
    def _load_feed_forward(self, weights: WeightSource, p: str) -> None:
        super()._load_feed_forward(weights, p)
        self.expert_bias = {name: weights.vector(p + name) for name in EXPERT_BIASES}
        self._bias_values |= {name: weights.vector_values(p + name) for name in EXPERT_BIASES}

    def _biases(self) -> list[np.ndarray]:
        return super()._biases() + _float32_values(self._bias_values, list(EXPERT_BIASES))

    def _kernel_form(self) -> dict:
        form = super()._kernel_form()
        return form | {"form": int(abi.LayerForm.BIASES | abi.LayerForm.SWIGLU_CLAMPED)}

    def tensors(self) -> list[Tensor]:
        return super().tensors() + list(self.expert_bias.values())

    def _router_logits(self, n: Tensor) -> Tensor:
        return self.router(n).float() + self.expert_bias["ffn_gate_inp.bias"].float()

    def _expert_outputs(self, gate: Tensor, up: Tensor) -> Tensor:
        E, F, D = self.c.experts, self.c.expert_hidden_dim, self.c.dim
        bias = self.expert_bias
        gate = (gate + bias["ffn_gate_exps.bias"].reshape(E, 1, F).cast(gate.dtype)).minimum(LIMIT)
        up = (up + bias["ffn_up_exps.bias"].reshape(E, 1, F).cast(up.dtype)).clip(-LIMIT, LIMIT)
        mixed = gate * (gate * ALPHA).sigmoid() * (up + 1)
        return mixed @ self.down_exps.cast(gate.dtype) + bias["ffn_down_exps.bias"].reshape(E, 1, D).cast(gate.dtype)
