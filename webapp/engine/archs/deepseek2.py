"""DeepSeek-V2 / V3 and the files converted as `deepseek2` (GLM-4.7-Flash among them): multi-head
latent attention (latent_config.py) with interleaved rotary pairs, then routing the file describes
with ungated shared experts. A file without expert_count is dense throughout; the selection bias is
a DeepSeek-V3-style file's only.

Where a file has no expert_gating_func, llama.cpp's default is softmax, but GLM-4.7-Flash's is
sigmoid; its files are known by their layers and vocabulary only (`is_glm47_flash`).
"""

from webapp.engine.archs.record import Architecture, Experts, Mixer

GLM47_FLASH_BLOCKS = (47, 48)  # its trunk, with or without the NextN layer
GLM47_FLASH_VOCABULARY = 154880
SOFTMAX, SIGMOID = 1, 2  # expert_gating_func's values


def is_glm47_flash(kv: dict) -> bool:
    """GLM-4.7-Flash, converted as deepseek2: its block count and the size of its vocabulary."""
    tokens = kv.get("tokenizer.ggml.tokens") or ()
    return kv.get("deepseek2.block_count") in GLM47_FLASH_BLOCKS and len(tokens) == GLM47_FLASH_VOCABULARY


def default_gating(kv: dict) -> int:
    return SIGMOID if is_glm47_flash(kv) else SOFTMAX


ARCHITECTURES = (
    Architecture(
        ("deepseek2",),
        mixer=Mixer.LATENT,
        experts=Experts.OPTIONAL,
        interleaved_rope=True,
        shared_expert=True,
        routing_from_file=True,
        selection_bias_optional=True,
        default_gating=default_gating,
    ),
)
