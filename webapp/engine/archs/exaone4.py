"""EXAONE 4.0 (LG AI Research): OLMo 2's kind of layer (no input norms, each sublayer's output normed
before it is added) with q/k norms a head at a time, rotary pairs split in halves. The 32B model
alone interleaves three sliding-window layers with one global layer, and its global layers attend
without RoPE; its files say so only by their layer count, as llama.cpp reads them (the 1.2B model's
30 layers are all global, all rotated)."""

from webapp.engine.archs.record import Architecture, with_layers

is_exaone4_32b = with_layers(64)  # EXAONE 4.0 32B; the 1.2B has 30 layers


ARCHITECTURES = (
    Architecture(
        ("exaone4",),
        post_norms=True,
        input_norms=False,
        sliding_window_every=4,
        no_rope_every=4,
        layer_patterns=is_exaone4_32b,
    ),
)
