"""The text after an image, ours beside llama.cpp's: Gemma 3's image attended both ways or causally;
Qwen2.5-VL's image and the text after it at their M-RoPE positions.

Usage: DEV=CPU .venv/bin/python bench/image_text_fidelity.py --llama-server $BIN/llama-server
           [--family gemma3|qwen2.5vl] [--layers 4] [--projector-layers N] [--images 6] [--tokens 24]

A language model of the family's real shape (bench/shaped_model.py's `gemma3-4b` or
`qwen2.5-vl-3b`, its first `--layers` layers, random F16 weights) and a projector in its real
shape but `--projector-layers` encoder layers (Gemma 3: bench/image_encode.py's SHAPES, 2 layers
unless told; Qwen2.5-VL: bench/qwen25vl_projector.py, 8 unless told, seven windowed and the full
one its window pattern asks, which our loader wants within the depth; the rows it hands the model
are what matter here). For each of
`--images` pictures (smooth gradients with noise, a seed each; Gemma 3's at the encoder's size,
Qwen2.5-VL's at QWEN_SIZES in turn: square and not, wide and tall, all whole merged tokens, so
neither side resizes), llama-server with `--mmproj` continues "Describe this image.\\n<image>\\n"
greedily for `--tokens` tokens (`/completion` with `multimodal_data`). Ours, through the server's
own loader (the picture decoded, encoded on the CPU kernels, its rows in place of placeholders), is
teacher-forced on llama.cpp's tokens: for Gemma 3 twice, the image's positions attending each
other both ways (as the server runs Gemma 3) and causally (as it did before); for Qwen2.5-VL once,
as the server runs it. Each is judged at every position of the continuation against llama.cpp's
token and against a float64 forward pass of the same file given our rows
(tests/support/tiny_models.Reference; for Qwen2.5-VL at M-RoPE positions laid out here, by
`mtmd_places`); "decided" positions are those where float64's top-two gap is at least 0.1 of its
logits' spread (bench/float64_triangle.py).

Qwen2.5-VL's table is the check of the M-RoPE positions. Ours runs as the server runs it, its
positions from Vision.rope_positions; the float64 pass takes them from `mtmd_places`, written
from llama.cpp's mtmd (the image's token (r, c) at (start, start + r, start + c), the text after it
from start + max(rows, cols) on), and each image's line says whether the two agree. Two float64
controls show what a position mistake costs: the same pass with every token at its plain 1-D
position, and with the image's rows and columns swapped (their rows in the table: how often their
top-1 is still llama.cpp's token, and the right float64's). Each image's line also gives ours'
largest logit error against float64 (over the logits' spread) in the text before the image, on
the image, and after it (the continuation included); the table the largest over the images, on the
image and after it, for ours and the controls alike (the scale a position mistake shows at).

The prompt's text is tokenized by llama-server (`/tokenize`), as mtmd cuts it: the text before the
image with the family's opening string (`<start_of_image>`, `<|vision_start|>`; BOS first where the
file adds one), then the closing one (`<end_of_image>`, `<|vision_end|>`) with the text after it.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
from image_encode import SHAPES  # noqa: E402
from image_fidelity import picture  # noqa: E402
from qwen25vl_projector import write_qwen25vl_projector  # noqa: E402
from shaped_model import write_shaped  # noqa: E402
from support.tiny_models import Reference  # noqa: E402
from support.tiny_projectors import write_tiny_projector  # noqa: E402

from bench.servers import exit_on_sigterm, llama_completion, post_json, start_llama_server  # noqa: E402
from webapp.engine.model.lanes import Lane, Want  # noqa: E402
from webapp.engine.serving.loader import load_gguf_model  # noqa: E402
from webapp.engine.vision.vision import ImageSpan  # noqa: E402

BEFORE, AFTER = "Describe this image.\n", "\n"
MARKER = "<__media__>"  # where the image goes in llama-server's prompt (pinned: it draws a random one otherwise)
DECIDED = 0.1  # float64's top-two gap over its logits' standard deviation
# Qwen2.5-VL's pictures (height, width), in turn: 8 x 8 merged tokens, 9 x 13 and 13 x 9, 7 x 15 and
# 15 x 7 (max(rows, cols), where the text after the image goes on, from both sides), 10 x 10
QWEN_SIZES = ((224, 224), (252, 364), (364, 252), (196, 420), (420, 196), (280, 280))


@dataclass(frozen=True)
class Family:
    shape: str  # bench/shaped_model.py's language model
    write_projector: Callable[[str, int], str]  # (path, encoder layers) -> path
    projector_layers: int  # the encoder's depth unless --projector-layers says
    sizes: tuple[tuple[int, int], ...] | None  # the pictures' (height, width) in turn; None: the encoder's square
    ways: tuple[bool, ...]  # ours runs the image attended both ways (True), causally (False)


FAMILIES = {
    "gemma3": Family(
        "gemma3-4b",
        lambda path, layers: write_tiny_projector(path, "gemma3", tensor_type="F16", **{**SHAPES["gemma3"], "layers": layers}),
        2,
        None,
        (True, False),
    ),
    "qwen2.5vl": Family("qwen2.5-vl-3b", lambda path, layers: write_qwen25vl_projector(path, layers=layers), 8, QWEN_SIZES, (False,)),
}


def mtmd_places(before: int, grid: tuple[int, int], after: int) -> np.ndarray:
    """(3, T) M-RoPE positions (time, row, column) of `before` text tokens, an image of `grid`
    (rows, cols) tokens and `after` text tokens, as llama.cpp's mtmd lays them out."""
    rows, cols = grid
    r, c = np.divmod(np.arange(rows * cols), cols)
    image = np.stack([np.full(rows * cols, before), before + r, before + c])
    text = lambda first, n: np.tile(np.arange(first, first + n), (3, 1))  # noqa: E731
    return np.concatenate([text(0, before), image, text(before + max(rows, cols), after)], axis=1)


def noisy_picture(height: int, width: int, seed: int) -> np.ndarray:
    """image_fidelity.py's gradients, shifted and noised by `seed`: each picture its own rows."""
    rng = np.random.default_rng(seed)
    rgb = np.roll(picture(height, width), rng.integers(0, (height, width)), axis=(0, 1)).astype(np.int16)
    return np.clip(rgb + rng.integers(-40, 40, rgb.shape), 0, 255).astype(np.uint8)


def png(rgb: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def llama_tokens(port: int, text: str, first: bool) -> list[int]:
    answer = post_json(port, "/tokenize", {"content": text, "add_special": first, "parse_special": True})
    return [int(t) for t in answer["tokens"]]


def llama_continuation(port: int, image: bytes, n: int) -> list[int]:
    body = {
        "prompt": {"prompt_string": f"{BEFORE}{MARKER}{AFTER}", "multimodal_data": [base64.b64encode(image).decode()]},
        "n_predict": n, "temperature": 0, "top_k": 1, "repeat_penalty": 1.0, "return_tokens": True, "cache_prompt": False,
    }  # fmt: skip
    return [int(t) for t in llama_completion(port, body)["tokens"]]


def ours(steps, tokens: list[int], at: int, rows: np.ndarray, both_ways: bool, positions: np.ndarray | None) -> np.ndarray:
    """Our logits at every position of `tokens` in one chunk (the image whole in it), turned by
    `positions` (3, len(tokens)) where given."""
    lane = Lane(0, 0, tokens, Want.ALL, inputs=((at, rows),), inputs_both_ways=both_ways, rope_positions=positions)
    return steps.run([lane])[0]


def largest_error(ours_logits: np.ndarray, exact: np.ndarray) -> float:
    """The largest difference between our logits and float64's, over each row's spread."""
    return float((np.abs(ours_logits - exact).max(-1) / exact.std(-1)).max()) if len(exact) else float("nan")


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gemma3")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--projector-layers", type=int, help="the encoder's layers (default: the family's, see above)")
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    os.environ["LLAMA_MEDIA_MARKER"] = MARKER
    family, qwen = FAMILIES[args.family], args.family == "qwen2.5vl"
    with tempfile.TemporaryDirectory() as folder:
        model_path, projector_path = os.path.join(folder, f"{family.shape}.gguf"), os.path.join(folder, f"{args.family}.mmproj.gguf")
        write_shaped(family.shape, model_path, args.layers)
        family.write_projector(projector_path, args.projector_layers or family.projector_layers)
        loaded = load_gguf_model(model_path, 1, 2048, 32, mmproj=projector_path)
        steps, vision, reference = loaded.runner.steps, loaded.vision, Reference(model_path)
        # a row of the table -> per image, (agrees with llama.cpp, with float64, decided) at each position of the
        # continuation and the largest logit errors against float64 on the image and after it: ours as run each
        # way, then (Qwen2.5-VL) float64's controls at wrong positions
        figures = {label(family, way): [] for way in family.ways}
        llama_f64 = []  # llama.cpp's token is float64's top-1, per position
        with start_llama_server(args.llama_server, model_path, parallel=1, context=2048, extra=("--mmproj", projector_path)) as server:
            for seed in range(args.images):
                height, width = family.sizes[seed % len(family.sizes)] if family.sizes else (vision.projector.image_size,) * 2
                image = png(noisy_picture(height, width, seed))
                theirs = llama_continuation(server.port, image, args.tokens)
                (piece,) = vision.prepare(image)
                before = llama_tokens(server.port, BEFORE + piece.before, True)
                after = llama_tokens(server.port, piece.after + AFTER, False)
                rows = vision.rows(piece)
                prompt = before + [vision.placeholder(piece)] * len(rows) + after
                tokens, start, image_end = prompt + theirs[:-1], len(before), len(before) + len(rows)
                inputs = {start + i: row.astype(np.float64) for i, row in enumerate(rows)}
                positions, notes, runs = None, [], []
                controls = {}  # a control's name -> its logits at every position
                if qwen:
                    places = mtmd_places(start, piece.grid, len(tokens) - image_end)
                    positions = vision.rope_positions((ImageSpan(start, piece),), 0, len(tokens))  # as the server's runner asks
                    notes.append(compare_positions(positions, places))
                    everywhere = reference.logits(tokens, inputs, turned=places)
                    for name, wrong in (("1-D positions", None), ("rows and columns swapped", places[[0, 2, 1]])):
                        controls[name] = reference.logits(tokens, inputs, turned=wrong)
                else:
                    everywhere = reference.logits(tokens, inputs, both_ways=((start, image_end),))
                exact = everywhere[len(prompt) - 1 :]
                top2 = np.sort(exact, axis=-1)[:, -2:]
                gap = (top2[:, 1] - top2[:, 0]) / exact.std(-1)  # float64's top-two gap over its logits' spread
                decided, theirs_array = gap >= DECIDED, np.array(theirs)
                llama_f64.append(theirs_array == exact.argmax(-1))
                for both_ways in family.ways:
                    logits = ours(steps, tokens, start, rows, both_ways, positions)
                    picks = logits[len(prompt) - 1 :].argmax(-1)
                    errors = [largest_error(logits[a:b], everywhere[a:b]) for a, b in ((0, start), (start, image_end), (image_end, None))]
                    figures[label(family, both_ways)].append((picks == theirs_array, picks == exact.argmax(-1), decided, errors[1:]))
                    runs.append(describe(label(family, both_ways), picks, theirs, exact.argmax(-1), gap, errors))
                for name, logits in controls.items():
                    picks = logits[len(prompt) - 1 :].argmax(-1)
                    errors = [largest_error(logits[a:b], everywhere[a:b]) for a, b in ((start, image_end), (image_end, None))]
                    row = (picks == theirs_array, picks == exact.argmax(-1), decided, errors)
                    figures.setdefault(f"control: float64 with {name}", []).append(row)
                grid = f"{piece.grid[0]} x {piece.grid[1]} tokens" if piece.grid else f"{len(rows)} tokens"
                print(f"image {seed} ({width}x{height}, {grid}): {len(prompt)} prompt tokens; " + "; ".join(runs + notes), flush=True)
    print_table(figures, llama_f64, qwen)


def compare_positions(ours_positions: np.ndarray | None, places: np.ndarray) -> str:
    """Whether the server's M-RoPE positions are mtmd's, and where they part if not."""
    if ours_positions is None:
        return "the server gives no M-RoPE positions (each token its own)"
    apart = np.flatnonzero((ours_positions != places).any(0))
    if not len(apart):
        return "positions = mtmd's"
    first = apart[0]
    return (
        f"positions differ from mtmd's at {len(apart)} tokens, first at {first}: ours {ours_positions[:, first]}, mtmd's {places[:, first]}"
    )


def label(family: Family, both_ways: bool) -> str:
    """Ours' row in the table: the image attended both ways or causally (one way only: "ours")."""
    return "ours" if len(family.ways) == 1 else "both ways" if both_ways else "causal"


def describe(name: str, picks: np.ndarray, theirs: list[int], exact: np.ndarray, gap: np.ndarray, errors: list[float]) -> str:
    """One run of ours on one image: where its tokens and llama.cpp's part (with float64's pick and
    its top-two gap there), and its largest logit errors against float64."""
    apart = np.flatnonzero(picks != np.array(theirs))
    text = f"{name}: = llama.cpp's at {len(theirs) - len(apart)} / {len(theirs)}"
    for at in apart:
        text += (
            f" (token {at}: ours {picks[at]}, llama.cpp's {theirs[at]}, float64's {exact[at]}, its top-two gap {gap[at]:.3f} of its spread)"
        )
    return text + ", logit error / spread before the image {:.4f}, on it {:.4f}, after it {:.4f}".format(*errors)


def print_table(figures: dict, llama_f64: list, qwen: bool) -> None:
    first = "run (ours: M-RoPE positions, image causal)" if qwen else "image attention (ours)"
    head = f"| {first} | top-1 = llama.cpp's | where float64 decides | top-1 = float64's | llama.cpp = float64's |"
    print(head + " logit error / spread on the image, after it (largest) |\n" + "|---" * 6 + "|")
    agreed = np.concatenate(llama_f64)
    for name, rows in figures.items():  # ours, then float64 at wrong positions: what a mistake there would cost
        with_llama, with_f64, decided, errors = zip(*rows, strict=True)
        with_llama, with_f64, decided = (np.concatenate(column) for column in (with_llama, with_f64, decided))
        errors = np.max(errors, axis=0)  # over the images
        both = "" if name.startswith("control") else f"{agreed.mean():.1%} ({agreed.sum()} / {len(agreed)})"
        print(
            f"| {name} | {with_llama.mean():.1%} ({with_llama.sum()} / {len(with_llama)})"
            f" | {with_llama[decided].mean():.1%} ({with_llama[decided].sum()} / {decided.sum()})"
            f" | {with_f64.mean():.1%} ({with_f64.sum()} / {len(with_f64)}) | {both} | {errors[0]:.4f}, {errors[1]:.4f} |"
        )


if __name__ == "__main__":
    main()
