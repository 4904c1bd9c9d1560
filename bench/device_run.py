"""tinygrad's path on a lent GPU in one time-boxed run: the figures #46 asks for, written to a folder.

Usage (on the device machine from the checkout's root; bench/device_run.sh installs what it lacks and
calls this once a device runs):
    python bench/device_run.py OUT [--shape llama3.1-8b] [--types Q4_K_M,F16] [--layers N]
        [--streams 1,8,32,64] [--tokens 64] [--prompt 2000] [--beside 32] [--budget 420]
Dry run on a CPU: DEV=CPU .venv/bin/python bench/device_run.py /tmp/out --layers 1 --streams 1,2 --prompt 64 --beside 2

For each type, a file of the shape (bench/shaped_model.py's `--direct` writer: each matrix's rows
drawn from a pool of random rows, so an 8B file takes seconds, not minutes), then the server's
loader on tinygrad's path (`load_gguf_model`, `cpu_kernels=False`) behind the real engine,
in-process, speculation off:
- seconds to write the file, to load it, to warm up (every kernel compiled), and the device memory
  the load and warm-up took (tinygrad's `GlobalCounters.mem_used`) beside the file's bytes;
- decode tok/s at each stream count: that many greedy requests of distinct 64-token prompts at
  once, `--tokens` each, tokens after each stream's first over the time from the first stream's
  first token to the last one's last;
- time to first token of a `--prompt`-token prompt alone, and again beside `--beside` streams
  that are decoding.
Every figure lands in OUT/device_run.json as it is measured, so a run its time box cuts off keeps
what it had; OUT/device_run.md gets the table at the end. `--budget` seconds in all: a stage that
would start with less than a minute left is skipped and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from webapp.engine.model.tinygrad_setup import prepare_tinygrad, use_tinygrad_from_this_thread  # noqa: E402

prepare_tinygrad()  # before tinygrad's first import

import numpy as np  # noqa: E402
from tinygrad import Device  # noqa: E402
from tinygrad.helpers import GlobalCounters  # noqa: E402

from bench.shaped_model import write_shaped  # noqa: E402
from webapp.engine.decoding.sampling_params import SamplingParams  # noqa: E402
from webapp.engine.serving.engine import Engine  # noqa: E402
from webapp.engine.serving.loader import load_gguf_model  # noqa: E402
from webapp.engine.serving.request import Finished, Request  # noqa: E402

SHORT_PROMPT = 64
CHUNK = 256  # prompt tokens a step: a GPU's steps are cheap beside its launch costs


class Run:
    """The figures so far, saved after each one."""

    def __init__(self, folder: str, budget: float):
        self.folder, self.deadline, self.figures = folder, time.monotonic() + budget, {}
        os.makedirs(folder, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self, key: str, **figures) -> None:
        self.figures.setdefault(key, {}).update(figures)
        print(key, json.dumps(figures), flush=True)
        with open(os.path.join(self.folder, "device_run.json"), "w") as f:
            json.dump({"device": Device.DEFAULT, **self.figures}, f, indent=1)


def stream(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
    """One greedy request: when it was submitted and when each of its tokens came."""
    request = Request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0))
    started, times = time.monotonic(), []
    engine.submit(request)
    while not isinstance(item := request.outputs.get(), Finished):
        if isinstance(item, Exception):
            raise item
        times.append(time.monotonic())
    return started, times


def concurrently(engine: Engine, prompts: list[list[int]], tokens: int) -> list[tuple[float, list[float]]]:
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = stream(engine, prompts[i], tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def decode_rate(results: list[tuple[float, list[float]]]) -> float:
    first, last = min(t[0] for _, t in results), max(t[-1] for _, t in results)
    return sum(len(t) - 1 for _, t in results) / max(last - first, 1e-9)


def measure(run: Run, key: str, path: str, args) -> None:
    slots = max(*args.streams, args.beside + 1)
    context = args.prompt + args.tokens + SHORT_PROMPT
    started, before = time.monotonic(), GlobalCounters.mem_used
    loaded = {}

    def loader():
        use_tinygrad_from_this_thread()  # the file was written on the main thread, with tinygrad's reader
        loaded["model"] = load_gguf_model(path, slots, context, CHUNK, cpu_kernels=False)
        loaded["at"] = time.monotonic()
        return loaded["model"]

    engine = Engine(loader, slots=slots, queue_limit=4 * slots, prefill_chunk=CHUNK, speculate=False).start()
    while engine.state == "loading":
        time.sleep(0.1)
    assert engine.state == "ok", engine.error
    run.save(
        key,
        load_s=round(loaded["at"] - started, 1),
        warm_up_s=round(time.monotonic() - loaded["at"], 1),
        device_mib=round((GlobalCounters.mem_used - before) / 2**20),
        file_mib=round(os.path.getsize(path) / 2**20),
        steps=loaded["model"].runner.steps.how,
    )
    rng = np.random.default_rng(0)
    vocab = engine.tokenizer.vocab_size
    prompt = lambda n: [int(t) for t in rng.integers(100, vocab - 100, size=n)]  # noqa: E731
    try:
        for n in args.streams:
            if run.left() < 60:
                run.save(key, **{f"decode_{n}": "skipped: the time box"})
                continue
            results = concurrently(engine, [prompt(SHORT_PROMPT) for _ in range(n)], args.tokens)
            run.save(key, **{f"decode_tok_s_{n}": round(decode_rate(results), 1)})
        if run.left() > 60:
            submitted, times = stream(engine, prompt(args.prompt), 1)
            run.save(key, **{f"ttft_s_{args.prompt}_alone": round(times[0] - submitted, 3)})
        if run.left() > 60:
            runners = [
                Request(prompt(SHORT_PROMPT), SamplingParams(max_tokens=args.tokens * 8, temperature=0.0)) for _ in range(args.beside)
            ]
            for request in runners:
                engine.submit(request)
            for request in runners:  # every one decoding before the long prompt comes
                item = request.outputs.get()
                assert not isinstance(item, Exception), item
            submitted, times = stream(engine, prompt(args.prompt), 1)
            run.save(key, **{f"ttft_s_{args.prompt}_beside_{args.beside}": round(times[0] - submitted, 3)})
            for request in runners:
                engine.abort(request)
    finally:
        engine.stop(10)


def table(run: Run) -> str:
    keys = sorted({k for figures in run.figures.values() if isinstance(figures, dict) for k in figures})
    lines = [f"device: {Device.DEFAULT}", "", "| figure | " + " | ".join(run.figures) + " |", "|---|" + "---:|" * len(run.figures)]
    lines += [f"| {k} | " + " | ".join(str(f.get(k, "")) for f in run.figures.values()) + " |" for k in keys]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--shape", default="llama3.1-8b")
    parser.add_argument("--types", default="Q4_K_M,F16")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's (a dry run)")
    parser.add_argument("--streams", default="1,8,32,64", type=lambda s: [int(n) for n in s.split(",")])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--beside", type=int, default=32)
    parser.add_argument("--budget", type=float, default=420)
    parser.add_argument("--files", default="/tmp", help="where the model files are written")
    args = parser.parse_args()
    run = Run(args.out, args.budget)
    for mix in args.types.split(","):
        if run.left() < 90:
            run.save(mix, skipped="the time box")
            continue
        path = os.path.join(args.files, f"{args.shape}-{mix}.gguf")
        started = time.monotonic()
        write_shaped(args.shape, path, args.layers, direct=mix)
        run.save(mix, write_s=round(time.monotonic() - started, 1), layers=args.layers or "all")
        try:
            measure(run, mix, path, args)
        finally:
            os.unlink(path)
    with open(os.path.join(args.out, "device_run.md"), "w") as f:
        f.write(table(run))
    print(table(run))


if __name__ == "__main__":
    main()
