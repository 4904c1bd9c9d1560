"""Llama (1, 2, 3 and the many files converted as `llama`): the reference layer, pre-norm attention
and SwiGLU. Its files store each head's rotary pairs interleaved (q and k regrouped at load)."""

from webapp.engine.archs.record import Architecture

ARCHITECTURES = (Architecture(("llama",), interleaved_rope=True),)
