"""What LoRA adapters cost a decode step: the same batched step without adapters, with one adapter on
every lane, with two adapters (half the lanes each) and with one on half the lanes beside lanes
without, at each width.

Usage: DEV=CPU .venv/bin/python bench/lora_speed.py [--model GGUF] [--rank 16] [--widths 1,8] [--rounds 7] [--steps 20]

Two random-weight adapters in real shapes (bench/lora_file.py: q, k, v, o, gate, up and down of
every layer, float16) are written for the model (the default one unless --model). The cases run in
turn within each round (`--rounds`), each `--steps` decode steps of `width` lanes (each lane its own
slot, 64 positions in); printed: each case's median milliseconds a step and the median of its
per-round ratio to the step without adapters.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.lora_file import write_lora  # noqa: E402
from bench.servers import usable_cores  # noqa: E402
from webapp.engine.model.tinygrad_setup import prepare_tinygrad  # noqa: E402

prepare_tinygrad()

from webapp.engine.model.lanes import Lane  # noqa: E402
from webapp.engine.serving.loader import load_gguf_model  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402

CONTEXT, CHUNK, PROMPT = 1024, 64, 64


def cases(width: int, first, second) -> dict[str, list]:
    half = width // 2 or 1
    return {
        "no adapter": [None] * width,
        "one adapter, every lane": [first] * width,
        "two adapters, half the lanes each": [first] * half + [second] * (width - half),
        "one adapter, half the lanes": [first] * half + [None] * (width - half),
    }


def step_ms(steps, loras: list, n: int) -> float:
    lanes = [Lane(slot, PROMPT, [11], decoding=True, lora=lora) for slot, lora in enumerate(loras)]
    steps.run(lanes)
    began = time.perf_counter()
    for _ in range(n):
        steps.run(lanes)
    return (time.perf_counter() - began) * 1000 / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: our default model)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    path = args.model or default_model_path()
    widths = [int(w) for w in args.widths.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        for seed, name in enumerate(("first", "second")):
            write_lora(os.path.join(folder, f"{name}.gguf"), path, rank=args.rank, alpha=2.0 * args.rank, seed=seed, dtype=np.float16)
        loaded = load_gguf_model(path, max(widths), CONTEXT, CHUNK, lora_dir=folder)
    steps, adapters = loaded.runner.steps, loaded.adapters
    first, second = adapters.choose("first").lane, adapters.choose("second").lane
    for slot in range(max(widths)):
        steps.run([Lane(slot, 0, [11 + slot] * PROMPT)])
    print(f"\nModel: {os.path.basename(path)}; adapters rank {args.rank}, q k v o gate up down of every layer, float16;")
    print(f"machine: {platform.machine()}, {usable_cores()} usable cores; {args.rounds} rounds of {args.steps} steps a case\n")
    print("| lanes | case | ms a step (median) | x the step without adapters (median of rounds) |")
    print("|---:|---|---:|---:|")
    for width in widths:
        by_case = cases(width, first, second)
        times = {name: [] for name in by_case}
        for _ in range(args.rounds):
            for name, loras in by_case.items():
                times[name].append(step_ms(steps, loras, args.steps))
        for name, ms in times.items():
            ratio = statistics.median(t / base for t, base in zip(ms, times["no adapter"]))
            print(f"| {width} | {name} | {statistics.median(ms):.2f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
