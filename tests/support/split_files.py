"""A GGUF written as llama.cpp's `gguf-split --split` writes one, for the tests of joining: every
part a GGUF of its own holding `split.no`, `split.count` and `split.tensors.count`, the first part
the whole metadata too, the tensors shared out in order. Written with the gguf package's writer
from its reader's view of the original, independently of webapp/engine/serving/split_gguf.py."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def write_split(path: str, prefix: str, parts: int) -> list[str]:
    """`path`'s file as `parts` files `{prefix}-0000i-of-0000N.gguf`; their paths, in order."""
    original = GGUFReader(path)
    arch = original.fields["general.architecture"].contents()
    tensors = original.tensors
    share = -(-len(tensors) // parts)
    names = []
    for i in range(parts):
        name = f"{prefix}-{i + 1:05d}-of-{parts:05d}.gguf"
        w = GGUFWriter(name, arch, use_temp_file=False)
        w.kv_data[0].pop("general.architecture", None)  # written below with the rest, in its own place
        w.add_key_value("split.no", i, GGUFValueType.UINT16)
        w.add_key_value("split.count", parts, GGUFValueType.UINT16)
        w.add_key_value("split.tensors.count", len(tensors), GGUFValueType.INT32)
        if i == 0:
            for key, field in original.fields.items():
                if key.startswith("GGUF."):
                    continue
                sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
                w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
        for t in tensors[i * share : (i + 1) * share]:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # the reader's rows: bytes, for a block format
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        names.append(name)
    return names
