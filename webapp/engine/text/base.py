"""What every tokenizer built from a GGUF file does, whatever its model: special tokens, ids, decoding.

Contract:
- `Tokenizer.from_gguf_metadata(kv)` (in `webapp.engine.text.tokenizer`) picks the subclass for
  `tokenizer.ggml.model` ("gpt2": byte-level BPE, `bpe.py`; "llama": SentencePiece, `spm.py`); a
  missing required key, or another model, raises ValueError. A subclass names its model
  (`class BpeTokenizer(TokenizerBase, model="gpt2")`) and gives `_encode_ordinary` and `_piece_bytes`.
- `encode(text, special=True)` returns token ids and never adds BOS by itself: the chat template
  usually writes the BOS text, and when it does not, the caller prepends `bos_id` if `add_bos`.
  With `special=True`, control, user-defined and unknown-token texts (`<|im_start|>`, ...) are
  matched literally, leftmost then longest; with `special=False` the whole text is ordinary text,
  so content cannot smuggle in control tokens.
- `decode(ids)` joins the tokens' bytes and decodes them as UTF-8 with replacement characters;
  special tokens decode to their text. `stream_decoder()` yields the same text piece by piece and
  never emits half of a multi-byte character.
- Pure Python (plus `regex`): no tinygrad, no Flask. A tokenizer is immutable after construction
  apart from its caches, so one instance can serve every request thread.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping
from typing import ClassVar

import regex

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6
# matched literally in text and decoded to their own text, as llama.cpp does
SPECIAL_TYPES = (TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)

# End-of-turn markers used by common chat formats; each is a stop token only when the vocab holds
# it as a special token, so an ordinary word that happens to look alike never ends generation.
_STOP_TOKEN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>")
# Harmony (gpt-oss) ends a turn with <|return|> (an answer) or <|call|> (a tool call); its <|end|> only
# closes one message of the turn (the reasoning before the answer), so there it must not stop
HARMONY_STOP_TEXTS, HARMONY_MESSAGE_END = ("<|return|>", "<|call|>"), "<|end|>"


def scalar(value):
    # tinygrad reads GGUF uint8 values with struct "c", i.e. as 1-byte `bytes` (b"\x00" is truthy!);
    # the gguf package hands out numpy scalars.
    if isinstance(value, (bytes, bytearray)) and len(value) == 1:
        return value[0]
    return value.item() if hasattr(value, "item") else value


def as_str(value) -> str:
    return bytes(value).decode("utf-8") if isinstance(value, (bytes, bytearray, memoryview)) else str(value)


def require(kv: Mapping, key: str):
    if key not in kv or kv[key] is None:
        raise ValueError(f"GGUF metadata has no {key!r}; cannot build the tokenizer")
    return kv[key]


class TokenizerBase:
    """See the module docstring."""

    models: ClassVar[dict[str, type[TokenizerBase]]] = {}  # tokenizer.ggml.model -> its class
    model: ClassVar[str] = ""

    def __init_subclass__(cls, model: str = "", **kwargs):
        super().__init_subclass__(**kwargs)
        if model:
            cls.model = model
            TokenizerBase.models[model] = cls

    def __init__(self, tokens: list[str], token_types: list[int], bos_id: int | None, eos_id: int, eot_id: int | None, add_bos: bool):
        if len(token_types) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(token_types)} token types")
        self.vocab_size = len(tokens)
        for name, tid in (("bos", bos_id), ("eos", eos_id), ("eot", eot_id)):
            if tid is not None and not 0 <= tid < self.vocab_size:
                raise ValueError(f"{name} token id {tid} is outside the vocab (size {self.vocab_size})")
        self._vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            self._vocab.setdefault(tok, i)  # a duplicated entry keeps its first id, as in llama.cpp
        self.special_ids = frozenset(i for i, t in enumerate(token_types) if t in SPECIAL_TYPES and tokens[i])
        self._special_vocab = {tokens[i]: i for i in sorted(self.special_ids, reverse=True)}
        specials = sorted(self._special_vocab, key=len, reverse=True)
        # Alternation tries branches in order, so longest-first gives leftmost-longest matching.
        self._special_re = regex.compile("|".join(map(regex.escape, specials))) if specials else None
        self._token_bytes = [
            tok.encode("utf-8") if i in self.special_ids else self._piece_bytes(tok, kind)
            for i, (tok, kind) in enumerate(zip(tokens, token_types))
        ]
        self.bos_id, self.eos_id, self.eot_id = bos_id, eos_id, eot_id
        self.bos_token = tokens[bos_id] if bos_id is not None else ""
        self.eos_token = tokens[eos_id]
        self.add_bos = bos_id is not None and add_bos
        stop = {eos_id} | ({eot_id} if eot_id is not None else set())
        stop |= {self._vocab[t] for t in _STOP_TOKEN_TEXTS if self._vocab.get(t) in self.special_ids}
        if all(self._vocab.get(t) in self.special_ids for t in HARMONY_STOP_TEXTS):
            stop = (stop | {self._vocab[t] for t in HARMONY_STOP_TEXTS}) - {self._vocab.get(HARMONY_MESSAGE_END)}
        self.stop_ids: frozenset[int] = frozenset(stop)

    @classmethod
    def from_gguf_metadata(cls, kv: Mapping) -> TokenizerBase:
        model = as_str(require(kv, "tokenizer.ggml.model"))
        if model not in TokenizerBase.models:
            known = " and ".join(repr(m) for m in sorted(TokenizerBase.models))
            raise ValueError(f"unsupported tokenizer model {model!r}: {known} are implemented")
        return TokenizerBase.models[model].from_gguf(kv)

    @classmethod
    def from_gguf(cls, kv: Mapping) -> TokenizerBase:
        raise NotImplementedError

    # -- encoding --------------------------------------------------------------------------------

    def encode(self, text: str, special: bool = True) -> list[int]:
        ids: list[int] = []
        pos = 0
        after_special = True  # the start of the text counts as following a special token
        if special and self._special_re is not None:
            for m in self._special_re.finditer(text):
                if m.start() > pos:
                    self._encode_ordinary(text[pos : m.start()], ids, after_special)
                ids.append(self._special_vocab[m.group()])
                pos, after_special = m.end(), True
        if pos < len(text):
            self._encode_ordinary(text[pos:], ids, after_special)
        return ids

    def _encode_ordinary(self, text: str, out: list[int], after_special: bool) -> None:
        """Append the ids of `text` (non-empty, no special tokens in it) to `out`; `after_special`
        says the text starts the input or follows a special token."""
        raise NotImplementedError

    # -- decoding --------------------------------------------------------------------------------

    def _piece_bytes(self, token: str, token_type: int) -> bytes:
        """What an ordinary token decodes to."""
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocab (size {self.vocab_size})")
        return self._token_bytes[token_id]

    def decode(self, ids: Iterable[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns token ids into text one at a time; the pieces concatenate to `Tokenizer.decode(ids)`.

    Holds back the bytes of a character that is still incomplete (an emoji split over two tokens);
    one decoder per request, not thread-safe.
    """

    def __init__(self, tokenizer: TokenizerBase):
        self._tokenizer = tokenizer
        # The stdlib incremental decoder buffers exactly the unfinished tail of a UTF-8 sequence and
        # replaces invalid bytes the same way bytes.decode(errors="replace") does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held back, as replacement characters; the decoder is then reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
