"""The GGUF file format: metadata and tensor table, read through one memory map.

Contract: `read_gguf(path)` returns the file's metadata (a dict of plain Python values) and its
tensors as `RawTensor`s whose bytes are views into the map, so only the pages that are used are ever
read. A file that lies about its own layout (truncated, offsets past the end, counts that do not
fit) raises `ValueError` naming the problem: GGUF files are untrusted input. `float_values(path,
name, tensor)` reads one (small) tensor whole as float32 in any block format, for the parts the
kernels never see (a projector's weights, a reranker's head).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from webapp.engine.kernels.block_weight import BLOCK_FORMATS
from webapp.engine.kernels.ggml_types import GGML_TYPES


@dataclass(frozen=True)
class RawTensor:
    """One tensor of a GGUF file as stored: ggml type, (rows, cols), and its bytes (memory-mapped)."""

    ggml_type: int
    rows: int
    cols: int
    data: np.ndarray | None  # (rows, bytes per row) uint8; None for a type without a kernel (F32 vectors have it)
    shape: tuple[int, ...] = ()  # as tinygrad's tensors have it: the file's dimensions, last first
    start: int = 0  # where its bytes lie in the file
    nbytes: int = 0


# struct format of one scalar metadata value, by GGUF value type; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf(path: str) -> tuple[dict, dict[str, RawTensor]]:
    """A GGUF file's metadata and its tensors with their raw bytes, through one memory map: only the
    pages the header and the used tensors occupy are ever read. (tinygrad's gguf_load also builds a
    lazy tensor per weight, and both it and gguf's GGUFReader took longer: bench/RESULTS.md,
    figures moved out of code comments.)"""
    file = np.memmap(path, dtype=np.uint8, mode="r")
    pos, where = 0, "the header"

    def take(fmt: str) -> tuple:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(file):
            raise ValueError(f"the file ends at byte {len(file)}, inside {where}")
        values = struct.unpack_from(fmt, file, pos)
        pos += size
        return values

    def text() -> str:
        nonlocal pos
        (length,) = take("<Q")
        if pos + length > len(file):
            raise ValueError(f"a string of {length} bytes in {where} runs past the file's end")
        pos += length
        try:
            return bytes(file[pos - length : pos]).decode()
        except UnicodeDecodeError:
            raise ValueError(f"a string in {where} is not UTF-8") from None

    def value(kind: int):
        if kind == 8:
            return text()
        if kind == 9:
            item, count = take("<IQ")
            if count > len(file) - pos:  # every item takes a byte at least
                raise ValueError(f"an array of {count} items in {where} is longer than the file")
            if item in _SCALARS:
                return list(take(f"<{count}{_SCALARS[item]}"))
            return [value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"{where} has value type {kind}, which GGUF does not define")
        return take("<" + _SCALARS[kind])[0]

    magic, version, n_tensors, n_kv = take("<4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a GGUF v2/v3 file")
    if n_kv > len(file) // 12 or n_tensors > len(file) // 24:  # the smallest entry of each
        raise ValueError(f"the header claims {n_kv} metadata entries and {n_tensors} tensors, more than {len(file)} bytes can hold")
    metadata = {}
    for i in range(n_kv):
        where = f"metadata entry {i}"
        key = text()
        where = f"metadata entry {i} ({key!r})"
        (kind,) = take("<I")
        metadata[key] = value(kind)
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or not 1 <= alignment <= 1 << 16:
        raise ValueError(f"general.alignment = {alignment!r}: expected a small positive whole number")
    infos = []
    for i in range(n_tensors):
        where = f"tensor {i}'s entry"
        name, (n_dims,) = text(), take("<I")
        if n_dims > 4:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions; GGUF allows at most 4")
        dims = take(f"<{n_dims}Q")
        ggml_type, offset = take("<IQ")
        infos.append((name, dims, ggml_type, offset))
    data_start = -(-pos // alignment) * alignment
    table = {}

    def extent(name: str, start: int, nbytes: int) -> np.ndarray:
        if start + nbytes > len(file):
            raise ValueError(f"tensor {name!r} ends at byte {start + nbytes}, past the file's end ({len(file)} bytes)")
        return file[start : start + nbytes]

    for name, dims, ggml_type, offset in infos:
        _, values, block_bytes = GGML_TYPES.get(ggml_type, (None, 1, 0))  # a type it cannot read: no bytes to check
        elements, start, shape = int(np.prod(dims, dtype=object)), data_start + offset, tuple(reversed(dims))
        if elements % values:
            raise ValueError(f"tensor {name!r} of {elements} values is not whole blocks of {values}")
        nbytes = elements // values * block_bytes
        data = extent(name, start, nbytes)  # every readable tensor lies inside the file
        if len(dims) == 1 and ggml_type == 0:  # a float32 vector (norms, biases), read as bytes
            table[name] = RawTensor(0, 1, dims[0], data.reshape(1, -1), shape, start, nbytes)
        elif len(dims) not in (2, 3):
            table[name] = RawTensor(ggml_type, 1, elements, None, shape, start, nbytes)
        else:  # a matrix, or a mixture of experts' matrices (experts, rows, cols) as experts * rows rows
            cols, rows = dims[0], int(np.prod(dims[1:]))
            blocks = data.reshape(rows, -1) if ggml_type in BLOCK_FORMATS and cols % BLOCK_FORMATS[ggml_type][1] == 0 else None
            table[name] = RawTensor(ggml_type, rows, cols, blocks, shape, start, nbytes)
    return metadata, table


def float_values(path: str, name: str, tensor: RawTensor) -> np.ndarray:
    """`tensor`'s values as a float32 array of its NumPy shape (the file's dimensions, last first),
    dequantized by the gguf package; a type it cannot read, or values that are not finite, raise
    ValueError naming `name`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in tensor.shape)
    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")[tensor.start : tensor.start + tensor.nbytes]
        values = dequantize(raw, GGMLQuantizationType(tensor.ggml_type))
    except (NotImplementedError, ValueError) as err:
        raise ValueError(f"tensor {name} has type {tensor.ggml_type!r}, which cannot be read here") from err
    if values.size != math.prod(shape):
        raise ValueError(f"tensor {name} holds {values.size} values, not the {math.prod(shape)} of its shape")
    array = np.array(values, dtype=np.float32).reshape(shape)
    if not np.isfinite(array).all():  # a NaN would spread through every row it touches
        raise ValueError(f"tensor {name} holds values that are not finite")
    return array
