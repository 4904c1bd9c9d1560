"""SentencePiece (`tokenizer.ggml.model == "llama"`): Llama 1/2, Mistral 7B, Mixtral, older Gemma and
Phi-3 files, as llama.cpp tokenizes them.

Spaces become "▁" (U+2581), and a space is put before the text that starts the input or follows a
special token (`tokenizer.ggml.add_space_prefix`, default on). The text is split into characters;
then, as long as any two neighbouring symbols together spell a vocabulary entry, the pair whose
entry has the highest score (`tokenizer.ggml.scores`; the leftmost among equals) is merged. A final
symbol is then an entry or a single character; a character without an entry is written as its
UTF-8 bytes, each the byte token `<0xXX>` (byte fallback), or as one unknown
token where the vocabulary has no byte tokens. Decoding turns "▁" back into spaces and byte tokens
into their bytes; unused tokens decode to nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from webapp.engine.text.base import TOKEN_TYPE_BYTE, TOKEN_TYPE_UNUSED, TokenizerBase, as_str, require, scalar

SPACE = "\u2581"


class SpmTokenizer(TokenizerBase, model="llama"):
    def __init__(
        self,
        tokens: list[str],
        token_types: list[int],
        scores: list[float],
        bos_id: int | None = 1,
        eos_id: int = 2,
        unk_id: int | None = 0,
        eot_id: int | None = None,
        add_bos: bool = True,
        add_space_prefix: bool = True,
    ):
        if len(scores) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(scores)} scores")
        if unk_id is not None and not 0 <= unk_id < len(tokens):
            raise ValueError(f"unknown-token id {unk_id} is outside the vocab (size {len(tokens)})")
        super().__init__(tokens, token_types, bos_id, eos_id, eot_id, add_bos)
        self.unk_id = unk_id
        self.add_space_prefix = add_space_prefix
        self._scores = [float(s) for s in scores]
        self._bytes = [self._vocab.get(f"<0x{b:02X}>", self._vocab.get(chr(b)) if b < 128 else None) for b in range(256)]

    @classmethod
    def from_gguf(cls, kv: Mapping) -> SpmTokenizer:
        tokens = [as_str(t) for t in require(kv, "tokenizer.ggml.tokens")]
        token_types = [int(scalar(t)) for t in require(kv, "tokenizer.ggml.token_type")]
        scores = [float(scalar(s)) for s in require(kv, "tokenizer.ggml.scores")]

        def optional(key: str, default, kind):
            return default if kv.get(key) is None else kind(scalar(kv[key]))

        return cls(
            tokens,
            token_types,
            scores,
            bos_id=optional("tokenizer.ggml.bos_token_id", 1, int),
            eos_id=optional("tokenizer.ggml.eos_token_id", 2, int),
            unk_id=optional("tokenizer.ggml.unknown_token_id", 0, int),
            eot_id=optional("tokenizer.ggml.eot_token_id", None, int),
            add_bos=optional("tokenizer.ggml.add_bos_token", True, bool),
            add_space_prefix=optional("tokenizer.ggml.add_space_prefix", True, bool),
        )

    def _encode_ordinary(self, text: str, out: list[int], after_special: bool) -> None:
        if self.add_space_prefix and after_special:
            text = " " + text
        # no pre-tokenizer splits the text into words, so no word cache: each fragment merges whole
        out.extend(self._merge(text.replace(" ", SPACE)))

    def _merge(self, text: str) -> tuple[int, ...]:
        vocab, scores = self._vocab, self._scores
        syms: list[str | None] = list(text)
        n = len(syms)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, str]] = []  # (-score, left index, merged text): best first, leftmost among equals

        def push(left: int, right: int) -> None:
            if left < 0 or right >= n:
                return
            merged = syms[left] + syms[right]
            if (tid := vocab.get(merged)) is not None:
                heapq.heappush(heap, (-scores[tid], left, merged))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, i, merged = heapq.heappop(heap)
            j = nxt[i]
            # stale: a neighbour merged since this pair was queued
            if syms[i] is None or j >= n or syms[i] + syms[j] != merged:
                continue
            syms[i], syms[j] = merged, None
            nxt[i] = nxt[j]
            if nxt[i] < n:
                prv[nxt[i]] = i
            push(prv[i], i)
            push(i, nxt[i])
        ids: list[int] = []
        i = 0
        while i < n:  # a merged symbol is an entry; a character may not be: its bytes then
            if (tid := vocab.get(syms[i])) is not None:
                ids.append(tid)
            else:
                ids.extend(self._fallback(syms[i]))
            i = nxt[i]
        return tuple(ids)

    def _fallback(self, char: str) -> list[int]:
        """A character without an entry: its UTF-8 bytes' tokens, or one unknown token where some byte has none."""
        byte_ids = [self._bytes[b] for b in char.encode("utf-8")]
        if None not in byte_ids:
            return byte_ids
        if self.unk_id is None:
            raise ValueError(f"{char!r} has no token, nor do its bytes, and the vocab has no unknown token")
        return [self.unk_id]

    def _piece_bytes(self, token: str, token_type: int) -> bytes:
        if token_type == TOKEN_TYPE_BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        if token_type == TOKEN_TYPE_UNUSED:
            return b""
        return token.replace(SPACE, " ").encode("utf-8")
