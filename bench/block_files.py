"""Quantized GGUF files written block by block, for shapes too big to write as float16 first.

A 48-layer Qwen3-30B-A3B in Q4_K_M is ~18 GB; as float16 for llama-quantize it would be ~60 GB.
`write_blocks(writer, tensors, layers, tied, mix)` writes each matrix straight in the type that
llama-quantize's `mix` gives it (Q4_K_M and Q5_K_M: tests/support/k_quants.k_m_type, Q6_K for the
head and some layers' attn_v and ffn_down, Q4_K or Q5_K for the rest; MXFP4_MOE: the experts in
MXFP4, every other matrix in Q8_0, as gpt-oss files are), its rows drawn from a pool of random rows
of that width quantized once (tests/support/k_quants.py, gguf-py's quantizers): real blocks with sane
scales, at the speed of copying bytes. Speed depends on shapes, not numbers, so every expert drawing on one pool costs a product what
its own random rows would. Tensors stream to the file one at a time: memory holds one tensor.
"""

from __future__ import annotations

import re

import gguf
import numpy as np
from support.k_quants import Q4_K, Q5_K, Q6_K, QUANTIZERS, k_m_type

# llama_ftype of each mix, as its files' general.file_type says (F16: every matrix float16, its rows
# from a pool as the others', for shapes whose random float16 values take minutes to draw)
MIXES = {"Q4_K_M": 15, "Q5_K_M": 17, "MXFP4_MOE": 38, "F16": 1}
POOL_ROWS = 256


class Random:
    """A random matrix not made yet: `shape` (..., rows, cols) of normal values times `scale`."""

    def __init__(self, shape: tuple[int, ...], scale: float):
        self.shape, self.scale = shape, scale


def _layer(name: str) -> int | None:
    match = re.match(r"blk\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def mix_type(mix: str, name: str, layers: int, tied: bool) -> int:
    """The type llama-quantize gives matrix `name` in a `mix` file."""
    if mix == "MXFP4_MOE":
        return gguf.GGMLQuantizationType.MXFP4 if "_exps." in name else gguf.GGMLQuantizationType.Q8_0
    if mix == "F16":
        return gguf.GGMLQuantizationType.F16
    return k_m_type(name, _layer(name), layers, tied, Q4_K if mix == "Q4_K_M" else Q5_K)


# llama-quantize's type for a matrix whose rows are not whole 256-value blocks (DeepSeek-V2's k_b: 128)
FALLBACK = {Q4_K: gguf.GGMLQuantizationType.Q5_0, Q5_K: gguf.GGMLQuantizationType.Q5_1, Q6_K: gguf.GGMLQuantizationType.Q8_0}


def _fitting(ggml_type: int, cols: int) -> int:
    return FALLBACK.get(ggml_type, ggml_type) if cols % 256 else ggml_type


def _quantized(rows: np.ndarray, ggml_type: int) -> np.ndarray:
    if ggml_type in QUANTIZERS:
        return QUANTIZERS[ggml_type](rows)
    if ggml_type == gguf.GGMLQuantizationType.F16:
        return rows.astype(np.float16).view(np.uint8)
    return gguf.quants.quantize(rows, gguf.GGMLQuantizationType(ggml_type))


def write_blocks(writer: gguf.GGUFWriter, tensors: list[tuple[str, object]], layers: int, tied: bool, mix: str, seed: int = 0) -> None:
    """Write `tensors` ((name, ndarray or Random) in file order) through `writer`, whose metadata is
    set: arrays as they are, each Random in its type of `mix` (one of MIXES)."""
    rng = np.random.default_rng(seed)
    pools: dict[tuple[int, int, float], np.ndarray] = {}

    def kind(name: str, value) -> int | None:
        if not isinstance(value, Random):
            return None
        return _fitting(mix_type(mix, name, layers, tied), value.shape[-1])

    def blocks(value: Random, ggml_type: int) -> np.ndarray:
        *outer, rows, cols = value.shape
        key = (ggml_type, cols, value.scale)
        if key not in pools:
            pools[key] = _quantized(rng.standard_normal((POOL_ROWS, cols), dtype=np.float32) * value.scale, ggml_type)
        picks = rng.integers(0, POOL_ROWS, size=int(np.prod(outer, dtype=np.int64)) * rows)
        return pools[key][picks].reshape(*outer, rows, -1)

    for name, value in tensors:
        ggml_type = kind(name, value)
        if ggml_type is None:
            writer.add_tensor_info(name, value.shape, value.dtype, value.nbytes)
        else:
            *outer, rows, cols = value.shape
            block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
            row_bytes = cols // block_values * block_bytes
            nbytes = int(np.prod(outer, dtype=np.int64)) * rows * row_bytes
            writer.add_tensor_info(name, (*outer, rows, row_bytes), np.dtype(np.uint8), nbytes, gguf.GGMLQuantizationType(ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, value in tensors:
        ggml_type = kind(name, value)
        writer.write_tensor_data(value if ggml_type is None else blocks(value, ggml_type))
    writer.close()
