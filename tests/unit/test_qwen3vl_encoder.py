"""Qwen3-VL (and Qwen3.5) image input against a float64 reference written here, on tiny random projectors.

The reference is written from llama.cpp's graph and inputs (tools/mtmd/models/qwen3vl.cpp;
resize_position_embeddings, the QWEN3VL hyperparameters, tensors and positions in
tools/mtmd/clip.cpp; ggml_interpolate's bilinear mode with GGML_SCALE_FLAG_ALIGN_CORNERS in
ggml/src/ggml-cpu/ops.cpp). What Qwen3-VL shares with Qwen2-VL (the preprocessing, the 2-D vision
rotary, LayerNorm, gelu, the row comparison) comes from that test's reference. What is Qwen3-VL's
own is computed another way than llama.cpp lays it out:

- the learned position grid resized as two interpolation matrices, one over rows and one over
  columns, each row of a matrix one output position's align-corners weights (ggml loops over output
  positions and fetches four neighbours);
- the encoder's rows kept in raster order of the patch grid (attention does not care about order,
  and the rotary angles are read from each row's own patch), and a merged token's 2 x 2 patches
  gathered from the grid at the end, for the main path and each deepstack layer alike (llama.cpp
  permutes the patches into merged order first and reshapes);
- the fused q/k/v projection as three products with the weight's thirds;
- which layers are deepstack by llama.cpp's rule, the presence of v.deepstack.{i}.fc1.weight
  (clip.cpp's loader; clip.vision.is_deepstack_layers is only the converter's record of it).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from support.tiny_projectors import ReferenceFile, write_tiny_qwen3vl_projector
from test_qwen2vl_encoder import (
    WRAP,
    an_image,
    assert_rows_close,
    cosine_min,
    gelu_tanh,
    merge_order,
    norm,
    reference_pixels,
    reference_size,
    rotate,
)

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.vision.projector import load_projector

TEXT_DIM = 48


@pytest.fixture(scope="module")
def projector_files(tmp_path_factory) -> dict[str, str]:
    """tensor type -> a tiny projector's path (6 x 6 learned positions, deepstack after layers 1 and
    2), written once for the module."""
    folder = tmp_path_factory.mktemp("qwen3vl")
    return {t: write_tiny_qwen3vl_projector(str(folder / f"qwen3vl-{t}.gguf"), TEXT_DIM, tensor_type=t) for t in ("F32", "F16")}


def resize_weights(n_in: int, n_out: int, aligned: bool = True) -> np.ndarray:
    """(n_out, n_in): output i reads the source at s = i (n_in - 1) / (n_out - 1) (aligned corners:
    the first and last positions land on the first and last sources), or at the half-pixel
    s = (i + 0.5) n_in / n_out - 0.5 clamped to the sources (`aligned` False, for the tests that
    show the mode matters), split between its two neighbours by linear weights."""
    weights = np.zeros((n_out, n_in))
    for i in range(n_out):
        if aligned:
            s = i * (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
        else:
            s = min(max((i + 0.5) * n_in / n_out - 0.5, 0.0), n_in - 1)
        low = min(math.floor(s), n_in - 1)
        high = min(low + 1, n_in - 1)
        weights[i, low] += 1 - (s - low)
        weights[i, high] += s - low
    return weights


def resize_positions(table: np.ndarray, rows: int, cols: int, aligned: bool = True) -> np.ndarray:
    """The learned (side * side, width) table, its rows the grid's positions in raster order, resized
    to (rows, cols, width)."""
    side = math.isqrt(table.shape[0])
    grid = table.reshape(side, side, -1)  # (row, column, width)
    return np.einsum("ry,yxw,cx->rcw", resize_weights(side, rows, aligned), grid, resize_weights(side, cols, aligned))


def merge_rows(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """(rows * cols, width) in raster order -> (rows / 2 * cols / 2, 4 width): merged token (Y, X) in
    raster order, its patches (2Y + dy, 2X + dx) side by side in (dy, dx) order."""
    grid = x.reshape(rows // 2, 2, cols // 2, 2, -1)  # (Y, dy, X, dx, width)
    return grid.transpose(0, 2, 1, 3, 4).reshape(rows // 2 * (cols // 2), -1)


def deepstack_layers(ref: ReferenceFile) -> list[int]:
    return [i for i in range(ref.vision("block_count")) if f"v.deepstack.{i}.fc1.weight" in ref.tensors]


def reference_encode(ref: ReferenceFile, pixels: np.ndarray, aligned: bool = True) -> np.ndarray:
    """(merged tokens, text_dim * (1 + deepstack layers)) for (3, H, W) pixels: the main rows, then each
    deepstack layer's in layer order. `aligned` False resizes the positions with half pixels."""
    t, eps = ref.tensors, ref.vision("attention.layer_norm_epsilon")
    patch, heads = ref.vision("patch_size"), ref.vision("attention.head_count")
    _, height, width = pixels.shape
    grid_rows, grid_cols = height // patch, width // patch
    view = pixels.astype(np.float64).reshape(3, grid_rows, patch, grid_cols, patch)
    embedded = sum(np.einsum("cyixj,wcij->yxw", view, t[name]) for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"))
    embedded = embedded + t["v.patch_embd.bias"] + resize_positions(t["v.position_embd.weight"], grid_rows, grid_cols, aligned)
    x = embedded.reshape(grid_rows * grid_cols, -1)  # (n, width), raster order
    rows, cols = np.divmod(np.arange(grid_rows * grid_cols), grid_cols)
    n, dim = x.shape
    head_dim = dim // heads

    def merger(merged: np.ndarray, up: str, down: str) -> np.ndarray:
        return linear(gelu_tanh(linear(merged, up)), down)

    def linear(y: np.ndarray, name: str) -> np.ndarray:
        return y @ t[name + ".weight"].T + t[name + ".bias"]

    deep = []
    for i in range(ref.vision("block_count")):
        p = f"v.blk.{i}."
        h = norm(x, t, p + "ln1", False, eps)
        qkv, qkv_bias = t[p + "attn_qkv.weight"], t[p + "attn_qkv.bias"]
        q, k, v = ((h @ qkv[j * dim : (j + 1) * dim].T + qkv_bias[j * dim : (j + 1) * dim]).reshape(n, heads, head_dim) for j in range(3))
        q, k = rotate(q, rows, cols), rotate(k, rows, cols)
        scores = np.einsum("nhd,mhd->hnm", q, k) / math.sqrt(head_dim)
        top = scores.max(axis=2, keepdims=True)
        log_probs = scores - (top + np.log(np.exp(scores - top).sum(axis=2, keepdims=True)))
        x = x + linear(np.einsum("hnm,mhd->nhd", np.exp(log_probs), v).reshape(n, dim), p + "attn_out")
        x = x + linear(gelu_tanh(linear(norm(x, t, p + "ln2", False, eps), p + "ffn_up")), p + "ffn_down")
        if i in deepstack_layers(ref):
            d = f"v.deepstack.{i}."
            merged = norm(merge_rows(x, grid_rows, grid_cols), t, d + "norm", False, eps)  # normalized over the 4 patches together
            deep.append(merger(merged, d + "fc1", d + "fc2"))

    main = merger(merge_rows(norm(x, t, "v.post_ln", False, eps), grid_rows, grid_cols), "mm.0", "mm.2")
    return np.concatenate([main, *deep], axis=1)


def encoded(path: str, image: np.ndarray):
    """The loaded projector, the reference file, the image's pixels and the projector's rows."""
    projector, ref = load_projector(path), ReferenceFile(path)
    ((before, pixels, after),) = projector.pieces(image)
    assert (before, after) == WRAP
    return projector, ref, pixels, projector.encode(pixels)


# the reference checked against itself, so that a disagreement below is the implementation's


def test_reference_resize_by_hand():
    np.testing.assert_allclose(resize_weights(2, 3), [[1, 0], [0.5, 0.5], [0, 1]])
    np.testing.assert_allclose(resize_weights(6, 6), np.eye(6))  # the same size: unchanged
    # 6 -> 4: sources 0, 5/3, 10/3, 5
    np.testing.assert_allclose(resize_weights(6, 4)[1], [0, 1 / 3, 2 / 3, 0, 0, 0])
    np.testing.assert_allclose(resize_weights(6, 4)[2], [0, 0, 0, 2 / 3, 1 / 3, 0])
    # half pixels, 2 -> 4: sources -0.25 (clamped to 0), 0.25, 0.75, 1.25 (clamped to 1)
    np.testing.assert_allclose(resize_weights(2, 4, aligned=False), [[1, 0], [0.75, 0.25], [0.25, 0.75], [0, 1]])


def test_reference_resize_is_linear_interpolation_on_a_linspace():
    """As Qwen3-VL's own processor does it: each output position at linspace(0, side - 1, n) along
    each axis, the table interpolated there; checked with numpy's interp, one axis at a time."""
    table = np.random.default_rng(3).standard_normal((36, 5))
    got = resize_positions(table, 10, 4)
    grid = table.reshape(6, 6, 5)
    by_rows = np.stack([[np.interp(np.linspace(0, 5, 10), np.arange(6), grid[:, x, w]) for x in range(6)] for w in range(5)])  # (w, x, r)
    want = np.stack([[np.interp(np.linspace(0, 5, 4), np.arange(6), by_rows[w, :, r]) for r in range(10)] for w in range(5)])  # (w, r, c)
    np.testing.assert_allclose(got, want.transpose(1, 2, 0), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(resize_positions(table, 6, 6), grid)


def test_reference_merge_rows_follow_the_merge_order():
    """Gathering a merged token's patches from the raster grid gives the rows Qwen2-VL's merge order
    lays side by side."""
    x = np.random.default_rng(4).standard_normal((4 * 6, 3))
    rows, cols = merge_order(4, 6)
    np.testing.assert_array_equal(merge_rows(x, 4, 6), x[rows * 6 + cols].reshape(6, 12))


def test_reference_deepstack_layers_are_the_flagged_ones(projector_files):
    ref = ReferenceFile(projector_files["F32"])
    assert deepstack_layers(ref) == [1, 2] and ref.vision("is_deepstack_layers") == [False, True, True, False]


def test_reference_position_resize_mode_shows(projector_files):
    """On a grid other than the learned one, aligned corners and half pixels give rows apart; on the
    learned grid they agree (no resize)."""
    ref = ReferenceFile(projector_files["F32"])
    wide = reference_pixels(an_image(), ref)  # 6 x 10 patches
    assert cosine_min(reference_encode(ref, wide), reference_encode(ref, wide, aligned=False)) < 0.999
    square = reference_pixels(an_image(2, 24, 24), ref)
    np.testing.assert_allclose(reference_encode(ref, square), reference_encode(ref, square, aligned=False), rtol=1e-12, atol=1e-12)


# the implementation against the reference

# image size -> patch grid against the 6 x 6 learned one
GRIDS = {
    "learned grid, no resize": ((24, 24), (6, 6)),
    "wider": ((22, 41), (6, 10)),
    "taller": ((37, 21), (10, 6)),
    "larger both ways": ((40, 48), (10, 12)),
    "fewer rows, more columns": ((16, 40), (4, 10)),
}


@pytest.mark.parametrize("tensor_type", ["F32", "F16"])
@pytest.mark.parametrize("case", list(GRIDS))
def test_encode_matches_reference(projector_files, case, tensor_type):
    (height, width), (rows, cols) = GRIDS[case]
    projector, ref, pixels, got = encoded(projector_files[tensor_type], an_image(5, height, width))
    assert pixels.shape == (3, 4 * rows, 4 * cols)
    assert projector.tokens(pixels) == rows * cols // 4 and tuple(projector.grid(pixels)) == (rows // 2, cols // 2)
    assert projector.text_dim == TEXT_DIM and projector.deepstack == 2
    assert got.shape == (rows * cols // 4, 3 * TEXT_DIM)
    assert_rows_close(got, reference_encode(ref, pixels))


def test_grid_smaller_than_learned(tmp_path):
    """A 10 x 10 learned grid shrunk to 6 x 8 patches."""
    path = write_tiny_qwen3vl_projector(str(tmp_path / "side10.gguf"), TEXT_DIM, position_side=10)
    _, ref, pixels, got = encoded(path, an_image(6, 24, 32))
    assert pixels.shape == (3, 24, 32)
    assert_rows_close(got, reference_encode(ref, pixels))


def test_positions_resized_with_aligned_corners(projector_files):
    _, ref, pixels, got = encoded(projector_files["F32"], an_image(5, 40, 48))
    assert_rows_close(got, reference_encode(ref, pixels))
    assert cosine_min(got, reference_encode(ref, pixels, aligned=False)) < 0.999


def test_deepstack_features_in_layer_order(tmp_path):
    """Deepstack after the first and the last layer: the main rows, then layer 0's, then layer 3's."""
    path = write_tiny_qwen3vl_projector(str(tmp_path / "ends.gguf"), TEXT_DIM, deepstack=(0, 3))
    projector, ref, pixels, got = encoded(path, an_image())
    want = reference_encode(ref, pixels)
    assert projector.deepstack == 2 and got.shape == (15, 3 * TEXT_DIM)
    for block in range(3):
        assert_rows_close(got[:, block * TEXT_DIM : (block + 1) * TEXT_DIM], want[:, block * TEXT_DIM : (block + 1) * TEXT_DIM])
    assert cosine_min(got[:, TEXT_DIM : 2 * TEXT_DIM], want[:, 2 * TEXT_DIM :]) < 0.99  # the layers' features are not alike


@pytest.mark.parametrize("flags", ["all false", "absent"])
def test_no_deepstack_layers(tmp_path, flags):
    """Qwen3.5's towers: no deepstack layer, the output as wide as the text model."""
    metadata = {"clip.vision.is_deepstack_layers": None} if flags == "absent" else None
    path = write_tiny_qwen3vl_projector(str(tmp_path / "plain.gguf"), TEXT_DIM, deepstack=(), metadata=metadata)
    projector, ref, pixels, got = encoded(path, an_image())
    assert projector.deepstack == 0 and projector.text_dim == TEXT_DIM and got.shape == (15, TEXT_DIM)
    assert_rows_close(got, reference_encode(ref, pixels))


def test_deepstack_tensors_without_flags(tmp_path):
    """llama.cpp takes the deepstack layers from the tensors present (clip.cpp's loader counts the
    layers with v.deepstack.{i}.fc1.weight), not from clip.vision.is_deepstack_layers."""
    path = write_tiny_qwen3vl_projector(str(tmp_path / "unflagged.gguf"), TEXT_DIM, metadata={"clip.vision.is_deepstack_layers": None})
    projector, ref, pixels, got = encoded(path, an_image())
    assert projector.deepstack == 2
    assert_rows_close(got, reference_encode(ref, pixels))


@pytest.mark.parametrize("size", [(22, 41), (8, 8), (37, 21), (600, 40)])
def test_preprocess_as_qwen2vl(projector_files, size):
    """Stretched to whole merged tokens between 8 and 4096 of them, bicubic, the file's mean and std."""
    projector, ref = load_projector(projector_files["F32"]), ReferenceFile(projector_files["F32"])
    image = an_image(7, *size)
    ((_, pixels, _),) = projector.pieces(image)
    assert pixels.dtype == np.float32 and pixels.shape[1:] == reference_size(ref, *size)
    np.testing.assert_allclose(pixels, reference_pixels(image, ref), rtol=0, atol=1e-5)


SPOILED = {
    "missing patch bias": ({"omit": ("v.patch_embd.bias",)}, "v.patch_embd.bias"),
    "missing position embedding": ({"omit": ("v.position_embd.weight",)}, "v.position_embd.weight"),
    "position table not square": ({"replace": {"v.position_embd.weight": np.zeros((35, 32), np.float32)}}, "v.position_embd.weight"),
    "deepstack layer missing fc2": ({"omit": ("v.deepstack.2.fc2.weight",)}, "v.deepstack.2.fc2.weight"),
    "qkv of the wrong shape": ({"replace": {"v.blk.1.attn_qkv.weight": np.zeros((64, 32), np.float32)}}, "v.blk.1.attn_qkv.weight"),
    "missing qkv bias": ({"omit": ("v.blk.0.attn_qkv.bias",)}, "v.blk.0.attn_qkv.bias"),
}


@pytest.mark.parametrize("case", list(SPOILED))
def test_bad_projector_names_the_problem(tmp_path, case):
    spoil, name = SPOILED[case]
    path = write_tiny_qwen3vl_projector(str(tmp_path / "bad.gguf"), TEXT_DIM, **spoil)
    with pytest.raises(ModelLoadError, match=re.escape(name)):
        load_projector(path)
