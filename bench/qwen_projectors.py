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
deepstack layers that fall within the depth): a shorter tower, for shorter runs.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from support.tiny_projectors import Draws as TestDraws  # noqa: E402
from support.tiny_projectors import write_projector_file  # noqa: E402

# Qwen2.5-VL-3B-Instruct's vision_config and preprocessor_config, as the converter writes them
QWEN25VL_SHAPE = dict(text_dim=2048, width=1280, ffn=3420, layers=32, heads=16, patch_size=14, image_size=560, n_wa_pattern=8)
QWEN25VL_MEAN = [0.48145466, 0.4578275, 0.40821073]
QWEN25VL_STD = [0.26862954, 0.26130258, 0.27577711]
# Qwen3-VL-4B-Instruct's: deepstack_visual_indexes [5, 11, 17], its processor's mean and std 0.5
QWEN3VL_SHAPE = dict(text_dim=2560, width=1024, ffn=4096, layers=24, heads=16, patch_size=16, image_size=768, deepstack=(5, 11, 17))
QWEN3VL_MEAN = QWEN3VL_STD = [0.5, 0.5, 0.5]


class Draws(TestDraws):
    """tests/support's Draws in the released files' types: float16 matrices (drawn in float32), float32 vectors."""

    def __init__(self, seed: int):
        super().__init__(np.random.default_rng(seed), np.float16, np.float32)

    def patch_halves(self, width: int, patch_size: int) -> dict[str, np.ndarray]:
        """The Conv3D's two temporal halves: they are summed, so each draws at the whole kernel's fan-in."""
        fan_in, names = 2 * 3 * patch_size * patch_size, ("v.patch_embd.weight", "v.patch_embd.weight.1")
        return {name: self.matrix(width, 3, patch_size, patch_size, fan_in=fan_in) for name in names}


def vision_keys(projector_type: str, s: dict, mean: list[float], std: list[float]) -> dict:
    """The keys both families' files carry (F16 mostly, the shape `s`), clip.vision.* among them."""
    keys = {"general.file_type": 1, "clip.has_vision_encoder": True, "clip.projector_type": projector_type}
    vision = {"projection_dim": s["text_dim"], "image_size": s["image_size"], "patch_size": s["patch_size"]}
    vision |= {"embedding_length": s["width"], "feed_forward_length": s["ffn"], "block_count": s["layers"]}
    vision |= {"attention.head_count": s["heads"], "image_mean": mean, "image_std": std}
    return keys | {f"clip.vision.{key}": value for key, value in vision.items()}


def write_qwen25vl_projector(path: str, layers: int = QWEN25VL_SHAPE["layers"], seed: int = 0, **shape) -> str:
    """Write Qwen2.5-VL-3B's projector to `path`: its widths (any of them replaced by `shape`), `layers` deep."""
    s = QWEN25VL_SHAPE | shape | {"layers": layers}
    width, ffn, merged = s["width"], s["ffn"], 4 * s["width"]
    keys = vision_keys("qwen2.5vl_merger", s, QWEN25VL_MEAN, QWEN25VL_STD) | {"clip.use_silu": True}
    keys |= {"clip.vision.n_wa_pattern": s["n_wa_pattern"], "clip.vision.attention.layer_norm_epsilon": 1e-6}
    draw = Draws(seed)
    tensors = draw.patch_halves(width, s["patch_size"])
    for i in range(layers):
        p = f"v.blk.{i}."
        tensors[p + "ln1.weight"] = draw.vector(width, 1.0, 0.1)
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors |= draw.linear(p + name, width, width)
        tensors[p + "ln2.weight"] = draw.vector(width, 1.0, 0.1)
        tensors |= draw.linear(p + "ffn_gate", ffn, width) | draw.linear(p + "ffn_up", ffn, width) | draw.linear(p + "ffn_down", width, ffn)
    tensors["v.post_ln.weight"] = draw.vector(width, 1.0, 0.1)
    tensors |= draw.linear("mm.0", merged, merged) | draw.linear("mm.2", s["text_dim"], merged)
    return write_projector_file(path, keys, tensors)


def qwen3vl_deepstack(layers: int) -> tuple[int, ...]:
    """The deepstack layers a `layers`-deep Qwen3-VL-4B tower keeps."""
    return tuple(i for i in QWEN3VL_SHAPE["deepstack"] if i < layers)


def write_qwen3vl_projector(path: str, layers: int = QWEN3VL_SHAPE["layers"], seed: int = 0, **shape) -> str:
    """Write Qwen3-VL-4B's projector to `path`: its widths (any of them replaced by `shape`), `layers`
    deep, at least through its first deepstack layer."""
    s = QWEN3VL_SHAPE | shape | {"layers": layers}
    deepstack = [i for i in s["deepstack"] if i < layers]
    if not deepstack:
        raise ValueError(f"{layers} layers: Qwen3-VL's first deepstack layer is layer {min(s['deepstack'])}")
    width, ffn, merged, side = s["width"], s["ffn"], 4 * s["width"], s["image_size"] // s["patch_size"]
    keys = vision_keys("qwen3vl_merger", s, QWEN3VL_MEAN, QWEN3VL_STD) | {"clip.use_gelu": True}
    vision = {"spatial_merge_size": 2, "attention.layer_norm_epsilon": 1e-6, "is_deepstack_layers": [i in deepstack for i in range(layers)]}
    keys |= {f"clip.vision.{key}": value for key, value in vision.items()}
    draw = Draws(seed)
    tensors = draw.patch_halves(width, s["patch_size"])
    # the patch bias and the positions large enough that leaving either out, or resizing the grid wrongly, shows
    tensors["v.patch_embd.bias"] = draw.vector(width, spread=0.3)
    tensors["v.position_embd.weight"] = (0.5 * draw.rng.standard_normal((side * side, width))).astype(np.float32)
    for i in range(layers):
        p = f"v.blk.{i}."
        tensors |= draw.layer_norm(p + "ln1", width) | draw.linear(p + "attn_qkv", 3 * width, width)
        tensors |= draw.linear(p + "attn_out", width, width) | draw.layer_norm(p + "ln2", width)
        tensors |= draw.linear(p + "ffn_up", ffn, width) | draw.linear(p + "ffn_down", width, ffn)
    tensors |= draw.layer_norm("v.post_ln", width)
    tensors |= draw.linear("mm.0", merged, merged) | draw.linear("mm.2", s["text_dim"], merged)
    for i in deepstack:
        p = f"v.deepstack.{i}."
        tensors |= draw.layer_norm(p + "norm", merged) | draw.linear(p + "fc1", merged, merged)
        tensors |= draw.linear(p + "fc2", s["text_dim"], merged)
    return write_projector_file(path, keys, tensors)
