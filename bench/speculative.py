"""Speculative decoding's speed-up, one stream at a time, with the outputs checked equal.

Usage: DEV=CPU .venv/bin/python bench/speculative.py [--model PATH] [--tokens 128] [--rounds 3]

For each kind of request (a code edit that repeats most of its input, a summary of a text, a JSON
extraction, a free chat answer) and each sampling (greedy; temperature 0.7 seeded), the same request
runs with prompt-lookup drafts and without, alternating A and B `--rounds` times in one engine (the
setting is read per request at admission). Printed per row: decode tok/s of both (median, from the
first token on, so the prompt's prefill is left out), their ratio, drafted tokens, the share of them
confirmed, and whether both runs gave the same tokens (they must: speculation changes no output).
Then 8 streams at once (two of each kind, temperature 0.7, seeded), on and off alternating: the
aggregate tok/s from the first token to the last, the issue's "no lower than without".
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from webapp.engine.model.tinygrad_setup import prepare_tinygrad  # noqa: E402

prepare_tinygrad()

from webapp.engine.model.loader import load_gguf_model  # noqa: E402
from webapp.engine.serving.engine import Engine  # noqa: E402
from webapp.engine.serving.request import Finished, Request, SamplingParams  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402

CODE = open(os.path.join(os.path.dirname(__file__), "..", "webapp", "engine", "serving", "kv_cache.py")).read()[-1400:]
ARTICLE = (
    "The city council met on Tuesday to discuss the new bus routes. Residents of the northern districts "
    "asked for more frequent service in the mornings, while shop owners in the centre worried about "
    "parking. The council agreed to test a route through the market square for three months, starting "
    "in May, and to publish the number of riders every week. A final vote on the routes is planned for "
    "the autumn, after the test ends."
)
KINDS = {
    "code edit": f"Rename the method `acquire` to `take` in this code and show the whole code:\n\n{CODE}",
    "summary": f"Summarize this article in three sentences, reusing its words:\n\n{ARTICLE}",
    "JSON extraction": f"From this article, give JSON with the keys when, who, what and where:\n\n{ARTICLE}",
    "free chat": "Tell me about the history of the bicycle.",
}
SAMPLINGS = {"greedy": dict(temperature=0.0), "temperature 0.7": dict(temperature=0.7, top_p=0.95, seed=1)}


def run(engine: Engine, prompt: list[int], tokens: int, speculate: bool, sampling: dict):
    engine.speculation.enabled = speculate
    request = Request(prompt, SamplingParams(max_tokens=tokens, stop_token_ids=frozenset(engine.tokenizer.stop_ids), **sampling))
    engine.submit(request)
    times = []
    while not isinstance(item := request.outputs.get(), Finished):
        if isinstance(item, Exception):
            raise item
        times.append(time.monotonic())
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    return rate, request


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = args.model or default_model_path()
    engine = Engine(lambda: load_gguf_model(path, 8, 4096, 32), slots=8, prefill_chunk=32).start()
    while engine.state == "loading":
        time.sleep(0.2)
    assert engine.state == "ok", engine.error
    print(f"# speculation on {os.path.basename(path)}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")
    print("| request | sampling | tokens | decode tok/s plain | with drafts | ratio | drafted | confirmed | same output |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, text in KINDS.items():
        prompt = engine.tokenizer.encode(
            engine.chat_template.render([{"role": "user", "content": text}], add_generation_prompt=True), special=True
        )
        for name, sampling in SAMPLINGS.items():
            plain, drafted, same, last = [], [], True, None
            for _ in range(args.rounds):
                rate_a, a = run(engine, prompt, args.tokens, False, sampling)
                rate_b, b = run(engine, prompt, args.tokens, True, sampling)
                plain.append(rate_a)
                drafted.append(rate_b)
                same &= a.output_ids == b.output_ids
                last = b
            p, d = statistics.median(plain), statistics.median(drafted)
            share = last.accepted_tokens / last.drafted_tokens if last.drafted_tokens else 0.0
            print(
                f"| {kind} | {name} | {len(last.output_ids)} | {p:.1f} | {d:.1f} | {d / p:.2f}x | {last.drafted_tokens} | {share:.0%} | {'yes' if same else 'NO'} |"
            )
    print("\n| 8 streams | aggregate tok/s plain | with drafts | ratio | drafted | confirmed | same outputs |")
    print("|---|---|---|---|---|---|---|")
    prompts = [p for p in prompts_of(engine) for _ in range(2)]
    plain, drafted, same = [], [], True
    for _ in range(args.rounds):
        rate_a, a = streams(engine, prompts, args.tokens, False)
        rate_b, b = streams(engine, prompts, args.tokens, True)
        plain.append(rate_a)
        drafted.append(rate_b)
        same &= [r.output_ids for r in a] == [r.output_ids for r in b]
    p, d = statistics.median(plain), statistics.median(drafted)
    n, ok = sum(r.drafted_tokens for r in b), sum(r.accepted_tokens for r in b)
    print(
        f"| 2 of each kind, temperature 0.7 | {p:.1f} | {d:.1f} | {d / p:.2f}x | {n} | {ok / n if n else 0:.0%} | {'yes' if same else 'NO'} |"
    )
    engine.stop(5)
    return 0


def prompts_of(engine) -> list[list[int]]:
    render = engine.chat_template.render
    return [
        engine.tokenizer.encode(render([{"role": "user", "content": t}], add_generation_prompt=True), special=True) for t in KINDS.values()
    ]


def streams(engine: Engine, prompts: list[list[int]], tokens: int, speculate: bool):
    """All prompts at once (seeded, temperature 0.7); aggregate tok/s from the first token to the last."""
    engine.speculation.enabled = speculate
    stops = frozenset(engine.tokenizer.stop_ids)
    requests = [Request(p, SamplingParams(max_tokens=tokens, stop_token_ids=stops, temperature=0.7, seed=i)) for i, p in enumerate(prompts)]
    for request in requests:
        engine.submit(request)
    for request in requests:
        while not isinstance(item := request.outputs.get(), Finished):
            if isinstance(item, Exception):
                raise item
    first = min(r.first_token_at for r in requests)
    last = max(r.last_token_at for r in requests)
    return sum(len(r.output_ids) for r in requests) / (last - first), requests


if __name__ == "__main__":
    sys.exit(main())
