"""IQ4_XS, Q3_K and Q2_K blocks from float matrices, in NumPy, for test files (gguf-py dequantizes these
types but cannot write them).

Plain rounding from each sub-block's largest value, not llama.cpp's search for the best scales (nor
its importance weights): exact GGUF blocks of values close to the matrix, which is all a test of how
they are read and multiplied needs.
"""

from __future__ import annotations

import numpy as np

Q2_K, Q3_K, IQ4_XS = 10, 11, 23
IQ4_TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b > 0)


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """(blocks, 256) values 0..3 -> (blocks, 64): value 128h + 32j + l at bit pair j of byte 32h + l."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols / 256 * 136) uint8: per 256 values a float16 d, eight 6-bit
    sub-scales (stored plus 32: 16 high bits, then 4 bytes of low nibbles), then 4-bit table indices."""
    rows, cols = x.shape
    sub = x.astype(np.float32).reshape(-1, 8, 32)  # (blocks, sub-blocks, values)
    step = np.abs(sub).max(-1) / 127  # x ~ step * IQ4_TABLE[index]
    d = (step.max(-1) / 31).astype(np.float16)
    dd = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_divide(step, dd)), 0, 31).astype(np.int64)  # stored plus 32
    dl = (dd * sc)[..., None, None]  # (blocks, 8, 1, 1)
    index = np.abs(dl * IQ4_TABLE - sub[..., None]).argmin(-1).astype(np.uint8)  # (blocks, 8, 32)
    stored = sc + 32
    high = (((stored >> 4) & 3) << (2 * np.arange(8))).sum(-1).astype(np.uint16)
    low = (stored[:, 0::2] & 15 | (stored[:, 1::2] & 15) << 4).astype(np.uint8)
    quants = (index[:, :, :16] | index[:, :, 16:] << 4).reshape(-1, 128)
    blocks = np.concatenate([_fp16_bytes(d), high.view(np.uint8).reshape(-1, 2), low, quants], axis=1)
    return blocks.reshape(rows, cols // 256 * 136)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols / 256 * 110) uint8: per 256 values each value's third bit (32
    bytes), its low bit pairs (64 bytes), sixteen 6-bit sub-scales (stored plus 32, packed in 12 bytes),
    a float16 d; values -4..3 stored plus 4."""
    rows, cols = x.shape
    sub = x.astype(np.float32).reshape(-1, 16, 16)
    step = np.abs(sub).max(-1) / 4  # x ~ d * sc * q, q in -4..3
    d = (step.max(-1) / 31).astype(np.float16)
    dd = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_divide(step, dd)), 0, 31).astype(np.int64)
    q = np.clip(np.rint(_divide(sub, (dd * sc)[..., None])), -4, 3).astype(np.int64).reshape(-1, 256) + 4
    h, j = np.arange(256) // 128, np.arange(256) // 32 % 4
    high = np.zeros((len(q), 32), np.int64)
    np.add.at(high, (slice(None), np.arange(256) % 32), (q >> 2) << (4 * h + j))  # bit 4h + j of byte l
    stored, k = sc + 32, np.arange(16)
    packed = np.zeros((len(q), 12), np.int64)
    np.add.at(packed, (slice(None), k % 8), (stored & 15) << 4 * (k // 8))
    np.add.at(packed, (slice(None), 8 + k % 4), (stored >> 4) << 2 * (k // 4))
    blocks = np.concatenate([high.astype(np.uint8), _two_bit_planes(q & 3), packed.astype(np.uint8), _fp16_bytes(d)], axis=1)
    return blocks.reshape(rows, cols // 256 * 110)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols / 256 * 84) uint8: per 256 values sixteen bytes of a 4-bit
    sub-scale and a 4-bit sub-min, the 2-bit values, a float16 d and dmin: x ~ d * sc * q - dmin * mn."""
    rows, cols = x.shape
    sub = x.astype(np.float32).reshape(-1, 16, 16)
    low = np.minimum(sub.min(-1), 0.0)
    step = (sub.max(-1) - low) / 3
    d, dmin = (step.max(-1) / 15).astype(np.float16), (-low.min(-1) / 15).astype(np.float16)
    dd, dm = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_divide(step, dd)), 0, 15).astype(np.uint8)
    mn = np.clip(np.rint(_divide(-low, dm)), 0, 15).astype(np.uint8)
    q = np.clip(np.rint(_divide(sub + (dm * mn)[..., None], (dd * sc)[..., None])), 0, 3).astype(np.uint8).reshape(-1, 256)
    blocks = np.concatenate([sc | mn << 4, _two_bit_planes(q), _fp16_bytes(d), _fp16_bytes(dmin)], axis=1)
    return blocks.reshape(rows, cols // 256 * 84)


QUANTIZERS = {IQ4_XS: quantize_iq4_xs, Q3_K: quantize_q3_k, Q2_K: quantize_q2_k}
