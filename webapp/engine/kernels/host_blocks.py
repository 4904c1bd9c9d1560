"""A matrix kept in its GGUF file's quantized blocks in host memory: how an image encoder holds a
quantized projector's matrices.

Contract: `HostBlocks(raw, ggml_type, cols)` is a (rows, cols) matrix whose `raw` (rows, bytes a row)
uint8 holds whole blocks of `ggml_type`, a type the CPU kernels multiply (abi.py's BlockType, not a
float type), in the file's layout; `shape`, `ndim` and `nbytes` read as an array's do. `packed(library)`
is the same matrix in the layout that kernel build's products read fastest (tq_repack: `layout` its
stored type, `library` the build); `floats()` is its float32 values whatever its layout, for whoever
multiplies with NumPy. `stacked(matrices)` is several matrices of one width one above the other:
blocks where all are file-layout blocks of one type, else float32.
"""

from __future__ import annotations

import ctypes

import numpy as np

from webapp.engine.kernels.abi import BlockType, Product
from webapp.engine.kernels.ggml_types import GGML_TYPES


class HostBlocks:
    def __init__(self, raw: np.ndarray, ggml_type: int, cols: int, layout: int | None = None, library: ctypes.CDLL | None = None):
        name, values, nbytes = GGML_TYPES.get(ggml_type, ("?", 1, 0))
        if ggml_type not in set(BlockType) or values == 1:
            raise ValueError(f"{name} is not a block type the kernels multiply")
        if raw.dtype != np.uint8 or raw.ndim != 2 or cols % values or raw.shape[1] != cols // values * nbytes:
            raise ValueError(f"{raw.dtype} {raw.shape} is not rows of {cols} {name} values")
        self.raw, self.ggml_type, self.cols = np.ascontiguousarray(raw), ggml_type, cols
        self.layout, self.library = ggml_type if layout is None else layout, library

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.cols

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def packed(self, library: ctypes.CDLL) -> HostBlocks:
        """This file-layout matrix as `library`'s products read it (rows in eights interleaved where they interleave)."""
        if self.library is not None:
            raise ValueError("the matrix is no longer in its file's layout")
        repack = library.tq_repack
        repack.argtypes, repack.restype = [ctypes.c_void_p] * 2 + [ctypes.POINTER(Product)], ctypes.c_int
        raw = np.empty_like(self.raw)
        layout = repack(raw.ctypes.data, self.raw.ctypes.data, Product(self.ggml_type, self.shape[0], self.cols))
        return HostBlocks(raw, self.ggml_type, self.cols, layout, library)

    def floats(self) -> np.ndarray:
        if self.library is None:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            return np.asarray(dequantize(self.raw, GGMLQuantizationType(self.ggml_type)), dtype=np.float32).reshape(self.shape)
        dequantize = self.library.tq_dequantize
        dequantize.argtypes, dequantize.restype = [ctypes.c_void_p] * 2 + [ctypes.POINTER(Product)], None
        values = np.empty(self.shape, dtype=np.float32)
        dequantize(values.ctypes.data, self.raw.ctypes.data, Product(self.layout, *self.shape))
        return values


def stacked(matrices: list) -> np.ndarray | HostBlocks:
    """`matrices` (arrays or HostBlocks, all as wide) one above the other."""
    first = matrices[0]
    if all(isinstance(m, HostBlocks) and m.library is None and m.ggml_type == first.ggml_type for m in matrices):
        return HostBlocks(np.concatenate([m.raw for m in matrices]), first.ggml_type, first.cols)
    if any(isinstance(m, HostBlocks) for m in matrices):
        return np.concatenate([m.floats() if isinstance(m, HostBlocks) else m.astype(np.float32) for m in matrices])
    return np.concatenate(matrices)
