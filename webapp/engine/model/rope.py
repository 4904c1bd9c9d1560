"""RoPE's inverse frequencies as a GGUF file asks for them: the base, Llama 3's per-frequency factors,
linear position scaling, YaRN.

Contract: `inverse_frequencies(kv, arch, rotary_dim, freq_factors)` returns (rotary_dim / 2,) float32,
the angle per position of each rotary pair (pair i of a head turns by position * inv_freq[i]; a head's
values past rotary_dim, where the file's `rope.dimension_count` is below the head size, are not
turned), or raises
`RopeUnsupported` naming the file's setting that this server does not run. Every step, on every
device, rotates by these: the CPU kernels and tinygrad's path read the same tensor.
`mrope_sections(kv, arch, record, rotary_dim)` is the M-RoPE section each rotary pair turns by
(Qwen2-VL's images), () for plain RoPE, or `ModelLoadError` where the file's sections are not run.
`attention_factor(kv, arch)` is what YaRN multiplies both q and k by after rotating (1 otherwise):
attention's scores then grow by its square, which is how the steps apply it.

- Llama 3.1 / 3.2 files carry `rope_freqs.weight` (head_dim / 2 factors, llama.cpp's "freq_factors"):
  low frequencies are divided by up to the scaling factor (8), high ones kept, a ramp between. Ignoring
  it changes every position's angles past the first, so those files' logits were wrong without it.
- `rope.scaling.type = linear` (or the older `rope.scale_linear`) divides every angle by the factor:
  positions are compressed into the trained range.
- `rope.scaling.type = yarn` (Qwen2.5 / Qwen3 files made for long contexts) keeps the high
  frequencies, which turn many times within the trained context (`rope.scaling.original_context_length`),
  divides the low ones by the factor, and ramps between them over the pairs whose wavelengths fall
  between beta_fast (32) and beta_slow (1) turns of that context; attention's scores are then scaled by
  (1 + 0.1 ln factor)^2, as llama.cpp's rope_yarn does (its ext_factor 1 and attn_factor 1, the
  defaults for these files).
- LongRoPE (Phi-3 128k, Phi-4-mini) files carry two sets of per-frequency factors,
  `rope_factors_short.weight` and `rope_factors_long.weight`: the short ones when a slot's context
  fits the original one (`rope.scaling.original_context_length`), else the long ones, as llama.cpp
  picks them; the file's `rope.scaling.attn_factor` scales q and k.
- Partial rotary (`rope.dimension_count` below the head size, Phi-4-mini's 96 of 128): the
  frequencies are those of a head of rope.dimension_count values (theta^(-2i / dims)), as llama.cpp's
  n_rot gives them.
"""

from __future__ import annotations

import numpy as np

from webapp.engine.archs.record import MRope
from webapp.engine.model.load_error import ModelLoadError


class RopeUnsupported(ValueError):
    """The file's rotary embedding needs something this server does not implement."""


def inverse_frequencies(kv: dict, arch: str, head_dim: int, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """`head_dim`: the values a head's RoPE turns (ModelConfig.rotary_dim)."""
    theta = float(kv.get(f"{arch}.rope.freq_base", 10000.0))
    # Python floats, as the default model has always been computed: bit-identical logits
    inv = np.array([1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)], dtype=np.float64)
    kind = kv.get(f"{arch}.rope.scaling.type", "linear" if f"{arch}.rope.scale_linear" in kv else "none")
    factor = float(kv.get(f"{arch}.rope.scaling.factor", kv.get(f"{arch}.rope.scale_linear", 1.0)) or 1.0)
    if kind in ("linear", "yarn") and not (factor > 0 and np.isfinite(factor)):
        raise RopeUnsupported(f"rope scaling factor {factor} must be positive")
    if kind == "linear":
        inv /= factor
    elif kind == "yarn":
        inv = _yarn(inv, kv, arch, head_dim, theta, factor)
    elif kind != "none":
        raise RopeUnsupported(f"rope.scaling.type {kind!r} is not supported (supported: none, linear, yarn, and Llama 3's rope_freqs)")
    if freq_factors is not None:
        factors = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
        if factors.shape != inv.shape or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
            raise RopeUnsupported(f"rope_freqs.weight must hold {len(inv)} positive factors, not {factors.shape[0]} values")
        inv /= factors
    return inv.astype(np.float32)


def _yarn(inv: np.ndarray, kv: dict, arch: str, head_dim: int, theta: float, factor: float) -> np.ndarray:
    """YaRN's frequencies: pair i is extrapolated (kept) below the ramp, interpolated (divided by
    the factor) above it, mixed linearly across it."""
    original = kv.get(f"{arch}.rope.scaling.original_context_length")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise RopeUnsupported(f"YaRN needs rope.scaling.original_context_length, not {original!r}")
    fast, slow = float(kv.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)), float(kv.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0))

    def pair_turning(turns: float) -> float:  # the pair whose wavelength fits `turns` times in the original context
        return head_dim * np.log(original / (turns * 2 * np.pi)) / (2 * np.log(theta))

    low, high = max(np.floor(pair_turning(fast)), 0.0), min(np.ceil(pair_turning(slow)), head_dim - 1.0)
    ramp = np.clip((np.arange(len(inv)) - low) / max(high - low, 0.001), 0.0, 1.0)
    kept = 1.0 - ramp  # 1: extrapolate, 0: interpolate
    return inv / factor * (1.0 - kept) + inv * kept


def attention_factor(kv: dict, arch: str) -> float:
    """The magnitude factor on q and k (llama.cpp's mscale): the file's rope.scaling.attn_factor (1 when
    it has none; LongRoPE files carry theirs), times YaRN's own (1 + 0.1 ln factor)."""
    scale = float(kv.get(f"{arch}.rope.scaling.attn_factor", 1.0))
    if kv.get(f"{arch}.rope.scaling.type") != "yarn":
        return scale
    factor = float(kv.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    return scale * (1.0 + 0.1 * float(np.log(factor))) if factor > 0 else scale


def mrope_sections(kv: dict, arch: str, record, rotary_dim: int) -> tuple[int, ...]:
    """Each rotary pair's section (0: time, 1: row, 2: column) from the file's
    `rope.dimension_sections` (pairs a section, in that order, repeating past their sum, as llama.cpp's
    mrope reads them), laid out as the architecture's `record.mrope` says: in runs (Qwen2-VL), or
    interleaved (Qwen3-VL, Qwen3.5: pair k takes row where k % 3 is 1, column where it is 2, while
    its section lasts, else time; llama.cpp's imrope turns the last few of those by a fourth position,
    0 for an image's rows, where Qwen's own code keeps time: an angle of the lowest frequencies). ()
    where the file has none; ModelLoadError where the architecture takes none or they do not fit."""
    sections = kv.get(f"{arch}.rope.dimension_sections") or []
    if isinstance(sections, list) and not any(sections):
        return ()
    if record.mrope is MRope.NONE:
        raise ModelLoadError(f"GGUF metadata {arch}.rope.dimension_sections: multimodal RoPE (M-RoPE) is not supported")
    if (
        not isinstance(sections, list)
        or len(sections) != 4
        or not all(isinstance(n, int) and n >= 0 for n in sections)
        or not 0 < sum(sections) <= rotary_dim // 2
    ):
        raise ModelLoadError(
            f"GGUF metadata {arch}.rope.dimension_sections = {sections!r}: expected four sections (time, row, column, another) "
            f"of at most {rotary_dim // 2} pairs"
        )
    time, row, column, _ = sections
    out = []
    for pair in range(rotary_dim // 2):
        k = pair % sum(sections)
        if record.mrope is MRope.INTERLEAVED:
            out.append(1 if k % 3 == 1 and k < 3 * row else 2 if k % 3 == 2 and k < 3 * column else 0)
        else:
            out.append(0 if k < time else 1 if k < time + row else 2 if k < time + row + column else 0)
    return tuple(out)
