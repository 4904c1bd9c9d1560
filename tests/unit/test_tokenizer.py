"""Tokenizer tests: known SmolLM2 ids from the real GGUF's metadata, plus small synthetic vocabs.

The expected ids were produced once with the `tokenizers` package (HF BPE over the same vocab and
merges, Digits(individual) + ByteLevel pre-tokenizer, as in SmolLM2's tokenizer.json); the tests
themselves need only the GGUF file.
"""

import logging
import random
import time

import numpy as np
import pytest

from webapp.engine.text.bpe import _BYTE_TO_CHAR, _PRE_TOKENIZERS
from webapp.engine.text.tokenizer import Tokenizer

# -- the real SmolLM2 vocab ----------------------------------------------------------------------

KNOWN_IDS = [
    ("Hello, world!", [19556, 28, 905, 17]),
    ("  leading and trailing  ", [216, 2899, 284, 35079, 256]),
    ("a\n\nb\t\tc   d\r\n", [81, 198, 198, 82, 197, 197, 83, 256, 287, 2738]),
    ("12345", [33, 34, 35, 36, 37]),
    ("Call 555-0123 in 2024.", [12800, 216, 37, 37, 37, 29, 32, 33, 34, 35, 281, 216, 34, 32, 34, 36, 30]),
    ("naïve café 日本語 😀👍🏽", [3546, 46494, 37366, 17097, 241, 115, 40993, 179, 120, 248, 40303, 218, 10813, 235, 231, 10813, 233, 138]),
    ("I'm sure you're right; it's what we'd've done.", [57, 5248, 2090, 346, 2316, 1048, 43, 357, 506, 732, 392, 6737, 3543, 2294, 30]),
    ("<|im_start|>user\nHi<|im_end|>\n", [1, 4093, 198, 26843, 2, 198]),
    ("def f(x):\n    return x**2\n", [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 198]),
]


def test_metadata_attributes(smollm2_tokenizer):
    assert smollm2_tokenizer.vocab_size == 49152
    assert (smollm2_tokenizer.bos_id, smollm2_tokenizer.eos_id) == (1, 2)
    assert (smollm2_tokenizer.bos_token, smollm2_tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smollm2_tokenizer.add_bos is False  # the file says so explicitly
    assert smollm2_tokenizer.stop_ids == frozenset({0, 2})  # <|endoftext|> and <|im_end|>
    assert smollm2_tokenizer.pre == "smollm"


@pytest.mark.parametrize("text, ids", KNOWN_IDS)
def test_known_smollm2_ids(smollm2_tokenizer, text, ids):
    assert smollm2_tokenizer.encode(text) == ids
    assert smollm2_tokenizer.decode(ids) == text


def test_special_false_treats_control_text_as_ordinary(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("<|im_start|>user", special=False)
    assert ids == [44, 108, 306, 79, 3738, 108, 46, 4093]
    assert smollm2_tokenizer.decode(ids) == "<|im_start|>user"


def test_special_tokens_decode_to_their_text(smollm2_tokenizer):
    assert smollm2_tokenizer.decode([1, 4093, 2, 0]) == "<|im_start|>user<|im_end|><|endoftext|>"
    assert smollm2_tokenizer.token_bytes(1) == b"<|im_start|>"


ROUNDTRIP = [
    "",
    " ",
    "\n",
    "\n\n\n",
    "   x",
    "x   ",
    "\t\tindented\n",
    "a  b   c    d",
    "line1\r\nline2\rline3",
    "3.14159 and 2,718 and -42",
    "don't can't won't I'LL WE'VE",
    "Ünïcödé ñ ß Ø ø",
    "Привет, мир!",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "こんにちは世界",
    "안녕하세요",
    "🙂🙃🤖🧠 👩‍👩‍👧‍👦 🇯🇵",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_end",
    "<|im_end|><|im_end|>",
    "<repo_name>x<file_sep>y",
    '{"key": [1, 2, {"n": null}]}',
    "$x = `ls -la` && echo ~/.rc",
    "a" * 3000,
    "ab " * 500,
    "\u00a0\u2028\u3000 mixed\u200b spaces",
]


@pytest.mark.parametrize("text", ROUNDTRIP)
def test_decode_inverts_encode(smollm2_tokenizer, text):
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


def test_stream_decoder_emits_emoji_only_when_complete(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("日本語 😀👍🏽!")
    decoder = smollm2_tokenizer.stream_decoder()
    pieces = [decoder.add(i) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == smollm2_tokenizer.decode(ids) == "日本語 😀👍🏽!"
    assert not any("\ufffd" in p for p in pieces)
    # "😀" is split over two tokens: " \xf0\x9f\x98" then "\x80"; only the second completes it.
    first = ids.index(40303)
    assert ids[first + 1] == 218
    assert pieces[first] == " "
    assert pieces[first + 1] == "😀"


def test_stream_decoder_flushes_incomplete_bytes_like_decode(smollm2_tokenizer):
    decoder = smollm2_tokenizer.stream_decoder()
    assert decoder.add(19556) == "Hello"
    assert decoder.add(10813) == ""  # b"\xf0\x9f": the start of a 4-byte character
    assert decoder.flush() == smollm2_tokenizer.decode([10813]) == "\ufffd"
    assert decoder.add(19556) == "Hello"  # usable after a flush


def test_token_id_out_of_range(smollm2_tokenizer):
    with pytest.raises(ValueError):
        smollm2_tokenizer.token_bytes(smollm2_tokenizer.vocab_size)
    with pytest.raises(ValueError):
        smollm2_tokenizer.decode([-1])


def test_encodes_6000_tokens_well_under_a_second(smollm2_kv):
    fresh = Tokenizer.from_gguf_metadata(smollm2_kv)  # empty word cache
    rng = random.Random(0)
    # Varied words, so the per-word cache cannot make this trivially fast.
    words = [fresh.decode([i]).strip() for i in rng.sample(range(1000, fresh.vocab_size), 4000)]
    text = "".join(w + rng.choice([" ", ", ", ".\n", "  ", "\t"]) for w in words)
    start = time.perf_counter()
    ids = fresh.encode(text)
    elapsed = time.perf_counter() - start
    assert len(ids) >= 6000
    assert elapsed < 0.5, f"encoding {len(ids)} tokens took {elapsed:.2f}s"


# -- small synthetic vocabs ----------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "<s>x"]


def synthetic_kv(pre: str, merges: list[str] = (), extra: list[str] = (), **overrides) -> dict:
    """A byte-level vocab: special tokens, the 256 byte characters, then `extra` ordinary tokens."""
    tokens = [*SPECIALS, *(_BYTE_TO_CHAR[b] for b in range(256)), *extra]  # byte b has id 5 + b
    kv = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 4, 4] + [1] * (len(tokens) - len(SPECIALS)),
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 0,
    }
    kv.update(overrides)
    return kv


def pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.decode([i]) for i in tok.encode(text)]


@pytest.mark.parametrize(
    "pre, expected",
    [
        ("gpt2", ["12", "34"]),  # one pre-token; "3 4" has the lowest rank so it merges first
        ("llama-bpe", ["123", "4"]),  # digits in groups of three
        ("qwen2", ["1", "2", "3", "4"]),  # every digit alone
        ("smollm", ["1", "2", "3", "4"]),
    ],
)
def test_pre_tokenizer_is_chosen_by_name(pre, expected):
    tok = Tokenizer.from_gguf_metadata(synthetic_kv(pre, merges=["3 4", "1 2", "12 3"], extra=["34", "12", "123"]))
    assert pieces(tok, "1234") == expected


def test_ignore_merges_for_llama3_family():
    kv = {"merges": ["a b"], "extra": ["ab", "abc"]}
    assert pieces(Tokenizer.from_gguf_metadata(synthetic_kv("gpt2", **kv)), "abc") == ["ab", "c"]
    assert pieces(Tokenizer.from_gguf_metadata(synthetic_kv("llama-bpe", **kv)), "abc") == ["abc"]


def test_bpe_applies_lowest_rank_first_and_leftmost_on_ties():
    tok = Tokenizer.from_gguf_metadata(synthetic_kv("gpt2", merges=["a a", "b c", "aa a"], extra=["aa", "bc", "aaa"]))
    assert pieces(tok, "aaaaabc") == ["aa", "aaa", "bc"]
    assert pieces(tok, "aaa") == ["aaa"]


def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="webapp.engine.text.tokenizer"):
        tok = Tokenizer.from_gguf_metadata(synthetic_kv("brand-new-model", merges=["3 4", "1 2"], extra=["34", "12"]))
    assert "brand-new-model" in caplog.text
    assert pieces(tok, "1234") == ["12", "34"]


def test_special_tokens_match_longest_first_and_only_when_asked():
    tok = Tokenizer.from_gguf_metadata(synthetic_kv("gpt2"))
    assert tok.encode("<s>x<s>y") == [4, 3, 5 + ord("y")]  # "<s>x" wins over "<s>"
    assert tok.encode("<s>", special=False) == [5 + ord("<"), 5 + ord("s"), 5 + ord(">")]


def test_stop_ids_and_bos_defaults():
    extra = ["<|eot_id|>", "<|end_of_text|>"]
    kv = synthetic_kv("llama-bpe", extra=extra)
    kv["tokenizer.ggml.token_type"][-2:] = [3, 1]  # <|end_of_text|> here is ordinary text: not a stop
    kv["tokenizer.ggml.eot_token_id"] = len(kv["tokenizer.ggml.tokens"]) - 2
    tok = Tokenizer.from_gguf_metadata(kv)
    assert tok.stop_ids == {0, 2, tok.eot_id}  # eos, <|im_end|>, eot
    assert tok.add_bos is True  # llama3's default when the file does not say
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|endoftext|>")
    assert Tokenizer.from_gguf_metadata(synthetic_kv("smollm")).add_bos is False


def test_a_harmony_vocabulary_stops_at_return_and_call_not_at_end():
    """gpt-oss's <|end|> closes its reasoning message, then the answer follows: only <|return|> and
    <|call|> end the turn there (llama.cpp drops <|end|> from such a vocabulary's stops alike)."""
    harmony = ["<|return|>", "<|call|>", "<|end|>", "<|channel|>"]
    kv = synthetic_kv("gpt2", extra=harmony)
    kv["tokenizer.ggml.token_type"][-4:] = [3, 3, 3, 3]
    kv["tokenizer.ggml.eot_token_id"] = len(kv["tokenizer.ggml.tokens"]) - 2  # files may name <|end|> their eot
    tok = Tokenizer.from_gguf_metadata(kv)
    ids = {t: tok.encode(t)[0] for t in harmony}
    assert ids["<|return|>"] in tok.stop_ids and ids["<|call|>"] in tok.stop_ids
    assert ids["<|end|>"] not in tok.stop_ids and ids["<|channel|>"] not in tok.stop_ids
    kv["tokenizer.ggml.token_type"][-3] = 1  # no <|call|> token: not Harmony, so <|end|> stops again
    assert ids["<|end|>"] in Tokenizer.from_gguf_metadata(kv).stop_ids


def test_accepts_tinygrad_uint8_and_numpy_values():
    # tinygrad's reader returns GGUF uint8 as 1-byte bytes; the gguf package returns numpy arrays.
    kv = synthetic_kv("gpt2", **{"tokenizer.ggml.add_bos_token": b"\x00"})
    assert Tokenizer.from_gguf_metadata(kv).add_bos is False
    kv["tokenizer.ggml.add_bos_token"] = b"\x01"
    kv["tokenizer.ggml.token_type"] = np.array(kv["tokenizer.ggml.token_type"], dtype=np.int32)
    kv["tokenizer.ggml.eos_token_id"] = np.uint32(2)
    tok = Tokenizer.from_gguf_metadata(kv)
    assert tok.add_bos is True and tok.eos_id == 2 and type(tok.eos_id) is int
    assert tok.encode("<|im_start|>") == [1]


@pytest.mark.parametrize(
    "key",
    ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"],
)
def test_missing_required_key_is_named(key):
    kv = synthetic_kv("gpt2")
    del kv[key]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Tokenizer.from_gguf_metadata(kv)


def test_an_unknown_tokenizer_model_is_rejected_by_name():
    with pytest.raises(ValueError, match="'bert'.*'gpt2' and 'llama' are implemented"):
        Tokenizer.from_gguf_metadata(synthetic_kv("gpt2", **{"tokenizer.ggml.model": "bert"}))


@pytest.mark.parametrize("pre", sorted(_PRE_TOKENIZERS))
def test_every_known_pre_tokenizer_compiles_and_round_trips(pre):
    tok = Tokenizer.from_gguf_metadata(synthetic_kv(pre))
    text = "Hello WORLD 12345 世界 한국어 it's\n\n  x\t😀 <tag>"
    assert tok.decode(tok.encode(text)) == text


def test_qwen35_keeps_a_letters_combining_marks_in_its_word():
    """Qwen3.5's pre-tokenizer takes letters and marks as one run, where Qwen2's parts a mark from
    the letter before it (the bench compares both with llama.cpp's ids: bench/tokenizer_conformance.py)."""
    text = "cafe\u0301 नमस्ते"

    def words(pre):
        return Tokenizer.from_gguf_metadata(synthetic_kv(pre))._pre_tokenize(text)

    assert words("qwen35") == ["cafe\u0301", " नमस्ते"]
    assert words("qwen2") != words("qwen35")
