"""Rows fed in place of token embeddings (an image's, tq_forward's negative ids): a step that takes
them equals the float64 reference given the same rows, chunked or beside other lanes, and ids that
name no row are refused before any C runs."""

import numpy as np
import pytest

from tests.support.tiny_models import Reference, load_steps, off_by, write_tiny_gguf
from webapp.engine.model.lanes import Lane, Want

IMAGE_AT, IMAGE_ROWS, PLACEHOLDER = 3, 5, 10**6  # a placeholder id lies past the vocabulary


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("inputs") / "tiny.gguf"), matrix_type="Q8_0")
    steps = load_steps(path, slots=3, context=64)
    assert steps.takes_inputs
    rows = np.random.default_rng(7).normal(0, 0.5, (IMAGE_ROWS, steps.model.config.dim)).astype(np.float32)
    tokens = [1, 17, 23] + [PLACEHOLDER] * IMAGE_ROWS + [40, 41, 42]
    inputs = {IMAGE_AT + i: rows[i].astype(np.float64) for i in range(IMAGE_ROWS)}
    return steps, Reference(path).logits(tokens, inputs), tokens, rows


def test_a_prompt_with_rows_matches_the_reference(model):
    steps, want, tokens, rows = model
    got = steps.run([Lane(0, 0, tokens, Want.ALL, inputs=((IMAGE_AT, rows),))])[0]
    assert off_by(got, want) < 0.02
    # and the rows matter: other rows give other logits after them
    other = steps.run([Lane(0, 0, tokens, Want.ALL, inputs=((IMAGE_AT, rows[::-1].copy()),))])[0]
    assert off_by(other[IMAGE_AT + IMAGE_ROWS :], want[IMAGE_AT + IMAGE_ROWS :]) > 0.05


def test_chunks_that_cut_the_rows_and_a_lane_beside_them_change_nothing(model):
    steps, want, tokens, rows = model
    cut = IMAGE_AT + 2  # the first chunk ends inside the rows
    steps.prefill([5, 6, 7, 8], slot=1, start=0)
    first = steps.run([Lane(0, 0, tokens[:cut], Want.ALL, inputs=((IMAGE_AT, rows[:2]),))])[0]
    rest, beside = steps.run([Lane(0, cut, tokens[cut:], Want.ALL, inputs=((0, rows[2:]),)), Lane(1, 4, [9], Want.LAST, decoding=True)])
    assert off_by(np.concatenate([first, rest]), want) < 0.02
    np.testing.assert_array_equal(beside, steps.decode([9], slots=[1], positions=[4])[0])


def test_ids_that_name_no_row_are_refused(model):
    steps, _, tokens, rows = model
    with pytest.raises(ValueError, match="negative token id"):
        steps.kernels.step(steps.whole_model, [-1], [0, 0], [0])
    with pytest.raises(ValueError, match="inputs of shape"):
        steps.kernels.step(steps.whole_model, [-1, -3], [0, 0, 0, 1], [1], inputs=rows[:2])
    with pytest.raises(ValueError, match="inputs of shape"):
        steps.kernels.step(steps.whole_model, [-1], [0, 0], [0], inputs=rows[:, :7])
