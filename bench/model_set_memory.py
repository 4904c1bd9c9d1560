"""What a model set holds in memory as models load and unload (LLM_MODELS_DIR, LLM_MEMORY_BUDGET).

Usage: .venv/bin/python bench/model_set_memory.py [--context 1024] [--rounds 3]

Two copies of the default model (real weights) in a temporary folder, served by one model set as
`build_engine` makes it, under a budget that holds one (1.5 times the first model's footprint, set once it has loaded): each step asks one model for a short greedy
answer, which loads it and unloads the other (least recently used). The table gives the process's
resident memory after each step, which models are loaded, and the load's wall time, so an unload
that did not give the memory back shows as growth from round to round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from webapp.engine.decoding.sampling_params import SamplingParams  # noqa: E402
from webapp.engine.serving.loader import build_engine  # noqa: E402
from webapp.engine.serving.request import Finished, Request  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def answer(models, name: str) -> list[int]:
    lease = models.lease(name)
    try:
        engine = lease.engine
        request = Request(engine.tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=8, temperature=0))
        engine.submit(request)
        tokens = []
        while not isinstance(item := request.outputs.get(timeout=120), Finished):
            tokens.append(item)
        return tokens
    finally:
        lease.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="model-set-")
    try:
        for name in ("a", "b"):
            shutil.copyfile(default_model_path(), os.path.join(folder, f"{name}.gguf"))
        size = os.path.getsize(os.path.join(folder, "a.gguf"))
        models = build_engine({"MODELS_DIR": folder, "MAX_CONTEXT": args.context, "SPECULATIVE": False}).start()
        print(f"file {size / 2**20:.1f} MiB, context {args.context}")
        print(f"{'step':>5} {'asked':>5} {'loaded':>7} {'RSS MiB':>8} {'took s':>7}  tokens")
        print(f"{0:>5} {'-':>5} {'-':>7} {rss_mib():8.1f} {'-':>7}")
        first: dict[str, list[int]] = {}
        for step in range(1, 2 * args.rounds + 1):
            name = "ab"[(step - 1) % 2]
            started = time.monotonic()
            tokens = answer(models, name)
            took = time.monotonic() - started
            first.setdefault(name, tokens)
            if models.budget is None:  # room for one model's footprint, not two
                footprint = next(m["memory_bytes"] for m in models.listing() if m["loaded"])
                models.budget = int(footprint * 1.5)
                print(f"{'':>5} LLM_MEMORY_BUDGET {models.budget / 2**20:.1f} MiB (1.5 footprints of {footprint / 2**20:.1f} MiB)")
            loaded = ",".join(m["id"] for m in models.listing() if m["loaded"])
            same = "same as first" if tokens == first[name] else "DIFFERENT"
            print(f"{step:>5} {name:>5} {loaded:>7} {rss_mib():8.1f} {took:7.2f}  {same}")
        models.stop(10)
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
