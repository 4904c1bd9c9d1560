"""LoRA adapters for the tests: bench/lora_file.py's writer, and the float64 reference of the model an
adapter makes (`merged_reference`: each matrix plus scale * alpha / rank * B A)."""

from __future__ import annotations

import gguf
import numpy as np
from support.tiny_models import Reference

from bench.lora_file import write_lora as write_lora_gguf  # noqa: F401 (the tests' name for it)


def merged_reference(model_path: str, adapter_path: str, scale: float = 1.0) -> Reference:
    reference = Reference(model_path)
    reader = gguf.GGUFReader(adapter_path)
    alpha = float(reader.fields["adapter.lora.alpha"].contents())
    shape = lambda t: [int(d) for d in reversed(t.shape)]  # noqa: E731
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape(t)) for t in reader.tensors}
    for name in [n.removesuffix(".lora_a") for n in tensors if n.endswith(".lora_a")]:
        a, b = tensors[name + ".lora_a"], tensors[name + ".lora_b"]
        reference.w[name] = reference.w[name] + scale * alpha / a.shape[0] * (b @ a)
    return reference
