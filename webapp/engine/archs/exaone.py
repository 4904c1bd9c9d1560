"""EXAONE 3.0 and 3.5 (LG AI Research): the llama-family layer, pre-norm attention and SwiGLU, with
each head's rotary pairs split in halves as its converter leaves them; where a file carries
rope_freqs (Llama 3's long-context factors) they are read from the tensors, as for every file."""

from webapp.engine.archs.record import Architecture

ARCHITECTURES = (Architecture(("exaone",)),)
