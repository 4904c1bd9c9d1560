"""Grammar-constrained decoding: which tokens a request may produce next, with llguidance.

Contract:
- A grammar is llguidance's grammar text, built by `json_schema_grammar(schema)`,
  `lark_grammar(source)` or `gbnf_grammar(source)`. It is a plain string, so it can be checked,
  logged and compared without a tokenizer. `grammar_problem(grammar)` returns the library's error
  message ("Unimplemented keys: [\\"if\\"]", a Lark syntax error, ...) or "" when it compiles.
- `GrammarCompiler(tokenizer)` is made once per loaded model (`Engine.grammars`). Its token table
  is built lazily from the tokenizer's own token bytes, once, under a lock (the costly part: its time
  and a matcher's are in bench/RESULTS.md, constrained decoding); then `matcher(grammar)` makes a
  fresh `TokenConstraint` per request, from any thread (llguidance releases the GIL while compiling).
  It raises `GrammarError` (a ValueError) for a grammar that does not compile.
- `TokenConstraint` belongs to one request and is used only by the model thread once submitted:
  `allowed(width)` is the (width,) boolean mask of tokens the grammar accepts next (the tokenizer's
  stop tokens only where the grammar may end), `accept(token)` advances it.

Special (control) tokens are marked in the token table so that grammar text can never be spelled
with them: a JSON string can never contain `<|im_end|>`, which would end the reply mid-value.
The tokenizer needs `vocab_size`, `token_bytes(id)`, `special_ids`, `stop_ids`, `eos_id`, `bos_id`
and `encode(text, special=False)`; it may be the GGUF tokenizer or a test double.
"""

from __future__ import annotations

import threading

import llguidance
import numpy as np

# Marks a special token in llguidance's token table (llama.cpp's binding does the same).
_SPECIAL_MARK = b"\xff"
# JSON as models write it (json.dumps' separators), and no free whitespace: with flexible
# whitespace a small model can pad a reply with newlines until it runs out of tokens.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar (or JSON schema) the constraint library cannot compile; the message says why."""


def json_schema_grammar(schema: dict) -> str:
    """The grammar of JSON documents matching `schema`; unknown keywords make it fail to compile."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)


def lark_grammar(source: str) -> str:
    """A Lark grammar (llguidance's dialect: `%json {...}` embeds a JSON schema)."""
    return llguidance.LLMatcher.grammar_from_lark(source)


def gbnf_grammar(source: str) -> str:
    """A GBNF grammar (llama.cpp's format), converted to Lark by the library."""
    return llguidance.grammar_from("gbnf", source)


def grammar_problem(grammar: str) -> str:
    """The compile error of `grammar`, or "" when it is fine."""
    return llguidance.LLMatcher.validate_grammar(grammar)


class _TokenTable:
    """What llguidance reads from a tokenizer: token bytes, specials, EOS, and an encoder."""

    def __init__(self, tokenizer):
        specials = frozenset(tokenizer.special_ids)
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(specials)
        self.tokens = [
            _SPECIAL_MARK + tokenizer.token_bytes(i) if i in specials else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)
        ]
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, special=False)


class GrammarCompiler:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._table = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        with self._lock:
            if self._table is None:
                stops = sorted(self._tokenizer.stop_ids)
                self._table = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(self._tokenizer)), eos_token=stops)
            return self._table

    def matcher(self, grammar: str) -> TokenConstraint:
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return TokenConstraint(matcher, self._tokenizer.vocab_size)


class TokenConstraint:
    """One request's position in its grammar; see the module docstring."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self, width: int) -> np.ndarray:
        """(width,) bool: the tokens the grammar accepts next; ids past the vocabulary never."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little").astype(bool)
        mask = np.zeros(width, dtype=bool)
        n = min(width, self.vocab_size)
        mask[:n] = bits[:n]
        return mask

    def accept(self, token: int) -> bool:
        """Advance past `token`; False (and the matcher stays broken) if the grammar forbids it."""
        return self._matcher.consume_token(token)

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""
