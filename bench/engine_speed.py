"""Single-stream engine speed on the default model, beside llama.cpp on the same GGUF when available.

Usage: DEV=CPU .venv/bin/python bench/engine_speed.py [--model PATH] [--llama-bench PATH] [--rounds R] [--kv-layout slots|pool]

Prints one table: this process's resident memory (RSS) before loading and after warm-up, prefill
tok/s for 50- and 500-token prompts, decode tok/s, time to first token of a 40-token chat prompt,
the per-token decode and sampling time of a request constrained by a JSON schema against a free
one, and batched decode steps at B = 1, 2, 4, 8. llama.cpp runs on the same GGUF in the same run when
one of these is at hand, and a column with our speed as a share of its speed is printed:
  --llama-bench PATH  llama.cpp's `llama-bench` binary (`-p 50,500 -n 64 -t <usable cores> -o json`):
                      the prefill and decode rows, run before our model loads; then, with our model
                      loaded and idle, R more rounds (--rounds, default 3) of those three rows from
                      each side, the order alternating round by round, printed as a second table:
                      each side's median and the median of the rounds' ratios with their range
                      (neighbours in time, so a machine that drifts moves both). A file of more than
                      a third of the memory skips the rounds (both would be held at once).
  llama_cpp           llama-cpp-python (optional, never needed by the tests), in this process: the
                      prefill, decode, start and time-to-first-token rows
Kernels are whatever the server would use: tuned ones when `make tune` has run for this
configuration, else tinygrad's defaults. The KV cache is 8 slots of 4,096 positions, or with
`--kv-layout pool` the paged pool the server takes by default (8 sequences, its auto budget),
without the batched rows (a pool's rows hold no blocks between requests).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.servers import rss_mb, usable_cores  # noqa: E402
from webapp.engine.model.tinygrad_setup import prepare_tinygrad  # noqa: E402

prepare_tinygrad()  # before the model module imports tinygrad, which reads HCQ2 then

from webapp.engine.decoding.sampling import RequestSampler  # noqa: E402
from webapp.engine.decoding.sampling_params import SamplingParams  # noqa: E402
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread  # noqa: E402
from webapp.engine.serving import engine as engine_module  # noqa: E402
from webapp.engine.serving.engine import Engine  # noqa: E402
from webapp.engine.serving.loader import load_gguf_model  # noqa: E402
from webapp.engine.serving.request import Finished, Request  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402

SLOTS, CONTEXT, CHUNK = 8, 4096, 32
RSS_BEFORE, RSS_AFTER = "resident memory before loading (MiB)", "resident memory after warm-up (MiB)"
# rows that are not speeds: no share of llama.cpp's figure is printed for them
NOT_SPEEDS = {"chat prompt tokens", RSS_BEFORE, RSS_AFTER}


def random_prompt(rng, n, vocab):
    return [int(t) for t in rng.integers(100, vocab - 100, size=n)]


# the constrained-decoding row: a list of records, so the output can run long
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            },
        }
    },
    "required": ["people"],
}


def run(engine, prompt, max_tokens, constraint=None, **sampling):
    # a constrained request keeps its stop tokens (the grammar decides when it may end); free ones run to max_tokens
    stops = frozenset(engine.tokenizer.stop_ids) if constraint else frozenset()
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stops, **{"temperature": 0.0, **sampling})
    request = Request(prompt, params, constraint=constraint)
    started = time.monotonic()
    engine.submit(request)
    times = []
    while not isinstance(item := request.outputs.get(), Finished):
        if isinstance(item, Exception):
            raise item
        times.append(time.monotonic())
    return started, times, request


def speed_rows(engine, rng):
    """Our prefill (50- and 500-token prompts, time to the first token) and one-stream decode speeds:
    the rows llama-bench measures too."""
    vocab, out = engine.tokenizer.vocab_size, {}
    for n in (50, 500):
        started, times, _ = run(engine, random_prompt(rng, n, vocab), 1)
        out[f"prefill tok/s ({n}-token prompt)"] = n / (times[0] - started)
    _, times, _ = run(engine, random_prompt(rng, 20, vocab), 65)
    out["decode tok/s (1 stream)"] = (len(times) - 1) / (times[-1] - times[0])
    return out


def alternated_rounds(engine, theirs, rounds):
    """`rounds` rounds of speed_rows and `theirs()` (llama-bench's same rows), ours first in even
    rounds and second in odd ones: per row, each round's (ours, theirs)."""
    rng, pairs = np.random.default_rng(1), {}
    for r in range(rounds):
        if r % 2:
            other = theirs()
            mine = speed_rows(engine, rng)
        else:
            mine = speed_rows(engine, rng)
            other = theirs()
        for name, value in mine.items():
            if name in other:
                pairs.setdefault(name, []).append((value, other[name]))
    return pairs


def ours(path, cpu_kernels=True, pool=False, theirs=None, rounds=0):
    rss_before = rss_mb()
    # no speculation: these rows compare one decode step with llama.cpp's (bench/speculative.py has its own);
    # `pool`: the paged KV cache the server takes by default (LLM_KV_LAYOUT=auto), SLOTS sequences
    paging = (SLOTS, None) if pool else None
    loader = lambda: load_gguf_model(path, SLOTS, CONTEXT, CHUNK, cpu_kernels=cpu_kernels, paging=paging)  # noqa: E731
    engine = Engine(loader, slots=SLOTS, prefill_chunk=CHUNK, speculate=False)
    t0 = time.monotonic()
    engine.start()
    while engine.state == "loading":
        time.sleep(0.2)
    assert engine.state == "ok", engine.error
    ready_s = time.monotonic() - t0
    out = {RSS_BEFORE: rss_before, RSS_AFTER: rss_mb(), "start to ready (s)": ready_s}
    out.update(speed_rows(engine, np.random.default_rng(0)))
    chat = engine.tokenizer.encode(
        engine.chat_template.render([{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}])
    )
    started, times, _ = run(engine, chat, 1)
    out["TTFT, chat prompt (s)"] = times[0] - started
    out["chat prompt tokens"] = len(chat)
    out.update(constrained_rows(engine))
    rounds_pairs = alternated_rounds(engine, theirs, rounds) if theirs and rounds else None

    engine.stop(5)
    if engine.loaded.kv_pool is not None:  # a pool's rows own no blocks between requests: no raw steps on them
        return out, chat, rounds_pairs
    use_tinygrad_from_this_thread()  # the model is ours now, no longer the stopped model thread's
    model_steps = engine.loaded.runner.steps
    for lanes in (1, 2, 4, 8):
        steps = []
        for i in range(8):
            t = time.monotonic()
            model_steps.decode([5] * lanes, list(range(lanes)), [100 + i] * lanes)  # padded as the server pads
            steps.append(time.monotonic() - t)
        out[f"batched decode B={lanes}: tok/s (step ms)"] = (lanes / min(steps), min(steps) * 1000)
    return out, chat, rounds_pairs


class TimedSampler(RequestSampler):
    """The engine's sampler, adding up the time its choices take (mask, penalties, draw)."""

    seconds = 0.0

    def choose(self, logits):
        started = time.perf_counter()
        try:
            return super().choose(logits)
        finally:
            TimedSampler.seconds += time.perf_counter() - started


def constrained_rows(engine):
    """Per generated token after the first: step time and sampling time, free (greedy), drawn at
    temperature 0.7 with top-p 0.9 (seeded), and constrained by SCHEMA."""
    from webapp.engine.decoding.constraints import json_schema_grammar

    prompt = engine.tokenizer.encode(
        engine.chat_template.render([{"role": "user", "content": "List five people with their ages as JSON."}])
    )
    grammar = json_schema_grammar(SCHEMA)
    rows = {}
    engine_module.RequestSampler = TimedSampler  # the engine builds one per admitted request
    try:
        drawn = {"temperature": 0.7, "top_p": 0.9, "seed": 1}
        for name, constraint, sampling in (
            ("free", None, {}),
            ("temperature 0.7, top-p 0.9", None, drawn),
            ("JSON schema", engine.grammars.matcher(grammar), {}),
        ):
            TimedSampler.seconds = 0.0
            _, times, _ = run(engine, prompt, 65, constraint, **sampling)
            per_token = (times[-1] - times[0]) / max(len(times) - 1, 1) * 1000
            rows[f"decode ms/token, {name} ({len(times)} tokens)"] = per_token
            rows[f"sampling ms/token, {name}"] = TimedSampler.seconds / len(times) * 1000
    finally:
        engine_module.RequestSampler = RequestSampler
    return rows


def llama_cpp_rows(path, chat):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    t0 = time.monotonic()
    llm = Llama(model_path=path, n_ctx=CONTEXT, n_threads=usable_cores(), n_batch=512, verbose=False)
    out = {"start to ready (s)": time.monotonic() - t0}
    rng = np.random.default_rng(0)
    vocab = llm.n_vocab()
    for n in (50, 500):
        llm.reset()
        prompt = random_prompt(rng, n, vocab)
        t = time.monotonic()
        llm.eval(prompt)
        out[f"prefill tok/s ({n}-token prompt)"] = n / (time.monotonic() - t)
    llm.reset()
    llm.eval(random_prompt(rng, 20, vocab))
    t = time.monotonic()
    for _ in range(64):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    out["decode tok/s (1 stream)"] = 64 / (time.monotonic() - t)
    llm.reset()
    t = time.monotonic()
    llm.eval(chat)
    int(np.argmax(llm.scores[llm.n_tokens - 1]))
    out["TTFT, chat prompt (s)"] = time.monotonic() - t
    out["chat prompt tokens"] = len(chat)
    return out


def llama_bench_rows(binary, path, repetitions=5):
    """llama-bench's prefill (pp50, pp500) and decode (tg64) speeds on the same file, every usable core
    (each the mean of `repetitions` runs, llama-bench's -r)."""
    argv = [binary, "-m", path, "-p", "50,500", "-n", "64", "-t", str(usable_cores()), "-r", str(repetitions), "-o", "json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}:\n{done.stderr[-2000:]}")
    out = {}
    for test in json.loads(done.stdout):
        if test["n_gen"] == 0:
            out[f"prefill tok/s ({test['n_prompt']}-token prompt)"] = test["avg_ts"]
        elif test["n_prompt"] == 0:
            out["decode tok/s (1 stream)"] = test["avg_ts"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--cpu-kernels", choices=("on", "off"), default="on", help="off: tinygrad's float16 path for every matrix (LLM_CPU_KERNELS=false)"
    )
    ap.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench binary, run on the same GGUF before our rows")
    ap.add_argument("--rounds", type=int, default=3, help="with --llama-bench: alternated rounds of the speed rows, both loaded (0: none)")
    ap.add_argument(
        "--kv-layout",
        choices=("slots", "pool"),
        default="slots",
        help="pool: the paged KV cache (the server's default); no batched rows then",
    )
    args = ap.parse_args()
    path = args.model or default_model_path()
    # llama-bench first: its process has ended before our model loads, so a file of more than half
    # the memory is never held twice (a 17 GiB Qwen3-30B-A3B on this 24 GiB machine was killed)
    theirs = llama_bench_rows(args.llama_bench, path) if args.llama_bench else None
    held_twice_fits = os.path.getsize(path) * 3 < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    in_rounds = (lambda: llama_bench_rows(args.llama_bench, path, repetitions=2)) if args.llama_bench and held_twice_fits else None  # noqa: E731
    mine, chat, rounds_pairs = ours(
        path, cpu_kernels=args.cpu_kernels == "on", pool=args.kv_layout == "pool", theirs=in_rounds, rounds=args.rounds
    )
    if args.llama_bench:
        source = f"llama.cpp = `llama-bench -t {usable_cores()}`"
    else:
        theirs, source = llama_cpp_rows(path, chat), f"llama.cpp = llama-cpp-python in this process, {usable_cores()} threads"
    print(
        f"\nModel: {os.path.basename(path)}; machine: {platform.machine()}, {usable_cores()} usable cores; device {os.environ.get('DEV', 'default')}"
    )
    if theirs:
        print(f"{source}; the last column is our speed as a share of llama.cpp's")
    print("| measure | tinyserve | llama.cpp | tinyserve speed vs llama.cpp |" if theirs else "| measure | tinyserve |")
    print("|---|---:|---:|---:|" if theirs else "|---|---:|")
    for name, value in mine.items():
        shown = f"{value[0]:.1f} ({value[1]:.0f} ms)" if isinstance(value, tuple) else f"{value:.2f}"
        if not theirs:
            print(f"| {name} | {shown} |")
            continue
        other = theirs.get(name)
        ratio = ""
        if other and not isinstance(value, tuple) and name not in NOT_SPEEDS:
            # rows in seconds are better when lower: the ratio is always "how fast are we"
            ratio = f"{(other / value if name.endswith('(s)') else value / other):.0%}"
        print(f"| {name} | {shown} | {'' if other is None else f'{other:.2f}'} | {ratio} |")
    if theirs is None:
        print("\n(no llama.cpp: pass --llama-bench PATH, or `.venv/bin/pip install llama-cpp-python`, a ~10-minute build)")
    if rounds_pairs:
        print_rounds(rounds_pairs)
    elif args.llama_bench and args.rounds and not held_twice_fits:
        print("\n(no alternated rounds: the file is over a third of this machine's memory, and both would hold it)")


def print_rounds(pairs):
    """The alternated rounds' table: each side's median, and the median of each round's ratio with its range."""
    rounds = len(next(iter(pairs.values())))
    print(f"\n{rounds} alternated rounds, both loaded (llama-bench -r 2 a round; ours one request a row):")
    print("| measure | tinyserve, median | llama.cpp, median | ratio, median of rounds (range) | each round's ours / theirs |")
    print("|---|---:|---:|---:|---|")
    for name, values in pairs.items():
        ratios = [mine / theirs for mine, theirs in values]
        mine_median, theirs_median = np.median([m for m, _ in values]), np.median([t for _, t in values])
        each = ", ".join(f"{m:.1f}/{t:.1f}" for m, t in values)
        print(
            f"| {name} | {mine_median:.2f} | {theirs_median:.2f} | {np.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {each} |"
        )


if __name__ == "__main__":
    main()
