"""Our image rows beside llama.cpp's: the same random-weight projector file in each family's real
shape (F16), the same pictures at sizes the encoder takes as they are (so neither side resizes),
encoded by `llama-mtmd-cli` (its MTMD_DEBUG_EMBEDDINGS dump of the rows it hands the language
model) and by webapp/engine/vision.

    DEV=CPU .venv/bin/python bench/image_fidelity.py --mtmd-cli $BIN/llama-mtmd-cli [--families gemma3,idefics3,qwen2.5vl]
        [--rounds 3] [--qwen-layers 8]

Shapes: Gemma 3's and SmolVLM's as bench/image_encode.py's SHAPES, at the encoder's own size;
Qwen2.5-VL-3B's tower and merger (bench/qwen25vl_projector.py) `--qwen-layers` deep (32 is the
released depth; 8 keeps the runs short and still has the full-attention layer 7 after seven
windowed ones) at QWEN_SIZES: square and not, a grid of whole 4 x 4-token windows and grids whose
last windows are cut short, so a window or a row/column mix-up shows. llama-mtmd-cli needs a
language model whose width is the projector's: a one-layer Qwen3-4B-shaped file for Gemma 3's
2,560, the default model (SmolLM2-135M, 576, SmolVLM-256M's own text model) for SmolVLM, a
one-layer Qwen2.5-VL-3B-shaped one (bench/shaped_model.py) for Qwen2.5-VL. Prints a table: the
image, tokens, cosine similarity per token (the lowest, where it is, and the median), the largest
difference over the largest value, and each side's encode time on this machine's cores (medians
of `--rounds` rounds, llama.cpp then ours in each) with the median of the rounds' ratios. Ours
runs as the server runs it: attention and gelu on the CPU kernels' cores
(kernels/vision_encoder.py), OpenBLAS's threads told to sleep at once (wsgi.py).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as wsgi.py sets it for the server

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
from image_encode import SHAPES  # noqa: E402
from qwen25vl_projector import SHAPE as QWEN_SHAPE  # noqa: E402
from qwen25vl_projector import write_qwen25vl_projector  # noqa: E402
from shaped_model import write_shaped  # noqa: E402
from support.tiny_models import default_model_path  # noqa: E402
from support.tiny_projectors import write_tiny_projector  # noqa: E402

from webapp.engine.kernels.cpu import QuantizedCPU, cpu_threads  # noqa: E402
from webapp.engine.kernels.vision_encoder import VisionEncoderKernels  # noqa: E402
from webapp.engine.vision.projector import load_projector  # noqa: E402

# Qwen2.5-VL's pictures (height, width): whole 28-pixel merged tokens, so neither side resizes;
# 8 x 8 tokens (four whole windows), 9 x 13 and 13 x 9 (windows cut short at the right and the
# bottom; the two orientations tell rows from columns), 16 x 16 (sixteen windows)
QWEN_SIZES = ((224, 224), (252, 364), (364, 252), (448, 448))


def picture(size: int, width: int | None = None) -> np.ndarray:
    """Smooth colour gradients with some noise: a photo's statistics more than random pixels'
    (`size` x `size`, or `size` high and `width` wide)."""
    width = width or size
    y, x = np.mgrid[0:size, 0:width] / max(size, width)
    rgb = np.stack([np.sin(6 * x + 2 * y), np.cos(5 * y - 3 * x), np.sin(4 * (x + y))], axis=-1) * 0.4 + 0.5
    rgb += np.random.default_rng(0).normal(0, 0.05, rgb.shape)
    return (np.clip(rgb, 0, 1) * 255).astype(np.uint8)


def language_model(family: str, folder: str) -> str:
    if family == "idefics3":
        return default_model_path()
    shape = "qwen2.5-vl-3b" if family == "qwen2.5vl" else "qwen3-4b"
    path = os.path.join(folder, f"{shape}-1-layer.gguf")
    write_shaped(shape, path, 1)
    return path


def projector_file(family: str, folder: str, qwen_layers: int) -> str:
    path = os.path.join(folder, f"{family}.mmproj.gguf")
    if family == "qwen2.5vl":
        return write_qwen25vl_projector(path, layers=qwen_layers)
    return write_tiny_projector(path, family, tensor_type="F16", **SHAPES[family])


def llama_cpp_rows(cli: str, model: str, projector: str, image: str, dump: str) -> tuple[np.ndarray, float]:
    """The rows llama-mtmd-cli encoded (the last image slice's, MTMD_DEBUG_EMBEDDINGS) and its encode ms."""
    command = [cli, "-m", model, "--mmproj", projector, "--image", image, "-p", "Describe.", "-n", "1", "-t", str(cpu_threads())]
    done = subprocess.run(command, env={**os.environ, "MTMD_DEBUG_EMBEDDINGS": dump}, capture_output=True, text=True, timeout=1800)
    # SmolLM2's vocabulary lacks SmolVLM's <fake_token_around_image>: mtmd asserts when it lays the
    # prompt out, after the first image piece was encoded and dumped, which is all this compares
    if not os.path.exists(dump):
        raise RuntimeError(f"llama-mtmd-cli failed: {done.stderr[-2000:]}")
    times = [float(ms) for ms in re.findall(r"(?:slice|batch) encod\w+ (?:in|done in) (\d+) ms", done.stderr)]
    with open(dump, "rb") as f:
        tokens, width = np.frombuffer(f.read(8), dtype=np.int32)
        rows = np.frombuffer(f.read(), dtype=np.float32).reshape(tokens, width)
    return rows, times[-1] / 1000 if times else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mtmd-cli", required=True, help="llama.cpp's llama-mtmd-cli")
    parser.add_argument("--families", default=",".join([*SHAPES, "qwen2.5vl"]))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--qwen-layers", type=int, default=8, help=f"Qwen2.5-VL's tower layers (released: {QWEN_SHAPE['layers']})")
    args = parser.parse_args()
    kernels = QuantizedCPU.load()
    print("| family | image | tokens | cosine min (at) | cosine median | max diff / max | llama.cpp encode s | ours s | ours / llama.cpp |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for family in args.families.split(","):
            projector_path = projector_file(family, folder, args.qwen_layers)
            projector = load_projector(projector_path)
            projector.encoder.kernels = VisionEncoderKernels(kernels.library) if kernels else None
            model = language_model(family, folder)
            name = f"{family} ({args.qwen_layers} of {QWEN_SHAPE['layers']} layers)" if family == "qwen2.5vl" else family
            for height, width in QWEN_SIZES if family == "qwen2.5vl" else [(projector.image_size,) * 2]:
                rgb = picture(height, width)
                image = os.path.join(folder, f"{family}.png")
                Image.fromarray(rgb).save(image)
                theirs, ours, their_s, our_s, ratio = compare(args, projector, model, projector_path, image, rgb, folder)
                if theirs.shape != ours.shape:
                    print(
                        f"| {name} | {width}x{height} | ours {ours.shape}, llama.cpp's {theirs.shape} | | | | {their_s:.2f} | {our_s:.2f} | {ratio:.2f} |"
                    )
                    continue
                cosine = (ours * theirs).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
                off = np.abs(ours - theirs).max() / np.abs(theirs).max()
                worst = int(cosine.argmin())
                grid = projector.grid(projector.preprocess(rgb))  # None: rows in a row, no 2-D grid
                at = f"token {worst}" + (f", row {worst // grid[1]} col {worst % grid[1]} of {grid[0]}x{grid[1]}" if grid else "")
                print(
                    f"| {name} | {width}x{height} | {len(ours)} | {cosine.min():.5f} ({at}) | {statistics.median(cosine):.5f}"
                    f" | {off:.4f} | {their_s:.2f} | {our_s:.2f} | {ratio:.2f} |",
                    flush=True,
                )


def compare(args, projector, model: str, projector_path: str, image: str, rgb: np.ndarray, folder: str):
    """Both sides' rows for one picture and their encode times: `--rounds` rounds, llama.cpp then ours."""
    theirs_s, ours_s = [], []
    for _ in range(args.rounds):
        dump = os.path.join(folder, "rows.bin")
        if os.path.exists(dump):
            os.unlink(dump)
        theirs, seconds = llama_cpp_rows(args.mtmd_cli, model, projector_path, image, dump)
        theirs_s.append(seconds)
        started = time.perf_counter()
        ours = projector.encode(projector.preprocess(rgb))
        ours_s.append(time.perf_counter() - started)
    ratio = statistics.median(o / t for o, t in zip(ours_s, theirs_s))
    return theirs, ours, statistics.median(theirs_s), statistics.median(ours_s), ratio


if __name__ == "__main__":
    main()
