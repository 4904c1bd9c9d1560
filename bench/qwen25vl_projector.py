"""A random-weight Qwen2.5-VL projector ("mmproj") GGUF in the released model's shape, for the benches.

Keys and tensor names as llama.cpp's converter writes Qwen2.5-VL-3B's vision tower and merger
(conversion/qwenvl.py) and clip.cpp reads them: the Conv3D patch kernel as its two temporal halves
`v.patch_embd.weight` and `.weight.1` (no bias), pre-norm blocks with RMS norms (`v.blk.N.ln1`,
`ln2`, weights only), q, k and v apart with biases, a SwiGLU feed-forward with biases
(`clip.use_silu`), the final `v.post_ln` and the merger `mm.0` (4 x width square) and `mm.2` (to
the text width), each with a bias. `clip.vision.n_wa_pattern` 8: layers 7, 15, 23 and 31 attend
the whole image, the others within 112-pixel windows (the converter writes no window size; clip.cpp
and our loader default to Qwen's 112). Matrices (the patch kernel too) are float16 as the released
file's are; norms and biases float32. Weights are drawn with a 1/sqrt(fan-in) scale so that
activations stay of order one through the layers.

`layers` below 32 keeps the widths and the window pattern: a shorter tower, for shorter runs.
"""

from __future__ import annotations

import os
import sys

import gguf
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from support.tiny_projectors import add_key  # noqa: E402

# Qwen2.5-VL-3B-Instruct's vision_config and preprocessor_config, as the converter writes them
SHAPE = dict(text_dim=2048, width=1280, ffn=3420, layers=32, heads=16, patch_size=14, image_size=560, n_wa_pattern=8)
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


def write_qwen25vl_projector(path: str, layers: int = SHAPE["layers"], seed: int = 0, **shape) -> str:
    """Write the projector to `path`: SHAPE's widths (any of them replaced by `shape`), `layers` deep."""
    s = SHAPE | shape | {"layers": layers}
    width, ffn, p_size, merged = s["width"], s["ffn"], s["patch_size"], 4 * s["width"]
    rng = np.random.default_rng(seed)

    keys = {"general.file_type": 1, "clip.has_vision_encoder": True, "clip.projector_type": "qwen2.5vl_merger", "clip.use_silu": True}
    vision = {"projection_dim": s["text_dim"], "image_size": s["image_size"], "patch_size": p_size}
    vision |= {"embedding_length": width, "feed_forward_length": ffn, "block_count": layers, "attention.head_count": s["heads"]}
    vision |= {"image_mean": IMAGE_MEAN, "image_std": IMAGE_STD, "n_wa_pattern": s["n_wa_pattern"], "attention.layer_norm_epsilon": 1e-6}
    keys |= {f"clip.vision.{key}": value for key, value in vision.items()}

    def matrix(*shape: int, fan_in: int | None = None) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * (fan_in or shape[-1]) ** -0.5).astype(np.float16)

    def vector(n: int, center: float = 0.0, spread: float = 0.02) -> np.ndarray:
        return (center + spread * rng.standard_normal(n)).astype(np.float32)

    w = gguf.GGUFWriter(path, "clip")
    for key, value in keys.items():
        add_key(w, key, value)
    patch_fan_in = 2 * 3 * p_size * p_size  # the two temporal halves are summed: one Conv3D's fan-in
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
        w.add_tensor(name, matrix(width, 3, p_size, p_size, fan_in=patch_fan_in))
    for i in range(layers):
        p = f"v.blk.{i}."
        w.add_tensor(p + "ln1.weight", vector(width, 1.0, 0.1))
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(p + f"{name}.weight", matrix(width, width))
            w.add_tensor(p + f"{name}.bias", vector(width))
        w.add_tensor(p + "ln2.weight", vector(width, 1.0, 0.1))
        for name, rows, cols in (("ffn_gate", ffn, width), ("ffn_up", ffn, width), ("ffn_down", width, ffn)):
            w.add_tensor(p + f"{name}.weight", matrix(rows, cols))
            w.add_tensor(p + f"{name}.bias", vector(rows))
    w.add_tensor("v.post_ln.weight", vector(width, 1.0, 0.1))
    w.add_tensor("mm.0.weight", matrix(merged, merged))
    w.add_tensor("mm.0.bias", vector(merged))
    w.add_tensor("mm.2.weight", matrix(s["text_dim"], merged))
    w.add_tensor("mm.2.bias", vector(s["text_dim"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
