"""NumPy's reference of the KV cache's rows (webapp/engine/model/kv_types.py, c/attention_q8.c),
written from the format's definition: per 32 values, d = max |x| / 127 in float32, q = x * (1 / d)
rounded to nearest even, d kept as float16 before the block's 32 int8."""

from __future__ import annotations

import numpy as np

BLOCK, BLOCK_BYTES = 32, 34


def q8_rows(x: np.ndarray) -> np.ndarray:
    """float values (..., head_dim) -> Q8_0 rows (..., head_dim / 32 * 34) uint8."""
    *lead, head_dim = x.shape
    blocks = x.astype(np.float32).reshape(*lead, head_dim // BLOCK, BLOCK)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv).astype(np.int8)
    rows = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=-1)
    return rows.reshape(*lead, head_dim // BLOCK * BLOCK_BYTES)


def q8_values(rows: np.ndarray) -> np.ndarray:
    """Q8_0 rows (..., head_dim / 32 * 34) uint8 -> their values (..., head_dim) float32."""
    *lead, width = rows.shape
    blocks = np.ascontiguousarray(rows).reshape(*lead, width // BLOCK_BYTES, BLOCK_BYTES)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return (q * d).reshape(*lead, width // BLOCK_BYTES * BLOCK)


def cached(x: np.ndarray, kv_type: str) -> np.ndarray:
    """Keys or values (..., head_dim) as a KV cache of `kv_type` ("f16", "q8_0") gives them back, float64."""
    if kv_type == "q8_0":
        return q8_values(q8_rows(x)).astype(np.float64)
    return x.astype(np.float16).astype(np.float64)
