"""SmolLM3's layers without RoPE (every fourth), against the float64 reference on the CPU kernels and
on tinygrad's path; the reference with RoPE everywhere is far off, so the layers do matter here."""

import numpy as np
import pytest
from support.tiny_models import Reference, load_steps, write_tiny_gguf

from webapp.engine.kernels.abi import AttendFlag
from webapp.engine.model.steps import OneCallSteps, TinygradJitSteps, steps_for
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model

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
    ref.arch = "llama"  # the same file read as if every layer rotated: another model, much further off
    assert np.abs(ref.logits(PROMPT) - got).max() > 3 * ours


def test_every_fourth_layer_attends_without_rope_on_tinygrad(smollm3):
    path, ref = smollm3
    model, _ = load_model(path, slots=2, context=64, cpu_kernels=False)
    steps = steps_for(model, 16)
    assert isinstance(steps, TinygradJitSteps)
    want = Reference(path).logits(PROMPT + [42])
    np.testing.assert_allclose(steps.prefill(PROMPT, slot=0, start=0), want[-2], atol=0.02 * np.abs(want).max())
    np.testing.assert_allclose(steps.decode([42], slots=[0], positions=[len(PROMPT)])[0], want[-1], atol=0.02 * np.abs(want).max())
