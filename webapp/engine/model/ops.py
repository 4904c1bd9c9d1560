"""Tensor operations the layers share on tinygrad's path: RMS norm and rotary position embedding."""

from __future__ import annotations

from tinygrad import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x's rows rms-normed times weight, in x's dtype; computed in float32 whatever x's dtype: a float16
    square overflows from 256 up, and activations of real models reach past it."""
    xf = x.float()
    return (xf * (xf.square().mean(-1, keepdim=True) + eps).rsqrt() * weight).cast(x.dtype)


def rotation(pos: Tensor, inv_freq: Tensor, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos and sin of the RoPE angles for positions pos (T,) or (B, 1, 1), times `scale` (YaRN's or
    LongRoPE's attention factor): computed once a step, read by every layer."""
    angles = pos.float().unsqueeze(-1) * inv_freq  # (..., half)
    if scale == 1.0:
        return angles.cos().contiguous(), angles.sin().contiguous()
    return (angles.cos() * scale).contiguous(), (angles.sin() * scale).contiguous()


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the half-split pairs of x (..., T, head_dim) by the angles whose cos and sin (..., half)
    are given: all of x, or its first 2 * half values (partial rotary), the rest passed as they are."""
    half = cos.shape[-1]
    if 2 * half < x.shape[-1]:
        return rope(x[..., : 2 * half], cos, sin).cat(x[..., 2 * half :], dim=-1)
    x1, x2 = x[..., :half], x[..., half:]
    return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)
