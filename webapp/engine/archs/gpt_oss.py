"""gpt-oss: attention with sinks and biases (read from the file), every other layer a sliding window;
a mixture of experts with biases on the router and every expert's products (read from the file), a
softmax over the chosen experts' logits (the chosen probabilities divided by their sum) and a
clamped SwiGLU. Its files call the feed-forward's input norm post_attention_norm."""

from webapp.engine.archs.record import Architecture, Experts

ARCHITECTURES = (
    Architecture(
        ("gpt-oss",),
        experts=Experts.ALWAYS,
        expert_weights_norm=True,
        swiglu_clamped=True,
        sliding_window_every=2,
        ffn_norm_name="post_attention_norm.weight",
    ),
)
