"""RoPE as the file asks for it: the base, Llama 3's rope_freqs factors, linear scaling; refusals for
what the kernels do not run, a yarn file's at load. Files with each go through the model against
the float64 reference in tests/integration/test_rope_files.py."""

import numpy as np
import pytest
from support.tiny_models import write_tiny_gguf

from webapp.engine.model.rope import RopeUnsupported, inverse_frequencies
from webapp.engine.model.transformer import ModelLoadError, load_model

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
        ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, None, "'yarn' is not supported"),
        ({"llama.rope.dimension_count": 8}, None, "partial rotary"),
        ({}, np.ones(3), "must hold 8 positive factors"),
        ({}, np.zeros(8), "must hold 8 positive factors"),
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": -1.0}, None, "must be positive"),
    ],
)
def test_what_the_kernels_cannot_run_is_refused_by_name(extra, factors, words):
    with pytest.raises(RopeUnsupported, match=words):
        inverse_frequencies({"llama.rope.freq_base": 10000.0, **extra}, "llama", HEAD_DIM, factors)


def test_a_yarn_file_fails_at_load_with_the_setting_named(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "y.gguf"), "qwen3", metadata={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope.scaling.type 'yarn'"):
        load_model(path, slots=1, context=32)
