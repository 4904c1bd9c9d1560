"""A layer's products with what surrounds them, on either path: one fused kernel where the matrix is
in blocks on the CPU kernels, tinygrad's operations around the product otherwise.

Contract: each function takes a product (`weights.BlockLinear` or tinygrad's linear) and returns what
the layer adds to its residual stream or feeds on; the float32 helpers read vectors the kernels take
as float32 buffers, refusing a file that stores them otherwise where the kernels need them.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor

from webapp.engine.device.buffers import device_array
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.ops import rms_norm
from webapp.engine.model.weights import BlockLinear, WeightSource


def after_norm(linear, x: Tensor, norm: Tensor | None, eps: float) -> Tensor:
    """linear(rms_norm(x) * norm); linear(x) where there is no norm (a layer without input norms)."""
    if norm is None:
        return linear(x)
    if isinstance(linear, BlockLinear):
        return linear.kernels.norm_linear(x, linear.weight, norm, eps)
    return linear(rms_norm(x, norm, eps))


def plus(linear, x: Tensor, residual: Tensor) -> Tensor:
    """residual + linear(x)."""
    if isinstance(linear, BlockLinear):
        return linear.kernels.residual_linear(x, linear.weight, residual)
    return (residual + linear(x)).contiguous()


def swiglu_plus(linear, gate_up: Tensor, residual: Tensor) -> Tensor:
    """residual + linear(silu(gate) * up), gate_up being gate's values then up's."""
    if isinstance(linear, BlockLinear):
        return linear.kernels.swiglu_linear(gate_up, linear.weight, residual)
    hidden = gate_up.shape[-1] // 2
    return (residual + linear(gate_up[..., :hidden].silu() * gate_up[..., hidden:])).contiguous()


def float32_values(values: dict[str, np.ndarray | None], names: list[str]) -> list[np.ndarray]:
    """The named biases' float32 values, refusing one the file stores otherwise (the kernels read float32)."""
    for name in names:
        if values[name] is None:
            raise ModelLoadError(f"{name} is not stored as F32, which the CPU kernels read")
    return [values[name] for name in names]


def float32_buffer(weights: WeightSource, names: list[str]) -> Tensor:
    """The named vectors one after another as one float32 buffer (the kernels read them so), read from
    the file straight into it where they are stored as F32."""
    values = [weights.vector_values(n) for n in names]
    if all(v is not None for v in values):
        return device_array(np.concatenate(values) if values else np.zeros(1, np.float32))
    return Tensor.cat(*(weights.vector(n) for n in names)).float().contiguous()
