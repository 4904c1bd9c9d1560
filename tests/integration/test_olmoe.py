"""OLMoE's layers: q and k normed over all their heads at once (not a head at a time) and a mixture of
experts whose chosen probabilities weigh the experts as they are, against the float64 reference."""

import numpy as np
import pytest
from support.tiny_models import Reference, assert_tinygrad_path_matches, load_steps, write_tiny_gguf

from webapp.engine.kernels.abi import AttendFlag
from webapp.engine.model.steps import OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

PROMPT = [int(t) for t in np.random.default_rng(7).integers(2, 4000, 16)]


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("olmoe") / "olmoe.gguf"), "olmoe", n_layers=2, matrix_type="F32", experts=(8, 2, 64))
    return path, Reference(path)


def test_in_one_call_the_model_matches_the_reference(olmoe):
    path, ref = olmoe
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, OneCallSteps)
    assert all(b.attend_flags & AttendFlag.QK_NORM_WHOLE for b in steps.model.blocks)
    assert all(b.layer_tensors.experts.flags == 0 for b in steps.model.blocks)  # weights not divided by their sum
    want, got = ref.logits(PROMPT), steps.score(PROMPT, slot=0, start=0)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_tinygrad_norms_all_of_q_and_k_too(olmoe):
    path, ref = olmoe
    assert_tinygrad_path_matches(path, ref.logits(PROMPT + [42]), PROMPT, 42)
