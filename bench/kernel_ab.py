"""Two builds of the C kernels in one process, on a loaded model, alternating: step times and logits.

Usage: DEV=CPU .venv/bin/python bench/kernel_ab.py --before DIR [--model FILE] [--positions 32,700]
           [--lanes 1,2,4,8,9,32] [--batches 1,4,8,16] [--rounds 7] [--isa RUNG] [--before-isa RUNG]

DIR is another checkout (`git worktree add DIR COMMIT`); its `webapp/engine/kernels/c/` is built
beside this checkout's, and each timed step calls `tq_forward` from one library or the other, in
turns. Both builds take one rung of the ISA ladder (--isa, else LLM_CPU_ISA's, else the highest this
CPU runs: the server's), unless --before-isa gives the before build its own: `--before . --before-isa
avx2` compares two rungs of this checkout. The model is loaded once a rung, by this checkout's build of
it (whose `tq_repack` lays out the weights as that rung's products read them), so the before
checkout's kernels must read its rung's layout as this checkout's do. On a shared VM whose speed drifts
by 10-20% between runs, only ratios taken this way, a few milliseconds apart, are worth reading.
Prints, per position: a verification of n lanes of one sequence (a speculative step; 32 lanes: a
prefill piece) and a decode step of B sequences each in its own slot, the median of each build's
times, after/before, the median and range of each round's after/before, and whether both builds
gave the same logits bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from webapp.engine.kernels import abi  # noqa: E402
from webapp.engine.kernels.build import ISA_VARIABLE, SOURCES, compile_library, rung_for  # noqa: E402
from webapp.engine.model.tinygrad_setup import prepare_tinygrad  # noqa: E402
from webapp.engine.serving.loader import load_gguf_model  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402


def forward_of(sources: Path, threads: int, flags: list[str]):
    """tq_forward of the kernels built from the folder `sources` with `flags`, with its own thread pool."""
    lib = ctypes.CDLL(str(compile_library(flags, sources)))
    lib.tq_start(ctypes.c_long(threads), ctypes.c_long(abi.SPIN_US))
    forward = lib.tq_forward
    forward.argtypes, forward.restype = [ctypes.c_void_p] * 5 + [ctypes.POINTER(abi.Step), ctypes.c_void_p], None
    return forward


def timed(run, times: int = 3) -> float:
    run()  # a width's first call sizes its buffers
    started = time.perf_counter()
    for _ in range(times):
        run()
    return (time.perf_counter() - started) / times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="another checkout, whose kernels are the 'before'")
    ap.add_argument("--model", default=None)
    ap.add_argument("--positions", default="32,700")
    ap.add_argument("--lanes", default="1,2,3,4,5,6,7,8,9,32")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--isa", default=os.environ.get(ISA_VARIABLE), help="the ISA rung both builds take (build.py's RUNGS); default: the server's"
    )
    ap.add_argument("--before-isa", default=None, help="the before build's rung, where it differs from --isa's")
    args = ap.parse_args()
    prepare_tinygrad()
    positions, lanes, batches = ([int(x) for x in v.split(",")] for v in (args.positions, args.lanes, args.batches))
    here = Path(__file__).resolve().parent.parent
    rung, flags = rung_for(args.isa)
    before_rung, before_flags = rung_for(args.before_isa) if args.before_isa else (rung, flags)
    for name, (r, f) in {"before": (before_rung, before_flags), "after": (rung, flags)}.items():
        print(f"{name}: the {r.name} rung, {' '.join(f) or 'portable C'}")
    loads = {
        r.name: load_gguf_model(args.model or default_model_path(), max(batches), 4096, 32, cpu_isa=r.name) for r in (before_rung, rung)
    }
    steps_of = {"before": loads[before_rung.name].runner.steps, "after": loads[rung.name].runner.steps}
    for loaded in loads.values():
        loaded.runner.warm_up(lambda _: None)
    if not all(hasattr(steps, "kernels") for steps in steps_of.values()):
        print("this model's steps do not run on the CPU kernels")
        return 1
    threads = steps_of["after"].kernels.threads
    builds = {
        "before": forward_of(Path(args.before) / SOURCES.resolve().relative_to(here), threads, before_flags),
        "after": forward_of(SOURCES, threads, flags),
    }

    def runs_of(steps):
        scratch = steps.model.slots
        return {
            **{("lanes", n): (lambda n=n, pos=0: steps.verify([[0] * n], [scratch], [pos])) for n in lanes},
            **{("batch", b): (lambda b=b, pos=0: steps.decode([0] * b, list(range(b)), [pos] * b)) for b in batches},
        }

    runs = {build: runs_of(steps) for build, steps in steps_of.items()}
    seconds = {(kind, n, pos, build): [] for (kind, n) in runs["after"] for pos in positions for build in builds}
    for round_ in range(args.rounds):
        for pos in positions:
            for kind, n in runs["after"]:
                order = list(builds) if round_ % 2 == 0 else list(builds)[::-1]
                for build in order:
                    run = runs[build][(kind, n)]
                    steps_of[build].kernels._forward = builds[build]  # one kernels object where both take one rung
                    seconds[(kind, n, pos, build)].append(timed(lambda run=run, pos=pos: run(pos=pos)))
    # a prompt prefilled from position 0, which starts a recurrent layer's state afresh too (repeating
    # a verification would not compare like with like: each one moves that state on)
    prompt, logits = [5 + 7 * i % 1000 for i in range(300)], {}
    for build, steps in steps_of.items():
        steps.kernels._forward = builds[build]
        logits[build] = np.array(steps.prefill(prompt, steps.model.slots, 0))
    same = np.array_equal(logits["before"].view(np.uint32), logits["after"].view(np.uint32))
    print(
        f"# {os.path.basename(args.model or default_model_path())}: kernels of {args.before} (before) and this checkout (after), {args.rounds} rounds"
    )
    print(f"same logits, bit for bit (a {len(prompt)}-token prompt's last): {'yes' if same else 'no'}\n")
    print("| step | position | before ms | after ms | after / before | each round's after / before: median (range) |")
    print("|---|---:|---:|---:|---:|---:|")
    for pos in positions:
        for kind, n in runs["after"]:
            before, after = (statistics.median(seconds[(kind, n, pos, build)]) for build in ("before", "after"))
            # a round's two builds ran a few milliseconds apart: their ratio is free of the VM's drift
            ratios = [a / b for b, a in zip(seconds[(kind, n, pos, "before")], seconds[(kind, n, pos, "after")])]
            plural = "s" if n > 1 else ""
            what = f"{n} lane{plural} of one sequence" if kind == "lanes" else f"decode of {n} sequence{plural}"
            spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            print(f"| {what} | {pos} | {before * 1e3:.2f} | {after * 1e3:.2f} | {after / before:.2f} | {spread} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
