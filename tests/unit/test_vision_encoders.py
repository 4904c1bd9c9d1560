"""The vision side of image input against a float64 reference written here, on tiny random projectors.

The reference reads the same file with gguf's own reader and computes each step another way than
webapp.engine.vision does: the patch convolution as an einsum over the image's (channel, row, dy,
col, dx) view, LayerNorm from its mean and variance, every head's attention at once with a
log-sum-exp softmax, gelu through the logistic function (0.5 (1 + tanh z) = sigmoid(2 z)), Gemma
3's pooling as explicit block means and Idefics3's pixel shuffle as an index loop that sends each
output (token, channel) to the input (row, column, channel) its definition names.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image
from support.tiny_models import write_tiny_gguf
from support.tiny_projectors import ReferenceFile, write_tiny_projector

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.vision.projector import load_projector

FAMILIES = ("gemma3", "idefics3")
RESAMPLE = {"gemma3": Image.Resampling.BILINEAR, "idefics3": Image.Resampling.LANCZOS}
WRAP = {
    "gemma3": ("<start_of_image>", "<end_of_image>"),
    "idefics3": ("<fake_token_around_image><global-img>", "<fake_token_around_image>"),
}


@pytest.fixture(scope="module")
def projector_files(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(family, tensor type) -> a tiny projector's path, written once for the module."""
    folder = tmp_path_factory.mktemp("projectors")
    return {(f, t): write_tiny_projector(str(folder / f"{f}-{t}.gguf"), f, tensor_type=t) for f in FAMILIES for t in ("F32", "F16")}


def an_image(seed: int = 1, height: int = 37, width: int = 53) -> np.ndarray:
    """A random RGB image of another size and aspect ratio than any encoder's square."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def reference_pixels(rgb: np.ndarray, ref: ReferenceFile, family: str) -> np.ndarray:
    size = ref.vision("image_size")
    resized = np.asarray(Image.fromarray(rgb).resize((size, size), RESAMPLE[family]), dtype=np.float64)
    mean, std = np.array(ref.vision("image_mean")), np.array(ref.vision("image_std"))
    return np.stack([(resized[:, :, c] / 255.0 - mean[c]) / std[c] for c in range(3)])  # (3, size, size)


def reference_layer_norm(x, weight, bias, eps):
    return (x - x.mean(axis=1, keepdims=True)) / np.sqrt(x.var(axis=1, keepdims=True) + eps) * weight + bias


def reference_encoder(ref: ReferenceFile, pixels: np.ndarray) -> np.ndarray:
    t, eps = ref.tensors, ref.vision("attention.layer_norm_epsilon")
    patch, heads = ref.vision("patch_size"), ref.vision("attention.head_count")
    side = ref.vision("image_size") // patch
    whole = side * patch  # pixels past the last whole patch belong to none
    grid = pixels[:, :whole, :whole].astype(np.float64).reshape(3, side, patch, side, patch)
    x = np.einsum("cyixj,wcij->yxw", grid, t["v.patch_embd.weight"]).reshape(side * side, -1) + t["v.patch_embd.bias"]
    x = x + t["v.position_embd.weight"]
    n, width = x.shape
    head_dim = width // heads
    for i in range(ref.vision("block_count")):
        p = f"v.blk.{i}."

        def lin(y, name, p=p):
            return y @ t[p + name + ".weight"].T + t[p + name + ".bias"]

        h = reference_layer_norm(x, t[p + "ln1.weight"], t[p + "ln1.bias"], eps)
        q, k, v = (lin(h, name).reshape(n, heads, head_dim) for name in ("attn_q", "attn_k", "attn_v"))
        scores = np.einsum("nhd,mhd->hnm", q, k) / math.sqrt(head_dim)
        top = scores.max(axis=2, keepdims=True)
        log_probs = scores - (top + np.log(np.exp(scores - top).sum(axis=2, keepdims=True)))
        x = x + lin(np.einsum("hnm,mhd->nhd", np.exp(log_probs), v).reshape(n, width), "attn_out")
        up = lin(reference_layer_norm(x, t[p + "ln2.weight"], t[p + "ln2.bias"], eps), "ffn_up")
        z = math.sqrt(2 / math.pi) * (up + 0.044715 * up**3)
        x = x + lin(up / (1 + np.exp(-2 * z)), "ffn_down")
    return reference_layer_norm(x, t["v.post_ln.weight"], t["v.post_ln.bias"], eps)


def reference_gemma3(ref: ReferenceFile, features: np.ndarray) -> np.ndarray:
    side = ref.vision("image_size") // ref.vision("patch_size")
    pooled = min(16, side)
    kernel = side // pooled
    grid = features.reshape(side, side, -1)
    cells = np.array(
        [grid[r * kernel : (r + 1) * kernel, c * kernel : (c + 1) * kernel].mean(axis=(0, 1)) for r in range(pooled) for c in range(pooled)]
    )
    eps = ref.vision("attention.layer_norm_epsilon")
    normed = cells / np.sqrt((cells**2).mean(axis=1, keepdims=True) + eps) * ref.tensors["mm.soft_emb_norm.weight"]
    return normed @ ref.tensors["mm.input_projection.weight"]


def reference_idefics3(ref: ReferenceFile, features: np.ndarray) -> np.ndarray:
    # Idefics3's shuffle: view (side, side, D) as (side, side/s, D s), swap the first two axes, view as
    # (side/s, side/s, D s^2), swap them back, flatten. Followed index by index, output channel k of
    # token (R, C) is input channel k % D of the patch at row R s + k // (D s), column C s + (k % (D s)) // D.
    s, side, width = ref.vision("projector.scale_factor"), ref.vision("image_size") // ref.vision("patch_size"), features.shape[1]
    shuffled = np.empty(((side // s) ** 2, width * s * s))
    for token in range(shuffled.shape[0]):
        row_block, col_block = divmod(token, side // s)
        for k in range(width * s * s):
            row = row_block * s + k // (width * s)
            col = col_block * s + (k % (width * s)) // width
            shuffled[token, k] = features[row * side + col, k % width]
    return shuffled @ ref.tensors["mm.model.fc.weight"].T


REFERENCE_PROJECTIONS = {"gemma3": reference_gemma3, "idefics3": reference_idefics3}


def assert_rows_close(got: np.ndarray, want: np.ndarray) -> None:
    """Float32 against float64: every row pointing the same way, and no value off by more than
    float32 rounding allows; tight enough that gelu's erf form, in place of its tanh approximation, fails."""
    assert got.shape == want.shape and got.dtype == np.float32
    cosine = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() >= 0.99999, cosine.min()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), np.abs(got - want).max()


@pytest.mark.parametrize("tensor_type", ["F32", "F16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_encode_matches_reference(projector_files, family, tensor_type):
    path = projector_files[family, tensor_type]
    projector, ref = load_projector(path), ReferenceFile(path)
    pixels = projector.preprocess(an_image())
    want = REFERENCE_PROJECTIONS[family](ref, reference_encoder(ref, pixels))
    assert_rows_close(projector.encode(pixels), want)


def test_pixels_past_the_last_whole_patch_are_dropped(tmp_path):
    """SmolVLM's 384-pixel images in 14-pixel patches: a 27 x 27 grid, the last 6 pixels no patch's."""
    path = write_tiny_projector(str(tmp_path / "odd.gguf"), "idefics3", image_size=70, patch_size=8)
    projector, ref = load_projector(path), ReferenceFile(path)
    pixels = projector.preprocess(an_image())
    assert pixels.shape == (3, 70, 70) and projector.tokens_per_image == 16
    assert_rows_close(projector.encode(pixels), reference_idefics3(ref, reference_encoder(ref, pixels)))


@pytest.mark.parametrize("family", FAMILIES)
def test_preprocess_matches_pillow_and_formula(projector_files, family):
    path = projector_files[family, "F32"]
    projector, ref = load_projector(path), ReferenceFile(path)
    for image in (an_image(), an_image(2, 300, 120), an_image(3, 8, 8)):
        pixels = projector.preprocess(image)
        assert pixels.dtype == np.float32 and pixels.shape == (3, projector.image_size, projector.image_size)
        np.testing.assert_allclose(pixels, reference_pixels(image, ref, family), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_projector_describes_itself(projector_files, family):
    projector = load_projector(projector_files[family, "F16"])
    tokens = {"gemma3": 256, "idefics3": 16}[family]
    assert (projector.family, projector.text_dim, projector.tokens_per_image) == (family, 48, tokens)
    assert [(before, after) for before, _, after in projector.pieces(an_image())] == [WRAP[family]]  # a file without tiles
    weights = ReferenceFile(projector_files[family, "F32"]).tensors.items()
    # the encoder layers' matrices as the F16 file holds them (widened a layer at a time), the rest float32
    assert projector.nbytes == sum(w.size * (2 if name.startswith("v.blk.") and w.ndim == 2 else 4) for name, w in weights)
    assert load_projector(projector_files[family, "F32"]).nbytes == sum(w.size for _, w in weights) * 4


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_is_deterministic(projector_files, family):
    projector = load_projector(projector_files[family, "F32"])
    pixels = projector.preprocess(an_image())
    assert np.array_equal(projector.encode(pixels), projector.encode(pixels.copy()))


SPOILED = {
    "missing tensor": ("gemma3", {"omit": ("v.blk.1.attn_k.weight",)}, "v.blk.1.attn_k.weight"),
    "missing projection": ("idefics3", {"omit": ("mm.model.fc.weight",)}, "mm.model.fc.weight"),
    "wrong shape": ("idefics3", {"replace": {"v.blk.0.ffn_up.weight": np.zeros((65, 32), np.float32)}}, "v.blk.0.ffn_up.weight"),
    "wrong patch kernel": ("gemma3", {"replace": {"v.patch_embd.weight": np.zeros((32, 3, 4, 5), np.float32)}}, "v.patch_embd.weight"),
    "unknown projector type": ("gemma3", {"projector_type": "llava"}, "clip.projector_type"),
    "image smaller than a patch": ("idefics3", {"metadata": {"clip.vision.image_size": 6}}, "clip.vision.image_size"),
    "grid that does not pool": ("gemma3", {"image_size": 72}, "clip.vision.image_size"),
    "heads not dividing width": ("idefics3", {"heads": 5}, "clip.vision.attention.head_count"),
    "scale not dividing grid": ("idefics3", {"scale_factor": 3}, "clip.vision.projector.scale_factor"),
    "missing key": ("gemma3", {"metadata": {"clip.vision.image_std": None}}, "clip.vision.image_std"),
    "missing scale factor": ("idefics3", {"metadata": {"clip.vision.projector.scale_factor": None}}, "clip.vision.projector.scale_factor"),
    "short mean": ("gemma3", {"metadata": {"clip.vision.image_mean": [0.5, 0.5]}}, "clip.vision.image_mean"),
    "zero patch size": ("idefics3", {"metadata": {"clip.vision.patch_size": 0}}, "clip.vision.patch_size"),
    "key of another type": ("gemma3", {"metadata": {"clip.vision.block_count": "two"}}, "clip.vision.block_count"),
    "no vision encoder": ("gemma3", {"metadata": {"clip.has_vision_encoder": False}}, "clip.has_vision_encoder"),
}


@pytest.mark.parametrize("case", list(SPOILED))
def test_bad_projector_names_the_problem(tmp_path, case):
    family, spoil, name = SPOILED[case]
    path = write_tiny_projector(str(tmp_path / "bad.gguf"), family, **spoil)
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        load_projector(path)


def test_language_model_is_not_a_projector(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "llama.gguf"))
    with pytest.raises(ModelLoadError, match=r"general\.architecture"):
        load_projector(path)


@pytest.mark.parametrize("keep", [4, 200, 0.5, -10])
def test_truncated_or_foreign_bytes_raise_load_error(projector_files, tmp_path, keep):
    data = open(projector_files["gemma3", "F32"], "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_projector(str(path))


@pytest.mark.parametrize("family", FAMILIES)
def test_an_encode_in_slices_gives_the_same_rows(projector_files, family):
    """What the model thread runs a slice a pass: many small slices, the rows of one whole encode."""
    from webapp.engine.vision.siglip import run_to_end

    projector = load_projector(projector_files[family, "F32"])
    pixels = projector.preprocess(an_image())
    slices, yields = projector.encoder.forward_slices(pixels, slice_flops=2e5), 0
    while True:
        try:
            next(slices)
            yields += 1
        except StopIteration as done:
            features = done.value
            break
    assert yields > 4 * len(projector.encoder.layers)  # rows of every product and queries of every head cut apart
    whole = run_to_end(projector.encoder.forward_slices(pixels, slice_flops=1e12))
    np.testing.assert_allclose(features, whole, rtol=1e-5, atol=1e-5 * np.abs(whole).max())
    np.testing.assert_allclose(projector.projection.project(features), projector.encode(pixels), rtol=1e-5, atol=1e-5)


def test_vision_encodes_a_slice_at_a_time_and_keeps_the_rows(projector_files):
    from webapp.engine.vision.vision import ImageSpan, Vision

    projector = load_projector(projector_files["idefics3", "F32"])
    vision = Vision(projector, vocab=100)
    (first,), (second,) = vision.prepare(_png(an_image(2))), vision.prepare(_png(an_image(3)))  # one piece each: no tiles
    spans = (ImageSpan(3, first), ImageSpan(40, second))
    passes = 0
    while not vision.encoded(spans):
        vision.encode_slice(spans)
        passes += 1
    assert passes > 2 and vision.encodes == 2
    rows = vision.inputs(spans, 0, 64)
    assert [offset for offset, _ in rows] == [3, 40]
    np.testing.assert_array_equal(rows[0][1], projector.encode(spans[0].image.pixels))
    assert vision.placeholder(spans[0].image) >= 100 and vision.placeholder(spans[0].image) != vision.placeholder(spans[1].image)


def test_an_encode_with_no_step_beside_it_runs_in_larger_slices(projector_files, monkeypatch):
    """Where no request runs, the model thread cuts an encode into ALONE_SLICES times fewer slices
    (a few BLAS calls of many rows go faster than many of few); the rows are the same."""
    from webapp.engine.vision import vision as vision_module
    from webapp.engine.vision.vision import ImageSpan, Vision

    monkeypatch.setattr(vision_module, "SLICE_FLOPS", 1e4)  # the tiny encoder in many slices
    passes = {}
    for alone in (False, True):
        vision = Vision(load_projector(projector_files["idefics3", "F32"]), vocab=100)
        spans = (ImageSpan(0, vision.prepare(_png(an_image(4)))[0]),)
        passes[alone] = 0
        while not vision.encoded(spans):
            vision.encode_slice(spans, alone)
            passes[alone] += 1
        np.testing.assert_array_equal(vision.inputs(spans, 0, 64)[0][1], vision.projector.encode(spans[0].image.pixels))
    assert passes[True] * 4 < passes[False], passes


def _png(rgb: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def test_smolvlm_tiles_then_its_overview_as_llama_cpp_lays_them_out(tmp_path):
    """With clip.vision.preproc_image_size, an image is resized (Lanczos, ratio kept) to that longest
    edge, then to whole tiles; each tile after its row/col marker, a newline after each row but the
    last, then the overview of the tiled picture."""
    path = write_tiny_projector(str(tmp_path / "tiles.gguf"), "idefics3", metadata={"clip.vision.preproc_image_size": 128})
    projector, ref = load_projector(path), ReferenceFile(path)
    rgb = an_image(4, height=60, width=100)
    pieces = projector.pieces(rgb)
    # 100 x 60 -> 128 x 76 (the short side made even) -> 2 x 2 tiles of 64 -> 128 x 128
    texts = [(before, after) for before, _, after in pieces]
    assert texts == [
        ("<fake_token_around_image><row_1_col_1>", ""),
        ("<fake_token_around_image><row_1_col_2>", "\n"),
        ("<fake_token_around_image><row_2_col_1>", ""),
        ("<fake_token_around_image><row_2_col_2>", ""),
        ("\n\n<fake_token_around_image><global-img>", "<fake_token_around_image>"),
    ]
    picture = Image.fromarray(rgb).resize((128, 76), Image.Resampling.LANCZOS).resize((128, 128), Image.Resampling.LANCZOS)
    mean, std = np.array(ref.vision("image_mean")), np.array(ref.vision("image_std"))

    def normalized(square: Image.Image) -> np.ndarray:
        return ((np.asarray(square, dtype=np.float64) / 255 - mean) / std).transpose(2, 0, 1)

    np.testing.assert_allclose(pieces[1][1], normalized(picture.crop((64, 0, 128, 64))), atol=1e-5)
    np.testing.assert_allclose(pieces[4][1], normalized(picture.resize((64, 64), Image.Resampling.LANCZOS)), atol=1e-5)
    # a file without the key: the overview alone
    plain = load_projector(write_tiny_projector(str(tmp_path / "plain.gguf"), "idefics3"))
    assert [(b, a) for b, _, a in plain.pieces(rgb)] == [("<fake_token_around_image><global-img>", "<fake_token_around_image>")]
