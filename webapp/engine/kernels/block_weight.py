"""A matrix kept in its GGUF file's block format, as the CPU kernels read it, and how the log names it.

Contract: `BLOCK_FORMATS[ggml_type] = (name, values, bytes)` per block as the kernels count them, for
every type with a kernel; `BlockWeight` is one such matrix on the device (its bytes maybe repacked
into an interleaved or stacked layout, `ggml_type` then the stored type, abi.py's ROWS_X8 (ROWS_X16) and
STACKED); `stored_form(type)` says in words how a matrix of a type is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinygrad import Tensor

from webapp.engine.kernels.abi import ROWS_X8, STACKED, BlockType
from webapp.engine.kernels.ggml_types import GGML_TYPES

# The kernels read a plain float type (F32, F16, BF16: a GGML block of one value) in blocks of the
# activations' 32 values (format_float.c), so its rows are whole blocks like every other format's
ACTIVATION_BLOCK = 32


def _kernel_block(name: str, values: int, nbytes: int) -> tuple[str, int, int]:
    return (name, values, nbytes) if values > 1 else (name, ACTIVATION_BLOCK, ACTIVATION_BLOCK * nbytes)


# GGML type ids with a kernel: (name, values, bytes) per block as the kernels count them
BLOCK_FORMATS = {int(t): _kernel_block(*GGML_TYPES[t]) for t in BlockType}


@dataclass(frozen=True)
class BlockWeight:
    """A GGUF matrix kept in its file's block format: `raw` (rows, bytes per row) on the device."""

    raw: Tensor
    ggml_type: int
    rows: int
    cols: int
    parts: tuple[tuple[int, int], ...] = ()  # a STACKED matrix's parts: (stored type, rows) each

    @property
    def type_name(self) -> str:
        """The file's type, e.g. "Q4_1"; a stacked matrix's parts' types, e.g. "Q4_K+Q4_K+Q6_K"."""
        if self.parts:
            return "+".join(BLOCK_FORMATS[_file_type(t)][0] for t, _ in self.parts)
        return BLOCK_FORMATS[_file_type(self.ggml_type)][0]

    @property
    def form(self) -> str:
        """How the start-up log names this matrix's form, e.g. "Q4_1 blocks (rows interleaved)"."""
        return stored_form(self.ggml_type) + (" (rows interleaved)" if ROWS_X8 < self.ggml_type < STACKED else "")


def _file_type(stored_type: int) -> int:
    """The GGML type of a stored (maybe interleaved) type."""
    return stored_type % ROWS_X8 if ROWS_X8 <= stored_type < STACKED else stored_type


def stored_form(ggml_type: int) -> str:
    """How the start-up log names a matrix kept in the file's type: "Q4_1 blocks", "F16 (the file's bytes)"."""
    name, values, _ = GGML_TYPES[_file_type(ggml_type)]
    return f"{name} (the file's bytes)" if values == 1 else f"{name} blocks"
