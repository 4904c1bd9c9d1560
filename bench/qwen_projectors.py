"""Random-weight Qwen2.5-VL and Qwen3-VL projector ("mmproj") GGUFs in the released models' shapes,
for the benches.

Keys and tensor names as llama.cpp's converter writes the two towers and clip.cpp reads them. Both
families share: the Conv3D patch kernel as its two temporal halves `v.patch_embd.weight` and
`.weight.1`, pre-norm blocks `v.blk.N.*` with biased products, the final `v.post_ln` and the
merger `mm.0` (4 x width square) and `mm.2` (to the text width), each with a bias. Matrices (the
patch kernel too) are float16 as the released files' are; norms, biases and positions float32.
Weights are drawn with a 1/sqrt(fan-in) scale so that activations stay of order one through the
layers.

Qwen2.5-VL-3B (conversion/qwenvl.py): RMS norms (weights only), q, k and v apart, a SwiGLU
feed-forward (`clip.use_silu`), no patch bias; `clip.vision.n_wa_pattern` 8: layers 7, 15, 23 and
31 attend the whole image, the others within 112-pixel windows (the converter writes no window
size; clip.cpp and our loader default to Qwen's 112).

Qwen3-VL-4B (conversion/qwen3vl.py): LayerNorms, one `attn_qkv` product, a gelu feed-forward
(`clip.use_gelu`) without a gate, a patch bias, a 48 x 48 grid of learned positions
(`v.position_embd.weight`; image_size 768 is the converter's sqrt(2304) x 16), and after layers 5,
11 and 17 a deepstack merger (`v.deepstack.N.norm`, a LayerNorm over a merged token's four rows,
then `fc1`, gelu, `fc2` to the text width), flagged in `clip.vision.is_deepstack_layers`.

`layers` below the released depth keeps the widths (and Qwen2.5-VL's window pattern, Qwen3-VL's
deepstack layers that fall within the depth): a shorter tower, for shorter runs. The tensors are
laid out by the tests' tiny writers (tests/support/tiny_projectors.py), given these shapes, F16
matrices and the processors' means and deviations.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from support.tiny_projectors import write_tiny_qwen2vl_projector, write_tiny_qwen3vl_projector  # noqa: E402

# Qwen2.5-VL-3B-Instruct's vision_config and preprocessor_config, as the converter writes them
QWEN25VL_SHAPE = dict(text_dim=2048, width=1280, ffn=3420, layers=32, heads=16, patch_size=14, image_size=560, n_wa_pattern=8)
QWEN25VL_MEAN = [0.48145466, 0.4578275, 0.40821073]
QWEN25VL_STD = [0.26862954, 0.26130258, 0.27577711]
# Qwen3-VL-4B-Instruct's: deepstack_visual_indexes [5, 11, 17], its processor's mean and std 0.5
QWEN3VL_SHAPE = dict(text_dim=2560, width=1024, ffn=4096, layers=24, heads=16, patch_size=16, image_size=768, deepstack=(5, 11, 17))
QWEN3VL_MEAN = QWEN3VL_STD = [0.5, 0.5, 0.5]


def released_keys(image_size: int, mean: list[float], std: list[float]) -> dict:
    """The keys that differ from the tiny writers': a mostly-F16 file, the processor's statistics."""
    keys = {"general.file_type": 1, "clip.vision.image_size": image_size}
    return keys | {"clip.vision.image_mean": mean, "clip.vision.image_std": std}


def released_tower(s: dict, seed: int) -> dict:
    """The tiny writers' arguments for a released tower of shape `s`: its widths and depth, F16 (or
    `s`'s tensor_type: Q8_0, as llama.cpp's quantized projector files)."""
    keys = ("width", "ffn", "layers", "heads", "patch_size")
    return {key: s[key] for key in keys} | {"seed": seed, "tensor_type": s.get("tensor_type", "F16")}


def write_qwen25vl_projector(path: str, layers: int = QWEN25VL_SHAPE["layers"], seed: int = 0, **shape) -> str:
    """Write Qwen2.5-VL-3B's projector to `path`: its widths (any of them replaced by `shape`), `layers`
    deep; no window size, as the converter writes none."""
    s = QWEN25VL_SHAPE | shape | {"layers": layers}
    return write_tiny_qwen2vl_projector(
        path,
        "qwen2.5vl",
        s["text_dim"],
        window_size=None,
        n_wa_pattern=s["n_wa_pattern"],
        metadata=released_keys(s["image_size"], QWEN25VL_MEAN, QWEN25VL_STD),
        **released_tower(s, seed),
    )


def qwen3vl_deepstack(layers: int) -> tuple[int, ...]:
    """The deepstack layers a `layers`-deep Qwen3-VL-4B tower keeps."""
    return tuple(i for i in QWEN3VL_SHAPE["deepstack"] if i < layers)


def write_qwen3vl_projector(path: str, layers: int = QWEN3VL_SHAPE["layers"], seed: int = 0, **shape) -> str:
    """Write Qwen3-VL-4B's projector to `path`: its widths (any of them replaced by `shape`), `layers`
    deep, at least through its first deepstack layer."""
    s = QWEN3VL_SHAPE | shape | {"layers": layers}
    deepstack = tuple(i for i in s["deepstack"] if i < layers)
    if not deepstack:
        raise ValueError(f"{layers} layers: Qwen3-VL's first deepstack layer is layer {min(s['deepstack'])}")
    return write_tiny_qwen3vl_projector(
        path,
        s["text_dim"],
        position_side=s["image_size"] // s["patch_size"],
        deepstack=deepstack,
        metadata=released_keys(s["image_size"], QWEN3VL_MEAN, QWEN3VL_STD),
        **released_tower(s, seed),
    )
