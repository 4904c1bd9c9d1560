"""Random-weight LoRA adapters in llama.cpp's GGUF layout (what `convert_lora_to_gguf.py` writes), for a model file.

`write_lora(path, model_path, ...)` writes `general.type` "adapter", `adapter.type` "lora",
`adapter.lora.alpha` and, for the named matrices of every layer (or of `layers`), a pair
`<matrix>.lora_a` (rank, cols) and `.lora_b` (rows, rank) of normal values times `size`, shaped from
the model file's own matrices; `extra` adds pairs as given (to write files that do not fit).
Used by bench/lora_fidelity.py and by the tests (tests/support/tiny_lora.py).
"""

from __future__ import annotations

import gguf
import numpy as np

ATTENTION_AND_FFN = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def matrix_shapes(model_path: str) -> tuple[str, dict[str, tuple[int, int]]]:
    """The model's architecture and its matrices' (rows, cols) by name."""
    reader = gguf.GGUFReader(model_path)
    arch = reader.fields["general.architecture"].contents()
    return arch, {t.name: (int(t.shape[1]), int(t.shape[0])) for t in reader.tensors if len(t.shape) == 2}


def write_lora(
    path: str,
    model_path: str,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ATTENTION_AND_FFN,
    layers: tuple[int, ...] | None = None,
    seed: int = 0,
    size: float = 0.05,
    dtype=np.float32,
    extra: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> str:
    arch, shapes = matrix_shapes(model_path)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, (rows, cols) in sorted(shapes.items()):
        layer, _, rest = name.removeprefix("blk.").partition(".")
        if not name.startswith("blk.") or rest.removesuffix(".weight") not in targets or (layers is not None and int(layer) not in layers):
            continue
        writer.add_tensor(name + ".lora_a", (rng.standard_normal((rank, cols)) * size).astype(dtype))
        writer.add_tensor(name + ".lora_b", (rng.standard_normal((rows, rank)) * size).astype(dtype))
    for name, (a, b) in (extra or {}).items():
        writer.add_tensor(name + ".lora_a", a)
        writer.add_tensor(name + ".lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
