"""Tiny random-weight projector ("mmproj") GGUFs for the vision tests, in llama.cpp's layout.

The keys and tensor names are those llama.cpp's converter writes for Gemma 3, SmolVLM/Idefics3,
Qwen2-VL / Qwen2.5-VL and Qwen3-VL (Qwen3.5's tower too) projectors; the sizes are small enough
that a float64 reference runs in a blink. Weights are drawn with a 1/sqrt(fan-in) scale so that activations stay of order one through the layers. `metadata`,
`omit` and `replace` spoil a file on purpose, for the tests of what the loader refuses.
"""

from __future__ import annotations

import gguf
import numpy as np
from support.k_quants import quantize_q4_k

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
    `tensor_type` "F16" stores every matrix (the patch kernel too) as float16, a block type (Q8_0,
    Q4_0, Q4_K) the layers' and projection's matrices in its blocks (write_projector_file); positions, norms
    and biases staying float32 as real files have them. `projector_type` writes another
    clip.projector_type than the family's; `metadata` adds or replaces keys (a value of None leaves
    the key out); `omit` leaves out tensors and `replace` writes other arrays under their names."""
    default_image, default_patch = DEFAULT_SIZES[family]
    image_size, patch_size = image_size or default_image, patch_size or default_patch
    n_patches = (image_size // patch_size) ** 2
    rng = np.random.default_rng(seed)
    matrix_dtype = MATRIX_DTYPES[tensor_type]

    vision = {"projector.scale_factor": scale_factor} if family == "idefics3" else {}
    keys = projector_keys(projector_type or family, (image_size, patch_size, width, ffn, text_dim, layers, heads), vision, metadata)

    draw = Draws(rng, matrix_dtype)
    matrix, vector = draw.matrix, draw.vector

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
    return write_projector_file(path, keys, tensors | (replace or {}), omit, tensor_type)


def write_tiny_qwen2vl_projector(
    path: str,
    family: str = "qwen2.5vl",
    text_dim: int = 48,
    *,
    width: int = 32,
    ffn: int = 64,
    layers: int = 4,
    heads: int = 4,
    patch_size: int = 4,
    window_size: int | None = 16,
    n_wa_pattern: int | None = 2,
    min_tokens: int | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    tensor_type: str = "F32",
    metadata: dict | None = None,
    omit: tuple[str, ...] = (),
    replace: dict[str, np.ndarray] | None = None,
) -> str:
    """A random-weight Qwen2.5-VL (`family` "qwen2.5vl": RMS norms, SiLU-gated feed-forwards, window
    attention) or Qwen2-VL ("qwen2vl": LayerNorms, gelu_quick feed-forwards, every layer full)
    projector. The Conv3D patch kernel is written as llama.cpp's converter splits it, one (width, 3,
    p, p) half per frame. `window_size` (pixels) and `n_wa_pattern` are Qwen2.5-VL's (None leaves the
    key out); `min_tokens` / `max_tokens` write clip.vision.image_min_pixels / image_max_pixels as
    that many merged tokens of (2 p)^2 pixels. `tensor_type`, `metadata`, `omit` and `replace` as
    for `write_tiny_projector`."""
    rng = np.random.default_rng(seed)
    matrix_dtype = MATRIX_DTYPES[tensor_type]
    rms = family == "qwen2.5vl"
    merged_pixels = (2 * patch_size) ** 2

    projector_type = {"qwen2.5vl": "qwen2.5vl_merger", "qwen2vl": "qwen2vl_merger"}[family]
    vision = {"n_wa_pattern": n_wa_pattern, "window_size": window_size} if rms else {}
    if min_tokens is not None:
        vision["image_min_pixels"] = min_tokens * merged_pixels
    if max_tokens is not None:
        vision["image_max_pixels"] = max_tokens * merged_pixels
    # image_size is only llama.cpp's warm-up size for these dynamic-resolution encoders; use_silu the
    # converter's add_vision_use_silu: a clip.* key, not clip.vision.*
    shape = (16 * patch_size, patch_size, width, ffn, text_dim, layers, heads)
    keys = projector_keys(projector_type, shape, vision, {"clip.use_silu": True if rms else None} | (metadata or {}))

    draw = Draws(rng, matrix_dtype)
    matrix, vector = draw.matrix, draw.vector

    def norm(name: str) -> dict[str, np.ndarray]:
        weight = {name + ".weight": vector(width, 1.0, 0.1)}
        return weight if rms else weight | {name + ".bias": vector(width, spread=0.05)}

    linear = draw.linear

    # the two frames' halves; each alone (fan-in 3 p^2) so that their sum is of order one
    conv = {"v.patch_embd.weight": matrix(width, 3, patch_size, patch_size, fan_in=6 * patch_size * patch_size)}
    tensors = conv | {"v.patch_embd.weight.1": matrix(width, 3, patch_size, patch_size, fan_in=6 * patch_size * patch_size)}
    for i in range(layers):
        p = f"v.blk.{i}."
        tensors |= norm(p + "ln1")
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors |= linear(p + name, width, width)
        tensors |= norm(p + "ln2")
        if rms:
            tensors |= linear(p + "ffn_gate", ffn, width)
        tensors |= linear(p + "ffn_up", ffn, width) | linear(p + "ffn_down", width, ffn)
    tensors |= norm("v.post_ln")
    tensors |= linear("mm.0", 4 * width, 4 * width) | linear("mm.2", text_dim, 4 * width)
    return write_projector_file(path, keys, tensors | (replace or {}), omit, tensor_type)


def write_tiny_qwen3vl_projector(
    path: str,
    text_dim: int = 48,
    *,
    width: int = 32,
    ffn: int = 64,
    layers: int = 4,
    heads: int = 4,
    patch_size: int = 4,
    position_side: int = 6,
    deepstack: tuple[int, ...] = (1, 2),
    seed: int = 0,
    tensor_type: str = "F32",
    metadata: dict | None = None,
    omit: tuple[str, ...] = (),
    replace: dict[str, np.ndarray] | None = None,
) -> str:
    """A random-weight Qwen3-VL projector ("qwen3vl_merger"; Qwen3.5's vision tower is the same with
    no deepstack layer): LayerNorms, a fused q/k/v projection, gelu feed-forwards without a gate, a
    learned `position_side` x `position_side` position grid (image_size = position_side *
    patch_size, as the converter derives it), and a deepstack merger after each layer in
    `deepstack`, flagged in clip.vision.is_deepstack_layers (all false for `deepstack` ()). The
    patch kernel comes in llama.cpp's two halves plus a bias. `tensor_type`, `metadata`, `omit` and
    `replace` as for `write_tiny_projector`."""
    rng = np.random.default_rng(seed)
    matrix_dtype = MATRIX_DTYPES[tensor_type]
    merged = 4 * width  # a merged token's 2 x 2 patches side by side

    vision = {"spatial_merge_size": 2, "is_deepstack_layers": [i in deepstack for i in range(layers)]}
    shape = (position_side * patch_size, patch_size, width, ffn, text_dim, layers, heads)
    keys = projector_keys("qwen3vl_merger", shape, vision, {"clip.use_gelu": True} | (metadata or {}))

    draw = Draws(rng, matrix_dtype)
    matrix, vector, linear = draw.matrix, draw.vector, draw.linear

    def layer_norm(name: str, n: int = width) -> dict[str, np.ndarray]:
        return draw.layer_norm(name, n)

    # the two frames' halves, each of fan-in 3 p^2 so that their sum is of order one; the patch bias
    # and the positions large enough that leaving either out, or resizing the grid wrongly, shows
    half = dict(fan_in=6 * patch_size * patch_size)
    tensors = {
        "v.patch_embd.weight": matrix(width, 3, patch_size, patch_size, **half),
        "v.patch_embd.weight.1": matrix(width, 3, patch_size, patch_size, **half),
        "v.patch_embd.bias": vector(width, spread=0.3),
        # float32 in real files too: the converter keeps position embeddings so, and ggml resizes only float32
        "v.position_embd.weight": (0.5 * rng.standard_normal((position_side * position_side, width))).astype(np.float32),
    }
    for i in range(layers):
        p = f"v.blk.{i}."
        tensors |= layer_norm(p + "ln1") | linear(p + "attn_qkv", 3 * width, width) | linear(p + "attn_out", width, width)
        tensors |= layer_norm(p + "ln2") | linear(p + "ffn_up", ffn, width) | linear(p + "ffn_down", width, ffn)
    tensors |= layer_norm("v.post_ln")
    tensors |= linear("mm.0", merged, merged) | linear("mm.2", text_dim, merged)
    for i in sorted(deepstack):
        p = f"v.deepstack.{i}."
        tensors |= layer_norm(p + "norm", merged) | linear(p + "fc1", merged, merged) | linear(p + "fc2", text_dim, merged)
    return write_projector_file(path, keys, tensors | (replace or {}), omit, tensor_type)


def projector_keys(projector_type: str, shape: tuple[int, ...], vision: dict, metadata: dict | None) -> dict:
    """A projector file's keys: its type, a vision encoder alone, `shape` (image_size, patch_size,
    width, ffn, text_dim, layers, heads) and the statistics every family has as clip.vision.* keys,
    a family's own `vision` keys, then `metadata` (whole names) added or replaced (a value of None
    leaves the key out: add_key writes nothing)."""
    image_size, patch_size, width, ffn, text_dim, layers, heads = shape
    keys: dict = {"clip.has_vision_encoder": True, "clip.has_text_encoder": False, "clip.projector_type": projector_type}
    common = {"image_size": image_size, "patch_size": patch_size, "embedding_length": width, "feed_forward_length": ffn}
    common["projection_dim"] = text_dim  # llama.cpp reads it; this loader takes the width from the projection
    common |= {"block_count": layers, "attention.head_count": heads, "attention.layer_norm_epsilon": 1e-6}
    common |= {"image_mean": IMAGE_MEAN, "image_std": IMAGE_STD}
    keys |= {f"clip.vision.{key}": value for key, value in (common | vision).items()}
    return keys | (metadata or {})


# the matrices' type in memory before writing: a block type's are drawn float32 and quantized as written
MATRIX_DTYPES = {"F32": np.float32, "F16": np.float16, "Q8_0": np.float32, "Q4_0": np.float32, "Q4_K": np.float32}


class Draws:
    """Random tensors from one seeded stream, in the order they are asked for: matrices at
    1/sqrt(fan-in) scale in `matrix_dtype`, vectors float32 (norms near one, biases near zero)."""

    def __init__(self, rng: np.random.Generator, matrix_dtype=np.float32, normal_dtype=np.float64):
        self.rng, self.matrix_dtype, self.normal_dtype = rng, matrix_dtype, normal_dtype

    def matrix(self, *shape: int, fan_in: int | None = None) -> np.ndarray:
        return (self.rng.standard_normal(shape, dtype=self.normal_dtype) * (fan_in or shape[-1]) ** -0.5).astype(self.matrix_dtype)

    def vector(self, n: int, center: float = 0.0, spread: float = 0.02) -> np.ndarray:
        return (center + spread * self.rng.standard_normal(n)).astype(np.float32)

    def linear(self, name: str, rows: int, cols: int) -> dict[str, np.ndarray]:
        """`name`.weight (rows, cols) and its bias."""
        return {f"{name}.weight": self.matrix(rows, cols), f"{name}.bias": self.vector(rows)}

    def layer_norm(self, name: str, n: int) -> dict[str, np.ndarray]:
        return {f"{name}.weight": self.vector(n, 1.0, 0.1), f"{name}.bias": self.vector(n, spread=0.05)}


def write_projector_file(
    path: str, keys: dict, tensors: dict[str, np.ndarray], omit: tuple[str, ...] = (), tensor_type: str = "F32"
) -> str:
    """A GGUF of architecture "clip" with `keys` and `tensors` but those named in `omit`; with a block
    `tensor_type` (Q8_0, Q4_0 ...), the layers' and the projection's matrices are quantized to it
    where their rows are whole blocks (else float16), as llama.cpp quantizes a projector."""
    w = gguf.GGUFWriter(path, "clip")
    for key, value in keys.items():
        add_key(w, key, value)
    block = None if tensor_type in ("F32", "F16") else gguf.GGMLQuantizationType[tensor_type]
    for name, array in tensors.items():
        if name in omit:
            continue
        # Gemma 3's projection stays float: llama.cpp multiplies by its transpose, which ggml cannot make of blocks
        quantized = block is not None and name.startswith(("v.blk.", "mm.")) and array.ndim == 2 and name != "mm.input_projection.weight"
        if quantized and array.shape[1] % gguf.GGML_QUANT_SIZES[block][0] == 0:
            blocks = (
                quantize_q4_k(array) if block == gguf.GGMLQuantizationType.Q4_K else gguf.quants.quantize(array.astype(np.float32), block)
            )
            w.add_tensor(name, blocks, raw_dtype=block)
        elif quantized:  # rows not whole blocks: float16, as llama.cpp leaves such a matrix
            w.add_tensor(name, array.astype(np.float16))
        else:
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


class ReferenceFile:
    """A projector file's keys and tensors (float64), as gguf's reader gives them: what the tests'
    float64 references read, apart from the server's loader."""

    def __init__(self, path: str):
        reader = gguf.GGUFReader(path)
        self.keys = {name: field.contents() for name, field in reader.fields.items()}
        self.tensors = {}
        for t in reader.tensors:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            self.tensors[t.name] = values.reshape(tuple(int(d) for d in reversed(t.shape)))

    def vision(self, key: str, default=None):
        return self.keys.get(f"clip.vision.{key}", default)
