"""The tokenizer of a GGUF file: `Tokenizer.from_gguf_metadata(kv)` returns the one its
`tokenizer.ggml.model` names, byte-level BPE (`bpe.py`) or SentencePiece (`spm.py`); what they
share (special tokens, ids, decoding, the stream decoder) is `base.py`'s.
"""

from __future__ import annotations

from webapp.engine.text import bpe, spm
from webapp.engine.text.base import StreamDecoder, TokenizerBase

Tokenizer = TokenizerBase  # the type every tokenizer is; `from_gguf_metadata` picks the subclass

__all__ = ["StreamDecoder", "Tokenizer", "bpe", "spm"]  # importing bpe and spm registers their models
