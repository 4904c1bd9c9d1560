"""LoRA fidelity against llama.cpp: how often our top-1 token, with an adapter, equals `llama-server --lora`'s
along its own greedy text.

Usage: DEV=CPU .venv/bin/python bench/lora_fidelity.py --llama-server PATH [--model GGUF] [--rank 16] [--alpha 32]
       [--size 0.05] [--tokens 64] [--prompts 8] [--tinygrad]

A random-weight adapter in real shapes (bench/lora_file.py: q, k, v, o, gate, up and down of every
layer, float16 as `convert_lora_to_gguf.py` writes them) is written for the model (the default one
unless --model). `llama-server --lora` continues eight chat prompts greedily (token ids to its
`/completion`, as bench/fidelity.py does), and its tokens are teacher-forced through our model with
the adapter on the lanes (prefill chunks, then one decode lane a token). Printed: the share of
positions where our argmax is llama.cpp's token, with the adapter (and among the positions our top two
are decided apart); to show the adapter matters, the share where our model without it gives
llama.cpp's adapted token; and, to show how far rounding alone moves the adapted model, the share
where ours with the adapter's scale nudged by 0.1% keeps its own top-1.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.fidelity import CHUNK, CONTEXT, SLOTS, llama_continuation, teacher_forced_logits  # noqa: E402
from bench.lora_file import write_lora  # noqa: E402
from bench.servers import exit_on_sigterm, start_llama_server, usable_cores  # noqa: E402
from bench.workload import QUESTIONS  # noqa: E402
from webapp.engine.model.tinygrad_setup import prepare_tinygrad  # noqa: E402

prepare_tinygrad()

from webapp.engine.serving.loader import load_gguf_model  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402

DECIDED = 0.5  # a top-two gap (logits) past any rounding between two float16 adapters' products
SCALE_NUDGE = 1e-3  # how sensitive the adapted model is: its own top-1s with the scale nudged this much


def picks_and_gaps(steps, prompt: list[int], theirs: list[int], lora) -> list[tuple[int, float]]:
    """At each position of `theirs`, teacher-forced with the adapter `lora` (a lane's, or None): our
    top-1 and the gap between our top two logits."""
    logits = teacher_forced_logits(steps, CHUNK, prompt, theirs, lora).astype(np.float64)
    top_two = np.sort(np.partition(logits, -2, axis=1)[:, -2:], axis=1)
    return [(int(p), float(gap)) for p, gap in zip(logits.argmax(axis=1), top_two[:, 1] - top_two[:, 0])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", metavar="PATH", required=True)
    ap.add_argument("--model", help="GGUF file (default: our default model)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--size", type=float, default=0.05, help="the adapter's values: normal times this")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tinygrad", action="store_true", help="our model on tinygrad's path (LLM_CPU_KERNELS=false), not the CPU kernels")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    path = args.model or default_model_path()
    with tempfile.TemporaryDirectory() as folder:
        adapter = write_lora(os.path.join(folder, "adapter.gguf"), path, rank=args.rank, alpha=args.alpha, size=args.size, dtype=np.float16)
        loaded = load_gguf_model(path, SLOTS, CONTEXT, CHUNK, lora_dir=folder, cpu_kernels=not args.tinygrad)
        prompts = [
            loaded.tokenizer.encode(loaded.chat_template.render([{"role": "user", "content": q}])) for q in QUESTIONS[: args.prompts]
        ]
        with start_llama_server(args.llama_server, path, parallel=1, context=CONTEXT, extra=("--lora", adapter)) as server:
            continuations = [llama_continuation(server.port, p, args.tokens)[0] for p in prompts]
    steps, (index, scale) = loaded.runner.steps, loaded.adapters.choose("adapter").lane
    totals = np.zeros(6, np.int64)
    print(f"\nModel: {os.path.basename(path)}; adapter rank {args.rank}, alpha {args.alpha:g}, values N(0, {args.size:g}), float16;")
    print(
        f"steps: {steps.how}; machine: {platform.machine()}, {usable_cores()} usable cores; decided: our top-two gap >= {DECIDED} logits\n"
    )
    print(
        "| prompt | llama.cpp tokens | same top-1 with the adapter | decided | same where decided "
        "| our top-1 without the adapter | ours at scale x1.001, same as ours |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for i, (prompt, theirs) in enumerate(zip(prompts, continuations)):
        adapted = picks_and_gaps(steps, prompt, theirs, (index, scale))
        base = picks_and_gaps(steps, prompt, theirs, None)
        nudged = picks_and_gaps(steps, prompt, theirs, (index, scale * (1 + SCALE_NUDGE)))
        counts = np.array(
            [
                len(theirs),
                sum(ours == t for (ours, _), t in zip(adapted, theirs)),
                sum(gap >= DECIDED for _, gap in adapted),
                sum(ours == t for (ours, gap), t in zip(adapted, theirs) if gap >= DECIDED),
                sum(ours == t for (ours, _), t in zip(base, theirs)),
                sum(a == b for (a, _), (b, _) in zip(adapted, nudged)),
            ]
        )
        totals += counts
        print(_row(str(i), counts))
    print(_row("all", totals))
    return 0


def _row(label: str, counts) -> str:
    n, same, decided, same_decided, base, nudged = (int(c) for c in counts)
    share = lambda k, of: f"{k} ({k / max(1, of):.1%})"  # noqa: E731
    return f"| {label} | {n} | {share(same, n)} | {decided} | {share(same_decided, decided)} | {share(base, n)} | {share(nudged, n)} |"


if __name__ == "__main__":
    sys.exit(main())
