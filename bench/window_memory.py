"""A sliding-window model's KV cache against a full-attention one of the same model: bytes a slot,
and the memory a long prompt really commits, with decode speed at its end.

Usage: DEV=CPU .venv/bin/python bench/window_memory.py MODEL.gguf [--context 8192] [--prompt 8000]
       [--steps 16]

MODEL is a sliding-window file (gemma3; bench/shaped_model.py gemma3-1b writes one in Gemma 3 1B's
shapes). It is loaded twice in one process with one slot of --context positions: as the server
loads it (each local layer's cache a ring, kv_types.cache_positions) and with every ring as long
as the context (a full-attention cache; the window still masks, so both compute the same numbers).
For each: the cache tensors' bytes a slot (every layer's key and value rows, the scratch slot
apart), the resident memory the process gains while --prompt tokens are prefilled into the slot
(fresh cache pages are committed as positions fill), decode tokens/s at that position (median
of --steps steps), and whether both give the same greedy tokens.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from webapp.engine.model.tinygrad_setup import prepare_tinygrad  # noqa: E402

CHUNK = 32  # the server's prefill chunk


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def measure(path: str, context: int, prompt: list[int], steps: int, rings: bool) -> dict:
    from webapp.engine.model import block as block_module
    from webapp.engine.model.steps import steps_for
    from webapp.engine.model.transformer import load_model

    cache_positions = block_module.cache_positions
    if not rings:  # every layer's cache as long as the context: a full-attention cache
        block_module.cache_positions = lambda window, context, step_writes: context
    try:
        model, _ = load_model(path, slots=1, context=context, max_chunk=CHUNK)
    finally:
        block_module.cache_positions = cache_positions
    run = steps_for(model, CHUNK)
    cache = sum(b.cache.nbytes() // (model.slots + 1) for b in model.blocks)
    before = resident_bytes()
    for start in range(0, len(prompt), CHUNK):
        logits = run.prefill(prompt[start : start + CHUNK], 0, start)
    grown = resident_bytes() - before
    tokens, times = [int(np.argmax(logits))], []
    for step in range(steps):
        started = time.perf_counter()
        logits = run.decode([tokens[-1]], [0], [len(prompt) + step])
        times.append(time.perf_counter() - started)
        tokens.append(int(np.argmax(logits[0])))
    del run, model
    return {"cache": cache, "grown": grown, "tok_s": 1 / statistics.median(times), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    prepare_tinygrad()
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, 40000, args.prompt)]
    rows = {"rings": measure(args.model, args.context, prompt, args.steps, True)}
    rows["full"] = measure(args.model, args.context, prompt, args.steps, False)
    mib = 2**20
    print(
        f"{os.path.basename(args.model)}, one slot of {args.context} positions, {args.prompt}-token prompt; {platform.processor() or platform.machine()}"
    )
    print("| cache | bytes a slot | resident growth over the prompt | decode tok/s at its end |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['cache'] / mib:.0f} MiB | {r['grown'] / mib:.0f} MiB | {r['tok_s']:.1f} |")
    ring, full = rows["rings"], rows["full"]
    print(f"rings / full: bytes {ring['cache'] / full['cache']:.3f}, resident growth {ring['grown'] / max(full['grown'], 1):.3f}")
    print(f"same greedy tokens: {ring['tokens'] == full['tokens']}")


if __name__ == "__main__":
    main()
