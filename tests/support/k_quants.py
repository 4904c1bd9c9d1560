"""Q4_K, Q5_K, Q6_K and IQ4_NL blocks from float matrices, in NumPy, for test files (gguf-py dequantizes these
but cannot write them, and llama-quantize is a bench tool, not a test dependency).

Plain min/max rounding, not llama.cpp's search for the best scales: the blocks are exact GGUF blocks
of values close to the matrix, which is all a test of how they are read and multiplied needs.
`k_m_type(name, layer, layers, tied, base)` is llama-quantize's choice of type per tensor for a Q4_K_M or Q5_K_M file.
"""

from __future__ import annotations

import numpy as np

Q4_K, Q5_K, Q6_K = 12, 13, 14
IQ4_NL = 20
# GGML's IQ4_NL levels (kvalues_iq4nl), the table every IQ4_NL block indexes
IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols / 256 * 144) uint8: per 256 values a float16 scale and min, eight
    6-bit sub-scales and sub-mins (one per 32 values) packed in 12 bytes, then 4-bit quants."""
    rows, cols = x.shape
    sub = x.astype(np.float32).reshape(-1, 8, 32)  # (blocks, sub-blocks, values)
    low = np.minimum(sub.min(-1), 0.0)  # x ~ d * sc * q - dmin * m, q in 0..15
    scale = (sub.max(-1) - low) / 15
    d = _fp16(scale.max(-1) / 63)
    dmin = _fp16(-low.min(-1) / 63)
    dd, dm = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, dd, out=np.zeros_like(scale), where=dd > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(-low, dm, out=np.zeros_like(low), where=dm > 0)), 0, 63).astype(np.uint8)
    step = (dd * sc)[..., None]
    shifted = sub + (dm * mn)[..., None]
    q = np.clip(np.rint(np.divide(shifted, step, out=np.zeros_like(sub), where=step > 0)), 0, 15).astype(np.uint8)
    packed = np.empty((len(sub), 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    pairs = q.reshape(-1, 4, 2, 32)  # sub-blocks 2j and 2j+1 share 32 bytes: low nibbles, then high
    quants = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, quants], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols / 256 * 176) uint8: Q4_K's scales and mins, then each value's
    fifth bit (bit j of byte i for value i of sub-block j, 32 bytes), then the low 4 bits as Q4_K packs them."""
    rows, cols = x.shape
    sub = x.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)  # x ~ d * sc * q - dmin * m, q in 0..31
    scale = (sub.max(-1) - low) / 31
    d, dmin = _fp16(scale.max(-1) / 63), _fp16(-low.min(-1) / 63)
    dd, dm = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, dd, out=np.zeros_like(scale), where=dd > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(-low, dm, out=np.zeros_like(low), where=dm > 0)), 0, 63).astype(np.uint8)
    step = (dd * sc)[..., None]
    q = np.clip(np.rint(np.divide(sub + (dm * mn)[..., None], step, out=np.zeros_like(sub), where=step > 0)), 0, 31).astype(np.uint8)
    packed = np.empty((len(sub), 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    high = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)  # (blocks, 32)
    pairs = (q & 15).reshape(-1, 4, 2, 32)
    quants = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, high, quants], axis=1)
    return blocks.reshape(rows, cols // 256 * 176)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols / 256 * 210) uint8: per 256 values 6-bit quants as low nibbles
    (128 bytes) and high pairs (64 bytes), sixteen int8 sub-scales (one per 16 values), a float16 scale."""
    rows, cols = x.shape
    sub = x.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31  # x ~ d * sc * (q - 32), q in 0..63
    d = _fp16(scale.max(-1) / 127)
    dd = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, dd, out=np.zeros_like(scale), where=dd > 0)), 0, 127).astype(np.int8)
    step = (dd * sc)[..., None]
    q = np.clip(np.rint(np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)), -32, 31).astype(np.int64) + 32
    q = q.reshape(-1, 2, 4, 32)  # (blocks, halves of 128, quarters, values)
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    blocks = np.concatenate(
        [ql.reshape(-1, 128).astype(np.uint8), qh.reshape(-1, 64).astype(np.uint8), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
        axis=1,
    )
    return blocks.reshape(rows, cols // 256 * 210)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols / 32 * 18) uint8: per 32 values a float16 scale d, then 4-bit
    indices into IQ4_NL_LEVELS (low nibbles values 0..15, high 16..31), each value's nearest level of
    d * level; d puts the block's largest magnitude on the table's end, -127 (llama.cpp's first guess)."""
    rows, cols = x.shape
    blocks = x.astype(np.float32).reshape(-1, 32)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[:, None], axis=-1)  # (blocks, 1), signed
    d = _fp16(extreme / IQ4_NL_LEVELS[0])
    dd = d.astype(np.float32)
    scaled = np.divide(blocks, dd, out=np.zeros_like(blocks), where=dd != 0)
    q = np.abs(scaled[..., None] - IQ4_NL_LEVELS).argmin(-1).astype(np.uint8)  # (blocks, 32)
    quants = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), quants], axis=1).reshape(rows, cols // 32 * 18)


QUANTIZERS = {Q4_K: quantize_q4_k, Q5_K: quantize_q5_k, Q6_K: quantize_q6_k, IQ4_NL: quantize_iq4_nl}


def _more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's layers that get more bits in a _M mix: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def k_m_type(name: str, layer: int | None, layers: int, tied: bool, base: int = Q4_K) -> int:
    """The type llama-quantize gives a matrix of a Q4_K_M file (base Q4_K) or a Q5_K_M one (Q5_K): Q6_K
    for the output head (the embedding when the file ties them), and for attn_v and ffn_down of the
    layers `_more_bits` picks; `base` for the rest."""
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        return Q6_K
    if layer is not None and name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) and _more_bits(layer, layers):
        return Q6_K
    return base
