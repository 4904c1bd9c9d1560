"""Qwen2-VL and Qwen2.5-VL image input against a float64 reference written here, on tiny random projectors.

The reference is written from llama.cpp's graph and inputs (tools/mtmd/models/qwen2vl.cpp, the
QWEN25VL inputs in tools/mtmd/clip.cpp, calc_size_preserved_ratio in tools/mtmd/mtmd-image.cpp,
ggml's GGML_ROPE_TYPE_VISION in ggml/src/ggml-cpu/ops.cpp), and computes each step another way than
llama.cpp lays it out:

- the smart-resize size rule in float32 scalars, as llama.cpp computes it, with C's round half away
  from zero;
- the patch embedding as two einsums (one per temporal half of the Conv3D kernel) over the image's
  (channel, row, dy, col, dx) view;
- the 2 x 2 merge order as an explicit list of each patch's (row, column), built in (Y, X, dy, dx)
  order; the encoder's rows follow it and the rotary angles are read from it;
- the 2-D rotary embedding as a complex product: element k and element k + d/2 of a head are the
  real and imaginary parts of one number turned by angle row * f_k (k < d/4) or column * f_{k-d/4};
- window attention as a boolean mask between patches of the same window (llama.cpp reorders the
  merged groups by window and back instead; attention does not care about order);
- softmax through log-sum-exp, RMS norm and LayerNorm from their definitions, gelu (ggml's tanh
  form) and gelu_quick from tanh and the logistic function.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image
from support.tiny_projectors import ReferenceFile, write_tiny_qwen2vl_projector

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.vision.projector import load_projector

FAMILIES = ("qwen2.5vl", "qwen2vl")
WRAP = ("<|vision_start|>", "<|vision_end|>")


@pytest.fixture(scope="module")
def projector_files(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(family, tensor type) -> a tiny projector's path, written once for the module."""
    folder = tmp_path_factory.mktemp("qwen2vl")
    return {(f, t): write_tiny_qwen2vl_projector(str(folder / f"{f}-{t}.gguf"), f, tensor_type=t) for f in FAMILIES for t in ("F32", "F16")}


def an_image(seed: int = 1, height: int = 22, width: int = 41) -> np.ndarray:
    """A random RGB image; at the tiny files' 4-pixel patches 22 x 41 becomes 24 x 40 pixels, a 3 x 5
    merged grid that 2 x 2 windows do not tile: the last row and column of windows are partial."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def is_rms(ref: ReferenceFile) -> bool:
    return ref.keys["clip.projector_type"] == "qwen2.5vl_merger"


def reference_size(ref: ReferenceFile, height: int, width: int) -> tuple[int, int]:
    """llama.cpp's calc_size_preserved_ratio for these files: (h_bar, w_bar), multiples of 2 patches,
    in float32 arithmetic as llama.cpp does it (std::round rounds halves away from zero)."""
    f32 = np.float32
    align = 2 * ref.vision("patch_size")
    min_pixels = ref.vision("image_min_pixels", 8 * align * align)
    max_pixels = ref.vision("image_max_pixels", 4096 * align * align)

    def by(x: np.float32, to_int) -> int:
        return int(to_int(float(x / f32(align)))) * align

    def round_half_away(v: float) -> float:
        return math.floor(v + 0.5)

    h_bar = max(align, by(f32(height), round_half_away))
    w_bar = max(align, by(f32(width), round_half_away))
    if h_bar * w_bar > max_pixels:
        beta = np.sqrt(f32(height) * f32(width) / f32(max_pixels))
        h_bar = max(align, by(f32(height) / beta, math.floor))
        w_bar = max(align, by(f32(width) / beta, math.floor))
    elif h_bar * w_bar < min_pixels:
        beta = np.sqrt(f32(min_pixels) / (f32(height) * f32(width)))
        h_bar, w_bar = by(f32(height) * beta, math.ceil), by(f32(width) * beta, math.ceil)
    return h_bar, w_bar


def reference_pixels(rgb: np.ndarray, ref: ReferenceFile) -> np.ndarray:
    """Stretched to the smart-resize size with Pillow's bicubic filter, then normalized: (3, h_bar, w_bar)."""
    h_bar, w_bar = reference_size(ref, *rgb.shape[:2])
    resized = np.asarray(Image.fromarray(rgb).resize((w_bar, h_bar), Image.Resampling.BICUBIC), dtype=np.float64)
    mean, std = np.array(ref.vision("image_mean")), np.array(ref.vision("image_std"))
    return np.stack([(resized[:, :, c] / 255.0 - mean[c]) / std[c] for c in range(3)])


def merge_order(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Each encoder row's patch (row, column): merged token (Y, X) in raster order, inside it (dy, dx)."""
    order = [(2 * y + dy, 2 * x + dx) for y in range(rows // 2) for x in range(cols // 2) for dy in (0, 1) for dx in (0, 1)]
    return np.array([r for r, _ in order]), np.array([c for _, c in order])


def rotate(q: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """2-D rotary embedding of (n, heads, d): the first quarter of the angles from the patch's row,
    the second from its column, each quarter's frequencies 10000^(-4 j / d) restarting at j = 0."""
    d = q.shape[2]
    freqs = 10000.0 ** (-4.0 * np.arange(d // 4) / d)
    angles = np.concatenate([np.outer(rows, freqs), np.outer(cols, freqs)], axis=1)  # (n, d/2)
    turned = (q[:, :, : d // 2] + 1j * q[:, :, d // 2 :]) * np.exp(1j * angles)[:, None, :]
    return np.concatenate([turned.real, turned.imag], axis=2)


def norm(x: np.ndarray, t: dict, name: str, rms: bool, eps: float) -> np.ndarray:
    if rms:
        return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * t[name + ".weight"]
    centered = x - x.mean(axis=1, keepdims=True)
    return centered / np.sqrt((centered**2).mean(axis=1, keepdims=True) + eps) * t[name + ".weight"] + t[name + ".bias"]


def gelu_tanh(u: np.ndarray) -> np.ndarray:
    return 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))


def reference_encode(ref: ReferenceFile, pixels: np.ndarray, windows: bool = True) -> np.ndarray:
    """(merged tokens, text_dim) rows for (3, H, W) pixels; `windows` False makes every layer attend fully."""
    t, rms, eps = ref.tensors, is_rms(ref), ref.vision("attention.layer_norm_epsilon")
    patch, heads = ref.vision("patch_size"), ref.vision("attention.head_count")
    _, height, width = pixels.shape
    grid_rows, grid_cols = height // patch, width // patch
    view = pixels.astype(np.float64).reshape(3, grid_rows, patch, grid_cols, patch)
    embedded = sum(np.einsum("cyixj,wcij->yxw", view, t[name]) for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"))
    rows, cols = merge_order(grid_rows, grid_cols)
    x = embedded[rows, cols]  # (n, width), in the merge order
    n, dim = x.shape
    head_dim = dim // heads

    pattern = ref.vision("n_wa_pattern", 0) if rms and windows else 0
    g = ref.vision("window_size", 112) // patch // 2  # merged tokens per window side
    window = (rows // 2 // g) * 10_000 + (cols // 2 // g)
    same_window = window[:, None] == window[None, :]

    for i in range(ref.vision("block_count")):
        p = f"v.blk.{i}."

        def lin(y, name, p=p):
            return y @ t[p + name + ".weight"].T + t[p + name + ".bias"]

        h = norm(x, t, p + "ln1", rms, eps)
        q, k, v = (lin(h, name).reshape(n, heads, head_dim) for name in ("attn_q", "attn_k", "attn_v"))
        q, k = rotate(q, rows, cols), rotate(k, rows, cols)
        scores = np.einsum("nhd,mhd->hnm", q, k) / math.sqrt(head_dim)
        if pattern > 0 and (i + 1) % pattern != 0:
            scores = np.where(same_window, scores, -np.inf)
        top = scores.max(axis=2, keepdims=True)
        log_probs = scores - (top + np.log(np.exp(scores - top).sum(axis=2, keepdims=True)))
        x = x + lin(np.einsum("hnm,mhd->nhd", np.exp(log_probs), v).reshape(n, dim), "attn_out")
        h = norm(x, t, p + "ln2", rms, eps)
        if rms:
            gate = lin(h, "ffn_gate")
            x = x + lin(gate / (1 + np.exp(-gate)) * lin(h, "ffn_up"), "ffn_down")
        else:
            up = lin(h, "ffn_up")
            x = x + lin(up / (1 + np.exp(-1.702 * up)), "ffn_down")

    merged = norm(x, t, "v.post_ln", rms, eps).reshape(n // 4, 4 * dim)  # a merged token's 4 patches side by side
    hidden = gelu_tanh(merged @ t["mm.0.weight"].T + t["mm.0.bias"])
    return hidden @ t["mm.2.weight"].T + t["mm.2.bias"]


def assert_rows_close(got: np.ndarray, want: np.ndarray) -> None:
    """Float32 against float64: every row pointing the same way, and no value off by more than float32
    rounding allows."""
    assert got.shape == want.shape and got.dtype == np.float32, (got.shape, got.dtype, want.shape)
    cosine = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() >= 0.99999, cosine.min()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), np.abs(got - want).max() / np.abs(want).max()


def cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


# the reference checked against itself, so that a disagreement below is the implementation's


def test_reference_size_rule_by_hand(tmp_path):
    """Hand-worked sizes at 4-pixel patches (align 8), 6 to 20 merged tokens (384 to 1280 pixels)."""
    ref = ReferenceFile(write_tiny_qwen2vl_projector(str(tmp_path / "limits.gguf"), min_tokens=6, max_tokens=20))
    assert reference_size(ref, 22, 41) == (24, 40)  # rounded: 2.75 -> 3, 5.125 -> 5
    assert reference_size(ref, 12, 20) == (16, 24)  # halves away from zero: 1.5 -> 2, 2.5 -> 3; 384 is not below the minimum
    assert reference_size(ref, 8, 8) == (24, 24)  # 64 < 384: beta = sqrt(6), ceil(2.45) = 3 merged tokens a side
    assert reference_size(ref, 100, 70) == (40, 24)  # 104 x 72 > 1280: beta = sqrt(7000 / 1280), floor(5.35), floor(3.74)
    assert reference_size(ref, 3, 200) == (8, 288)  # the short side kept at one merged token: over the maximum as in llama.cpp


def test_reference_rotary_turns_pairs_by_row_then_column():
    d = 8
    q = np.zeros((2, 1, d))
    q[:, 0, 0] = 1.0  # pair (0, 4): angle row * 1
    q[:, 0, 3] = 1.0  # pair (3, 7): angle col * 10000^(-4/8)
    turned = rotate(q, np.array([0, 2]), np.array([0, 3]))
    np.testing.assert_allclose(turned[0, 0], q[0, 0])  # position (0, 0) turns nothing
    assert np.isclose(turned[1, 0, 0], math.cos(2)) and np.isclose(turned[1, 0, 4], math.sin(2))
    assert np.isclose(turned[1, 0, 3], math.cos(3 * 0.01)) and np.isclose(turned[1, 0, 7], math.sin(3 * 0.01))


def test_reference_merge_order():
    rows, cols = merge_order(4, 6)
    assert list(zip(rows[:8], cols[:8])) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    assert (rows[12], cols[12]) == (2, 0)  # the second merged row starts after the first's 3 tokens


def test_reference_windows_are_a_mask(projector_files):
    """A window covering the whole grid is full attention; 2 x 2 windows on a 3 x 5 grid are not."""
    ref = ReferenceFile(projector_files["qwen2.5vl", "F32"])
    pixels = reference_pixels(an_image(), ref)
    windowed, full = reference_encode(ref, pixels), reference_encode(ref, pixels, windows=False)
    assert windowed.shape == full.shape == (15, 48)
    assert cosine_min(windowed, full) < 0.999
    ref.keys["clip.vision.window_size"] = 5 * 2 * ref.vision("patch_size")
    np.testing.assert_allclose(reference_encode(ref, pixels), full, rtol=1e-12, atol=1e-12)


# the implementation against the reference


@pytest.mark.parametrize("tensor_type", ["F32", "F16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_encode_matches_reference(projector_files, family, tensor_type):
    path = projector_files[family, tensor_type]
    projector, ref = load_projector(path), ReferenceFile(path)
    ((before, pixels, after),) = projector.pieces(an_image())
    assert (before, after) == WRAP and pixels.shape == (3, 24, 40)
    assert projector.tokens(pixels) == 15 and tuple(projector.grid(pixels)) == (3, 5)
    assert_rows_close(projector.encode(pixels), reference_encode(ref, pixels))


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_of_another_shape(projector_files, family):
    """A tall image, a 5 x 3 merged grid: rows and columns not swapped anywhere."""
    path = projector_files[family, "F32"]
    projector, ref = load_projector(path), ReferenceFile(path)
    ((_, pixels, _),) = projector.pieces(an_image(5, height=37, width=21))
    assert pixels.shape == (3, 40, 24) and tuple(projector.grid(pixels)) == (5, 3)
    assert_rows_close(projector.encode(pixels), reference_encode(ref, pixels))


def test_windows_matter(projector_files):
    """Qwen2.5-VL's windowed layers: the implementation matches the windowed reference, not the full one."""
    path = projector_files["qwen2.5vl", "F32"]
    projector, ref = load_projector(path), ReferenceFile(path)
    ((_, pixels, _),) = projector.pieces(an_image())
    got = projector.encode(pixels)
    assert_rows_close(got, reference_encode(ref, pixels))
    assert cosine_min(got, reference_encode(ref, pixels, windows=False)) < 0.999


@pytest.mark.parametrize(
    "spoil",
    [{"n_wa_pattern": 0}, {"window_size": None}],  # no windowed layer; llama.cpp's 112-pixel default window covers the 3 x 5 grid
    ids=["n_wa_pattern 0", "default window"],
)
def test_full_attention_files(tmp_path, spoil):
    path = write_tiny_qwen2vl_projector(str(tmp_path / "full.gguf"), **spoil)
    projector, ref = load_projector(path), ReferenceFile(path)
    ((_, pixels, _),) = projector.pieces(an_image())
    assert_rows_close(projector.encode(pixels), reference_encode(ref, pixels, windows=False))


@pytest.mark.parametrize(
    "size",
    [(22, 41), (12, 20), (8, 8), (100, 70), (3, 200), (37, 21), (200, 9)],
)
def test_preprocess_size_rule_and_pixels(tmp_path, size):
    path = write_tiny_qwen2vl_projector(str(tmp_path / "limits.gguf"), min_tokens=6, max_tokens=20)
    projector, ref = load_projector(path), ReferenceFile(path)
    image = an_image(7, *size)
    ((before, pixels, after),) = projector.pieces(image)
    h_bar, w_bar = reference_size(ref, *size)
    assert (before, after) == WRAP and pixels.dtype == np.float32 and pixels.shape == (3, h_bar, w_bar)
    assert projector.tokens(pixels) == h_bar * w_bar // 64 and tuple(projector.grid(pixels)) == (h_bar // 8, w_bar // 8)
    np.testing.assert_allclose(pixels, reference_pixels(image, ref), rtol=0, atol=1e-5)


def test_default_token_limits(projector_files):
    """Without the keys: 8 to 4096 merged tokens. A 2 x 2 image grows to 8 tokens' worth of pixels."""
    projector, ref = load_projector(projector_files["qwen2vl", "F32"]), ReferenceFile(projector_files["qwen2vl", "F32"])
    ((_, pixels, _),) = projector.pieces(an_image(8, 2, 2))
    assert pixels.shape[1:] == reference_size(ref, 2, 2) == (24, 24)  # ceil(sqrt(512 / 4) / 4) = 3 tokens a side
    ((_, pixels, _),) = projector.pieces(an_image(9, 600, 40))
    assert pixels.shape[1:] == reference_size(ref, 600, 40) == (600, 40)  # 75 x 5 = 375 tokens: within the limits


def test_encode_is_deterministic(projector_files):
    projector = load_projector(projector_files["qwen2.5vl", "F16"])
    ((_, pixels, _),) = projector.pieces(an_image())
    assert np.array_equal(projector.encode(pixels), projector.encode(pixels.copy()))


SPOILED = {
    "missing second conv half": ("qwen2.5vl", {"omit": ("v.patch_embd.weight.1",)}, "v.patch_embd.weight.1"),
    "second conv half of another shape": (
        "qwen2vl",
        {"replace": {"v.patch_embd.weight.1": np.zeros((32, 3, 4, 2), np.float32)}},
        "v.patch_embd.weight.1",
    ),
    "projection of the wrong width": ("qwen2.5vl", {"replace": {"mm.2.weight": np.zeros((48, 64), np.float32)}}, "mm.2.weight"),
    "missing projection bias": ("qwen2vl", {"omit": ("mm.0.bias",)}, "mm.0.bias"),
    "missing gate": ("qwen2.5vl", {"omit": ("v.blk.2.ffn_gate.weight",)}, "v.blk.2.ffn_gate.weight"),
    "missing LayerNorm bias": ("qwen2vl", {"omit": ("v.blk.1.ln2.bias",)}, "v.blk.1.ln2.bias"),
    "no n_wa_pattern": ("qwen2.5vl", {"n_wa_pattern": None}, "clip.vision.n_wa_pattern"),
    "missing key": ("qwen2vl", {"metadata": {"clip.vision.image_mean": None}}, "clip.vision.image_mean"),
}


@pytest.mark.parametrize("case", list(SPOILED))
def test_bad_projector_names_the_problem(tmp_path, case):
    family, spoil, name = SPOILED[case]
    path = write_tiny_qwen2vl_projector(str(tmp_path / "bad.gguf"), family, **spoil)
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        load_projector(path)


def test_the_operators_token_range_bounds_an_images_positions(projector_files):
    """LLM_IMAGE_MAX_TOKENS / LLM_IMAGE_MIN_TOKENS (the loader's `limit_tokens`): a large image is
    scaled down to at most the most, a small one up to at least the least."""
    projector = load_projector(projector_files["qwen2.5vl", "F32"])
    assert projector.limit_tokens(None, 12) == (8, 12)
    ((_, large, _),) = projector.pieces(an_image(height=200, width=300))
    assert projector.tokens(large) <= 12 and projector.encode(large).shape == (projector.tokens(large), 48)
    assert projector.limit_tokens(40, 100) == (40, 100)
    ((_, small, _),) = projector.pieces(an_image(height=10, width=12))
    assert projector.tokens(small) >= 40


def test_a_strip_too_narrow_to_fit_is_refused(projector_files):
    """One side held at a merged token while the other scales down: a strip may take more positions
    than the most, as llama.cpp lets it, but one past what the tower takes (4,096 tokens of 16,384
    patches) is refused as bad input (a 400), not encoded for hours."""
    from webapp.engine.vision.images import ImageError

    projector = load_projector(projector_files["qwen2.5vl", "F32"])
    with pytest.raises(ImageError, match=r"240000x1 pixels: .* takes \d+ positions, more than the 4096"):
        projector.pieces(np.zeros((1, 240_000, 3), np.uint8))
    projector.limit_tokens(None, 16)
    ((_, pixels, _),) = projector.pieces(np.zeros((1, 2000, 3), np.uint8))  # past 16, as llama.cpp's
    assert projector.grid(pixels)[0] == 1 and projector.tokens(pixels) > 16
