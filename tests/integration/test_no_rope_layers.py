"""SmolLM3's layers without RoPE (every fourth), against the float64 reference on the CPU kernels and
on tinygrad's path; the reference with RoPE everywhere is far off, so the layers do matter here."""

import numpy as np
import pytest
from support.tiny_models import Reference, assert_tinygrad_path_matches, load_steps, write_tiny_gguf

from webapp.engine.kernels.abi import AttendFlag
from webapp.engine.model.steps import OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 77, 88, 99, 1234, 5]


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("m") / "smollm3.gguf"), "smollm3", n_layers=4, matrix_type="Q8_0")
    return path, Reference(path)


def test_every_fourth_layer_attends_without_rope_on_the_kernels(smollm3):
    path, ref = smollm3
    steps = load_steps(path, slots=2, context=64)
    assert isinstance(steps, OneCallSteps)
    assert [b.attend_flags & AttendFlag.NO_ROPE for b in steps.model.blocks] == [0, 0, 0, AttendFlag.NO_ROPE]
    want, got = ref.logits(PROMPT), steps.score(PROMPT, slot=0, start=0)
    ours = np.abs(got - want).max()
    assert ours < 0.05 * np.abs(want).max()
    ref.no_rope_every = 0  # the same file read as if every layer rotated: another model, much further off
    assert np.abs(ref.logits(PROMPT) - got).max() > 3 * ours


def test_every_fourth_layer_attends_without_rope_on_tinygrad(smollm3):
    path, _ = smollm3  # a fresh reference: the test above reads the fixture's as another model
    assert_tinygrad_path_matches(path, Reference(path).logits(PROMPT + [42]), PROMPT, 42)
