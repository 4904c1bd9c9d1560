"""Tiny random-weight projector ("mmproj") GGUFs for the vision tests, in llama.cpp's layout.

The keys and tensor names are those llama.cpp's converter writes for Gemma 3 and SmolVLM/Idefics3
projectors; the sizes are small enough that a float64 reference runs in a blink. Weights are drawn
with a 1/sqrt(fan-in) scale so that activations stay of order one through the layers. `metadata`,
`omit` and `replace` spoil a file on purpose, for the tests of what the loader refuses.
"""

from __future__ import annotations

import gguf
import numpy as np

# family -> (image_size, patch_size): gemma3's 32 x 32 grid pools in 2 x 2 blocks to its 16 x 16
# tokens; idefics3's 8 x 8 grid shuffles in 2 x 2 blocks to 16 tokens
DEFAULT_SIZES = {"gemma3": (128, 4), "idefics3": (64, 8)}
# made-up statistics, different per channel, so that a channel mixed up shows in the pixels
IMAGE_MEAN = [0.48, 0.46, 0.41]
IMAGE_STD = [0.27, 0.26, 0.28]


def write_tiny_projector(
    path: str,
    family: str,
    text_dim: int = 48,
    *,
    width: int = 32,
    ffn: int = 64,
    layers: int = 2,
    heads: int = 4,
    image_size: int | None = None,
    patch_size: int | None = None,
    scale_factor: int = 2,
    seed: int = 0,
    tensor_type: str = "F32",
    projector_type: str | None = None,
    metadata: dict | None = None,
    omit: tuple[str, ...] = (),
    replace: dict[str, np.ndarray] | None = None,
) -> str:
    """A random-weight projector of `family` ("gemma3" or "idefics3") projecting to `text_dim`;
    `tensor_type` "F16" stores every matrix (the patch kernel too) as float16; positions, norms
    and biases staying float32 as real files have them. `projector_type` writes another
    clip.projector_type than the family's; `metadata` adds or replaces keys (a value of None leaves
    the key out); `omit` leaves out tensors and `replace` writes other arrays under their names."""
    default_image, default_patch = DEFAULT_SIZES[family]
    image_size, patch_size = image_size or default_image, patch_size or default_patch
    n_patches = (image_size // patch_size) ** 2
    rng = np.random.default_rng(seed)
    matrix_dtype = {"F32": np.float32, "F16": np.float16}[tensor_type]

    keys: dict = {"clip.has_vision_encoder": True, "clip.has_text_encoder": False, "clip.projector_type": projector_type or family}
    vision = {"image_size": image_size, "patch_size": patch_size, "embedding_length": width, "feed_forward_length": ffn}
    vision["projection_dim"] = text_dim  # llama.cpp reads it; this loader takes the width from the projection
    vision |= {"block_count": layers, "attention.head_count": heads, "attention.layer_norm_epsilon": 1e-6}
    vision |= {"image_mean": IMAGE_MEAN, "image_std": IMAGE_STD}
    if family == "idefics3":
        vision["projector.scale_factor"] = scale_factor
    keys |= {f"clip.vision.{key}": value for key, value in vision.items()}
    keys |= metadata or {}

    def matrix(*shape: int, fan_in: int | None = None) -> np.ndarray:
        return (rng.standard_normal(shape) * (fan_in or shape[-1]) ** -0.5).astype(matrix_dtype)

    def vector(n: int, center: float = 0.0, spread: float = 0.02) -> np.ndarray:
        return (center + spread * rng.standard_normal(n)).astype(np.float32)

    tensors = {
        "v.patch_embd.weight": matrix(width, 3, patch_size, patch_size, fan_in=3 * patch_size * patch_size),
        "v.patch_embd.bias": vector(width),
        "v.position_embd.weight": (0.3 * rng.standard_normal((n_patches, width))).astype(np.float32),
    }
    for i in range(layers):
        p = f"v.blk.{i}."
        tensors |= {p + "ln1.weight": vector(width, 1.0, 0.1), p + "ln1.bias": vector(width, spread=0.05)}
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors |= {p + f"{name}.weight": matrix(width, width), p + f"{name}.bias": vector(width)}
        tensors |= {p + "ln2.weight": vector(width, 1.0, 0.1), p + "ln2.bias": vector(width, spread=0.05)}
        tensors |= {p + "ffn_up.weight": matrix(ffn, width), p + "ffn_up.bias": vector(ffn)}
        tensors |= {p + "ffn_down.weight": matrix(width, ffn), p + "ffn_down.bias": vector(width)}
    tensors |= {"v.post_ln.weight": vector(width, 1.0, 0.1), "v.post_ln.bias": vector(width, spread=0.05)}
    if family == "gemma3":  # the norm's weight as the converter stores it: 1 + w
        tensors |= {"mm.soft_emb_norm.weight": vector(width, 1.0, 0.1), "mm.input_projection.weight": matrix(width, text_dim, fan_in=width)}
    else:
        tensors["mm.model.fc.weight"] = matrix(text_dim, width * scale_factor**2)
    tensors |= replace or {}

    w = gguf.GGUFWriter(path, "clip")
    for key, value in keys.items():
        add_key(w, key, value)
    for name, array in tensors.items():
        if name not in omit:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_key(w: gguf.GGUFWriter, key: str, value) -> None:
    """One metadata key in the GGUF type its Python type implies (int as uint32, float as float32);
    None writes nothing."""
    if value is None:
        return
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))
