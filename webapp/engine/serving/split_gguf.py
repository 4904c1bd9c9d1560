"""A split GGUF (llama.cpp's `gguf-split` output, `NAME-00001-of-0000N.gguf`) joined into one file,
which the loader maps whole.

Contract: `part_names(first)` names a first part's parts in order; `split_parts(path)` lists them
where every one must be there;
`join_split(first, out)` writes `out` once: the first part's metadata without the `split.*` keys,
every part's tensors in order (their data re-aligned to the file's alignment), byte for byte as
stored, through `out` + ".partial" renamed at the end (a join cut off is started again, never
served half-written). The parts are read with the gguf package's reader, which checks each header
against the file; a part that lies about itself raises ValueError.
"""

from __future__ import annotations

import os
import re
import struct

import numpy as np

PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
CHUNK = 1 << 26  # tensor bytes copied at a time
GGUF_VERSION = 3


def part_names(first: str) -> list[str]:
    """A split GGUF's part names (paths), its first part's given, in order."""
    match = PART.search(first)
    if match is None or int(match.group(1)) != 1:
        raise ValueError(f"{os.path.basename(first)} is not the first part of a split GGUF")
    count = int(match.group(2))
    return [first[: match.start()] + f"-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def split_parts(path: str) -> list[str]:
    parts = part_names(path)
    missing = [os.path.basename(p) for p in parts if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"the split GGUF lacks {', '.join(missing)}")
    return parts


def join_split(first: str, out: str) -> str:
    from gguf import GGUFReader

    readers = [GGUFReader(part, "r") for part in split_parts(first)]
    fields = [f for name, f in readers[0].fields.items() if not name.startswith(("split.", "GGUF."))]
    alignment = readers[0].alignment
    tensors = [t for reader in readers for t in reader.tensors]
    header = [b"GGUF", struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(fields))]
    header += [part.tobytes() for field in fields for part in field.parts]
    offset = 0
    for tensor in tensors:
        name_len, name, n_dims, dims, dtype, _ = tensor.field.parts
        header += [name_len.tobytes(), name.tobytes(), n_dims.tobytes(), dims.tobytes(), dtype.tobytes(), struct.pack("<Q", offset)]
        offset += _aligned(tensor.n_bytes, alignment)
    partial = out + ".partial"
    with open(partial, "wb") as f:
        f.write(b"".join(header))
        f.write(b"\0" * (_aligned(f.tell(), alignment) - f.tell()))
        for tensor in tensors:
            data = tensor.data.reshape(-1).view(np.uint8)
            for start in range(0, len(data), CHUNK):
                f.write(data[start : start + CHUNK].tobytes())
            f.write(b"\0" * (_aligned(tensor.n_bytes, alignment) - tensor.n_bytes))
    os.replace(partial, out)
    return out


def _aligned(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment
