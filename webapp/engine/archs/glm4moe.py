"""GLM-4.5 / 4.6 (llama.cpp's glm4moe): a mixture whose routing the file describes (leading dense
layers, sigmoid gating by default, a selection bias, a scale on the weights) with ungated shared
experts; its files call the feed-forward's input norm post_attention_norm. NextN layers past the
trunk are read by the config and left out of the model."""

from webapp.engine.archs.record import Architecture, Experts

ARCHITECTURES = (
    Architecture(
        ("glm4moe",),
        experts=Experts.ALWAYS,
        shared_expert=True,
        routing_from_file=True,
        ffn_norm_name="post_attention_norm.weight",
    ),
)
