"""A model's steps compiled for another device and run on none: what tinygrad's NULL device shows.

Usage (the device named before tinygrad is imported; tests/integration/test_device_compile.py sets it up):
    DEV="MOCK+NULL:PTX:sm_90" NULL_ALLOW_COPYOUT=1 python tests/support/device_compile.py FILE.gguf [--widths 1,8,32] [--lora RANK]

Loads FILE on tinygrad's path (no CPU kernels), captures a prefill piece and a decode step of each
width, and prints one JSON object: the bytes the weights take on the device beside those of the
file's tensors they come from, and for each step its kernel count, how many of its kernels multiply on
tensor cores (`mma` in the PTX source each captured kernel carries), how many write float32
activations (a buffer of a row of the model's width a lane), the host's time for it once captured,
whole and without reading its logits back (the device runs nothing, so that time is the host's alone),
and the bytes read back; each decode width again with every lane greedy (its argmax picked in the step).
With `--lora RANK`, a random adapter of that rank on every attention and feed-forward matrix
(bench/lora_file.py) is loaded too, and a prefill piece and each decode width are captured again with every lane adapted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..")]

from tinygrad import dtypes  # noqa: E402
from tinygrad.engine.realize import get_call_arg_uops, get_call_outs_ins  # noqa: E402
from tinygrad.uop.ops import Ops  # noqa: E402

from webapp.engine.model.gguf import read_gguf  # noqa: E402
from webapp.engine.model.lanes import Lane, Want, decode_lanes  # noqa: E402
from webapp.engine.model.steps import steps_for  # noqa: E402
from webapp.engine.model.transformer import load_model  # noqa: E402
from webapp.engine.serving.loader import adapters_for  # noqa: E402

PIECE = 32


def kernel_calls(jit) -> list:
    """A captured jit's kernel calls, those inside its graph batches one by one."""
    calls = []
    for call in jit.captured._linear.src:
        batched = call.src[0].op is Ops.CUSTOM_FUNCTION and call.src[0].arg == "graph"
        calls += list(call.src[0].src[0].src) if batched else [call]
    return calls


def source(call) -> str:
    """A kernel call's rendered source ("" where it holds none: a copy)."""
    program = call.src[0]
    return next((u.arg for u in program.toposort() if u.op is Ops.SOURCE), "") if program.op is Ops.PROGRAM else ""


def float32_rows(calls: list, rows: int, dim: int) -> int:
    """Kernels that write a float32 buffer of `rows` x `dim` values: activations between layers kept in float32."""
    written = 0
    for call in calls:
        args = get_call_arg_uops(call)
        for i in get_call_outs_ins(call)[0]:
            buffer = args[i]  # a view of the step's arena: its size() is its shape
            elements = math.prod(buffer.size()) if callable(buffer.size) else buffer.size
            written += getattr(buffer.dtype, "base", buffer.dtype) == dtypes.float32 and elements == rows * dim
    return written


def captured(run, jit_of, reads, rows: int, dim: int) -> dict:
    """Capture a step (its first calls compile it), then time it on the host: the whole call, and
    its launch alone (the call less the reading back of its outputs, `reads` the StepBuffers)."""
    for _ in range(3):
        run()
    calls = kernel_calls(jit_of())
    whole, launch, spent, read_bytes = [], [], [], []
    reading = reads.read

    def timed_read(output, *args, **kwargs):
        read_bytes.append(output.nbytes())  # a device's read copies the whole output back
        began = time.perf_counter()
        try:
            return reading(output, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - began)

    reads.read = timed_read
    try:
        for _ in range(5):
            spent.clear()
            began = time.perf_counter()
            run()
            whole.append(time.perf_counter() - began)
            launch.append(whole[-1] - sum(spent))
    finally:
        reads.read = reading
    return {
        "kernels": len(calls),
        "tensor_core_kernels": sum("mma" in source(c) for c in calls),
        "float32_activations": float32_rows(calls, rows, dim),
        "host_ms": round(statistics.median(whole) * 1e3, 2),
        "launch_ms": round(statistics.median(launch) * 1e3, 2),
        "read_back_bytes": read_bytes[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--widths", default="1,8,32")
    ap.add_argument("--lora", type=int, default=0, help="an adapter of this rank, and the decode steps with it")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model, _ = load_model(args.file, slots=max(widths), context=256, max_chunk=PIECE, cpu_kernels=False)
    _, table = read_gguf(args.file)
    held = [*model.embed.tensors(), *model.head.tensors()]
    for block in model.blocks:
        held += [*block.mixer.matrix_tensors(), *block.ffn.tensors()]
    names = {"token_embd.weight", "output.weight"} | {n for n in table if n.startswith("blk.") and table[n].rows > 1}
    steps = steps_for(model, PIECE)
    report = {
        "weight_bytes": sum(t.nbytes() for t in held),
        "file_bytes": sum(table[n].nbytes for n in names if n in table),
        "prefill": captured(
            lambda: steps.prefill(list(range(1, PIECE + 1)), slot=0, start=0),
            lambda: steps._prefill_jits[PIECE],
            steps.buffers,
            PIECE,
            model.config.dim,
        ),
        "decode": {},
    }
    for width in widths:
        run = lambda w=width: steps.run(decode_lanes([1] * w, list(range(w)), [PIECE + 1] * w))  # noqa: E731  as the engine calls it
        report["decode"][width] = captured(run, lambda w=width: steps._decode_jits[w], steps.buffers, width, model.config.dim)
    report["decode_picks"] = {}
    for width in widths:  # every lane greedy: each one's argmax picked in the step
        greedy = [replace(x, want=Want.TOKEN) for x in decode_lanes([1] * width, list(range(width)), [PIECE + 1] * width)]
        key = lambda w=width: steps._decode_jits["pick", w]  # noqa: E731
        report["decode_picks"][width] = captured(lambda g=greedy: steps.run(g), key, steps.buffers, width, model.config.dim)
    if args.lora:
        report["lora"] = lora_steps(args.file, args.lora, steps, widths)
    print(json.dumps(report))


def lora_steps(path: str, rank: int, steps, widths: list[int]) -> dict:
    """A prefill piece and each decode width captured again, every lane adapted by a random adapter of `rank`."""
    from bench.lora_file import write_lora

    with tempfile.TemporaryDirectory() as folder:
        write_lora(os.path.join(folder, "adapter.gguf"), path, rank=rank)
        lane = adapters_for(folder, path, steps.model, steps).choose("adapter").lane
    dim = steps.model.config.dim
    out = {
        "decode": {},
        "prefill": captured(
            lambda: steps.run([Lane(0, 0, list(range(1, PIECE + 1)), lora=lane)]),
            lambda: steps._prefill_jits["lora", steps.lora_table.generation, PIECE],
            steps.buffers,
            PIECE,
            dim,
        ),
    }
    for width in widths:
        run = lambda w=width: steps.run([replace(x, lora=lane) for x in decode_lanes([1] * w, list(range(w)), [PIECE + 1] * w)])  # noqa: E731
        key = lambda w=width: steps._decode_jits["lora", steps.lora_table.generation, w]  # noqa: E731
        out["decode"][width] = captured(run, key, steps.buffers, width, dim)
    return out


if __name__ == "__main__":
    main()
