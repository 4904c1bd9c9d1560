"""The text after an image, ours beside llama.cpp's: Gemma 3's image attended both ways or causally;
Qwen2.5-VL's and Qwen3-VL's image and the text after it at their M-RoPE positions (Qwen3-VL's
interleaved, its first layers adding the image's deepstack features); SmolVLM's tiles and overview.

Usage: DEV=CPU .venv/bin/python bench/image_text_fidelity.py --llama-server $BIN/llama-server
           [--family gemma3|idefics3|qwen2.5vl|qwen3vl] [--layers 4] [--projector-layers N] [--images 6] [--tokens 24]

A language model of the family's real shape (bench/shaped_model.py's `gemma3-4b`, `smolvlm-256m`,
`qwen2.5-vl-3b` or `qwen3-vl-4b`, its first `--layers` layers, random F16 weights) and a projector
in its real shape but `--projector-layers` encoder layers (Gemma 3: bench/image_encode.py's
SHAPES, 2 layers unless told; SmolVLM: its SHAPES, all 12 unless told, its longest edge
SMOLVLM_EDGE, 3 tiles where SmolVLM's own files say 4: the language model's vocabulary has row and
column markers for 3 x 3 tiles at most; Qwen2.5-VL: bench/qwen_projectors.py's, 8 unless told,
seven windowed and the full one its window pattern asks, which our loader wants within the depth; Qwen3-VL: its, 18 of 24
unless told, through the last of its three deepstack layers, the language model written with as
many deepstack layers as the tower keeps; the rows it hands the model are what matter here). For
each of `--images` pictures (smooth gradients with noise, a seed each; Gemma 3's at the encoder's
size, the Qwens' at their SIZES in turn: square and not, wide and tall, all whole merged tokens,
so neither side resizes; SmolVLM's at IDEFICS3_SIZES in turn, whole tiles of its longest edge but
the last), llama-server with `--mmproj` continues "Describe this image.\\n<image>\\n"
greedily for `--tokens` tokens (`/completion` with `multimodal_data`). Ours, through the server's
own loader (the picture decoded, encoded on the CPU kernels, its rows in place of placeholders), is
teacher-forced on llama.cpp's tokens: for Gemma 3 twice, the image's positions attending each
other both ways (as the server runs Gemma 3) and causally (as it did before); for the others once,
as the server runs them. Each is judged at every position of the continuation against llama.cpp's
token and against a float64 forward pass of the same file given our rows
(tests/support/tiny_models.Reference; for the Qwens at M-RoPE positions laid out here, by
`mtmd_places`); "decided" positions are those where float64's top-two gap is at least 0.1 of its
logits' spread (bench/float64_triangle.py).

The Qwens' tables are the check of the M-RoPE positions. Ours runs as the server runs it, its
positions from Vision.rope_positions; the float64 pass takes them from `mtmd_places`, written
from llama.cpp's mtmd (the image's token (r, c) at (start, start + r, start + c), the text after it
from start + max(rows, cols) on), and each image's line says whether the two agree. Two float64
controls show what a position mistake costs: the same pass with every token at its plain 1-D
position, and with the image's rows and columns swapped (their rows in the table: how often their
top-1 is still llama.cpp's token, and the right float64's). Each image's line also gives ours'
largest logit error against float64 (over the logits' spread) in the text before the image, on
the image, and after it (the continuation included); the table the largest over the images, on the
image and after it, for ours and the controls alike (the scale a position mistake shows at).

Qwen3-VL's has two controls more: float64 with the image's deepstack features zeroed (what leaving
them out would cost), and float64 turned as llama.cpp turns it. llama.cpp's interleaved M-RoPE
takes a fourth position, 0 for text and images alike, and turns by it the pairs past their
section's reach (ggml's imrope: pair k by time, row or column as k % 3 is 0, 1 or 2, while k < 3
x that section; sections [24, 20, 20, 0] leave pairs 61 and 62 of 64, near the lowest frequency),
where Qwen's code, ours and the float64 pass turn them by the time position: that control's logit
error against float64 is the size of the difference.

SmolVLM's has two float64 controls: every image row zeroed (how much the continuation owes the
image), and the tiles' rows placed column by column (what a tile order mistake costs; images
whose grid has more than one row and column).

Our prompt is the server's own (`webapp.http.generation.image_prompt`: the text before the image,
each piece's text before and after its rows, the text after), and each image's line says whether
it is llama-server's: each text ours tokenizes apart against llama-server's `/tokenize` of it, and
the prompt llama-server ran (mtmd's layout, returned with the answer: its length, and its text with
the image left out) against ours (its length, and llama-server's `/detokenize` of our text tokens).
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
from types import SimpleNamespace

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
from image_encode import SHAPES  # noqa: E402
from image_fidelity import picture  # noqa: E402
from qwen_projectors import qwen3vl_deepstack, write_qwen3vl_projector, write_qwen25vl_projector  # noqa: E402
from shaped_model import SMOLVLM_TILES, write_shaped  # noqa: E402
from support.tiny_models import Reference  # noqa: E402
from support.tiny_projectors import write_tiny_projector  # noqa: E402

from bench.servers import exit_on_sigterm, llama_completion, post_json, start_llama_server  # noqa: E402
from webapp.engine.model.lanes import Lane, Want  # noqa: E402
from webapp.engine.serving.loader import load_gguf_model  # noqa: E402
from webapp.engine.vision.vision import ImageSpan  # noqa: E402
from webapp.http.generation import image_prompt, with_bos  # noqa: E402
from webapp.openai.images import IMAGE_MARKER  # noqa: E402

BEFORE, AFTER = "Describe this image.\n", "\n"
MARKER = "<__media__>"  # where the image goes in llama-server's prompt (pinned: it draws a random one otherwise)
DECIDED = 0.1  # float64's top-two gap over its logits' standard deviation
# Qwen2.5-VL's pictures (height, width), in turn: 8 x 8 merged tokens, 9 x 13 and 13 x 9, 7 x 15 and
# 15 x 7 (max(rows, cols), where the text after the image goes on, from both sides), 10 x 10;
# Qwen3-VL's the same grids of its 32-pixel tokens
QWEN25_SIZES = ((224, 224), (252, 364), (364, 252), (196, 420), (420, 196), (280, 280))
QWEN3_SIZES = ((256, 256), (288, 416), (416, 288), (224, 480), (480, 224), (320, 320))
# SmolVLM's, its projector's longest edge SMOLVLM_TILES tiles of 512: 3 x 3, 2 x 3 and 3 x 2 whole tiles
# and 1 x 3 (no resize before the cut; the overview is always squeezed), then 1200 x 800 resized to 3 x 2
SMOLVLM_EDGE = SMOLVLM_TILES * SHAPES["idefics3"]["image_size"]
IDEFICS3_SIZES = ((1536, 1536), (1024, 1536), (1536, 1024), (512, 1536), (800, 1200))


@dataclass(frozen=True)
class Family:
    shape: str  # bench/shaped_model.py's language model
    write_projector: Callable[[str, int], str]  # (path, encoder layers) -> path
    projector_layers: int  # the encoder's depth unless --projector-layers says
    sizes: tuple[tuple[int, int], ...] | None  # the pictures' (height, width) in turn; None: the encoder's square
    ways: tuple[bool, ...]  # ours runs the image attended both ways (True), causally (False)
    mrope: bool = False  # the image at M-RoPE positions (the Qwens'), with float64's controls at wrong ones
    deepstack: Callable[[int], int] | None = None  # encoder layers -> the language model's deepstack layers (Qwen3-VL)
    run: str = "image attention (ours)"  # the table's first column
    # float64's controls where neither M-RoPE's apply: (reference, tokens, inputs, spans) -> logits by name
    controls: Callable[..., dict[str, np.ndarray]] | None = None


def tile_controls(reference: Reference, tokens: list[int], inputs: dict, spans: tuple[ImageSpan, ...]) -> dict[str, np.ndarray]:
    """SmolVLM's float64 controls, by name: every image row zeroed (how much the continuation owes
    the image at all), and, where the grid has more than one row and column, the tiles' rows placed
    column by column instead of row by row (what a tile order mistake would cost)."""
    controls = {"the image's rows zeroed": reference.logits(tokens, {at: np.zeros_like(row) for at, row in inputs.items()})}
    tiles, (rows, cols) = spans[:-1], tile_grid(spans)
    if rows > 1 and cols > 1:
        order = [r * cols + c for c in range(cols) for r in range(rows)]  # slot k takes the k-th tile column by column
        n = tiles[0].image.tokens
        moved = dict(inputs)
        for slot, tile in enumerate(order):
            for i in range(n):
                moved[tiles[slot].start + i] = inputs[tiles[tile].start + i]
        controls["the tiles in column order"] = reference.logits(tokens, moved)
    return controls


def tile_grid(spans: tuple[ImageSpan, ...]) -> tuple[int, int]:
    """The (rows, cols) of an image's tiles, its pieces but the last (the overview): each tile row
    but the last ends in a newline."""
    tiles = spans[:-1]
    rows = 1 + sum(span.image.after == "\n" for span in tiles)
    return rows, len(tiles) // rows


FAMILIES = {
    "gemma3": Family(
        "gemma3-4b",
        lambda path, layers: write_tiny_projector(path, "gemma3", tensor_type="F16", **{**SHAPES["gemma3"], "layers": layers}),
        2,
        None,
        (True, False),
    ),
    "qwen2.5vl": Family(
        "qwen2.5-vl-3b",
        lambda path, layers: write_qwen25vl_projector(path, layers=layers),
        8,
        QWEN25_SIZES,
        (False,),
        mrope=True,
        run="run (ours: M-RoPE positions, image causal)",
    ),
    "qwen3vl": Family(
        "qwen3-vl-4b",
        lambda path, layers: write_qwen3vl_projector(path, layers=layers),
        18,
        QWEN3_SIZES,
        (False,),
        mrope=True,
        deepstack=lambda layers: len(qwen3vl_deepstack(layers)),
        run="run (ours: M-RoPE positions, image causal)",
    ),
    "idefics3": Family(
        "smolvlm-256m",
        lambda path, layers: write_tiny_projector(
            path,
            "idefics3",
            tensor_type="F16",
            metadata={"clip.vision.preproc_image_size": SMOLVLM_EDGE},
            **{**SHAPES["idefics3"], "layers": layers},
        ),
        SHAPES["idefics3"]["layers"],
        IDEFICS3_SIZES,
        (False,),
        run="run (ours: tiles, then the overview, causal)",
        controls=tile_controls,
    ),
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


def llama_continuation(port: int, image: bytes, n: int) -> dict:
    """llama-server's /completion answer: its greedy `tokens`, and the prompt it ran (`prompt`: its
    text, the image left out; `tokens_evaluated`: its length, the image's positions counted)."""
    body = {
        "prompt": {"prompt_string": f"{BEFORE}{MARKER}{AFTER}", "multimodal_data": [base64.b64encode(image).decode()]},
        "n_predict": n, "temperature": 0, "top_k": 1, "repeat_penalty": 1.0, "return_tokens": True, "cache_prompt": False,
    }  # fmt: skip
    return llama_completion(port, body)


def ours(steps, tokens: list[int], placed: dict, both_ways: bool, positions: np.ndarray | None) -> np.ndarray:
    """Our logits at every position of `tokens` in one chunk (each piece's `placed` rows, by their
    first position, whole in it), turned by `positions` (3, len(tokens)) where given."""
    lane = Lane(0, 0, tokens, Want.ALL, inputs=tuple(placed.items()), inputs_both_ways=both_ways, rope_positions=positions)
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
    family = FAMILIES[args.family]
    encoder_layers = args.projector_layers or family.projector_layers
    with tempfile.TemporaryDirectory() as folder:
        model_path, projector_path = os.path.join(folder, f"{family.shape}.gguf"), os.path.join(folder, f"{args.family}.mmproj.gguf")
        write_shaped(family.shape, model_path, args.layers, deepstack=family.deepstack(encoder_layers) if family.deepstack else None)
        family.write_projector(projector_path, encoder_layers)
        loaded = load_gguf_model(model_path, 1, 2048, 32, mmproj=projector_path)
        steps, vision, reference = loaded.runner.steps, loaded.vision, Reference(model_path)
        engine = SimpleNamespace(vision=vision, tokenizer=loaded.tokenizer, model_name=family.shape)  # what image_prompt reads
        # a row of the table -> per image, (agrees with llama.cpp, with float64, decided) at each position of the
        # continuation and the largest logit errors against float64 on the image and after it: ours as run each
        # way, then (the Qwens) float64's controls at wrong positions
        figures = {label(family, way): [] for way in family.ways}
        llama_f64 = []  # llama.cpp's token is float64's top-1, per position
        with start_llama_server(args.llama_server, model_path, parallel=1, context=2048, extra=("--mmproj", projector_path)) as server:
            for seed in range(args.images):
                height, width = family.sizes[seed % len(family.sizes)] if family.sizes else (vision.projector.image_size,) * 2
                image = png(noisy_picture(height, width, seed))
                answer = llama_continuation(server.port, image, args.tokens)
                theirs = [int(t) for t in answer["tokens"]]
                prompt, spans = image_prompt(engine, f"{BEFORE}{IMAGE_MARKER}{AFTER}", (image,))  # as the server lays it out
                placed = {span.start: vision.rows(span.image) for span in spans}
                tokens, start, image_end = prompt + theirs[:-1], spans[0].start, spans[-1].start + spans[-1].image.tokens
                inputs = {at + i: row.astype(np.float64) for at, rows in placed.items() for i, row in enumerate(rows)}
                positions, notes, runs = None, [compare_prompts(server.port, engine.tokenizer, spans, prompt, answer)], []
                controls = {}  # a control's name -> its logits at every position
                if family.mrope:
                    (span,) = spans
                    places = mtmd_places(start, span.image.grid, len(tokens) - image_end)
                    positions = vision.rope_positions(spans, 0, len(tokens))  # as the server's runner asks
                    notes.append(compare_positions(positions, places))
                    everywhere = reference.logits(tokens, inputs, turned=places)
                    controls = mrope_controls(reference, tokens, inputs, places, vision.projector.text_dim)
                else:
                    mutual = tuple((s.start, s.start + s.image.tokens) for s in spans if s.image.both_ways)  # Gemma 3's image
                    everywhere = reference.logits(tokens, inputs, both_ways=mutual)
                    controls = family.controls(reference, tokens, inputs, spans) if family.controls else {}
                exact = everywhere[len(prompt) - 1 :]
                top2 = np.sort(exact, axis=-1)[:, -2:]
                gap = (top2[:, 1] - top2[:, 0]) / exact.std(-1)  # float64's top-two gap over its logits' spread
                decided, theirs_array = gap >= DECIDED, np.array(theirs)
                llama_f64.append(theirs_array == exact.argmax(-1))
                for both_ways in family.ways:
                    logits = ours(steps, tokens, placed, both_ways, positions)
                    picks = logits[len(prompt) - 1 :].argmax(-1)
                    errors = [largest_error(logits[a:b], everywhere[a:b]) for a, b in ((0, start), (start, image_end), (image_end, None))]
                    figures[label(family, both_ways)].append((picks == theirs_array, picks == exact.argmax(-1), decided, errors[1:]))
                    runs.append(describe(label(family, both_ways), picks, theirs, exact.argmax(-1), gap, errors))
                for name, logits in controls.items():
                    picks = logits[len(prompt) - 1 :].argmax(-1)
                    errors = [largest_error(logits[a:b], everywhere[a:b]) for a, b in ((start, image_end), (image_end, None))]
                    row = (picks == theirs_array, picks == exact.argmax(-1), decided, errors)
                    figures.setdefault(f"control: float64 with {name}", []).append(row)
                print(
                    f"image {seed} ({width}x{height}, {layout(spans)}): {len(prompt)} prompt tokens; " + "; ".join(runs + notes), flush=True
                )
    print_table(figures, llama_f64, family.run)


def mrope_controls(reference: Reference, tokens: list[int], inputs: dict, places: np.ndarray, dim: int) -> dict[str, np.ndarray]:
    """float64's logits at every position where something is done wrong, or as llama.cpp does it,
    by name: the positions 1-D, or with rows and columns swapped; for Qwen3-VL also the image's
    deepstack features zeroed, and the rotary's fourth position (see the module's docstring)."""
    wrong = {"1-D positions": None, "rows and columns swapped": places[[0, 2, 1]]}
    controls = {name: reference.logits(tokens, inputs, turned=turned) for name, turned in wrong.items()}
    if reference.deepstack:
        zeroed = {at: np.concatenate([row[:dim], np.zeros(len(row) - dim)]) for at, row in inputs.items()}
        controls["deepstack features zeroed"] = reference.logits(tokens, zeroed, turned=places)
    if reference.arch == "qwen3vl":
        sections = np.asarray(reference.sections)
        sector = np.arange(sections.sum())
        fourth = ", ".join(str(k) for k in sector[sector >= 3 * sections[:3][sector % 3]])
        name = f"llama.cpp's fourth position (0) on pairs {fourth}"
        controls[name] = reference.logits(tokens, inputs, turned=np.vstack([places, np.zeros_like(places[:1])]))
    return controls


def compare_prompts(port: int, tokenizer, spans: tuple[ImageSpan, ...], prompt: list[int], answer: dict) -> str:
    """Whether our prompt is llama-server's: each text our server tokenizes apart (the text before the
    image, BOS first where the file adds one; each piece's before and after; the text after), by our
    tokenizer and by llama-server's /tokenize; then the whole prompt against the one llama-server ran
    (mtmd's layout: its length with the image's positions, and its text with them left out, beside
    llama-server's /detokenize of our text tokens). A line saying so, or what differs."""
    texts = [BEFORE, *(text for span in spans for text in (span.image.before, span.image.after)), AFTER]
    apart = []
    for i, text in enumerate(texts):
        first = i == 0  # BOS first, where the file adds one
        ids = with_bos(tokenizer, tokenizer.encode(text, special=True)) if first else tokenizer.encode(text, special=True)
        theirs = llama_tokens(port, text, first) if text or first else []
        if ids != theirs:
            apart.append(f"{text!r}: ours {ids}, llama-server's {theirs}")
    inside = {at for span in spans for at in range(span.start, span.start + span.image.tokens)}
    text_ids = [t for at, t in enumerate(prompt) if at not in inside]
    ours_text = post_json(port, "/detokenize", {"tokens": text_ids})["content"]
    if answer["tokens_evaluated"] != len(prompt):
        apart.append(f"llama-server ran {answer['tokens_evaluated']} prompt tokens, ours {len(prompt)}")
    if answer["prompt"] != ours_text:
        apart.append(f"llama-server's prompt text {answer['prompt']!r}, ours {ours_text!r}")
    return "prompt = llama-server's" if not apart else "prompt differs: " + "; ".join(apart)


def layout(spans: tuple[ImageSpan, ...]) -> str:
    """An image's pieces in a few words: its token grid, or its tiles and overview."""
    image = spans[0].image
    if len(spans) == 1:
        return f"{image.grid[0]} x {image.grid[1]} tokens" if image.grid else f"{image.tokens} tokens"
    rows, cols = tile_grid(spans)
    return f"{rows} x {cols} tiles and the overview, {sum(s.image.tokens for s in spans)} tokens"


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


def print_table(figures: dict, llama_f64: list, first: str) -> None:
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
            f" | {with_f64.mean():.1%} ({with_f64.sum()} / {len(with_f64)}) | {both} | {error(errors[0])}, {error(errors[1])} |"
        )


def error(value: float) -> str:
    """A logit error over the spread: four decimals, or two figures where those would read 0.0000."""
    return f"{value:.4f}" if value >= 5e-5 or value == 0 else f"{value:.1e}"


if __name__ == "__main__":
    main()
