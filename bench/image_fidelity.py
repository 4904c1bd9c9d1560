"""Our image rows beside llama.cpp's: the same random-weight projector file in each family's real
shape (F16, or with `--type Q8_0` its layers' and mergers' matrices in Q8_0, as llama.cpp's quantized
projector files), the same pictures at sizes the encoder takes as they are (so neither side
resizes), encoded by `llama-mtmd-cli` (its MTMD_DEBUG_EMBEDDINGS dump of the rows it hands the
language model) and by webapp/engine/vision.

    DEV=CPU .venv/bin/python bench/image_fidelity.py --mtmd-cli $BIN/llama-mtmd-cli [--families gemma3,idefics3,qwen2.5vl,qwen3vl]
        [--rounds 3] [--qwen-layers N] [--type F16|Q8_0]

Shapes: Gemma 3's and SmolVLM's as bench/image_encode.py's SHAPES, at the encoder's own size;
Qwen2.5-VL-3B's and Qwen3-VL-4B's towers and mergers (bench/qwen_projectors.py) `--qwen-layers`
deep, at QWEN[family]'s sizes. Qwen2.5-VL: 8 of 32 layers unless told (the full-attention layer 7
after seven windowed ones); square and not, a grid of whole 4 x 4-token windows and grids whose
last windows are cut short, so a window or a row/column mix-up shows. Qwen3-VL: 18 of 24 layers
unless told (through its last deepstack layer, 17); sides of whole 32-pixel merged tokens within
its 8 to 4,096 tokens (so neither side's smart resize, nor llama.cpp's letterbox, changes them),
square and not, the two orientations, and the learned 48 x 48 position grid's own 768 x 768 beside
smaller grids that resize it. Its rows are the merger's 2,560 values and then each deepstack
layer's (as the dump holds them: llama.cpp hands the language model all of them): the table gives
each image's whole rows, then each part alone.

llama-mtmd-cli needs a language model whose width is the projector's: a one-layer
Qwen3-4B-shaped file for Gemma 3's 2,560, the default model (SmolLM2-135M, 576, SmolVLM-256M's own
text model) for SmolVLM, a one-layer Qwen2.5-VL-3B-shaped one for Qwen2.5-VL, a Qwen3-VL-4B-shaped
one with the tower's count of deepstack layers and one layer more for Qwen3-VL
(bench/shaped_model.py). Prints a table: the image, tokens, cosine similarity per token (the
lowest, where it is, and the median), the largest difference over the largest value, and each
side's encode time on this machine's cores (medians of `--rounds` rounds, llama.cpp then ours in
each) with the median of the rounds' ratios. Ours runs as the server runs it: attention and gelu
on the CPU kernels' cores (kernels/vision_encoder.py), OpenBLAS's threads told to sleep at once
(wsgi.py), in the slices the model thread cuts an encode no request runs beside (vision.py's
ALONE_SLICES).
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
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as wsgi.py sets it for the server

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
from image_encode import SHAPES  # noqa: E402
from qwen_projectors import (  # noqa: E402
    QWEN3VL_SHAPE,
    QWEN25VL_SHAPE,
    qwen3vl_deepstack,
    write_qwen3vl_projector,
    write_qwen25vl_projector,
)
from shaped_model import write_shaped  # noqa: E402
from support.tiny_models import default_model_path  # noqa: E402
from support.tiny_projectors import write_tiny_projector  # noqa: E402

from webapp.engine.kernels.cpu import QuantizedCPU, cpu_threads  # noqa: E402
from webapp.engine.kernels.vision_encoder import VisionEncoderKernels  # noqa: E402
from webapp.engine.vision.projector import load_projector  # noqa: E402
from webapp.engine.vision.siglip import SLICE_FLOPS  # noqa: E402
from webapp.engine.vision.vision import ALONE_SLICES  # noqa: E402


@dataclass(frozen=True)
class QwenTower:
    """A Qwen family's projector here: its writer, depths, pictures and language model."""

    write: Callable[..., str]  # (path, layers, tensor_type=) -> path
    released: int  # the released tower's layers
    layers: int  # the layers written unless --qwen-layers says
    sizes: tuple[tuple[int, int], ...]  # the pictures' (height, width)
    language: str  # bench/shaped_model.py's shape for llama-mtmd-cli


QWEN = {
    # whole 28-pixel merged tokens: 8 x 8 tokens (four whole windows), 9 x 13 and 13 x 9 (windows cut
    # short at the right and the bottom; the two orientations tell rows from columns), 16 x 16 (sixteen windows)
    "qwen2.5vl": QwenTower(
        lambda path, layers, **types: write_qwen25vl_projector(path, layers=layers, **types),
        QWEN25VL_SHAPE["layers"],
        8,
        ((224, 224), (252, 364), (364, 252), (448, 448)),
        "qwen2.5-vl-3b",
    ),
    # whole 32-pixel merged tokens: 8 x 8, 9 x 13 and 13 x 9 (the position grid resized to each, apart
    # along rows and columns), 24 x 24 (the grid as it is)
    "qwen3vl": QwenTower(
        lambda path, layers, **types: write_qwen3vl_projector(path, layers=layers, **types),
        QWEN3VL_SHAPE["layers"],
        18,
        ((256, 256), (288, 416), (416, 288), (768, 768)),
        "qwen3-vl-4b",
    ),
}


def picture(size: int, width: int | None = None) -> np.ndarray:
    """Smooth colour gradients with some noise: a photo's statistics more than random pixels'
    (`size` x `size`, or `size` high and `width` wide)."""
    width = width or size
    y, x = np.mgrid[0:size, 0:width] / max(size, width)
    rgb = np.stack([np.sin(6 * x + 2 * y), np.cos(5 * y - 3 * x), np.sin(4 * (x + y))], axis=-1) * 0.4 + 0.5
    rgb += np.random.default_rng(0).normal(0, 0.05, rgb.shape)
    return (np.clip(rgb, 0, 1) * 255).astype(np.uint8)


def language_model(family: str, folder: str, qwen_layers: int) -> str:
    if family == "idefics3":
        return default_model_path()
    shape = QWEN[family].language if family in QWEN else "qwen3-4b"
    # Qwen3-VL's as wide as the tower's rows, and a layer past the deepstack ones: llama.cpp's last
    # layer keeps only the rows it outputs, to which it cannot add an image's deepstack part (its
    # warm-up asserts)
    deepstack = len(qwen3vl_deepstack(qwen_layers)) if family == "qwen3vl" else None
    layers = 1 + (deepstack or 0)
    path = os.path.join(folder, f"{shape}-{layers}-layer.gguf")
    write_shaped(shape, path, layers, deepstack=deepstack)
    return path


def projector_file(family: str, folder: str, qwen_layers: int, tensor_type: str) -> str:
    path = os.path.join(folder, f"{family}.mmproj.gguf")
    if family in QWEN:
        return QWEN[family].write(path, qwen_layers, tensor_type=tensor_type)
    return write_tiny_projector(path, family, tensor_type=tensor_type, **SHAPES[family])


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
    parser.add_argument("--families", default=",".join([*SHAPES, *QWEN]))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--qwen-layers", type=int, help="a Qwen tower's layers (default: QWEN's; see above)")
    parser.add_argument("--type", default="F16", choices=["F16", "Q8_0"], help="the projector's matrices' type")
    args = parser.parse_args()
    kernels = QuantizedCPU.load()
    print("| family | image | tokens | cosine min (at) | cosine median | max diff / max | llama.cpp encode s | ours s | ours / llama.cpp |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for family in args.families.split(","):
            qwen = QWEN.get(family)
            layers = (args.qwen_layers or qwen.layers) if qwen else 0
            projector_path = projector_file(family, folder, layers, args.type)
            projector = load_projector(projector_path, kernels.library if kernels else None)  # as the server loads it
            projector.encoder.kernels = VisionEncoderKernels(kernels.library) if kernels else None
            projector.encoder.slice_flops = SLICE_FLOPS * ALONE_SLICES  # as the server encodes an image no step waits beside
            model = language_model(family, folder, layers)
            name = f"{family} ({layers} of {qwen.released} layers)" if qwen else family
            for height, width in qwen.sizes if qwen else [(projector.image_size,) * 2]:
                rgb = picture(height, width)
                image = os.path.join(folder, f"{family}.png")
                Image.fromarray(rgb).save(image)
                theirs, ours, their_s, our_s, ratio = compare(args, projector, model, projector_path, image, rgb, folder)
                times = f"{their_s:.2f} | {our_s:.2f} | {ratio:.2f}"
                if theirs.shape != ours.shape:
                    print(f"| {name} | {width}x{height} | ours {ours.shape}, llama.cpp's {theirs.shape} | | | | {times} |")
                    continue
                grid = projector.grid(projector.preprocess(rgb))  # None: rows in a row, no 2-D grid
                print(f"| {name} | {width}x{height} | {len(ours)} | {agreement(ours, theirs, grid)} | {times} |", flush=True)
                parts = parts_of(projector)
                for part, columns in parts.items() if len(parts) > 1 else ():  # a row's parts alone (Qwen3-VL's deepstack)
                    print(f"| | {part} | | {agreement(ours[:, columns], theirs[:, columns], grid)} | | | |", flush=True)


def parts_of(projector) -> dict[str, slice]:
    """An encoded row's columns by what makes them: the merger's, then each deepstack layer's (Qwen3-VL's)."""
    if not projector.deepstack:
        return {"all": slice(None)}
    names = ["merger", *(f"deepstack after layer {i}" for i in sorted(projector.encoder.deepstack))]
    return {name: slice(i * projector.text_dim, (i + 1) * projector.text_dim) for i, name in enumerate(names)}


def agreement(ours: np.ndarray, theirs: np.ndarray, grid: tuple[int, int] | None) -> str:
    """The table's cosine and difference columns for two (tokens, values) arrays."""
    cosine = (ours * theirs).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    off = np.abs(ours - theirs).max() / np.abs(theirs).max()
    worst = int(cosine.argmin())
    at = f"token {worst}" + (f", row {worst // grid[1]} col {worst % grid[1]} of {grid[0]}x{grid[1]}" if grid else "")
    return f"{cosine.min():.5f} ({at}) | {statistics.median(cosine):.5f} | {off:.4f}"


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
