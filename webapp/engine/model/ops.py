"""Tensor operations the layers share on tinygrad's path: RMS norm and rotary position embedding."""

from __future__ import annotations

from tinygrad import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * (x.square().mean(-1, keepdim=True) + eps).rsqrt() * weight


def rotation(pos: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of the RoPE angles for positions pos (T,) or (B, 1, 1): computed once a step, read by every layer."""
    angles = pos.float().unsqueeze(-1) * inv_freq  # (..., half)
    return angles.cos().contiguous(), angles.sin().contiguous()


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the half-split pairs of x (..., T, head_dim) by the angles whose cos and sin are given."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)
