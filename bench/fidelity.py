"""Fidelity against llama.cpp: how often our top-1 token equals llama.cpp's along its own greedy text.

Usage: DEV=CPU .venv/bin/python bench/fidelity.py --llama-server PATH [--model GGUF] [--tokens 64] [--save FILE]
       DEV=CPU .venv/bin/python bench/fidelity.py --continuations FILE [--model GGUF]

Eight chat prompts (the load benches' first eight questions in the model's chat template, tokenized
by our tokenizer) go to a `llama-server` started here, as token ids to its native `/completion`
endpoint (`return_tokens`, greedy, `n_predict` = --tokens), so both sides see the same prompt
tokens. llama.cpp's continuation is then fed through our model in this process by teacher forcing:
the prompt is prefilled, and each of llama.cpp's tokens is decoded in turn at width 1. At every
position we compare our argmax with llama.cpp's token. If llama.cpp stops early at an end-of-text
token, that token is in its list and is compared too. `--save FILE` keeps the prompts and llama.cpp's
tokens as JSON; `--continuations FILE` replays them without llama.cpp, so a before/after pair of
engines is judged against the very same tokens.

Our side uses only `load_gguf_model(...)` and two calls on its step strategy, `runner.steps`:
`prefill(tokens, slot, start)` (logits (vocab,) of the last token), one prefill chunk at a time, and
`decode(tokens, slots, positions)` (one logits row per lane), with the server's default slots,
context and prefill chunk. Kernels are
compiled on first use with this process's settings (tinygrad's defaults unless BEAM is set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.servers import exit_on_sigterm, llama_completion, start_llama_server, usable_cores  # noqa: E402
from bench.workload import QUESTIONS  # noqa: E402
from webapp.engine.model.tinygrad_setup import prepare_tinygrad  # noqa: E402

prepare_tinygrad()  # before anything imports tinygrad, which reads HCQ2 then

from webapp.engine.model.lanes import Lane  # noqa: E402
from webapp.engine.serving.loader import load_gguf_model  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402

SLOTS, CONTEXT, CHUNK = 8, 4096, 32  # the server's defaults (engine_settings)
PROMPTS = 8
SLOT = 0


def llama_continuation(port: int, prompt: list[int], n: int) -> tuple[list[int], str]:
    """llama.cpp's greedy continuation of `prompt` (token ids) and why it stopped."""
    body = {
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0,
        "top_k": 1,
        "repeat_penalty": 1.0,
        "return_tokens": True,
        "cache_prompt": False,
        "stream": False,
    }
    answer = llama_completion(port, body, timeout=300)
    return [int(t) for t in answer["tokens"]], answer.get("stop_type", "")


def teacher_forced_logits(steps, chunk: int, prompt: list[int], theirs: list[int], lora=None) -> np.ndarray:
    """Prefill `prompt`, then feed `theirs` one token at a time (each lane with `lora`, a LoRA
    adapter's lane value, where given): our logits before each of theirs, (len(theirs), vocab)."""
    for start in range(0, len(prompt), chunk):
        logits = steps.run([Lane(SLOT, start, prompt[start : start + chunk], lora=lora)])[0]  # (vocab,)
    rows = [logits]
    for i, token in enumerate(theirs[:-1]):
        rows.append(steps.run([Lane(SLOT, len(prompt) + i, [token], decoding=True, lora=lora)])[0])
    return np.stack(rows[: len(theirs)]) if theirs else np.empty((0, len(logits)), np.float32)


def teacher_forced_matches(steps, chunk: int, prompt: list[int], theirs: list[int]) -> list[bool]:
    """Whether our argmax equals theirs at each position of `teacher_forced_logits`."""
    picks = teacher_forced_logits(steps, chunk, prompt, theirs).argmax(axis=1)
    return [int(ours) == token for ours, token in zip(picks, theirs, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: our default model)")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary, started here")
    source.add_argument("--continuations", metavar="FILE", help="prompts and llama.cpp tokens saved by --save")
    ap.add_argument("--tokens", type=int, default=64, help="llama.cpp tokens per prompt")
    ap.add_argument("--save", metavar="FILE", help="write the prompts and llama.cpp's tokens here (JSON)")
    ap.add_argument(
        "--cpu-kernels", choices=("on", "off"), default="on", help="off: tinygrad's float16 path for every matrix (LLM_CPU_KERNELS=false)"
    )
    args = ap.parse_args(argv)
    exit_on_sigterm()
    path = args.model or default_model_path()

    started = time.monotonic()
    loaded = load_gguf_model(path, SLOTS, CONTEXT, CHUNK, cpu_kernels=args.cpu_kernels == "on")
    print(f"  our model loaded in {time.monotonic() - started:.1f} s", file=sys.stderr)
    tokenizer, template = loaded.tokenizer, loaded.chat_template
    if args.continuations:
        with open(args.continuations) as f:
            saved = json.load(f)
        if saved["model"] != os.path.basename(path):
            raise SystemExit(f"{args.continuations} holds continuations of {saved['model']}, not of {os.path.basename(path)}")
        prompts, continuations = saved["prompts"], [tuple(c) for c in saved["continuations"]]
        args.tokens = saved["tokens"]
    else:
        prompts = [tokenizer.encode(template.render([{"role": "user", "content": q}])) for q in QUESTIONS[:PROMPTS]]
        with start_llama_server(args.llama_server, path, parallel=1, context=CONTEXT) as server:
            continuations = [llama_continuation(server.port, p, args.tokens) for p in prompts]
        print("  llama.cpp continuations done", file=sys.stderr)
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"model": os.path.basename(path), "tokens": args.tokens, "prompts": prompts, "continuations": continuations}, f)

    steps = loaded.runner.steps
    rows = []
    for i, (prompt, (theirs, stop)) in enumerate(zip(prompts, continuations)):
        matches = teacher_forced_matches(steps, CHUNK, prompt, theirs)
        first_miss = matches.index(False) if False in matches else None
        rows.append((i, len(prompt), len(theirs), stop, sum(matches), first_miss))
        print(f"  prompt {i}: {sum(matches)}/{len(matches)}", file=sys.stderr)

    print(
        f"\nModel: {os.path.basename(path)}; machine: {platform.machine()}, {usable_cores()} usable cores; device {os.environ.get('DEV', 'default')}"
    )
    print(
        f"llama.cpp's greedy continuation ({args.tokens} tokens) teacher-forced through ours; 'same top-1' = positions where our argmax is llama.cpp's token.\n"
    )
    print("| prompt | question | prompt tokens | llama.cpp tokens (stop) | same top-1 | share | first difference at |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for i, n_prompt, n_theirs, stop, same, first_miss in rows:
        print(
            f"| {i} | {QUESTIONS[i]} | {n_prompt} | {n_theirs} ({stop}) | {same} | {same / max(1, n_theirs):.1%} | "
            f"{'' if first_miss is None else first_miss} |"
        )
    same, total = sum(r[4] for r in rows), sum(r[2] for r in rows)
    print(f"| all | | | {total} | {same} | {same / max(1, total):.1%} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
