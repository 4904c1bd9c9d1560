"""M-RoPE (Qwen2-VL): an image's rows turn by its time, row and column, and the text after it by
positions that count the image as its grid's longer side. A step given those positions equals the
float64 reference given the same, cut across chunks and beside a decoding lane; the positions
themselves are checked against ones written out by hand; a file's sections are checked at load."""

import numpy as np
import pytest

from tests.support.tiny_models import Reference, load_steps, off_by, write_tiny_gguf
from webapp.engine.model.lanes import Lane, Want
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.transformer import load_model
from webapp.engine.vision.vision import ImageSpan, PreparedImage, Vision

HEAD_DIM = 16  # 8 rotary pairs: 2 by time, 3 by row, 3 by column
SECTIONS = [2, 3, 3, 0]
GRID = (2, 3)  # the image's rows and columns of merged tokens
IMAGE_AT, PLACEHOLDER = 3, 10**6
# written out by hand: three text tokens at 0..2; the image's six rows at time 3, rows 3..4, columns
# 3..5; the text after it from 3 + max(2, 3) = 6
TURNED = np.array(
    [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8],
    ]
)


def _image(tokens: int = 6, grid=GRID) -> PreparedImage:
    return PreparedImage(np.zeros((3, 4, 4), np.float32), b"x" * 32, tokens, grid=grid)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_gguf(
        str(tmp_path_factory.mktemp("mrope") / "qwen2vl.gguf"),
        "qwen2vl",
        head_dim=HEAD_DIM,
        matrix_type="Q8_0",
        metadata={"rope.dimension_sections": SECTIONS},
    )
    steps = load_steps(path, slots=3, context=64)
    assert steps.turns_by_sections and steps.model.config.rope_sections == (0, 0, 1, 1, 1, 2, 2, 2)
    rows = np.random.default_rng(3).normal(0, 0.5, (6, steps.model.config.dim)).astype(np.float32)
    tokens = [1, 17, 23] + [PLACEHOLDER] * 6 + [40, 41, 42]
    inputs = {IMAGE_AT + i: rows[i].astype(np.float64) for i in range(6)}
    return steps, Reference(path), tokens, rows, inputs


def test_the_positions_are_those_written_out_by_hand():
    vision = Vision(projector=None, vocab=100)
    spans = (ImageSpan(IMAGE_AT, _image()),)
    np.testing.assert_array_equal(vision.rope_positions(spans, 0, 12), TURNED)
    np.testing.assert_array_equal(vision.rope_positions(spans, 5, 4), TURNED[:, 5:9])  # a chunk inside the image
    assert vision.rope_positions(spans, 0, 3) is None  # before any image: each token's own position
    assert vision.rope_positions((ImageSpan(IMAGE_AT, _image(grid=None)),), 0, 12) is None  # a family without grids
    # a second image (a 1 x 4 grid at 12..15) saves 4 - 4 = 0 more; the first's 3 still hold after it
    later = vision.rope_positions((*spans, ImageSpan(12, _image(4, (1, 4)))), 12, 6)
    np.testing.assert_array_equal(later, [[9, 9, 9, 9, 13, 14], [9, 9, 9, 9, 13, 14], [9, 10, 11, 12, 13, 14]])


def test_a_prompt_with_an_image_matches_the_reference(model):
    steps, reference, tokens, rows, inputs = model
    want = reference.logits(tokens, inputs, turned=TURNED)
    got = steps.run([Lane(0, 0, tokens, Want.ALL, inputs=((IMAGE_AT, rows),), rope_positions=TURNED)])[0]
    assert off_by(got, want) < 0.02
    # and the positions matter: the image's rows turned as text give other logits after it
    plain = reference.logits(tokens, inputs)
    assert off_by(plain[IMAGE_AT + 1 :], want[IMAGE_AT + 1 :]) > 0.02


def test_chunks_cut_inside_the_image_and_decoding_after_it(model):
    steps, reference, tokens, rows, inputs = model
    want = reference.logits([*tokens, 50], inputs, turned=np.concatenate([TURNED, [[9], [9], [9]]], axis=1))
    cut = IMAGE_AT + 2
    steps.prefill([5, 6, 7, 8], slot=1, start=0)
    first = steps.run([Lane(0, 0, tokens[:cut], Want.ALL, inputs=((IMAGE_AT, rows[:2]),), rope_positions=TURNED[:, :cut])])[0]
    rest, beside = steps.run(
        [
            Lane(0, cut, tokens[cut:], Want.ALL, inputs=((0, rows[2:]),), rope_positions=TURNED[:, cut:]),
            Lane(1, 4, [9], Want.LAST, decoding=True),
        ]
    )
    decoded = steps.run([Lane(0, len(tokens), [50], Want.LAST, decoding=True, rope_positions=np.array([[9], [9], [9]]))])[0]
    assert off_by(np.concatenate([first, rest, decoded[None]]), want) < 0.02
    np.testing.assert_array_equal(beside, steps.decode([9], slots=[1], positions=[4])[0])


def test_text_alone_turns_as_qwen2(model):
    steps, reference, *_ = model
    tokens = [3, 9, 27, 81, 5]
    assert off_by(steps.run([Lane(2, 0, tokens, Want.ALL)])[0], reference.logits(tokens)) < 0.02


def test_positions_that_do_not_fit_are_refused_before_c(model, tmp_path):
    steps = model[0]
    for wrong in (np.zeros((3, 1), np.int64), np.zeros((2, 2), np.int64), np.full((3, 2), -1), np.zeros((3, 2), np.float32)):
        with pytest.raises(ValueError, match="RoPE positions must be"):
            steps.kernels.step(steps.whole_model, [1, 2], [0, 0, 0, 1], [1], rope_positions=wrong)
    plain = load_steps(write_tiny_gguf(str(tmp_path / "qwen2.gguf"), "qwen2"), slots=1, context=32)
    with pytest.raises(ValueError, match="without sections"):
        plain.kernels.step(plain.whole_model, [1], [0, 0], [0], rope_positions=np.zeros((3, 1), np.int64))


@pytest.mark.parametrize(
    "sections, message",
    [
        ([2, 3, 3, 1], "at most 8 pairs"),
        ([8, 8, 8, 0], "at most 8 pairs"),
        ([2, 3], "expected four sections"),
        ([2, -3, 3, 0], "expected four"),
    ],
)
def test_sections_that_do_not_fit_are_refused(tmp_path, sections, message):
    path = write_tiny_gguf(str(tmp_path / "bad.gguf"), "qwen2vl", head_dim=HEAD_DIM, metadata={"rope.dimension_sections": sections})
    with pytest.raises(ModelLoadError, match=message):
        load_model(path, slots=1, context=32)


@pytest.fixture(scope="module")
def qwen3vl(tmp_path_factory):
    """Qwen3-VL's language model: interleaved sections, and the image rows' deepstack features that
    its first layer adds to its output."""
    path = write_tiny_gguf(
        str(tmp_path_factory.mktemp("qwen3vl") / "qwen3vl.gguf"),
        "qwen3vl",
        head_dim=HEAD_DIM,
        matrix_type="Q8_0",
        metadata={"rope.dimension_sections": SECTIONS, "n_deepstack_layers": 1},
    )
    steps = load_steps(path, slots=2, context=64)
    assert steps.model.config.rope_sections == (0, 1, 2, 0, 1, 2, 0, 1) and steps.model.config.deepstack_layers == 1
    rows = np.random.default_rng(4).normal(0, 0.5, (6, 2 * steps.model.config.dim)).astype(np.float32)
    return steps, Reference(path), rows


def test_qwen3vls_interleaved_sections_and_deepstack_match_the_reference(qwen3vl):
    steps, reference, rows = qwen3vl
    tokens = [1, 17, 23] + [PLACEHOLDER] * 6 + [40, 41, 42]
    inputs = {IMAGE_AT + i: rows[i].astype(np.float64) for i in range(6)}
    want = reference.logits(tokens, inputs, turned=TURNED)
    got = steps.run([Lane(0, 0, tokens, Want.ALL, inputs=((IMAGE_AT, rows),), rope_positions=TURNED)])[0]
    assert off_by(got, want) < 0.02
    # the deepstack features matter: zeros there answer otherwise after the image
    flat = rows.copy()
    flat[:, steps.model.config.dim :] = 0
    other = steps.run([Lane(1, 0, tokens, Want.ALL, inputs=((IMAGE_AT, flat),), rope_positions=TURNED)])[0]
    assert off_by(other[IMAGE_AT:], want[IMAGE_AT:]) > 0.02
    with pytest.raises(ValueError, match="inputs of shape"):  # rows one model width wide: no deepstack parts
        steps.run([Lane(0, 0, tokens, Want.ALL, inputs=((IMAGE_AT, rows[:, : steps.model.config.dim].copy()),), rope_positions=TURNED)])


def test_qwen35s_gated_attention_turns_an_image_by_its_grid(tmp_path):
    """Qwen3.5: its gated attention layers turn an image's rows by interleaved sections (its
    recurrent layers read no positions)."""
    from tests.support.tiny_qwen35 import Qwen35Reference, write_tiny_qwen35

    path = write_tiny_qwen35(str(tmp_path / "qwen35.gguf"))  # float matrices: the reference's own values
    steps = load_steps(path, slots=1, context=64)
    assert steps.turns_by_sections and set(steps.model.config.rope_sections) == {0, 1, 2}
    rows = np.random.default_rng(5).normal(0, 0.5, (6, steps.model.config.dim)).astype(np.float32)
    tokens = [1, 17, 23] + [PLACEHOLDER] * 6 + [40, 41, 42]
    reference = Qwen35Reference(path)
    inputs = {IMAGE_AT + i: rows[i].astype(np.float64) for i in range(6)}
    want = reference.logits(tokens, inputs, turned=TURNED)
    got = steps.run([Lane(0, 0, tokens, Want.ALL, inputs=((IMAGE_AT, rows),), rope_positions=TURNED)])[0]
    assert off_by(got, want) < 1e-3
    assert off_by(reference.logits(tokens, inputs)[IMAGE_AT + 1 :], want[IMAGE_AT + 1 :]) > 1e-2


def test_qwen3vlmoe_is_qwen3moe_with_an_images_sections(tmp_path):
    """Qwen3-VL's mixtures (qwen3vlmoe): Qwen3-MoE's layers, an image's rows turned by its grid."""
    path = write_tiny_gguf(
        str(tmp_path / "qwen3vlmoe.gguf"),
        "qwen3vlmoe",
        head_dim=HEAD_DIM,
        experts=(4, 2, 32),
        metadata={"rope.dimension_sections": SECTIONS},
    )
    steps = load_steps(path, slots=1, context=64)
    assert steps.model.config.experts == 4 and steps.model.config.rope_sections == (0, 1, 2, 0, 1, 2, 0, 1)
    rows = np.random.default_rng(6).normal(0, 0.5, (6, steps.model.config.dim)).astype(np.float32)
    tokens = [1, 17, 23] + [PLACEHOLDER] * 6 + [40, 41, 42]
    inputs = {IMAGE_AT + i: rows[i].astype(np.float64) for i in range(6)}
    want = Reference(path).logits(tokens, inputs, turned=TURNED)
    got = steps.run([Lane(0, 0, tokens, Want.ALL, inputs=((IMAGE_AT, rows),), rope_positions=TURNED)])[0]
    assert off_by(got, want) < 0.02
