"""Every architecture this server serves, each on a tiny random-weight file of its kind (float32
matrices), against the float64 reference: the prompt's logits on the CPU kernels in one call, then a
prefill and a decode on tinygrad's path. A new architecture adds its row to ARCHITECTURE_FILES (or
names the suite that covers it in OWN_SUITES); the first test fails until it does. The mechanisms
one architecture alone has (windows, long RoPE, NextN, routing) are its own suite's to test."""

import numpy as np
import pytest
from support.tiny_models import Reference, assert_tinygrad_path_matches, load_steps, off_by, write_tiny_gguf

from webapp.engine.archs import supported
from webapp.engine.model.steps import OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

PROMPT = [int(t) for t in np.random.default_rng(7).integers(2, 4000, 16)]
MOE = (8, 2, 64)  # experts, chosen a token, width

# general.architecture -> write_tiny_gguf's arguments for a file of that architecture
ARCHITECTURE_FILES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"qk_norm": True},
    "exaone": {"tokenizer_pre": "exaone"},
    "smollm3": {"n_layers": 4},
    "phi3": {},
    "gemma3": {"n_layers": 7, "n_kv_heads": 1},
    "olmo2": {},
    "exaone4": {},
    "olmoe": {"experts": MOE},
    "qwen3moe": {"experts": MOE},
    "qwen2moe": {"experts": MOE},
    "gpt-oss": {"experts": MOE},
    "glm4moe": {"experts": MOE, "n_layers": 3},
    # text alone: every M-RoPE section turns by a token's one position (their images: test_qwen_vl_images.py)
    "qwen2vl": {"head_dim": 16, "metadata": {"rope.dimension_sections": [2, 3, 3, 0]}},
    "qwen3vl": {"head_dim": 16, "metadata": {"rope.dimension_sections": [2, 3, 3, 0], "n_deepstack_layers": 1}},
    "qwen3vlmoe": {"head_dim": 16, "experts": MOE, "metadata": {"rope.dimension_sections": [2, 3, 3, 0]}},
}
# architectures whose tiny files have writers of their own, tested by these suites
OWN_SUITES = {"deepseek2": "test_deepseek2.py", "qwen35": "test_qwen35.py", "qwen35moe": "test_qwen35.py"}


def test_every_served_architecture_has_a_row():
    assert sorted(supported()) == sorted([*ARCHITECTURE_FILES, *OWN_SUITES])


@pytest.fixture(scope="module", params=sorted(ARCHITECTURE_FILES))
def tiny(request, tmp_path_factory):
    use_tinygrad_from_this_thread()
    arch = request.param
    path = str(tmp_path_factory.mktemp(arch) / f"{arch}.gguf")
    write_tiny_gguf(path, arch, matrix_type="F32", seed=5, **ARCHITECTURE_FILES[arch])
    return path, Reference(path)


def test_the_kernels_in_one_call_match_the_reference(tiny):
    path, ref = tiny
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, OneCallSteps)
    assert off_by(steps.score(PROMPT, slot=0, start=0), ref.logits(PROMPT)) < 1e-3


def test_tinygrad_matches_the_reference(tiny):
    path, ref = tiny
    assert_tinygrad_path_matches(path, ref.logits(PROMPT + [42]), PROMPT, 42)
