"""A vision encoder's attention and gelu on the CPU kernels' cores (c/vision_encoder.c).

Contract: `VisionEncoderKernels(library)` is what the SigLIP encoder takes as its `kernels`.
`attention(q, kt, v, out)` writes one head's softmax(q . kt) . v into `out`, where q is (rows, hd)
and already scaled, kt (hd, n) the keys transposed, v (n, hd), and out a (rows, hd) view whose rows
may be apart (one head's columns of a (patches, heads, hd) array); `runs_attention(hd)` says which
heads it takes. `gelu_tanh(x)` overwrites a contiguous float32 array with its gelu (tanh form) and
returns it. `linear(x, weight, bias, out, add)` is x @ weight.T + bias for a float16 or float32
weight stored (out, in) as the file has it, read in its own type (c/float_gemm.c), or a quantized
one in its blocks (a `HostBlocks`: the language model's products, c/linear.c, the rows of x
rounded to int8 blocks as a token's are; laid out for this build's products where the projector
was loaded with its library, else copied so once), written into `out` or added to it. Everything
C will read or write is checked here first (float32, shapes that agree, contiguous rows): a
ValueError, never an access past a buffer.
"""

from __future__ import annotations

import ctypes

import numpy as np

from webapp.engine.kernels.abi import MAX_HEAD_DIM, BlockType, Product
from webapp.engine.kernels.host_blocks import HostBlocks

FLOAT32 = np.dtype(np.float32)
WEIGHT_TYPES = {np.dtype(np.float32): BlockType.F32, np.dtype(np.float16): BlockType.F16}


class VisionEncoderKernels:
    def __init__(self, library: ctypes.CDLL):
        self._attend = library.tq_encoder_attention
        self._attend.argtypes, self._attend.restype = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4, ctypes.c_int
        self._gelu = library.tq_gelu_tanh
        self._gelu.argtypes, self._gelu.restype = [ctypes.c_void_p, ctypes.c_long], None
        self._gemm = library.tq_float_gemm
        self._gemm.argtypes, self._gemm.restype = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6, ctypes.c_int
        self._linear = library.tq_linear
        self._linear.argtypes, self._linear.restype = [ctypes.c_void_p] * 3 + [ctypes.POINTER(Product)], None
        self.library = library
        # a file-layout quantized matrix (a projector loaded without these kernels) in this build's layout, made once
        self._packed: dict[int, tuple[HostBlocks, HostBlocks]] = {}

    @staticmethod
    def runs_attention(head_dim: int) -> bool:
        """Whether heads of `head_dim` values run here (else the encoder's own NumPy attention)."""
        return 0 < head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0

    def attention(self, q: np.ndarray, kt: np.ndarray, v: np.ndarray, out: np.ndarray) -> None:
        rows, hd = q.shape
        n = v.shape[0]
        for name, array in (("q", q), ("kt", kt), ("v", v), ("out", out)):
            if array.dtype != FLOAT32 or array.ndim != 2:
                raise ValueError(f"{name} must be a 2-d float32 array, not {array.dtype} {array.shape}")
        if kt.shape != (hd, n) or v.shape != (n, hd) or out.shape != (rows, hd) or not self.runs_attention(hd):
            raise ValueError(f"shapes q {q.shape}, kt {kt.shape}, v {v.shape}, out {out.shape} do not make one head's attention here")
        if not (q.flags.c_contiguous and kt.flags.c_contiguous and v.flags.c_contiguous):
            raise ValueError("q, kt and v must be contiguous")
        if out.strides[1] != FLOAT32.itemsize or out.strides[0] < hd * FLOAT32.itemsize or out.strides[0] % FLOAT32.itemsize:
            raise ValueError(f"out's rows must each be contiguous and apart, not strides {out.strides}")
        if n == 0 or rows == 0:
            return
        stride = out.strides[0] // FLOAT32.itemsize
        if self._attend(out.ctypes.data, q.ctypes.data, kt.ctypes.data, v.ctypes.data, n, rows, hd, stride) != 0:
            raise ValueError(f"tq_encoder_attention refused n={n} rows={rows} hd={hd}")

    def gelu_tanh(self, x: np.ndarray) -> np.ndarray:
        if x.dtype != FLOAT32 or not x.flags.c_contiguous or not x.flags.writeable:
            raise ValueError(f"gelu runs in place on a contiguous, writable float32 array, not {x.dtype} {x.shape}")
        self._gelu(x.ctypes.data, x.size)
        return x

    def linear(
        self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None = None, add: bool = False
    ) -> np.ndarray:
        """x @ weight.T + bias as (rows, outs) float32: into a new array, or into `out` (rows, outs),
        whose rows may be apart, added to what it holds where `add`."""
        if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1] or 0 in x.shape or 0 in weight.shape:
            raise ValueError(f"x {x.shape} and weight {weight.shape} make no product")
        blocks = isinstance(weight, HostBlocks)
        if not blocks and (weight.dtype not in WEIGHT_TYPES or not weight.flags.c_contiguous):
            raise ValueError(f"the weight must be a contiguous float16 or float32 array or HostBlocks, not {weight.dtype}")
        rows, outs = x.shape[0], weight.shape[0]
        x = np.ascontiguousarray(x, dtype=np.float32)
        if bias is not None and (bias.dtype != FLOAT32 or bias.shape != (outs,) or not bias.flags.c_contiguous):
            raise ValueError(f"the bias must be a contiguous float32 array of {outs}, not {bias.dtype} {bias.shape}")
        if out is None:
            if add:
                raise ValueError("adding needs an output to add to")
            out = np.empty((rows, outs), dtype=np.float32)
        elif out.dtype != FLOAT32 or out.shape != (rows, outs) or out.strides[1] != FLOAT32.itemsize or out.strides[0] % FLOAT32.itemsize:
            raise ValueError(f"out must be a float32 ({rows}, {outs}) array with contiguous rows, not {out.dtype} {out.shape}")
        elif out.strides[0] < outs * FLOAT32.itemsize or not out.flags.writeable:
            raise ValueError(f"out's rows must be apart and writable, not strides {out.strides}")
        if blocks:
            return self._block_product(x, weight, bias, out, add)
        bias_address = None if bias is None else bias.ctypes.data
        stride = out.strides[0] // FLOAT32.itemsize
        args = (WEIGHT_TYPES[weight.dtype], rows, x.shape[1], outs, stride, int(add))
        if self._gemm(out.ctypes.data, x.ctypes.data, weight.ctypes.data, bias_address, *args) != 0:
            raise ValueError(f"tq_float_gemm refused {args}")
        return out

    def _block_product(self, x: np.ndarray, weight: HostBlocks, bias: np.ndarray | None, out: np.ndarray, add: bool) -> np.ndarray:
        rows, (outs, cols) = x.shape[0], weight.shape
        if weight.library is None:
            kept = self._packed.get(id(weight))
            if kept is None or kept[0] is not weight:
                kept = self._packed[id(weight)] = (weight, weight.packed(self.library))
            weight = kept[1]
        elif weight.library is not self.library:
            raise ValueError("the matrix's blocks are laid out for another build's kernels")
        y = out if not add and out.flags.c_contiguous else np.empty((rows, outs), dtype=np.float32)  # tq_linear writes whole rows
        self._linear(y.ctypes.data, weight.raw.ctypes.data, x.ctypes.data, Product(weight.layout, outs, cols, rows))
        if bias is not None:
            y += bias
        if add:
            out += y
        elif y is not out:
            out[...] = y
        return out
