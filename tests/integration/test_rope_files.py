"""Files with scaled RoPE (Llama 3's rope_freqs factors, linear scaling, YaRN) through the model
against the float64 reference, which scales too. What the frequencies are and what is refused:
tests/unit/test_rope.py."""

import numpy as np
import pytest
from support.tiny_models import Reference, load_steps, write_tiny_gguf

from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

HEAD_DIM = 16  # the files' head width: dim 64 over 4 heads


PROMPT = list(range(300, 340))  # long enough that the low frequencies' angles matter


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("llama", {"rope_factors": np.linspace(1, 8, HEAD_DIM // 2)}),  # Llama 3.1 / 3.2 files
        ("qwen3", {"metadata": {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}}),
        # a long-context Qwen file: the trained context 4x the original, its ramp inside the head
        ("qwen3", {"metadata": {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16}}),
        ("llama", {"metadata": {"rope.scaling.type": "yarn", "rope.scaling.factor": 8.0, "rope.scaling.original_context_length": 16}}),
    ],
)
def test_scaled_rope_files_follow_the_reference_that_scales_too(tmp_path, arch, options):
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "r.gguf"), arch, n_heads=4, dim=64, **options)
    steps = load_steps(path, slots=1, context=64)
    got = steps.score(PROMPT, slot=0, start=0)
    reference = Reference(path)
    expected = reference.logits(PROMPT)
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() < 0.03 * scale
    # the scaling matters here: a reference that ignores it is further off than ours
    reference.w.pop("rope_freqs.weight", None)
    reference.scaling, reference.factor = "none", 1.0
    assert np.abs(reference.logits(PROMPT) - expected).max() > 3 * np.abs(got - expected).max()
