"""Encode time per image at each projector family's real shape (random weights, F16 as the released
files are): what an image costs before its prompt is prefilled, and the positions it then takes.

    DEV=CPU .venv/bin/python bench/image_encode.py [--families gemma3,idefics3] [--rounds 3] [--compare-slices] [--compare-kernels]

Shapes: Gemma 3's SigLIP-so400m at 896 pixels (27 layers of 1152, 14-pixel patches: 4096 patches
pooled to 256 rows of the 4B model's 2560) and SmolVLM-256M's SigLIP-base at 512 pixels (12 layers
of 768, 16-pixel patches: 1024 patches shuffled to 64 rows of 576). Prints a table: the file's size,
weights in memory, encode seconds (median of the rounds; in the slices the server cuts while no
request runs beside the encode, ALONE_SLICES of the small ones) and rows per second.
`--compare-slices` times the encoder in the slices the model thread cuts beside other requests'
steps and in those it cuts alone (SiglipEncoder.forward_slices), alternated each round, and prints
the median of the rounds' ratios. The encoder's attention and
gelu run on the CPU kernels' cores as the server runs them (kernels/vision_encoder.py; the table says
where they ran); `--compare-kernels` times the encoder with them and with NumPy's, alternated each
round, and prints the median of the rounds' kernels/NumPy ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as wsgi.py sets it for the server

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from support.tiny_projectors import write_tiny_projector  # noqa: E402

from webapp.engine.kernels.cpu import QuantizedCPU  # noqa: E402
from webapp.engine.kernels.vision_encoder import VisionEncoderKernels  # noqa: E402
from webapp.engine.vision.projector import load_projector  # noqa: E402
from webapp.engine.vision.siglip import SLICE_FLOPS, run_to_end  # noqa: E402
from webapp.engine.vision.vision import ALONE_SLICES  # noqa: E402

SHAPES = {
    "gemma3": dict(text_dim=2560, width=1152, ffn=4304, layers=27, heads=16, image_size=896, patch_size=14),
    "idefics3": dict(text_dim=576, width=768, ffn=3072, layers=12, heads=12, image_size=512, patch_size=16, scale_factor=4),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare-slices", action="store_true")
    parser.add_argument("--compare-kernels", action="store_true")
    args = parser.parse_args()
    kernels = QuantizedCPU.load()
    encoder_kernels = VisionEncoderKernels(kernels.library) if kernels else None
    print("| family | file MiB | in memory MiB | rows | attention, gelu | encode s (median) | rows/s |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for family in args.families.split(","):
            path = write_tiny_projector(os.path.join(folder, f"{family}.mmproj.gguf"), family, tensor_type="F16", **SHAPES[family])
            projector = load_projector(path)
            projector.encoder.kernels = encoder_kernels
            projector.encoder.slice_flops = SLICE_FLOPS * ALONE_SLICES  # as the server encodes an image no step waits beside
            picture = np.random.default_rng(0).integers(0, 256, (768, 1024, 3), dtype=np.uint8)
            pixels = projector.preprocess(picture)
            seconds = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                projector.encode(pixels)
                seconds.append(time.perf_counter() - started)
            median = statistics.median(seconds)
            size = os.path.getsize(path) / 2**20
            rows = projector.tokens_per_image
            where = f"kernels ({kernels.isa.name.lower()}, {kernels.threads} threads)" if encoder_kernels else "NumPy"
            print(f"| {family} | {size:.0f} | {projector.nbytes / 2**20:.0f} | {rows} | {where} | {median:.2f} | {rows / median:.0f} |")
            if args.compare_slices:
                ratios = [sliced_over_whole(projector, pixels) for _ in range(args.rounds)]
                print(
                    f"  {family}: sliced beside steps / alone, median of {len(ratios)} rounds"
                    f" {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
                )

            if args.compare_kernels and encoder_kernels:
                ratios = [kernels_over_numpy(projector, pixels, encoder_kernels) for _ in range(args.rounds)]
                print(
                    f"  {family}: attention and gelu on the kernels / in NumPy, median of {len(ratios)} rounds"
                    f" {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
                )


def kernels_over_numpy(projector, pixels, encoder_kernels) -> float:
    seconds = []
    for where in (encoder_kernels, None):
        projector.encoder.kernels = where
        started = time.perf_counter()
        projector.encode(pixels)
        seconds.append(time.perf_counter() - started)
    projector.encoder.kernels = encoder_kernels
    return seconds[0] / seconds[1]


def sliced_over_whole(projector, pixels) -> float:
    seconds = []
    for slice_flops in (SLICE_FLOPS * ALONE_SLICES, SLICE_FLOPS):  # alone, and beside other requests' steps
        started = time.perf_counter()
        run_to_end(projector.encoder.forward_slices(pixels, slice_flops=slice_flops))
        seconds.append(time.perf_counter() - started)
    return seconds[1] / seconds[0]


if __name__ == "__main__":
    main()
