"""The text after an image, ours beside llama.cpp's: Gemma 3's image attended both ways or causally.

Usage: DEV=CPU .venv/bin/python bench/image_text_fidelity.py --llama-server $BIN/llama-server
           [--layers 4] [--projector-layers 2] [--images 6] [--tokens 24]

A Gemma 3 4B-shaped language model (bench/shaped_model.py's `gemma3-4b`, its first `--layers`
layers, random F16 weights) and a Gemma 3 projector in its real shape but `--projector-layers`
encoder layers (bench/image_encode.py's SHAPES; the rows it hands the model are what matter here).
For each of `--images` pictures (smooth gradients with noise, a seed each, at the encoder's size so
neither side resizes), llama-server with `--mmproj` continues "Describe this image.\\n<image>\\n"
greedily for `--tokens` tokens (`/completion` with `multimodal_data`). Ours, through the server's own
loader (the picture decoded, encoded on the CPU kernels, its rows in place of 256 placeholders), is
teacher-forced on llama.cpp's tokens twice: the image's positions attending each other both ways (as
the server runs Gemma 3), and causally (as it did before). Each is judged at every position of the
continuation against llama.cpp's token and against a float64 forward pass of the same file given
our rows, attending both ways (tests/support/tiny_models.Reference); "decided" positions are those
where float64's top-two gap is at least 0.1 of its logits' spread (bench/float64_triangle.py).
The prompt's text is tokenized by llama-server (`/tokenize`), as mtmd cuts it: the text before the
image with `<start_of_image>` (BOS first), then `<end_of_image>` with the text after it.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
import tempfile

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
from image_encode import SHAPES  # noqa: E402
from image_fidelity import picture  # noqa: E402
from shaped_model import write_shaped  # noqa: E402
from support.tiny_models import Reference  # noqa: E402
from support.tiny_projectors import write_tiny_projector  # noqa: E402

from bench.servers import exit_on_sigterm, llama_completion, post_json, start_llama_server  # noqa: E402
from webapp.engine.model.lanes import Lane, Want  # noqa: E402
from webapp.engine.serving.loader import load_gguf_model  # noqa: E402

BEFORE, AFTER = "Describe this image.\n", "\n"
MARKER = "<__media__>"  # where the image goes in llama-server's prompt (pinned: it draws a random one otherwise)
DECIDED = 0.1  # float64's top-two gap over its logits' standard deviation


def noisy_picture(size: int, seed: int) -> np.ndarray:
    """image_fidelity.py's gradients, shifted and noised by `seed`: each picture its own rows."""
    rng = np.random.default_rng(seed)
    rgb = np.roll(picture(size), rng.integers(0, size, 2), axis=(0, 1)).astype(np.int16)
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


def ours(steps, prompt: list[int], at: int, rows: np.ndarray, theirs: list[int], both_ways: bool) -> np.ndarray:
    """Our logits before each of llama.cpp's tokens: the prompt in one chunk (the image whole in it), then theirs."""
    tokens = prompt + theirs[:-1]
    return steps.run([Lane(0, 0, tokens, Want.ALL, inputs=((at, rows),), inputs_both_ways=both_ways)])[0][len(prompt) - 1 :]


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--projector-layers", type=int, default=2)
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    os.environ["LLAMA_MEDIA_MARKER"] = MARKER
    with tempfile.TemporaryDirectory() as folder:
        model_path, projector_path = os.path.join(folder, "gemma3-4b.gguf"), os.path.join(folder, "gemma3.mmproj.gguf")
        write_shaped("gemma3-4b", model_path, args.layers)
        write_tiny_projector(projector_path, "gemma3", tensor_type="F16", **{**SHAPES["gemma3"], "layers": args.projector_layers})
        loaded = load_gguf_model(model_path, 1, 2048, 32, mmproj=projector_path)
        steps, vision, reference = loaded.runner.steps, loaded.vision, Reference(model_path)
        size = vision.projector.image_size
        figures = {True: [], False: []}  # both ways -> (agrees with llama.cpp, with float64, decided) per position
        llama_f64 = []  # llama.cpp's token is float64's top-1, per position
        with start_llama_server(args.llama_server, model_path, parallel=1, context=2048, extra=("--mmproj", projector_path)) as server:
            for seed in range(args.images):
                image = png(noisy_picture(size, seed))
                theirs = llama_continuation(server.port, image, args.tokens)
                before = llama_tokens(server.port, BEFORE + vision.projector.projection.before, True)
                after = llama_tokens(server.port, vision.projector.projection.after + AFTER, False)
                (piece,) = vision.prepare(image)
                rows = vision.rows(piece)
                prompt = before + [vision.placeholder(piece)] * len(rows) + after
                inputs = {len(before) + i: row.astype(np.float64) for i, row in enumerate(rows)}
                span = ((len(before), len(before) + len(rows)),)
                exact = reference.logits(prompt + theirs[:-1], inputs, both_ways=span)[len(prompt) - 1 :]
                top2 = np.sort(exact, axis=-1)[:, -2:]
                decided = (top2[:, 1] - top2[:, 0]) >= DECIDED * exact.std(-1)
                llama_f64.append(np.array(theirs) == exact.argmax(-1))
                for both_ways in (True, False):
                    picks = ours(steps, prompt, len(before), rows, theirs, both_ways).argmax(-1)
                    figures[both_ways].append((picks == np.array(theirs), picks == exact.argmax(-1), decided))
                print(f"image {seed}: {len(prompt)} prompt tokens, {len(theirs)} of llama.cpp's", flush=True)
    print("| image attention (ours) | top-1 = llama.cpp's | where float64 decides | top-1 = float64's | llama.cpp = float64's |")
    print("|---|---|---|---|---|")
    for both_ways, rows in figures.items():
        with_llama, with_f64, decided = (np.concatenate(column) for column in zip(*rows, strict=True))
        print(
            f"| {'both ways' if both_ways else 'causal'} | {with_llama.mean():.1%} ({with_llama.sum()} / {len(with_llama)})"
            f" | {with_llama[decided].mean():.1%} ({with_llama[decided].sum()} / {decided.sum()})"
            f" | {with_f64.mean():.1%} | {np.concatenate(llama_f64).mean():.1%} |"
        )


if __name__ == "__main__":
    main()
