"""One matrix product per block format on the CPU kernels, at 1 and 8 tokens: time per row and bytes read.

Usage: DEV=CPU .venv/bin/python bench/block_products.py [--rows 23040] [--cols 2880] [--types MXFP4,Q4_0,...] [--repeats 30]

The matrix is random blocks with sane scales (speed depends on the layout, not the numbers), stored as
the server stores it (interleaved in eights where the build has tiles) and multiplied through the
kernels' `tq_linear` on every usable core, as a decode step's products run. The default shape is
gpt-oss-20b's experts: 2880 wide, eight experts' 2880-row matrices one over the other (what a token's
top-4 gate and up read), big enough that the weights come from memory, not cache. The formats are
measured in turns, one call of each per round, so machine load falls on all alike; the table gives
medians, and each format's time against the first one's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from webapp.engine.kernels.abi import Product  # noqa: E402
from webapp.engine.kernels.block_weight import BLOCK_FORMATS  # noqa: E402
from webapp.engine.kernels.cpu import QuantizedCPU  # noqa: E402
from webapp.engine.kernels.ggml_types import GGML_TYPES  # noqa: E402
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread  # noqa: E402

TYPE_IDS = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}
# where each format's scale sits in its block, and how it is written: float16 d, or an E8M0 byte
SCALES = {"Q4_0": (0, "f16"), "Q8_0": (0, "f16"), "IQ4_NL": (0, "f16"), "MXFP4": (0, "e8m0")}


def random_matrix(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) of random blocks of a 32-value format, their scales small and finite."""
    _, values, size = BLOCK_FORMATS[TYPE_IDS[name]]
    blocks = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    at, kind = SCALES[name]
    if kind == "f16":
        d = rng.uniform(0.005, 0.05, size=(rows, cols // values)).astype(np.float16)
        blocks[..., at : at + 2] = d.view(np.uint8).reshape(rows, cols // values, 2)
    else:
        blocks[..., at] = rng.integers(119, 125, size=(rows, cols // values), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8 * 2880)
    ap.add_argument("--cols", type=int, default=2880)
    ap.add_argument("--types", default="MXFP4,Q4_0,IQ4_NL,Q8_0", help=f"formats among {', '.join(SCALES)}; the first is the reference")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    use_tinygrad_from_this_thread()
    kernels = QuantizedCPU.load()
    if kernels is None:
        sys.exit("the CPU kernels are not available here (DEV=CPU, clang)")
    names = [t for t in args.types.split(",") if t]
    rng = np.random.default_rng(0)
    stored = {}
    for name in names:
        raw = random_matrix(name, args.rows, args.cols, rng)
        weight = kernels.block_weight(raw, TYPE_IDS[name], args.cols)
        stored[name] = (np.ascontiguousarray(weight.raw.numpy()), weight.ggml_type, raw.nbytes)
    print(
        f"Machine: {platform.machine()}, {kernels.threads} threads, the {kernels.isa.name.lower()} rung; load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{args.rows} x {args.cols} matrix, medians of {args.repeats} rounds (formats in turns)\n")
    print("| format | tokens | bytes | ms a product | ns a row | GB/s | time vs " + names[0] + " |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for tokens in (1, 8):
        x = rng.standard_normal((tokens, args.cols)).astype(np.float32)
        out = np.empty((tokens, args.rows), np.float32)
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats + 2):  # the first two rounds warm up
            for name in names:
                w, stored_type, _ = stored[name]
                shape = Product(stored_type, args.rows, args.cols, tokens)
                start = time.perf_counter()
                kernels.library.tq_linear(out.ctypes.data_as(ctypes.c_void_p), w.ctypes.data_as(ctypes.c_void_p),
                                          x.ctypes.data_as(ctypes.c_void_p), ctypes.byref(shape))  # fmt: skip
                times[name].append(time.perf_counter() - start)
        medians = {name: float(np.median(t[2:])) for name, t in times.items()}
        for name in names:
            seconds, nbytes = medians[name], stored[name][2]
            row = f"| {name} | {tokens} | {nbytes / 2**20:.1f} MiB | {seconds * 1e3:.2f} | {seconds / args.rows * 1e9:.1f} | {nbytes / seconds / 1e9:.1f}"
            print(row + f" | {seconds / medians[names[0]]:.2f} |")


if __name__ == "__main__":
    main()
