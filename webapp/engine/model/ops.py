"""Tensor operations the layers share on tinygrad's path: RMS norm, rotary position embedding, and
attention's softmax-weighted sum of values."""

from __future__ import annotations

from tinygrad import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x's rows rms-normed times weight, in x's dtype; computed in float32 whatever x's dtype: a float16
    square overflows from 256 up, and activations of real models reach past it."""
    xf = x.float()
    return (xf * (xf.square().mean(-1, keepdim=True) + eps).rsqrt() * weight).cast(x.dtype)


def rotation(pos: Tensor, inv_freq: Tensor, scale: float = 1.0, sections: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin of the RoPE angles for positions pos (T,) or (B, 1, 1), times `scale` (YaRN's or
    LongRoPE's attention factor): computed once a step, read by every layer. With M-RoPE's
    `sections` (3, half), each pair's one-hot row of positions, pos has a last axis of three (time,
    row, column) and each pair turns by its section's."""
    if sections is not None:
        angles = (pos.float().unsqueeze(-1) * sections).sum(-2) * inv_freq  # (..., 3, 1) x (3, half) -> (..., half)
    else:
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


def attended(scores: Tensor, values: Tensor, sinks: Tensor | None = None) -> Tensor:
    """softmax(scores) @ values over the last axis of scores (..., T, S) and the rows of values
    (..., S, V), with `sinks` (broadcast to (..., T, 1)) as one more score a row that weighs no
    value where given. The softmax's denominator comes out of the values' product, as one more
    column of values all ones, and the division follows it, so neither the weights' sum nor their
    division is a kernel of its own."""
    top = scores.max(-1, keepdim=True)
    if sinks is not None:
        sinks = sinks.cast(top.dtype)
        top = top.maximum(sinks)
    width = values.shape[-1]
    summed = (scores - top).exp() @ values.pad(((0, 0),) * (values.ndim - 1) + ((0, 1),), value=1.0)  # (..., T, V + 1)
    total = summed[..., width:]
    if sinks is not None:
        total = total + (sinks - top).exp().cast(total.dtype)
    return summed[..., :width] / total
