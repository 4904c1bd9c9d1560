"""Continuous batching vs one-at-a-time, and prefix reuse, on the real default model (engine in-process).

Usage: DEV=CPU .venv/bin/python bench/throughput.py [--tokens 128] [--levels 1,2,4,8] [--slots 8] [--repeat 3]

Table 1: for each concurrency C, C streams of --tokens generated tokens each, all submitted at once
(batched), beside the same C streams run strictly one after another (FCFS, one request at a time),
measured in the same run, --repeat times in alternation; the table gives the medians, and each
level's ratios follow it (a shared machine's speed drifts between two measurements a few seconds
apart, which the alternation and the median wash out). Table 2: time to first token of a cold ~1,500-token conversation vs its
follow-up turn, which reuses the cached prefix. Numbers are wall-clock on this machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.workload import QUESTIONS, pct  # noqa: E402
from webapp.engine.decoding.sampling_params import SamplingParams  # noqa: E402
from webapp.engine.serving.loader import build_engine  # noqa: E402
from webapp.engine.serving.request import Finished, Request  # noqa: E402


class Stream:
    def __init__(self, engine, prompt_ids, tokens):
        self.request = Request(prompt_ids, SamplingParams(max_tokens=tokens, temperature=0.0))
        self.times: list[float] = []
        self.engine = engine

    def run(self):
        self.start = time.monotonic()
        self.engine.submit(self.request)
        while not isinstance(item := self.request.outputs.get(), Finished):
            if isinstance(item, Exception):
                raise item
            self.times.append(time.monotonic())
        self.end = time.monotonic()

    @property
    def ttft(self):
        return self.times[0] - self.start

    @property
    def itls(self):
        return [b - a for a, b in zip(self.times, self.times[1:])]


def decoding_seconds(streams: list[Stream]) -> float:
    """Seconds during which at least one stream was between its first and last token."""
    total, end = 0.0, float("-inf")
    for first, last in sorted((s.times[0], s.times[-1]) for s in streams):
        if last > end:
            total += last - max(first, end)
            end = last
    return total


def measure(streams: list[Stream], concurrent: bool) -> dict:
    started = time.monotonic()
    if concurrent:
        threads = [threading.Thread(target=s.run) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for s in streams:
            s.run()
    wall = time.monotonic() - started
    generated = sum(len(s.times) for s in streams)
    return {
        "agg": generated / wall,
        "decode_agg": sum(len(s.times) - 1 for s in streams) / decoding_seconds(streams),
        "per_stream": statistics.mean((len(s.times) - 1) / (s.end - s.times[0]) for s in streams),
        "ttft50": pct([s.ttft for s in streams], 0.5),
        "ttft95": pct([s.ttft for s in streams], 0.95),
        "itl50": pct([x for s in streams for x in s.itls], 0.5),
        "itl95": pct([x for s in streams for x in s.itls], 0.95),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="alternating batched / one-at-a-time measurements per level")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    t0 = time.monotonic()
    engine = build_engine({"SLOTS": args.slots, "MAX_CONTEXT": 4096, "QUEUE_LIMIT": 64}).start()
    while engine.state == "loading":
        time.sleep(0.2)
    assert engine.state == "ok", engine.error
    print(
        f"engine ready in {time.monotonic() - t0:.1f} s ({engine.model_name}, {args.slots} slots, device {os.environ.get('DEV', 'default')})"
    )
    tok, tpl = engine.tokenizer, engine.chat_template

    def prompt(i, salt):
        return tok.encode(tpl.render([{"role": "user", "content": f"({salt}) {QUESTIONS[i % len(QUESTIONS)]}"}]))

    rows = []
    for c in levels:
        pairs = []
        for r in range(args.repeat):
            # distinct salts so no run reuses another's cached prompt beyond the shared system prompt
            batched = measure([Stream(engine, prompt(i, f"b{c}.{r}"), args.tokens) for i in range(c)], concurrent=True)
            alone = measure([Stream(engine, prompt(i, f"a{c}.{r}"), args.tokens) for i in range(c)], concurrent=False)
            pairs.append((batched, alone))
            print(f"  measured concurrency {c} ({r + 1} of {args.repeat})", file=sys.stderr)
        rows.append((c, pairs))

    print(f"\nMachine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}")
    print(
        f"Each stream generates {args.tokens} tokens (greedy, ignore_eos). 'one-at-a-time' = the same streams run FCFS, one request at a time.\n"
    )
    print("'agg' counts every generated token over the whole run's wall time (prefill included); 'decode agg' counts")
    print("tokens after each stream's first over the time any stream was decoding.\n")
    print(
        "| streams | agg tok/s batched | agg tok/s one-at-a-time | ratio | decode agg tok/s batched | decode agg one-at-a-time | ratio "
        "| per-stream tok/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    for c, pairs in rows:
        b = {k: statistics.median(p[0][k] for p in pairs) for k in pairs[0][0]}
        a = {k: statistics.median(p[1][k] for p in pairs) for k in pairs[0][1]}
        ratios[c] = [p[0]["agg"] / p[1]["agg"] for p in pairs]
        decode_ratio = statistics.median(p[0]["decode_agg"] / p[1]["decode_agg"] for p in pairs)
        print(
            f"| {c} | {b['agg']:.1f} | {a['agg']:.1f} | {statistics.median(ratios[c]):.2f}x | {b['decode_agg']:.1f} | {a['decode_agg']:.1f} | "
            f"{decode_ratio:.2f}x | {b['per_stream']:.1f} | "
            f"{b['ttft50']:.2f} / {b['ttft95']:.2f} | {b['itl50'] * 1000:.0f} / {b['itl95'] * 1000:.0f} |"
        )
    print(f"\nMedians of {args.repeat} alternating measurements; each ratio is one batched run over the one-at-a-time run after it.")
    for c, values in ratios.items():
        print(f"  {c} streams, agg ratio of each pair: {', '.join(f'{v:.2f}x' for v in values)}")

    if not args.skip_prefix:
        history = []
        while True:
            history += [
                {"role": "user", "content": "Tell me something about " + QUESTIONS[len(history) // 2 % len(QUESTIONS)]},
                {"role": "assistant", "content": "Here is a long answer. " + " ".join(QUESTIONS) + " That is all I know."},
            ]
            if len(tok.encode(tpl.render(history))) >= 1500:
                break
        cold_msgs = history + [{"role": "user", "content": "Summarise our chat."}]
        cold = Stream(engine, tok.encode(tpl.render(cold_msgs)), 8)
        cold.run()
        reply = tok.decode(cold.request.output_ids)
        follow = Stream(
            engine,
            tok.encode(
                tpl.render(cold_msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks! One more thing?"}])
            ),
            8,
        )
        follow.run()
        print("\n| turn | prompt tokens | reused from cache | TTFT (s) |")
        print("|---|---:|---:|---:|")
        print(f"| cold | {cold.request.prompt_len} | {cold.request.cached_tokens} | {cold.ttft:.2f} |")
        print(f"| follow-up | {follow.request.prompt_len} | {follow.request.cached_tokens} | {follow.ttft:.2f} |")
        print(f"\nfollow-up TTFT = {follow.ttft / cold.ttft:.0%} of cold")
    engine.stop(5)


if __name__ == "__main__":
    main()
