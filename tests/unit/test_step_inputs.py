"""Rows fed in place of token embeddings (an image's, tq_forward's negative ids): a step that takes
them equals the float64 reference given the same rows, chunked or beside other lanes, and ids that
name no row are refused before any C runs."""

import numpy as np
import pytest

from tests.support.tiny_models import Reference, load_steps, off_by, write_tiny_gguf
from webapp.engine.model.lanes import Lane, Want

IMAGE_AT, IMAGE_ROWS, PLACEHOLDER = 3, 5, 10**6  # a placeholder id lies past the vocabulary
CLOSE = 1e-4  # float matrices against float64


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


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A Gemma 3 file, whose image positions attend each other both ways (float matrices: only the
    attention's float16 cache parts the kernels from the reference)."""
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("gemma") / "gemma3.gguf"), "gemma3", sliding_window=6)
    steps = load_steps(path, slots=3, context=64)
    rows = np.random.default_rng(8).normal(0, 0.5, (IMAGE_ROWS, steps.model.config.dim)).astype(np.float32)
    tokens = [1, 17, 23] + [PLACEHOLDER] * IMAGE_ROWS + [40, 41, 42]
    inputs = {IMAGE_AT + i: rows[i].astype(np.float64) for i in range(IMAGE_ROWS)}
    reference = Reference(path)
    both_ways = reference.logits(tokens, inputs, both_ways=((IMAGE_AT, IMAGE_AT + IMAGE_ROWS),))
    return steps, both_ways, reference.logits(tokens, inputs), tokens, rows


def test_an_image_attended_both_ways_matches_the_reference(gemma):
    steps, want, causal, tokens, rows = gemma
    assert off_by(want[IMAGE_AT:], causal[IMAGE_AT:]) > 0.05  # the two masks give other logits: the test tells them apart
    assert off_by(want[:IMAGE_AT], causal[:IMAGE_AT]) == 0.0
    got = steps.run([Lane(0, 0, tokens, Want.ALL, inputs=((IMAGE_AT, rows),), inputs_both_ways=True)])[0]
    assert off_by(got, want) < CLOSE
    as_before = steps.run([Lane(0, 0, tokens, Want.ALL, inputs=((IMAGE_AT, rows),))])[0]  # a causal family's lane
    assert off_by(as_before, causal) < CLOSE


def test_an_image_in_a_chunk_of_its_own_beside_other_lanes_and_from_a_cached_prefix(gemma):
    steps, want, _, tokens, rows = gemma
    end = IMAGE_AT + IMAGE_ROWS
    steps.prefill([5, 6, 7, 8], slot=1, start=0)
    first = steps.run([Lane(0, 0, tokens[:IMAGE_AT], Want.ALL)])[0]
    image, beside = steps.run(
        [
            Lane(0, IMAGE_AT, tokens[IMAGE_AT:end], Want.ALL, inputs=((0, rows),), inputs_both_ways=True),
            Lane(1, 4, [9], Want.LAST, decoding=True),
        ]
    )
    rest = steps.run([Lane(0, end, tokens[end:], Want.ALL)])[0]
    assert off_by(np.concatenate([first, image, rest]), want) < CLOSE
    np.testing.assert_array_equal(beside, steps.decode([9], slots=[1], positions=[4])[0])
    # the slot now holds the whole image's keys: a prompt taking its first two positions from there
    # (a cached prefix ending inside the image) computes the others seeing them, and the image's end
    cut = IMAGE_AT + 2
    tail = steps.run([Lane(0, cut, tokens[cut:], Want.ALL, inputs=((0, rows[2:]),), inputs_both_ways=True)])[0]
    assert off_by(tail, want[cut:]) < CLOSE


def test_last_keys_nothing_wrote_are_refused(gemma):
    steps = gemma[0]
    with pytest.raises(ValueError, match="last key"):
        steps.kernels.step(steps.whole_model, [5, 6], [0, 0, 0, 1], [1], last_keys=[2, 1])  # past the slot's last written position
    with pytest.raises(ValueError, match="last key"):
        steps.kernels.step(steps.whole_model, [5, 6], [0, 0, 0, 1], [1], last_keys=[0, 0])  # before its own position


@pytest.mark.parametrize("arch, both_ways", [("llama", False), ("gemma3", True)])
def test_tinygrads_path_takes_rows_too(tmp_path, arch, both_ways):
    """On tinygrad's own kernels (every device but the CPU's kernels) a chunk with rows runs whole as
    one piece: the same logits as the float64 reference, an image attended both ways for Gemma 3."""
    path = write_tiny_gguf(str(tmp_path / f"{arch}.gguf"), arch, **({"sliding_window": 6} if arch == "gemma3" else {}))
    steps = load_steps(path, slots=2, context=64, cpu_kernels=False)
    assert steps.takes_inputs
    rows = np.random.default_rng(9).normal(0, 0.5, (IMAGE_ROWS, steps.model.config.dim)).astype(np.float32)
    tokens = [1, 17, 23] + [PLACEHOLDER] * IMAGE_ROWS + [40, 41, 42]
    inputs = {IMAGE_AT + i: rows[i].astype(np.float64) for i in range(IMAGE_ROWS)}
    span = ((IMAGE_AT, IMAGE_AT + IMAGE_ROWS),) if both_ways else ()
    want = Reference(path).logits(tokens, inputs, both_ways=span)
    first = steps.run([Lane(0, 0, tokens[:IMAGE_AT], Want.LAST)])[0]
    got = steps.run([Lane(0, IMAGE_AT, tokens[IMAGE_AT:], Want.LAST, inputs=((0, rows),), inputs_both_ways=both_ways)])[0]
    assert off_by(first, want[IMAGE_AT - 1]) < 1e-3 and off_by(got, want[-1]) < 1e-3
    after = steps.run([Lane(0, len(tokens), [7], Want.LAST, decoding=True)])[0]
    assert off_by(after, Reference(path).logits(tokens + [7], inputs, both_ways=span)[-1]) < 1e-3
