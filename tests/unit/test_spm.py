"""SentencePiece tokenization (`tokenizer.ggml.model == "llama"`) on a small made-up vocabulary,
against a plain reference of the same rules: merge the best-scoring neighbouring pair (leftmost
among equals) until none spells an entry, then bytes for characters without one."""

import random

import pytest

from webapp.engine.text.base import TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_UNUSED
from webapp.engine.text.spm import SpmTokenizer
from webapp.engine.text.tokenizer import Tokenizer

S = "\u2581"
PIECES = {  # piece -> score: higher merges first
    S: -1.0, "a": -2.0, "b": -2.0, "c": -2.0, "l": -2.0, "o": -2.0, "H": -2.0, "e": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
    "ab": -3.0, "bc": -1.5, S + "a": -2.5, S + "H": -3.0, "He": -3.5, "ll": -1.2, "llo": -2.2,
    S + "He": -4.5, S + "Hello": -1.0, "Hell": -6.0, "or": -2.0, "ld": -2.0, S + "w": -3.0, S + "wor": -5.0, S + "world": -0.5,
    "é": -2.0, "<tag>": -1.0,
}  # fmt: skip
CONTROL = ["<unk>", "<s>", "</s>"]


def vocab(byte_tokens: bool = True, unused: tuple[str, ...] = ()):
    tokens, types, scores = list(CONTROL), [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL], [0.0] * 3
    if byte_tokens:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [TOKEN_TYPE_BYTE] * 256
        scores += [0.0] * 256
    for piece, score in PIECES.items():
        tokens.append(piece)
        types.append(TOKEN_TYPE_UNUSED if piece in unused else 1)
        scores.append(score)
    return tokens, types, scores


def kv(**extra):
    tokens, types, scores = vocab()
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **extra,
    }


def reference(tokens: list[str], scores: list[float], text: str, space_prefix: bool = True) -> list[int]:
    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    syms = list(((" " + text) if space_prefix else text).replace(" ", S))
    while True:
        best = None
        for i in range(len(syms) - 1):
            merged = syms[i] + syms[i + 1]
            if merged in ids and (best is None or scores[ids[merged]] > best[0]):
                best = (scores[ids[merged]], i)
        if best is None:
            break
        i = best[1]
        syms[i : i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for sym in syms:
        out += [ids[sym]] if sym in ids else [ids.get(f"<0x{b:02X}>", 0) for b in sym.encode()]
    return out


def test_the_gguf_model_name_picks_sentencepiece_with_llama_cpp_defaults():
    tok = Tokenizer.from_gguf_metadata(kv())
    assert isinstance(tok, SpmTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.add_bos, tok.add_space_prefix) == (1, 2, 0, True, True)
    off = Tokenizer.from_gguf_metadata(kv(**{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False}))
    assert (off.add_bos, off.add_space_prefix) == (False, False)


def test_the_best_scoring_pair_merges_first_not_the_leftmost():
    tok = Tokenizer.from_gguf_metadata(kv(**{"tokenizer.ggml.add_space_prefix": False}))
    tokens, _, _ = vocab()
    # "bc" (-1.5) beats "ab" (-3.0): a + bc, though "ab" is the leftmost pair
    assert [tokens[i] for i in tok.encode("abc")] == ["a", "bc"]
    assert [tokens[i] for i in Tokenizer.from_gguf_metadata(kv()).encode("Hello world")] == [S + "Hello", S + "world"]


def test_a_space_is_put_before_the_start_and_after_each_special_token_only():
    tok = Tokenizer.from_gguf_metadata(kv())
    tokens, _, _ = vocab()
    assert [tokens[i] for i in tok.encode("<s>Hello</s>world")] == ["<s>", S + "Hello", "</s>", S + "world"]
    assert [tokens[i] for i in tok.encode("<s>Hello", special=False)][:3] == [S, "<0x3C>", "<0x73>"]  # '<', 's'


def test_characters_without_an_entry_fall_back_to_byte_tokens_then_unknown():
    tok = Tokenizer.from_gguf_metadata(kv(**{"tokenizer.ggml.add_space_prefix": False}))
    tokens, _, _ = vocab()
    assert [tokens[i] for i in tok.encode("é😀")] == ["é", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert tok.decode(tok.encode("é😀 ab")) == "é😀 ab"
    bare_tokens, bare_types, bare_scores = vocab(byte_tokens=False)
    bare = SpmTokenizer(bare_tokens, bare_types, bare_scores, add_space_prefix=False)
    assert bare.encode("a😀") == [bare_tokens.index("a"), 0]  # no byte tokens: the unknown token


def test_decoding_turns_spaces_back_drops_unused_tokens_and_streams_whole_characters():
    tokens, types, scores = vocab(unused=("ll",))
    tok = SpmTokenizer(tokens, types, scores)
    ids = tok.encode("Hello world 😀")
    assert tok.decode(ids) == " Hello world 😀"  # llama.cpp's pieces keep the prefix space
    assert tok.decode([tokens.index("ll"), tokens.index("<tag>"), 1]) == "<tag><s>"
    stream = tok.stream_decoder()
    pieces = [stream.add(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == " Hello world 😀" and "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize("space_prefix", [True, False])
def test_random_texts_tokenize_as_the_reference_does(space_prefix):
    tokens, types, scores = vocab()
    tok = SpmTokenizer(tokens, types, scores, add_space_prefix=space_prefix)
    rng = random.Random(0)
    alphabet = list("abclo Hewrd") + ["é", "ü", "😀", "\n", "\t"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        assert tok.encode(text, special=False) == reference(tokens, scores, text, space_prefix), repr(text)
        assert tok.decode(tok.encode(text, special=False)) == (" " + text if space_prefix else text)


def test_a_malformed_vocabulary_is_refused_in_one_line():
    tokens, types, scores = vocab()
    with pytest.raises(ValueError, match="scores"):
        SpmTokenizer(tokens, types, scores[:-1])
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata({k: v for k, v in kv().items() if k != "tokenizer.ggml.scores"})
