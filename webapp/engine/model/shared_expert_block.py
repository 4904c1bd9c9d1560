"""A mixture of experts with a shared expert beside the routed ones (qwen2moe: Qwen1.5-MoE-A2.7B,
Qwen2-57B-A14B): qwen2's attention (q/k/v biases, from the file), then `MoeBlock`'s routed experts
plus one SwiGLU feed-forward that every token runs, scaled by its own gate.

Contract: `SharedExpertBlock` fills MoeBlock's hooks. n being the normed residual stream, a token's
feed-forward output is
    sum_j p_j expert_j(n) + sigmoid(g . n) * W_down_s . (silu(W_gate_s . n) * W_up_s . n)
the routed sum as MoeBlock computes it (qwen2moe's chosen probabilities as they are: not divided by
their sum), g the file's ffn_gate_inp_shexp (D values), the shared expert's width
expert_shared_feed_forward_length; llama.cpp's qwen2moe graph adds the two the same way before the
residual. On the CPU kernels, with every matrix in blocks, the layer stays one kernel (LayerEntry's
SHARED_GATE_UP, SHARED_DOWN and SHARED_GATE; kernels/c/shared_expert.c); elsewhere tinygrad runs the
shared expert beside MoeBlock's masked experts.

GLM-4.5's shared experts (glm4moe: expert_shared_count of them, stored as one of that many times the
routed experts' width) have no gate (`shared_expert_gated` false): their output is added as it is,
as llama.cpp's glm4-moe graph adds it.
"""

from __future__ import annotations

from tinygrad import Tensor, dtypes

from webapp.engine.kernels import abi
from webapp.engine.model.moe_block import MoeBlock
from webapp.engine.model.weights import BlockLinear, WeightSource


class SharedExpertBlock(MoeBlock):
    def _load_feed_forward(self, weights: WeightSource, p: str) -> None:
        self.shared_gate_up = weights.linear(p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight")  # D -> 2*S
        self.shared_down = weights.linear(p + "ffn_down_shexp.weight")  # S -> D
        self.shared_gate = None
        if self.c.shared_expert_gated:
            gate = weights.vector(p + "ffn_gate_inp_shexp.weight")  # (D,): the kernels read float32
            self.shared_gate = gate if gate.dtype == dtypes.float32 else gate.float().contiguous()
        super()._load_feed_forward(weights, p)

    @property
    def _router_in_blocks(self) -> bool:
        return super()._router_in_blocks and isinstance(self.shared_gate_up, BlockLinear) and isinstance(self.shared_down, BlockLinear)

    def _feed_forward_blocks(self) -> dict | None:
        blocks = super()._feed_forward_blocks()
        if blocks is None:
            return None
        return blocks | {"shared_gate_up": self.shared_gate_up.weight, "shared_down": self.shared_down.weight}

    def _kernel_experts(self) -> tuple:
        experts, tokens = super()._kernel_experts()
        experts.shared_ffn_dim = self.c.shared_expert_hidden_dim
        if self.shared_gate is None:
            experts.flags |= abi.ExpertsFlag.SHARED_UNGATED
        return experts, tokens

    def _kernel_form(self) -> dict:
        form = super()._kernel_form()
        return form if self.shared_gate is None else form | {"shared_gate": self.shared_gate}

    def _feed_forward_tensors(self) -> list[Tensor]:
        gate = [] if self.shared_gate is None else [self.shared_gate]
        return super()._feed_forward_tensors() + [*self.shared_gate_up.tensors(), *self.shared_down.tensors(), *gate]

    def feed_forward(self, n: Tensor) -> Tensor:
        """n (..., D) normed -> (..., D): the routed experts' weighted sum plus the (gated) shared expert."""
        S = self.c.shared_expert_hidden_dim
        gate_up = self.shared_gate_up(n).contiguous()  # (..., 2*S)
        shared = self.shared_down((gate_up[..., :S].silu() * gate_up[..., S:]).contiguous())  # (..., D)
        if self.shared_gate is None:
            return super().feed_forward(n) + shared
        scale = (n.float() * self.shared_gate.float()).sum(-1, keepdim=True).sigmoid()  # (..., 1)
        return super().feed_forward(n) + shared * scale.cast(shared.dtype)
