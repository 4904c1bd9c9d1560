"""The vision encoder's kernels (c/vision_encoder.c through kernels/vision_encoder.py): attention
against float64 softmax attention, on the best rung this CPU runs and the generic build: shapes that
leave partial tiles (patches not a multiple of 16 or of the key tile, queries not a multiple of the
item), scores large enough that a later tile's maximum rescales what came before, outputs written into
one head's columns of a wider array; gelu against float64's over float32's whole range; products
by float16 and float32 matrices against float64's, by quantized blocks against the float64 product of
the int8-rounded activations the language model's products take; then the whole SigLIP encoder with
and without them (an F16 file's matrices kept float16 in memory, a Q8_0 or Q4_K file's in its blocks)."""

from __future__ import annotations

import numpy as np
import pytest
from support.tiny_projectors import write_tiny_projector, write_tiny_qwen2vl_projector
from test_kernels import assert_rows_are_their_blocks_product, random_blocks

from webapp.engine.kernels.host_blocks import HostBlocks
from webapp.engine.kernels.vision_encoder import VisionEncoderKernels
from webapp.engine.vision.projector import load_projector


def float64_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    scores = q.astype(np.float64) @ k.astype(np.float64).T
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    return (probs / probs.sum(axis=1, keepdims=True)) @ v.astype(np.float64)


@pytest.mark.parametrize(
    "patches, queries, head_dim, spread",
    [
        (1, 1, 8, 1.0),
        (17, 5, 8, 3.0),
        (129, 49, 64, 1.0),
        (729, 37, 72, 2.0),
        (1024, 100, 64, 0.5),
        (300, 13, 576, 0.1),
        (256, 12, 16, 30.0),
    ],
)
def test_one_head_matches_float64(library, patches, queries, head_dim, spread):
    rng = np.random.default_rng(patches * 1000 + head_dim)
    q = (rng.standard_normal((queries, head_dim)) * spread / np.sqrt(head_dim)).astype(np.float32)
    k = rng.standard_normal((patches, head_dim)).astype(np.float32)
    v = rng.standard_normal((patches, head_dim)).astype(np.float32)
    if spread > 10:  # the largest score in the last key tile: every tile before it is rescaled
        k[-1] = q.mean(axis=0) * 4
    heads = np.full((queries, 3, head_dim), np.nan, dtype=np.float32)  # the middle head's columns written, the others untouched
    VisionEncoderKernels(library).attention(q, np.ascontiguousarray(k.T), v, heads[:, 1])
    np.testing.assert_allclose(heads[:, 1], float64_attention(q, k, v), atol=2e-5, rtol=1e-4)
    assert np.isnan(heads[:, 0]).all() and np.isnan(heads[:, 2]).all()


def test_what_c_would_misread_is_refused_before_it(library):
    kernels = VisionEncoderKernels(library)
    q, k, v = (np.zeros((4, 8), np.float32) for _ in range(3))
    out = np.zeros((4, 8), np.float32)
    for args, says in [
        ((q.astype(np.float64), k.T.copy(), v, out), "float32"),
        ((q, k.copy(), v[:3], out), "shapes"),
        ((q, k.T, v, out), "contiguous"),  # the transpose of k as a view: its rows are columns
        ((q, k.T.copy(), v, np.zeros((8, 4), np.float32).T), "rows"),  # a row of out is a column
        (
            (np.zeros((4, 12), np.float32), np.zeros((12, 4), np.float32), np.zeros((4, 12), np.float32), np.zeros((4, 12), np.float32)),
            "shapes",
        ),
    ]:
        with pytest.raises(ValueError, match=says):
            kernels.attention(*args)
    assert kernels.runs_attention(72) and kernels.runs_attention(64) and not kernels.runs_attention(12) and not kernels.runs_attention(1024)
    for x, says in [(np.zeros(8, np.float64), "float32"), (np.zeros((4, 4), np.float32).T[:, :2], "contiguous")]:
        with pytest.raises(ValueError, match=says):
            kernels.gelu_tanh(x)


def test_gelu_matches_float64_everywhere(library):
    # every size of value, both signs, the extremes, and a length that leaves a tail past the eights
    x = np.concatenate([np.linspace(-12, 12, 4001), [0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, 3.4e38, -3.4e38]])
    x = np.concatenate([x, np.random.default_rng(0).standard_normal(5000) * 3]).astype(np.float32)
    wide = x.astype(np.float64)
    expected = 0.5 * wide * (1 + np.tanh(np.sqrt(2 / np.pi) * (wide + 0.044715 * wide**3)))
    got = VisionEncoderKernels(library).gelu_tanh(x.copy())
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(
    "rows, cols, outs",
    [(1, 8, 1), (7, 37, 9), (13, 1176, 30), (64, 2100, 70), (300, 520, 260)],
)
def test_products_match_float64(library, rows, cols, outs, dtype):
    """Rows and outputs past whole tiles, columns past whole vectors and in pieces (past 1,024), several
    blocks of rows and of outputs; then into a wider array's columns, added to what it holds."""
    rng = np.random.default_rng(rows * 7 + cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    weight = (rng.standard_normal((outs, cols)) / np.sqrt(cols)).astype(dtype)
    bias = rng.standard_normal(outs).astype(np.float32)
    exact = x.astype(np.float64) @ weight.astype(np.float64).T
    kernels = VisionEncoderKernels(library)
    np.testing.assert_allclose(kernels.linear(x, weight, bias), exact + bias, rtol=1e-5, atol=1e-5)
    wide = rng.standard_normal((rows, outs + 5)).astype(np.float32)
    before = wide.copy()
    kernels.linear(x, weight, None, wide[:, 2 : 2 + outs], add=True)
    np.testing.assert_allclose(wide[:, 2 : 2 + outs], before[:, 2 : 2 + outs] + exact, rtol=1e-5, atol=1e-5)
    assert np.array_equal(wide[:, :2], before[:, :2]) and np.array_equal(wide[:, 2 + outs :], before[:, 2 + outs :])


def test_products_refuse_what_c_could_not_read(library):
    kernels = VisionEncoderKernels(library)
    x, weight = np.zeros((3, 8), np.float32), np.zeros((4, 8), np.float16)
    for args, says in [
        ((x, np.zeros((4, 8), np.float64), None), "float16 or float32"),
        ((x, np.zeros((4, 9), np.float16), None), "no product"),
        ((x, weight, np.zeros(5, np.float32)), "bias"),
        ((x, weight, None, np.zeros((3, 5), np.float32)), "out must be"),
        ((x, weight, None, np.zeros((3, 4), np.float32).T.copy().T), "out must be"),
        ((x, weight, None, None, True), "adding needs"),
    ]:
        with pytest.raises(ValueError, match=says):
            kernels.linear(*args)


def test_the_encoder_gives_the_same_rows_with_the_kernels_as_in_numpy(library, tmp_path):
    path = write_tiny_projector(
        str(tmp_path / "p.mmproj.gguf"), "gemma3", width=64, heads=8, image_size=112, patch_size=14, tensor_type="F16"
    )
    projector = load_projector(path)
    assert projector.encoder.layers[0].up_weight.dtype == np.float16  # half the memory, and what the kernels read
    pixels = projector.preprocess(np.random.default_rng(1).integers(0, 256, (90, 120, 3), dtype=np.uint8))
    in_numpy = projector.encode(pixels)
    projector.encoder.kernels = VisionEncoderKernels(library)
    on_kernels = projector.encode(pixels)
    np.testing.assert_allclose(on_kernels, in_numpy, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize(
    "ggml_type, rows, cols, outs", [(8, 1, 32, 1), (8, 45, 1152, 24), (2, 300, 256, 37), (12, 64, 1280, 16), (14, 9, 512, 8)]
)
def test_block_products_are_the_language_models(library, ggml_type, rows, cols, outs):
    """Q8_0, Q4_0, Q4_K, Q6_K: outputs in eights (the interleaved layout) and not; every row of
    patches against the float64 product of its int8-rounded self; the bias added, then into a wider
    array's columns, added to what it holds; the file's layout left as it was for NumPy."""
    rng = np.random.default_rng(ggml_type * 100 + rows)
    raw = random_blocks(ggml_type, outs, cols, rng)
    weight = HostBlocks(raw.copy(), ggml_type, cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    bias = rng.standard_normal(outs).astype(np.float32)
    kernels = VisionEncoderKernels(library)
    assert_rows_are_their_blocks_product(kernels.linear(x, weight, bias) - bias, x, raw, ggml_type, np.arange(outs), cols)
    wide = rng.standard_normal((rows, outs + 3)).astype(np.float32)
    before = wide.copy()
    kernels.linear(x, weight, None, wide[:, 1 : 1 + outs], add=True)
    assert_rows_are_their_blocks_product(wide[:, 1 : 1 + outs] - before[:, 1 : 1 + outs], x, raw, ggml_type, np.arange(outs), cols)
    assert np.array_equal(wide[:, :1], before[:, :1]) and np.array_equal(wide[:, 1 + outs :], before[:, 1 + outs :])
    assert np.array_equal(weight.raw, raw)


@pytest.mark.parametrize("family, tensor_type", [("gemma3", "Q8_0"), ("gemma3", "Q4_K"), ("qwen2.5vl", "Q8_0")])
def test_a_quantized_files_encoder_keeps_its_blocks_and_agrees_with_numpy(library, tmp_path, family, tensor_type):
    """In NumPy the blocks are widened to float32 (their exact values); on the kernels the patches'
    rows are rounded to int8 blocks as a token's are: the rows agree to float32 and int8 rounding.
    Qwen2.5-VL's q, k and v are one matrix: their blocks stacked."""
    path = str(tmp_path / "p.mmproj.gguf")
    if family == "gemma3":
        width = 256 if tensor_type == "Q4_K" else 64
        write_tiny_projector(path, family, width=width, ffn=2 * width, heads=8, image_size=112, patch_size=14, tensor_type=tensor_type)
    else:
        write_tiny_qwen2vl_projector(path, family, tensor_type=tensor_type)
    projector = load_projector(path)
    layer = projector.encoder.layers[0]
    assert all(
        isinstance(m, HostBlocks) for m in (getattr(layer, "q_weight", None) or layer.qkv_weight, layer.up_weight, layer.down_weight)
    )
    _, pixels, _ = projector.pieces(np.random.default_rng(2).integers(0, 256, (90, 120, 3), dtype=np.uint8))[0]
    in_numpy = projector.encode(pixels)
    projector.encoder.kernels = VisionEncoderKernels(library)
    on_kernels = projector.encode(pixels)
    cosine = (in_numpy * on_kernels).sum(1) / np.linalg.norm(in_numpy, axis=1) / np.linalg.norm(on_kernels, axis=1)
    assert cosine.min() > 0.999, cosine.min()
    projector.encoder.kernels = None  # and NumPy again, from the file's layout the kernels left alone
    np.testing.assert_array_equal(projector.encode(pixels), in_numpy)
    # loaded for the kernels (as the server loads it): each matrix laid out for them once, at load;
    # the same rows on them, and in NumPy from that layout
    for_kernels = load_projector(path, library)
    assert for_kernels.encoder.layers[0].up_weight.library is library
    for_kernels.encoder.kernels = VisionEncoderKernels(library)
    np.testing.assert_array_equal(for_kernels.encode(pixels), on_kernels)
    for_kernels.encoder.kernels = None
    np.testing.assert_allclose(for_kernels.encode(pixels), in_numpy, rtol=1e-5, atol=1e-5)
