"""SmolLM3: the llama layer (interleaved rotary pairs) whose every fourth layer attends without RoPE."""

from webapp.engine.archs.record import Architecture

ARCHITECTURES = (Architecture(("smollm3",), interleaved_rope=True, no_rope_every=4),)
