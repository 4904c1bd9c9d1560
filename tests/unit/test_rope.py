"""RoPE as the file asks for it: the base, Llama 3's rope_freqs factors, linear scaling, YaRN;
refusals for what the kernels do not run, named at load. Files with each go through the model against
the float64 reference in tests/integration/test_rope_files.py."""

import numpy as np
import pytest
from support.tiny_models import write_tiny_gguf

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.rope import RopeUnsupported, attention_factor, inverse_frequencies
from webapp.engine.model.transformer import load_model

HEAD_DIM = 16
PLAIN = 1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)


def test_plain_llama3_and_linear_frequencies():
    kv = {"llama.rope.freq_base": 10000.0}
    np.testing.assert_allclose(inverse_frequencies(kv, "llama", HEAD_DIM), PLAIN, rtol=1e-7)
    factors = np.linspace(1, 8, HEAD_DIM // 2)
    np.testing.assert_allclose(inverse_frequencies(kv, "llama", HEAD_DIM, factors), PLAIN / factors, rtol=1e-7)
    linear = {**kv, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    np.testing.assert_allclose(inverse_frequencies(linear, "llama", HEAD_DIM), PLAIN / 4, rtol=1e-7)
    np.testing.assert_allclose(inverse_frequencies({**kv, "llama.rope.scale_linear": 2.0}, "llama", HEAD_DIM), PLAIN / 2, rtol=1e-7)


@pytest.mark.parametrize(
    ("extra", "factors", "words"),
    [
        ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, None, "original_context_length"),
        ({"llama.rope.scaling.type": "su", "llama.rope.scaling.factor": 4.0}, None, "'su' is not supported"),
        ({}, np.ones(3), "must hold 8 positive factors"),
        ({}, np.zeros(8), "must hold 8 positive factors"),
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": -1.0}, None, "must be positive"),
    ],
)
def test_what_the_kernels_cannot_run_is_refused_by_name(extra, factors, words):
    with pytest.raises(RopeUnsupported, match=words):
        inverse_frequencies({"llama.rope.freq_base": 10000.0, **extra}, "llama", HEAD_DIM, factors)


def test_yarn_keeps_the_fast_pairs_divides_the_slow_ones_and_scales_attention():
    """Qwen's long-context setting: factor 4 over an original 32,768 positions, base 1,000,000, head 128.
    Pairs turning more than 32 times in the original context keep their frequency, those turning less
    than once are divided by 4; llama.cpp's corr_dims put the ramp between pairs 23 and 40 here."""
    kv = {"qwen3.rope.freq_base": 1e6, "qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0}
    kv["qwen3.rope.scaling.original_context_length"] = 32768
    plain = 1.0 / 1e6 ** (np.arange(0, 128, 2) / 128)
    yarn = inverse_frequencies(kv, "qwen3", 128)
    np.testing.assert_allclose(yarn[:24], plain[:24], rtol=1e-6)
    np.testing.assert_allclose(yarn[40:], plain[40:] / 4, rtol=1e-6)
    assert np.all((yarn[24:40] < plain[24:40]) & (yarn[24:40] > plain[24:40] / 4))
    assert attention_factor(kv, "qwen3") == pytest.approx(1 + 0.1 * np.log(4))
    assert attention_factor({"qwen3.rope.freq_base": 1e6}, "qwen3") == 1.0


def test_partial_rotary_turns_a_head_of_the_rotary_size():
    """llama.cpp's n_rot: the frequencies of a head of rope.dimension_count values."""
    plain = inverse_frequencies({"qwen3.rope.freq_base": 1e4}, "qwen3", 12)
    np.testing.assert_allclose(plain, 1.0 / 1e4 ** (np.arange(0, 12, 2) / 12), rtol=1e-6)


def test_partial_rotary_with_interleaved_pairs_fails_at_load_with_the_setting_named(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "p.gguf"), "llama", rotary_dim=8)
    with pytest.raises(ModelLoadError, match="partial rotary"):
        load_model(path, slots=1, context=32)
