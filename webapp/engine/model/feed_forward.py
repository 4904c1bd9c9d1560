"""A layer's feed-forward as a component the layer holds: dense (SwiGLU, or GeGLU as an option) here,
routed experts with or without a shared expert in routed.py; `feed_forward_for` chooses from the config.

Contract: every feed-forward takes the normed residual stream n (..., D) to (..., D) on tinygrad's
path (`__call__`) and, on the CPU kernels, `on_kernels(h, norm, eps, residual)` = itself of
rms_norm(h) * norm, plus `residual` where one is given (the add fused into the down product where
it is in blocks); how its output joins the residual stream is the layer's norm policy's
(norm_policy.py). For the kernels' one-kernel layer it gives LayerMatrices' feed-forward fields
(`blocks`, None where some matrix is outside blocks), LayerTensors' experts (`kernel_experts`), its
entries and form bits (`kernel_extras`, `form`), and the float32 biases it adds to the layer's
(`biases`); `drop_file_views` forgets views into the file's memory map once the layer is built.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor

from webapp.engine.kernels import abi
from webapp.engine.model.config import ModelConfig
from webapp.engine.model.products import after_norm, swiglu_plus
from webapp.engine.model.routed import RoutedFeedForward
from webapp.engine.model.weights import BlockLinear, WeightSource


class DenseFeedForward:
    """silu(gate) * up, then down: gate and up one product (D -> 2F), as fewer, larger kernels run
    faster. With `geglu` (Gemma 3) gelu(gate) * up, gelu by tanh's approximation as llama.cpp's."""

    def __init__(self, config: ModelConfig, weights: WeightSource, p: str):
        self.c = config
        self.geglu = config.geglu
        self.form = int(abi.LayerForm.GEGLU) if self.geglu else 0
        self.gate_up = weights.linear(*config.gate_up_names(p))  # D -> 2*F
        self.down = weights.linear(p + "ffn_down.weight")  # F -> D

    def blocks(self) -> dict | None:
        if isinstance(self.gate_up, BlockLinear) and isinstance(self.down, BlockLinear):
            return {"gate_up": self.gate_up.weight, "down": self.down.weight}
        return None

    def kernel_experts(self) -> tuple:
        """LayerTensors' experts and expert_tokens: a dense layer has none."""
        return ()

    def kernel_extras(self) -> dict:
        return {}

    def biases(self) -> list[np.ndarray]:
        return []

    def drop_file_views(self) -> None:
        pass

    def routed_tokens(self) -> np.ndarray | None:
        return None

    def tensors(self) -> list[Tensor]:
        return [*self.gate_up.tensors(), *self.down.tensors()]

    def on_kernels(self, h: Tensor, norm: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
        gate_up = after_norm(self.gate_up, h, norm, eps)
        if residual is not None and not self.geglu:  # the kernels' SwiGLU product adds the residual itself
            return swiglu_plus(self.down, gate_up, residual)
        out = self.down(self._mixed(gate_up))
        return out if residual is None else (residual + out).contiguous()

    def _gated(self, gate_up: Tensor) -> Tensor:
        hidden = self.c.hidden_dim
        gate = gate_up[..., :hidden].gelu() if self.geglu else gate_up[..., :hidden].silu()
        return gate * gate_up[..., hidden:]

    def _mixed(self, gate_up: Tensor) -> Tensor:
        return self._gated(gate_up).contiguous()  # the kernels read a buffer

    def __call__(self, n: Tensor) -> Tensor:
        # the gating computed where the down product reads its input: no kernel and no buffer of its own
        return self.down(self._gated(self.gate_up(n).contiguous()))  # gate_up (B, T, 2*F)


def feed_forward_for(config: ModelConfig, weights: WeightSource, layer: int, one_kernel: bool):
    """Layer `layer`'s feed-forward: routed experts (with a shared expert where the config has one) in
    a mixture's layers past its leading dense ones, else dense. `one_kernel`: the layer's attention
    runs inside the kernels' one-kernel layer, so the experts may be read in their blocks."""
    p = f"blk.{layer}."
    return RoutedFeedForward(config, weights, p, one_kernel) if config.routed(layer) else DenseFeedForward(config, weights, p)
