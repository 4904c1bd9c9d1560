"""The architecture registry (webapp/engine/archs): every name found once, and the rules that tell
models apart by their numbers, each in its architecture's own module."""

import pytest

from webapp.engine.archs import architecture, supported
from webapp.engine.archs.deepseek2 import SIGMOID, SOFTMAX, default_gating, is_glm47_flash
from webapp.engine.archs.gemma3 import is_gemma3_27b
from webapp.engine.archs.record import Experts, Mixer


def test_every_served_name_finds_its_record():
    names = supported()
    assert len(names) == len(set(names)) >= 14
    for name in names:
        assert name in architecture(name).names
    assert architecture("mamba") is None and architecture(["llama"]) is None


def test_true_aliases_share_a_record():
    assert architecture("qwen2") is architecture("qwen3")
    assert architecture("qwen35").mixer is architecture("qwen35moe").mixer is Mixer.HYBRID
    assert architecture("qwen35").experts is Experts.NONE and architecture("qwen35moe").experts is Experts.ALWAYS


@pytest.mark.parametrize(("layers", "by_width"), [(62, True), (26, False), (34, False), (48, False)])
def test_gemma3_27b_is_known_by_its_layers(layers, by_width):
    assert is_gemma3_27b({}, layers) is by_width
    assert architecture("gemma3").score_scale_by_width({}, layers) is by_width


def test_glm47_flash_is_known_by_its_blocks_and_vocabulary():
    flash = {"deepseek2.block_count": 48, "tokenizer.ggml.tokens": ["t"] * 154880}
    assert is_glm47_flash(flash) and default_gating(flash) == SIGMOID
    assert not is_glm47_flash(flash | {"deepseek2.block_count": 27}) and default_gating({}) == SOFTMAX
    assert not is_glm47_flash(flash | {"tokenizer.ggml.tokens": ["t"] * 100})
    assert architecture("glm4moe").default_gating({}) == SIGMOID
