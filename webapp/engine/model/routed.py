"""A routed feed-forward: a router choosing `experts_used` of `experts` SwiGLU feed-forwards per token
(qwen3moe, olmoe, gpt-oss, glm4moe, deepseek2, qwen35moe), with a shared expert every token runs
beside them where the config has one (qwen2moe, glm4moe, deepseek2, qwen35moe).

Contract: `RoutedFeedForward` is a feed-forward as feed_forward.py states it. A token's router logits
W_router . n (+ the router's bias, gpt-oss) become softmax probabilities (sigmoid ones with
`expert_sigmoid`, GLM-4.5); the `experts_used` largest (ties: the lower expert) weigh their experts'
outputs, divided by their sum where the model says so (`expert_weights_norm`, llama.cpp's clamp of
that sum at 2^-14 kept), then times `expert_weights_scale`. With `selection_bias` the experts are the
largest of probs + the layer's exp_probs_b.bias, still weighted by probs alone: the bias balances the
experts' load in training, and llama.cpp's build_moe_ffn keeps it out of the weights. gpt-oss's
experts (`expert_biases`, `swiglu_clamped`) add biases to every expert's products and take
    act(g, u) = min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1)
as llama.cpp's swiglu_oai computes it. The shared expert adds
    sigmoid(g . n) * W_down_s . (silu(W_gate_s . n) * W_up_s . n)
(g the file's ffn_gate_inp_shexp; without it, `shared_expert_gated` false, it is added as it is, as
llama.cpp's glm4-moe graph does) to the routed sum before the residual.

On the CPU kernels, with every matrix of the layer in blocks, the whole layer is one kernel
(kernels/c/moe.c, shared_expert.c: a step's tokens grouped by expert, each chosen expert's blocks read
once a step) and `expert_tokens` counts the lanes each expert took. Everywhere else the experts are
float16 (experts, cols, rows) tensors: where a step's tokens times the experts each uses are fewer
than the experts (a decode step's few lanes), each token's chosen experts' weights are read through
an indexed load folded into the products, and nothing else of them; otherwise every token runs
through every expert, weighted by a mask that is zero off its chosen ones, each expert read once.
"""

from __future__ import annotations

import math

import numpy as np
from tinygrad import Tensor, dtypes

from webapp.engine.device.buffers import device_array, host_values
from webapp.engine.kernels import abi
from webapp.engine.model.config import ModelConfig
from webapp.engine.model.ops import rms_norm
from webapp.engine.model.products import float32_values
from webapp.engine.model.weights import BlockLinear, WeightSource

# llama.cpp's floor under the chosen experts' weight sum before dividing by it (float16's smallest normal)
WEIGHT_SUM_FLOOR = 6.103515625e-5
EXPERT_BIASES = ("ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")
ALPHA, LIMIT = 1.702, 7.0  # the clamped SwiGLU's


def _float32(vector: Tensor) -> Tensor:
    """A vector the kernels read as float32."""
    return vector if vector.dtype == dtypes.float32 else vector.float().contiguous()


class SharedExpert:
    """One SwiGLU feed-forward every token runs, gated by sigmoid(g . n) where the file has g."""

    def __init__(self, config: ModelConfig, weights: WeightSource, p: str):
        self.width = config.shared_expert_hidden_dim
        self.gate_up = weights.linear(p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight")  # D -> 2*S
        self.down = weights.linear(p + "ffn_down_shexp.weight")  # S -> D
        self.gate = _float32(weights.vector(p + "ffn_gate_inp_shexp.weight")) if config.shared_expert_gated else None  # (D,)

    @property
    def in_blocks(self) -> bool:
        return isinstance(self.gate_up, BlockLinear) and isinstance(self.down, BlockLinear)

    def tensors(self) -> list[Tensor]:
        return [*self.gate_up.tensors(), *self.down.tensors(), *([] if self.gate is None else [self.gate])]

    def plus(self, routed: Tensor, n: Tensor) -> Tensor:
        """The routed experts' sum `routed` plus this expert's output for n (..., D)."""
        S = self.width
        gate_up = self.gate_up(n).contiguous()  # (..., 2*S)
        shared = self.down((gate_up[..., :S].silu() * gate_up[..., S:]).contiguous())  # (..., D)
        if self.gate is None:
            return routed + shared
        scale = (n.float() * self.gate.float()).sum(-1, keepdim=True).sigmoid()  # (..., 1)
        return routed + shared * scale.cast(shared.dtype)


class RoutedFeedForward:
    def __init__(self, config: ModelConfig, weights: WeightSource, p: str, one_kernel: bool):
        c = self.c = config
        self.shared = SharedExpert(config, weights, p) if c.shared_expert_hidden_dim else None
        self.router = weights.linear(p + "ffn_gate_inp.weight")  # D -> experts
        self.selection_bias = _float32(weights.vector(p + "exp_probs_b.bias")) if c.selection_bias else None  # (experts,)
        names = [p + f"ffn_{n}_exps.weight" for n in ("gate", "up", "down")]
        self.expert_blocks = self.expert_tokens = None
        # in blocks only where the whole layer runs as one kernel: the five-kernel path has no
        # kernel for the experts, and takes the float16 ones
        if one_kernel and self._router_in_blocks:
            blocks = [weights.experts(name, c.experts) for name in names]
            if None not in blocks:
                self.expert_blocks = blocks
                self.expert_tokens = device_array(np.zeros(c.experts, np.int64))
        if self.expert_blocks is None:
            self.gate_exps = weights.float_experts(names[0], transposed=True)  # (E, D, F)
            self.up_exps = weights.float_experts(names[1], transposed=True)  # (E, D, F)
            self.down_exps = weights.float_experts(names[2], transposed=True)  # (E, F, D)
        biases = EXPERT_BIASES if c.expert_biases else ()
        self.expert_bias = {name: weights.vector(p + name) for name in biases}
        self._bias_values = {name: weights.vector_values(p + name) for name in biases}
        self.form = int(abi.LayerForm.SWIGLU_CLAMPED) if c.swiglu_clamped else 0

    @property
    def _router_in_blocks(self) -> bool:
        """Whether the feed-forward's matrices other than the experts are in blocks (a shared expert's too)."""
        return isinstance(self.router, BlockLinear) and (self.shared is None or self.shared.in_blocks)

    def routed_tokens(self) -> np.ndarray | None:
        """How many lanes each expert has taken since load (int64, one an expert), where the kernels
        count them (one kernel a layer); None elsewhere."""
        return None if self.expert_tokens is None else host_values(self.expert_tokens, np.int64)

    def blocks(self) -> dict | None:
        if self.expert_blocks is None:
            return None
        gate, up, down = self.expert_blocks
        own = {"gate_up": gate, "down": down, "router": self.router.weight, "up": up}
        return own if self.shared is None else own | {"shared_gate_up": self.shared.gate_up.weight, "shared_down": self.shared.down.weight}

    def kernel_experts(self) -> tuple:
        c, F = self.c, abi.ExpertsFlag
        flags = (F.NORM_WEIGHTS if c.expert_weights_norm else 0) | (F.SIGMOID if c.expert_sigmoid else 0)
        flags |= F.SELECTION_BIAS if c.selection_bias else 0
        experts = abi.Experts(c.experts, c.experts_used, c.expert_hidden_dim, int(flags))
        experts.weights_scale = c.expert_weights_scale
        if self.shared is not None:
            experts.shared_ffn_dim = self.shared.width
            if self.shared.gate is None:
                experts.flags |= F.SHARED_UNGATED
        return experts, self.expert_tokens

    def kernel_extras(self) -> dict:
        extras = {} if self.selection_bias is None else {"selection_bias": self.selection_bias}
        return extras if self.shared is None or self.shared.gate is None else extras | {"shared_gate": self.shared.gate}

    def biases(self) -> list[np.ndarray]:
        """LayerForm.BIASES' values after the layer's own: the router's, then every expert's products'."""
        return float32_values(self._bias_values, list(self.expert_bias))

    def drop_file_views(self) -> None:
        self._bias_values = {}

    def tensors(self) -> list[Tensor]:
        experts = [b.raw for b in self.expert_blocks] if self.expert_blocks is not None else [self.gate_exps, self.up_exps, self.down_exps]
        own = [t for t in (self.expert_tokens, self.selection_bias) if t is not None]
        shared = [] if self.shared is None else self.shared.tensors()
        return [*self.router.tensors(), *experts] + own + shared + list(self.expert_bias.values())

    def on_kernels(self, h: Tensor, norm: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
        out = self(rms_norm(h, norm, eps))
        return out if residual is None else (residual + out).contiguous()

    def __call__(self, n: Tensor) -> Tensor:
        """n (..., D) normed -> (..., D): every expert's output, weighted by the router's choice (plus
        the shared expert's)."""
        routed = self._routed(n)
        return routed if self.shared is None else self.shared.plus(routed, n)

    def _routed(self, n: Tensor) -> Tensor:
        c = self.c
        logits = self.router(n).float()  # (..., E)
        if self.expert_bias:
            logits = logits + self.expert_bias["ffn_gate_inp.bias"].float()
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
        x = n.unsqueeze(-2).unsqueeze(-2)  # (..., 1, 1, D)
        if math.prod(n.shape[:-1]) * c.experts_used < c.experts:
            # fewer tokens x choices than experts (a decode step's few lanes): each token reads only its
            # chosen experts, an indexed load tinygrad folds into the products
            gate, up = x @ self.gate_exps[chosen].cast(n.dtype), x @ self.up_exps[chosen].cast(n.dtype)  # (..., K, 1, F)
            out = self._expert_outputs(gate, up, chosen)  # (..., K, 1, D)
            return (out.squeeze(-2) * top.unsqueeze(-1).cast(n.dtype)).sum(-2)  # (..., D)
        # else every expert runs every token, weighed by a mask: each expert's weights read once
        mask = ((chosen.unsqueeze(-1) == Tensor.arange(c.experts)).float() * top.unsqueeze(-1)).sum(-2)  # (..., E)
        gate = x @ self.gate_exps.cast(n.dtype)  # (..., E, 1, F)
        up = x @ self.up_exps.cast(n.dtype)
        out = self._expert_outputs(gate, up)  # (..., E, 1, D)
        return (out.squeeze(-2) * mask.unsqueeze(-1).cast(n.dtype)).sum(-2)  # (..., D)

    def _expert_outputs(self, gate: Tensor, up: Tensor, chosen: Tensor | None = None) -> Tensor:
        """The experts' outputs (..., E, 1, D) from their gate and up rows (..., E, 1, F): every
        expert's, or with `chosen` (..., K) the chosen ones' (..., K, 1, D)."""
        E, F, D = self.c.experts, self.c.expert_hidden_dim, self.c.dim
        bias = self.expert_bias

        def of(name: str, width: int) -> Tensor:
            rows = bias[name].reshape(E, 1, width)
            return (rows if chosen is None else rows[chosen]).cast(gate.dtype)

        if bias:
            gate = gate + of("ffn_gate_exps.bias", F)
            up = up + of("ffn_up_exps.bias", F)
        if self.c.swiglu_clamped:
            gate, up = gate.minimum(LIMIT), up.clip(-LIMIT, LIMIT)
            mixed = gate * (gate * ALPHA).sigmoid() * (up + 1)
        else:
            mixed = gate.silu() * up
        down = self.down_exps if chosen is None else self.down_exps[chosen]
        out = mixed @ down.cast(gate.dtype)
        return out + of("ffn_down_exps.bias", D) if bias else out
