"""RoPE's inverse frequencies as a GGUF file asks for them: the base, Llama 3's per-frequency factors,
linear position scaling.

Contract: `inverse_frequencies(kv, arch, head_dim, freq_factors)` returns (head_dim / 2,) float32, the
angle per position of each rotary pair (pair i of a head turns by position * inv_freq[i]), or raises
`RopeUnsupported` naming the file's setting that this server does not run. Every step, on every
device, rotates by these: the CPU kernels and tinygrad's path read the same tensor.

- Llama 3.1 / 3.2 files carry `rope_freqs.weight` (head_dim / 2 factors, llama.cpp's "freq_factors"):
  low frequencies are divided by up to the scaling factor (8), high ones kept, a ramp between. Ignoring
  it changes every position's angles past the first, so those files' logits were wrong without it.
- `rope.scaling.type = linear` (or the older `rope.scale_linear`) divides every angle by the factor:
  positions are compressed into the trained range.
- YaRN also rescales attention logits, which the kernels do not do yet, and partial rotary
  (`rope.dimension_count` below the head size) pairs dimensions differently: both are refused at
  load rather than run with wrong logits.
"""

from __future__ import annotations

import numpy as np


class RopeUnsupported(ValueError):
    """The file's rotary embedding needs something this server does not implement."""


def inverse_frequencies(kv: dict, arch: str, head_dim: int, freq_factors: np.ndarray | None = None) -> np.ndarray:
    theta = float(kv.get(f"{arch}.rope.freq_base", 10000.0))
    dims = kv.get(f"{arch}.rope.dimension_count", head_dim)
    if dims != head_dim:
        raise RopeUnsupported(f"rope.dimension_count {dims} is smaller than the head size {head_dim} (partial rotary): not supported")
    # Python floats, as the default model has always been computed: bit-identical logits
    inv = np.array([1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)], dtype=np.float64)
    kind = kv.get(f"{arch}.rope.scaling.type", "linear" if f"{arch}.rope.scale_linear" in kv else "none")
    factor = float(kv.get(f"{arch}.rope.scaling.factor", kv.get(f"{arch}.rope.scale_linear", 1.0)) or 1.0)
    if kind == "linear":
        if factor <= 0:
            raise RopeUnsupported(f"rope scaling factor {factor} must be positive")
        inv /= factor
    elif kind != "none":
        raise RopeUnsupported(f"rope.scaling.type {kind!r} is not supported (supported: none, linear, and Llama 3's rope_freqs)")
    if freq_factors is not None:
        factors = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
        if factors.shape != inv.shape or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
            raise RopeUnsupported(f"rope_freqs.weight must hold {len(inv)} positive factors, not {factors.shape[0]} values")
        inv /= factors
    return inv.astype(np.float32)
