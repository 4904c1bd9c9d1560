"""A layer whose feed-forward is a mixture of experts (qwen3moe): the attention of `TransformerBlock`,
then a router choosing `experts_used` of `experts` SwiGLU feed-forwards per token.

Contract: `MoeBlock` fills TransformerBlock's feed-forward hooks. A token's router logits W_router . n
(n the normed residual stream) become softmax probabilities (sigmoid ones with `expert_sigmoid`,
GLM-4.5); the `experts_used` largest (ties: the lower expert) weigh their experts' outputs, divided by
their sum where the model says so (`expert_weights_norm`, llama.cpp's clamp of that sum at 2^-14
kept), then times `expert_weights_scale`. With `selection_bias` the experts are the largest of
probs + the layer's exp_probs_b.bias, still weighted by probs alone: the bias balances the experts'
load in training, and llama.cpp's build_moe_ffn keeps it out of the weights. On the CPU kernels, with every
matrix of the layer in blocks, the whole layer is one kernel (kernels/c/moe.c: a step's tokens
grouped by expert, each chosen expert's blocks read once a step) and `expert_tokens` counts the lanes
each expert took. Everywhere else the experts are float16 (experts, cols, rows) tensors and every
token runs through every expert, weighted by a mask that is zero off its chosen ones: exact, but
reading all experts' weights each step (the kernels read only the chosen ones).
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor, dtypes

from webapp.engine.device.buffers import device_array, host_values
from webapp.engine.kernels import abi
from webapp.engine.model.block import TransformerBlock
from webapp.engine.model.ops import rms_norm
from webapp.engine.model.weights import BlockLinear, WeightSource

# llama.cpp's floor under the chosen experts' weight sum before dividing by it (float16's smallest normal)
WEIGHT_SUM_FLOOR = 6.103515625e-5


class MoeBlock(TransformerBlock):
    def _load_feed_forward(self, weights: WeightSource, p: str) -> None:
        c = self.c
        self.router = weights.linear(p + "ffn_gate_inp.weight")  # D -> experts
        self.selection_bias = None  # (experts,) float32: the kernels read float32
        if c.selection_bias:
            bias = weights.vector(p + "exp_probs_b.bias")
            self.selection_bias = bias if bias.dtype == dtypes.float32 else bias.float().contiguous()
        names = [p + f"ffn_{n}_exps.weight" for n in ("gate", "up", "down")]
        self.expert_blocks = self.expert_tokens = None
        # in blocks only where the whole layer runs as one kernel: the five-kernel path has no
        # kernel for the experts, and takes the float16 ones
        if self.kernels is not None and self._router_in_blocks and self._attention_in_blocks:
            blocks = [weights.experts(name, c.experts) for name in names]
            if None not in blocks:
                self.expert_blocks = blocks
                self.expert_tokens = device_array(np.zeros(c.experts, np.int64))
        if self.expert_blocks is None:
            self.gate_exps = weights.float_experts(names[0], transposed=True)  # (E, D, F)
            self.up_exps = weights.float_experts(names[1], transposed=True)  # (E, D, F)
            self.down_exps = weights.float_experts(names[2], transposed=True)  # (E, F, D)

    @property
    def _router_in_blocks(self) -> bool:
        """Whether the feed-forward's matrices other than the experts are in blocks (a shared expert's too)."""
        return isinstance(self.router, BlockLinear)

    def routed_tokens(self) -> np.ndarray | None:
        """How many lanes each expert has taken since load (int64, one an expert), where the kernels
        count them (one kernel a layer); None elsewhere."""
        return None if self.expert_tokens is None else host_values(self.expert_tokens, np.int64)

    def _feed_forward_blocks(self) -> dict | None:
        if self.expert_blocks is None:
            return None
        gate, up, down = self.expert_blocks
        return {"gate_up": gate, "down": down, "router": self.router.weight, "up": up}

    def _kernel_experts(self) -> tuple:
        c = self.c
        F = abi.ExpertsFlag
        flags = (F.NORM_WEIGHTS if c.expert_weights_norm else 0) | (F.SIGMOID if c.expert_sigmoid else 0)
        flags |= F.SELECTION_BIAS if c.selection_bias else 0
        experts = abi.Experts(c.experts, c.experts_used, c.expert_hidden_dim, int(flags))
        experts.weights_scale = c.expert_weights_scale
        return experts, self.expert_tokens

    def _kernel_form(self) -> dict:
        form = super()._kernel_form()
        return form if self.selection_bias is None else form | {"selection_bias": self.selection_bias}

    def _feed_forward_tensors(self) -> list[Tensor]:
        experts = [b.raw for b in self.expert_blocks] if self.expert_blocks is not None else [self.gate_exps, self.up_exps, self.down_exps]
        own = [t for t in (self.expert_tokens, self.selection_bias) if t is not None]
        return [*self.router.tensors(), *experts] + own

    def _feed_forward_on_kernels(self, h: Tensor) -> Tensor:
        return (h + self.feed_forward(rms_norm(h, self.w["ffn_norm.weight"], self.c.norm_eps))).contiguous()

    def feed_forward(self, n: Tensor) -> Tensor:
        """n (..., D) normed -> (..., D): every expert's SwiGLU, weighted by the router's choice."""
        c = self.c
        logits = self._router_logits(n)  # (..., E)
        probs = logits.sigmoid() if c.expert_sigmoid else logits.softmax(-1)
        if self.selection_bias is None:
            top, chosen = probs.topk(c.experts_used)  # (..., K), the largest first
        else:
            _, chosen = (probs + self.selection_bias.float()).topk(c.experts_used)
            top = probs.gather(-1, chosen)  # (..., K): weighted without the bias
        if c.expert_weights_norm:
            top = top / top.sum(-1, keepdim=True).maximum(WEIGHT_SUM_FLOOR)
        if c.expert_weights_scale != 1.0:
            top = top * c.expert_weights_scale
        mask = ((chosen.unsqueeze(-1) == Tensor.arange(c.experts)).float() * top.unsqueeze(-1)).sum(-2)  # (..., E)
        x = n.unsqueeze(-2).unsqueeze(-2)  # (..., 1, 1, D)
        gate = x @ self.gate_exps.cast(n.dtype)  # (..., E, 1, F)
        up = x @ self.up_exps.cast(n.dtype)
        out = self._expert_outputs(gate, up)  # (..., E, 1, D)
        return (out.squeeze(-2) * mask.unsqueeze(-1).cast(n.dtype)).sum(-2)  # (..., D)

    # what gpt-oss's experts change (gpt_oss_block.py): the router's logits, and each expert's output
    def _router_logits(self, n: Tensor) -> Tensor:
        return self.router(n).float()

    def _expert_outputs(self, gate: Tensor, up: Tensor) -> Tensor:
        """Every expert's output (..., E, 1, D) from its gate and up rows (..., E, 1, F)."""
        return (gate.silu() * up) @ self.down_exps.cast(gate.dtype)
