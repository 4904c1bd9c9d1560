"""Reranking beside llama-server: the same reranker file, the same requests, scores compared and timed.

Usage: .venv/bin/python bench/rerank.py --model RERANKER.gguf --llama-server $BIN/llama-server
           [--queries 6] [--documents 16] [--repeat 2]

RERANKER.gguf is a reranker's file (pooling type rank), e.g. a Qwen3-Reranker-0.6B-shaped one:
`bench/shaped_model.py qwen3-0.6b rr.gguf --type Q8_0 --llama-quantize $BIN/llama-quantize --reranker`.
Each server is started for its turn (ours as `make serve` starts it; `llama-server --reranking -np
8`) and sent the same `POST /v1/rerank` bodies one after the other: `--queries` queries, each with
`--documents` documents of 20 to 200 words, `--repeat` rounds (the first warms). The table gives
each server's documents a second (the median round), the prompt tokens each counted (the same
count means the same prompts), and how far our scores are from llama-server's: the largest and the
median difference (of the scores, and of the yes-no logit gaps they come from), and how often both
put the same document first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servers import exit_on_sigterm, post_json, start_llama_server, start_ours  # noqa: E402

WORDS = (
    "the capital of france is paris a city on the seine river known for art food and its tower "
    "bananas are yellow fruit grown in warm places markets sell them by the bunch every morning "
    "engines burn fuel to turn wheels while batteries store charge for electric motors in cars today "
    "rain falls when clouds grow heavy and cold air meets warm water over the sea in autumn"
).split()


def bodies(queries: int, documents: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS, size=int(rng.integers(low, high))))

    return [{"query": text(5, 12) + "?", "documents": [text(20, 200) for _ in range(documents)]} for _ in range(queries)]


def measure(port: int, requests: list[dict], repeat: int) -> tuple[list[list[float]], int, float]:
    """Each request's scores in document order, the prompt tokens counted, documents a second (median round)."""
    rates = []
    for _ in range(repeat):
        started, answers = time.monotonic(), [post_json(port, "/v1/rerank", body) for body in requests]
        rates.append(sum(len(body["documents"]) for body in requests) / (time.monotonic() - started))
    scores = [[r["relevance_score"] for r in sorted(a["results"], key=lambda r: r["index"])] for a in answers]
    return scores, sum(a["usage"]["prompt_tokens"] for a in answers), statistics.median(rates[1:] or rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--queries", type=int, default=6)
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    exit_on_sigterm()
    requests = bodies(args.queries, args.documents)
    results = {}
    with start_ours(model=args.model, env={"LLM_LOG_LEVEL": "warning"}) as ours:
        results["tinyserve"] = measure(ours.port, requests, args.repeat)
    with start_llama_server(args.llama_server, args.model, parallel=8, context=1024, extra=("--reranking",)) as llama:
        results["llama-server"] = measure(llama.port, requests, args.repeat)
    ours_scores, theirs = (np.array(results[name][0]) for name in ("tinyserve", "llama-server"))
    gaps = np.abs(ours_scores - theirs)
    same_first = int((ours_scores.argmax(axis=1) == theirs.argmax(axis=1)).sum())
    print(f"{os.path.basename(args.model)}: {args.queries} queries x {args.documents} documents, {args.repeat} rounds\n")
    print("| server | documents/s | prompt tokens |\n|---|---|---|")
    for name, (_, tokens, rate) in results.items():
        print(f"| {name} | {rate:.1f} | {tokens} |")
    print(
        f"\nscores: largest difference {gaps.max():.4f}, median {np.median(gaps):.4f}; the same document first in {same_first} of {args.queries}"
    )
    for q in np.flatnonzero(ours_scores.argmax(axis=1) != theirs.argmax(axis=1)):
        a, b = ours_scores[q].argmax(), theirs[q].argmax()
        print(
            f"query {q}: ours first {a} ({ours_scores[q, a]:.4f}, theirs {theirs[q, a]:.4f}), theirs first {b} ({theirs[q, b]:.4f}, ours {ours_scores[q, b]:.4f})"
        )
    print(f"score range: ours {ours_scores.min():.3f}..{ours_scores.max():.3f}, llama-server {theirs.min():.3f}..{theirs.max():.3f}")
    # a two-label score is sigmoid(yes - no): the gap itself says how far apart the two forward passes are
    ours_gap, their_gap = (np.log(p) - np.log1p(-p) for p in (ours_scores, theirs))
    spread = np.abs(ours_gap - their_gap)
    print(
        f"yes-no logit gaps: ours {ours_gap.min():.2f}..{ours_gap.max():.2f}; difference largest {spread.max():.3f}, median {np.median(spread):.3f}"
    )


if __name__ == "__main__":
    main()
