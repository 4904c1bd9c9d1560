"""Our tokenizer against llama.cpp's on the same GGUF, for each pre-tokenizer of the real families.

Usage: .venv/bin/python bench/tokenizer_conformance.py --llama-server PATH [--strings 400]

For each pre-tokenizer (`tokenizer.ggml.pre`: SmolLM2's `smollm`, Llama 3's `llama-bpe`, Qwen2/3's
`qwen2` and `deepseek-r1-qwen`, Qwen3.5's `qwen35`) a tiny GGUF carries SmolLM2's vocabulary and merges under that name, so
both sides split text by that family's regex and merge by the same ranks (`llama-bpe` also takes a
whole word that is in the vocabulary before merging, as Llama 3 does). `llama-server` started here
tokenizes each string (`/tokenize`, no special tokens, no BOS); ours is `Tokenizer.encode(text,
special=False)`. Strings are seeded and varied: words, numbers of every length, contractions,
punctuation runs, whitespace runs and newlines, accents, CJK, emoji, code. Prints per pre-tokenizer
how many strings gave identical ids, and the first few that did not.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from support.tiny_models import write_tiny_gguf  # noqa: E402

from bench.servers import HOST, exit_on_sigterm, start_llama_server  # noqa: E402
from webapp.engine.model.gguf import read_gguf  # noqa: E402
from webapp.engine.text.tokenizer import Tokenizer  # noqa: E402

PRE_TOKENIZERS = ("smollm", "llama-bpe", "qwen2", "deepseek-r1-qwen", "qwen35")
PIECES = [
    "Hello", "world", "the", "The", "don't", "I'm", "you're", "they've", "she'll", "we'd", "it's", "O'Neil",
    "12", "123", "1234", "12345", "3.14159", "2026-12-01", "1,000,000", "0x1F", "v2.0.1", "42nd",
    "!", "?!", "...", "---", "(", ")", "[x]", "{a: 1}", "<tag>", "&amp;", "@user", "#hash", "$5", "100%",
    " ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n",
    "café", "cafe\u0301", "नमस्ते", "ก้าว", "naïve", "Zürich", "São Paulo", "Ελληνικά", "русский", "日本語", "中文字符", "한국어", "עברית", "العربية",
    "😀", "👍🏽", "🇺🇸", "→", "∑", "€", "™",
    "def f(x):", "    return x * 2", "if (a && b) { c++; }", "SELECT * FROM t;", "https://example.com/a?b=c", "snake_case", "camelCase",
    "ALLCAPS", "MixedCASE words",
]  # fmt: skip


def strings(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = [p for p in PIECES]
    while len(out) < count:
        parts = [rng.choice(PIECES) for _ in range(rng.randint(2, 12))]
        out.append("".join(p if rng.random() < 0.4 else " " + p for p in parts))
    return out[:count]


def llama_tokenize(port: int, text: str) -> list[int]:
    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    try:
        conn.request("POST", "/tokenize", json.dumps({"content": text, "add_special": False}), {"Content-Type": "application/json"})
        return json.loads(conn.getresponse().read())["tokens"]
    finally:
        conn.close()


def main() -> None:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True, metavar="PATH")
    ap.add_argument("--strings", type=int, default=400)
    args = ap.parse_args()
    texts = strings(args.strings)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRE_TOKENIZERS:
            path = write_tiny_gguf(os.path.join(tmp, f"{pre}.gguf"), "llama", n_layers=1, tokenizer_pre=pre)
            ours = Tokenizer.from_gguf_metadata(read_gguf(path)[0])
            with start_llama_server(args.llama_server, path, parallel=1, context=512) as server:
                differing = [t for t in texts if ours.encode(t, special=False) != llama_tokenize(server.port, t)]
            rows.append((pre, len(texts) - len(differing), differing[:3]))
            print(f"  {pre}: {len(texts) - len(differing)} / {len(texts)} identical", file=sys.stderr)
    print(f"\n{len(texts)} strings; ids from our tokenizer and llama-server's /tokenize on the same GGUF\n")
    print("| pre-tokenizer | identical ids | first differing strings |")
    print("|---|---:|---|")
    for pre, same, differing in rows:
        print(f"| {pre} | {same} / {len(texts)} ({100 * same / len(texts):.1f}%) | {'; '.join(repr(d) for d in differing)} |")


if __name__ == "__main__":
    main()
