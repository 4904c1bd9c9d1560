"""The paged KV cache against the slots it replaces, on the default model, each configuration in a
process of its own (so resident memory is its own), the two alternating round by round.

Usage: DEV=CPU .venv/bin/python bench/kv_pool.py [--model PATH] [--rounds 2] [--parts shared,capacity,throughput]

Prints one table per part, a column per configuration, and the paged one over the slots where a
ratio means something:
  shared      16 users with the same 2,000-token system prompt (and a question each; 16 tokens out):
              resident memory growth over the warmed-up engine after the first user, after all 16
              (submitted together once the first has finished), and the two's ratio; the prompt
              tokens the later users found cached, and their time to first token (p50).
  capacity    the memory of today's 8 slots x 4,096 float16 positions (32,768 positions): 32 chats of
              ~1,000 prompt tokens and 32 out, submitted at once; the most running at one time,
              preemptions, and the time until all 32 finished.
  throughput  8 streams of 128 tokens after 100-token prompts, no speculation: aggregate decode tok/s
              (first token of the first stream to the last token of the last).
Configurations: "slots" (LLM_KV_LAYOUT=slots: 8 slots of 4,096) and "paged" (a pool: 32,768
positions, LLM_MAX_BATCH 32; 8 for throughput, to run the same lanes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.servers import rss_mb  # noqa: E402

POSITIONS = 8 * 4096  # today's default cache: 8 slots of 4,096 positions
CONFIGS = ("slots", "paged")


def engine_for(layout: str, path: str, rows: int, speculate: bool = True):
    from webapp.engine.serving.engine import Engine
    from webapp.engine.serving.loader import load_gguf_model

    paging = (rows, ("positions", POSITIONS)) if layout == "paged" else None
    engine = Engine(lambda: load_gguf_model(path, 8, 4096, 32, paging=paging), slots=8, prefill_chunk=32, speculate=speculate).start()
    while engine.state == "loading":
        time.sleep(0.2)
    assert engine.state == "ok", engine.error
    return engine


def submit(engine, prompt, max_tokens):
    from webapp.engine.decoding.sampling_params import SamplingParams
    from webapp.engine.serving.request import Request

    request = Request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))
    request.bench_times = []
    engine.submit(request)
    return request


def drain(requests):
    from webapp.engine.serving.request import Finished

    for request in requests:
        while not isinstance(item := request.outputs.get(timeout=600), Finished):
            if isinstance(item, Exception):
                raise item
            request.bench_times.append(time.monotonic())


def tokens(rng, n):
    return [int(t) for t in rng.integers(100, 40000, size=n)]


def shared(layout: str, path: str) -> dict:
    engine = engine_for(layout, path, 32)
    rng = np.random.default_rng(0)
    system = tokens(rng, 2000)
    base = rss_mb()
    first = submit(engine, system + tokens(rng, 20), 16)
    drain([first])
    one = rss_mb()
    started = time.monotonic()
    rest = [submit(engine, system + tokens(rng, 20), 16) for _ in range(15)]
    drain(rest)
    sixteen = rss_mb()
    engine.stop(5)
    return {
        "RSS growth, 1 user (MB)": one - base,
        "RSS growth, 16 users (MB)": sixteen - base,
        "16 users / 1 user": (sixteen - base) / max(one - base, 1e-9),
        "later users' cached prompt tokens (mean)": statistics.mean(r.cached_tokens for r in rest),
        "later users' TTFT p50 (s)": statistics.median(r.bench_times[0] - started for r in rest),
    }


def capacity(layout: str, path: str) -> dict:
    engine = engine_for(layout, path, 32)
    rng = np.random.default_rng(1)
    most, done = 0, threading.Event()

    def watch():
        nonlocal most
        while not done.is_set():
            most = max(most, engine.stats().get("running", 0))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    requests = [submit(engine, tokens(rng, 1000), 32) for _ in range(32)]
    drain(requests)
    elapsed = time.monotonic() - started
    done.set()
    watcher.join()
    pool = engine.stats().get("kv_pool") or {}
    engine.stop(5)
    return {
        "chats finished": sum(len(r.output_ids) == 32 for r in requests),
        "most running at once": most,
        "preemptions": pool.get("preemptions_total", 0),
        "time until all finished (s)": elapsed,
    }


def throughput(layout: str, path: str) -> dict:
    engine = engine_for(layout, path, 8, speculate=False)
    rng = np.random.default_rng(2)
    drain([submit(engine, tokens(rng, 100), 8)])  # every page of the weights mapped in
    requests = [submit(engine, tokens(rng, 100), 128) for _ in range(8)]
    drain(requests)
    engine.stop(5)
    first, last = min(r.bench_times[0] for r in requests), max(r.bench_times[-1] for r in requests)
    generated = sum(len(r.bench_times) - 1 for r in requests)
    return {"aggregate decode tok/s (8 streams)": generated / (last - first)}


PARTS = {"shared": shared, "capacity": capacity, "throughput": throughput}


def child(part: str, layout: str, path: str) -> None:
    from webapp.engine.model.tinygrad_setup import prepare_tinygrad

    prepare_tinygrad()
    print("RESULT " + json.dumps(PARTS[part](layout, path)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--child", nargs=2, metavar=("PART", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    from webapp.engine.serving.settings import default_model_path

    path = args.model or default_model_path()
    if args.child:
        child(*args.child, path)
        return
    env = {**os.environ, "DEV": os.environ.get("DEV", "CPU")}
    for part in args.parts.split(","):
        runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
        for _ in range(args.rounds):
            for layout in CONFIGS:  # alternating: a drift in the machine's speed falls on both
                out = subprocess.run(
                    [sys.executable, __file__, "--model", path, "--child", part, layout],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                runs[layout].append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
        print(f"\n## {part} ({args.rounds} rounds, medians)\n")
        print("| | slots | paged | paged / slots |\n|---|---:|---:|---:|")
        for row in runs["slots"][0]:
            a, b = (statistics.median(r[row] for r in runs[c]) for c in CONFIGS)
            print(f"| {row} | {a:.2f} | {b:.2f} | {b / a if a else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
