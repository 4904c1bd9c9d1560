"""Qwen3.5 / 3.6 (llama.cpp's qwen35, and qwen35moe its mixtures): Gated DeltaNet recurrent layers
beside gated full-attention ones (recurrent_config.py), their rotary pairs turned by interleaved
M-RoPE sections (an image's time, row and column; a text token's one position); the mixtures' chosen weights divided by their sum, with a gated shared expert.
Their files call the feed-forward's input norm post_attention_norm."""

from webapp.engine.archs.record import Architecture, Experts, Mixer, MRope

_NORM = "post_attention_norm.weight"

ARCHITECTURES = (
    Architecture(("qwen35",), mixer=Mixer.HYBRID, ffn_norm_name=_NORM, mrope=MRope.INTERLEAVED),
    Architecture(
        ("qwen35moe",),
        mixer=Mixer.HYBRID,
        ffn_norm_name=_NORM,
        mrope=MRope.INTERLEAVED,
        experts=Experts.ALWAYS,
        expert_weights_norm=True,
        shared_expert=True,
    ),
)
