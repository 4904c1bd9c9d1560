"""Matrices in the file's blocks on tinygrad's devices (every device but the CPU kernels' path):
dequantized inside the product's own kernel, so a step reads the file's bytes, not float16 copies.

Contract: `DeviceBlockLinear(parts, cols)` holds one or more matrices' raw GGUF blocks on the device
(each part a (rows, bytes a row) uint8 tensor, its GGML type and its rows; parts of different types
stack by rows, as a Q4_K_M layer's q and k in Q4_K over its v in Q6_K) and computes y = x @ W.T with
W dequantized lazily: tinygrad fuses the dequantization into the product's reduction, one kernel
that loads the blocks; from TENSOR_CORE_ROWS rows of float16 x (a prefill piece, a wide decode) W is
written out as float16 first, for a product on tensor cores. `DEVICE_BLOCK_TYPES` are the types whose
dequantization fuses that way: tinygrad's own for the types whose values are arithmetic on their
bytes, this module's for IQ4_XS and MXFP4, whose 16-value codebooks it reads by comparisons
(tinygrad's gathers from a table, a kernel of its own that writes every value out).
`DeviceBlockEmbedding` gathers token rows of an embedding's blocks and dequantizes those rows only.
"""

from __future__ import annotations

from tinygrad import Tensor, dtypes
from tinygrad.llm.gguf import ggml_data_to_tensor

from webapp.engine.kernels.ggml_types import GGML_TYPES
from webapp.engine.model.device_codebooks import CODEBOOK_TYPES

# From this many rows of float16 x a product first dequantizes W to float16 (a kernel of its own)
# and multiplies in float16 with float32 accumulation: tinygrad puts a fused dequantization's
# product on no tensor core, and rows enough share each weight for the float16 copy's traffic to pay.
TENSOR_CORE_ROWS = 16

# F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K: arithmetic on the block's bytes alone;
# IQ4_XS and MXFP4: a codebook read by comparisons
DEVICE_BLOCK_TYPES = frozenset({1, 30, 2, 3, 6, 7, 8, 12, 13, 14, *CODEBOOK_TYPES})


def row_bytes(ggml_type: int, cols: int) -> int:
    """The bytes of one row of `cols` values in `ggml_type`'s blocks."""
    _, values, nbytes = GGML_TYPES[ggml_type]
    return cols // values * nbytes


def dequantized(blocks: Tensor, ggml_type: int, rows: int, cols: int) -> Tensor:
    """(rows, cols) float values of (rows, row_bytes) blocks, as lazy tensor ops."""
    if ggml_type in CODEBOOK_TYPES:
        _, values, nbytes = GGML_TYPES[ggml_type]
        return CODEBOOK_TYPES[ggml_type](blocks.reshape(rows * cols // values, nbytes)).reshape(rows, cols)
    return ggml_data_to_tensor(blocks.flatten(), rows * cols, ggml_type).reshape(rows, cols)


def on_tensor_cores(x: Tensor) -> bool:
    """Whether a product of x (..., cols) runs on tensor cores: float16 rows, at least TENSOR_CORE_ROWS of them."""
    return x.dtype == dtypes.float16 and x.numel() // x.shape[-1] >= TENSOR_CORE_ROWS


class DeviceBlockLinear:
    """y = x @ W.T over W's blocks on the device, dequantized to the activations' dtype inside the product."""

    def __init__(self, parts: list[tuple[Tensor, int, int]], cols: int):
        self.parts, self.cols = parts, cols
        self.rows = sum(rows for _, _, rows in parts)

    def matrix(self, dtype) -> Tensor:
        """W (rows, cols) in `dtype`, lazily: realized alone it would be the float copy this class avoids."""
        mats = [dequantized(blocks, t, rows, self.cols).cast(dtype) for blocks, t, rows in self.parts]
        return mats[0] if len(mats) == 1 else Tensor.cat(*mats)

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        # a few lanes, or float32 activations (a device without float16 arithmetic has no tensor cores
        # either): the blocks read in the product
        if not on_tensor_cores(x):
            return x.linear(self.matrix(x.dtype).T, bias)
        # x, too, a buffer of its own: a norm fused into the product's input keeps it off the tensor cores
        y = x.contiguous() @ self.matrix(dtypes.float16).contiguous().T
        return y if bias is None else y + bias

    def tensors(self) -> list[Tensor]:
        return [blocks for blocks, _, _ in self.parts]


class DeviceBlockEmbedding:
    """token ids (...) -> (..., D) activations, from the embedding's blocks: only the tokens' rows are dequantized."""

    def __init__(self, blocks: Tensor, ggml_type: int, cols: int, act_dtype):
        self.blocks, self.ggml_type, self.cols, self.act_dtype = blocks, ggml_type, cols, act_dtype

    def __call__(self, tokens: Tensor) -> Tensor:
        picked = self.blocks[tokens.flatten()]  # (n, row bytes)
        rows = dequantized(picked, self.ggml_type, picked.shape[0], self.cols)
        return rows.reshape(*tokens.shape, self.cols).cast(self.act_dtype)

    def tensors(self) -> list[Tensor]:
        return [self.blocks]
