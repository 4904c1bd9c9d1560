"""phi3 files (Phi-3, Phi-4-mini): fused attn_qkv and gate|up matrices, partial rotary (a head's first
values turned, the rest passed) and LongRoPE's short and long factors with their attention factor,
against the float64 reference on the CPU kernels and on tinygrad's path."""

import numpy as np
import pytest
from support.tiny_models import Reference, assert_tinygrad_path_matches, load_steps, write_tiny_gguf

from webapp.engine.model.steps import OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 77, 88, 99, 1234, 5]
HEAD_DIM, ROTARY = 16, 12  # Phi-4-mini turns 96 of its 128
SHORT, LONG = np.linspace(1.0, 3.0, ROTARY // 2), np.linspace(1.0, 40.0, ROTARY // 2)
LONG_ROPE = {"rope.scaling.original_context_length": 64, "rope.scaling.attn_factor": 1.2}


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    use_tinygrad_from_this_thread()
    path = str(tmp_path_factory.mktemp("m") / "phi3.gguf")
    write_tiny_gguf(path, "phi3", matrix_type="Q8_0", rotary_dim=ROTARY, long_rope=(SHORT, LONG), metadata=LONG_ROPE, context=1024)
    return path, Reference(path)


def test_fused_matrices_partial_rotary_and_long_rope_match_the_reference_on_the_kernels(phi3):
    path, ref = phi3
    steps = load_steps(path, slots=2, context=64)  # within the original context: the short factors
    assert isinstance(steps, OneCallSteps)
    assert steps.model.config.fused_qkv and steps.model.config.rotary_dim == ROTARY
    want, got = ref.logits(PROMPT), steps.score(PROMPT, slot=0, start=0)
    ours = np.abs(got - want).max()
    assert ours < 0.05 * np.abs(want).max()
    wrong = Reference(path)  # every value turned (the extra pairs' factors 1): another model, much further off
    wrong.rotary = HEAD_DIM
    wrong.w["rope_factors_short.weight"] = np.concatenate([SHORT, np.ones((HEAD_DIM - ROTARY) // 2)])
    assert np.abs(wrong.logits(PROMPT) - got).max() > 3 * ours


def test_on_tinygrad_too(phi3):
    path, ref = phi3
    assert_tinygrad_path_matches(path, ref.logits(PROMPT + [42]), PROMPT, 42)


def test_a_context_past_the_original_one_takes_the_long_factors(phi3):
    path, _ = phi3
    base = 1.0 / 10000.0 ** (np.arange(0, ROTARY, 2) / ROTARY)
    short, _ = load_model(path, slots=1, context=64)
    np.testing.assert_allclose(short.inv_freq.numpy(), base / SHORT, rtol=1e-6)
    long, _ = load_model(path, slots=1, context=128)
    np.testing.assert_allclose(long.inv_freq.numpy(), base / LONG, rtol=1e-6)
    assert long.config.rope_attention_factor == pytest.approx(1.2)  # on the rotated values only
