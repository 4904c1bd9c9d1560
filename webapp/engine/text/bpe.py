"""Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): GPT-2, Llama 3, Qwen2/3, SmolLM2 and most
newer families.

Text is split by the family's pre-tokenizer regexes (`tokenizer.ggml.pre`), each piece's UTF-8
bytes are mapped to GPT-2's printable characters, and the piece is merged pair by pair, lowest
merge rank first, as llama.cpp and Hugging Face's tokenizers do.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import regex

from webapp.engine.text.base import TokenizerBase, as_str, require, scalar

log = logging.getLogger(__name__)

_WORD_CACHE_LIMIT = 100_000  # distinct pre-token words; cleared when full so memory stays bounded


# Pre-tokenizer regexes, as in the models' tokenizer.json files (llama.cpp's llama-vocab.cpp keeps
# the same table, keyed by `tokenizer.ggml.pre`). A pre-tokenizer is a sequence of regexes: each one
# splits every piece the previous one produced into its matches and the text between them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's with a letter's combining marks kept in its word (\p{M}: Devanagari's vowel
# signs, a decomposed accent), and case-insensitive contractions spelled out as llama.cpp does
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek's letter class is written with escapes: several of its code points (U+1F7D, U+1FBE,
# U+2126 OHM SIGN, U+212A KELVIN SIGN, ...) turn into other characters under Unicode normalization.
_DEEPSEEK_LETTERS = (
    r"A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    r"\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    r"\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    r"\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    r"\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    r"\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    r"\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    r"\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    r"\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    r"\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    r"\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    r"\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + r"]+",
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    (
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class _PreTokenizer:
    patterns: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a vocab entry is one token, merges or not
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token


_LLAMA3_PRE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    **dict.fromkeys(
        (
            "gpt2",
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
            "mellum",
            "modern-bert",
            "roberta-bpe",
            "gigachat",
            "jina-es",
            "jina-de",
            "jina-v1-en",
            "jina-v2-es",
            "jina-v2-de",
            "jina-v2-code",
            "a.x-4.0",
        ),
        _PreTokenizer((_GPT2,)),
    ),
    # Digits are split one by one before the GPT-2 regex runs.
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _PreTokenizer((r"\p{N}", _GPT2))),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), _LLAMA3_PRE),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), _PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "kormo"), _PreTokenizer((_QWEN2,))),
    "qwen35": _PreTokenizer((_QWEN35,)),
    "tekken": _PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4"), _PreTokenizer((_GPT4O,))),
    "deepseek-llm": _PreTokenizer(_DEEPSEEK_LLM),
    "deepseek-coder": _PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}")),
    "deepseek-v3": _PreTokenizer(_DEEPSEEK_V3),
    "falcon": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(("bloom", "poro-chat", "gpt3-finnish"), _PreTokenizer((_BLOOM,))),
    "viking": _PreTokenizer((_BLOOM, r"\p{N}")),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, so BPE never sees raw whitespace/control bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(shifted)
            shifted += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
# Decoding UTF-8 bytes as latin-1 gives one char per byte; this table then maps it in C, not a loop.
_LATIN1_TO_BYTE_CHAR = {b: c for b, c in _BYTE_TO_CHAR.items() if chr(b) != c}


class BpeTokenizer(TokenizerBase, model="gpt2"):
    def __init__(
        self,
        tokens: list[str],
        token_types: list[int],
        merges: list[str],
        pre: str,
        bos_id: int | None,
        eos_id: int,
        eot_id: int | None = None,
        add_bos: bool | None = None,
    ):
        if (pre_tok := _PRE_TOKENIZERS.get(pre)) is None:
            log.warning(
                "unknown pre-tokenizer %r (tokenizer.ggml.pre); falling back to gpt2's, so some "
                "texts may tokenize differently from the model's own tokenizer",
                pre or "<missing>",
            )
            pre_tok = _PRE_TOKENIZERS["gpt2"]
        super().__init__(tokens, token_types, bos_id, eos_id, eot_id, pre_tok.add_bos if add_bos is None else add_bos)
        self.pre = pre
        self._patterns = [regex.compile(p) for p in pre_tok.patterns]
        self._ignore_merges = pre_tok.ignore_merges
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            # Split at the first space after position 0: a merge's left half may itself be " ".
            cut = merge.find(" ", 1)
            if cut > 0:
                self._ranks.setdefault((merge[:cut], merge[cut + 1 :]), rank)
        self._absent_chars = frozenset(c for c in _BYTE_TO_CHAR.values() if c not in self._vocab)
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_gguf(cls, kv: Mapping) -> BpeTokenizer:
        tokens = [as_str(t) for t in require(kv, "tokenizer.ggml.tokens")]
        token_types = [int(scalar(t)) for t in require(kv, "tokenizer.ggml.token_type")]
        merges = [as_str(m) for m in require(kv, "tokenizer.ggml.merges")]
        eos_id = int(scalar(require(kv, "tokenizer.ggml.eos_token_id")))

        def optional_int(key: str) -> int | None:
            return None if kv.get(key) is None else int(scalar(kv[key]))

        add_bos = kv.get("tokenizer.ggml.add_bos_token")
        pre = as_str(kv.get("tokenizer.ggml.pre") or "")  # absent: warned about, then gpt2
        return cls(
            tokens,
            token_types,
            merges,
            pre,
            bos_id=optional_int("tokenizer.ggml.bos_token_id"),
            eos_id=eos_id,
            eot_id=optional_int("tokenizer.ggml.eot_token_id"),
            add_bos=None if add_bos is None else bool(scalar(add_bos)),
        )

    def _encode_ordinary(self, text: str, out: list[int], after_special: bool) -> None:
        for piece in self._pre_tokenize(text):
            word = piece.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTE_CHAR)
            if (hit := self._cache.get(word)) is None:
                hit = self._bpe(word)
                if len(self._cache) >= _WORD_CACHE_LIMIT:
                    self._cache.clear()
                self._cache[word] = hit
            out.extend(hit)

    def _pre_tokenize(self, text: str) -> list[str]:
        pieces = [text]
        for pattern in self._patterns:
            split: list[str] = []
            for piece in pieces:
                pos = 0
                for m in pattern.finditer(piece):
                    start, end = m.span()
                    if start > pos:  # text no alternative matched is still a piece of its own
                        split.append(piece[pos:start])
                    if end > start:
                        split.append(piece[start:end])
                    pos = end
                if pos < len(piece):
                    split.append(piece[pos:])
            pieces = split
        return pieces

    def _bpe(self, word: str) -> tuple[int, ...]:
        if (self._ignore_merges or len(word) == 1) and (tid := self._vocab.get(word)) is not None:
            return (tid,)
        if self._absent_chars and not self._absent_chars.isdisjoint(word):
            # Some vocabs lack a few byte characters (SmolLM2 has no 0x04, 0xC0, 0xF1, ...). Like the
            # HF tokenizer, drop them before merging, so their neighbours still merge with each other.
            word = "".join(c for c in word if c not in self._absent_chars)
        syms: list[str | None] = list(word)
        n = len(syms)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        ranks = self._ranks
        # (rank, left index): lowest rank first, leftmost among equals, as in the reference BPE.
        heap = [(r, i) for i in range(n - 1) if (r := ranks.get((syms[i], syms[i + 1]))) is not None]
        heapq.heapify(heap)
        while heap:
            rank, i = heapq.heappop(heap)
            left = syms[i]
            j = nxt[i]
            # Entries go stale when a neighbour merged; a changed pair never has the same rank again.
            if left is None or j >= n or ranks.get((left, syms[j])) != rank:
                continue
            syms[i] = left + syms[j]
            syms[j] = None
            nxt[i] = nxt[j]
            if nxt[i] < n:
                prv[nxt[i]] = i
                if (r := ranks.get((syms[i], syms[nxt[i]]))) is not None:
                    heapq.heappush(heap, (r, i))
            if prv[i] >= 0 and (r := ranks.get((syms[prv[i]], syms[i]))) is not None:
                heapq.heappush(heap, (r, prv[i]))
        ids: list[int] = []
        i = 0
        while i < n:
            sym = syms[i]
            if (tid := self._vocab.get(sym)) is not None:
                ids.append(tid)
            else:  # a merge whose result is not in the vocab (a malformed file): use its characters
                ids.extend(self._vocab[c] for c in sym)
            i = nxt[i]
        return tuple(ids)

    def _piece_bytes(self, token: str, token_type: int) -> bytes:
        try:
            return bytes(_CHAR_TO_BYTE[c] for c in token)
        except KeyError:  # not a byte-level string (malformed vocab entry): keep its text
            return token.encode("utf-8")
