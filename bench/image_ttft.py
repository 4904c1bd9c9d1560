"""Time to first token of a chat request with an image, ours beside llama-server's, over HTTP.

    DEV=CPU .venv/bin/python bench/image_ttft.py --llama-server $BIN/llama-server
        [--families gemma3,idefics3,qwen2.5vl,qwen3vl] [--rounds 3] [--layers 4]

Each family's projector in its released shape and depth (random F16 weights: Gemma 3's
SigLIP-so400m, SmolVLM-256M's SigLIP-base, Qwen2.5-VL-3B's and Qwen3-VL-4B's towers, as
bench/image_text_fidelity.py writes them) beside its language model's shape
(bench/shaped_model.py, the first `--layers` layers, F16). Both servers load the same two files
(ours through `make serve` with LLM_MODEL and LLM_MMPROJ, llama-server with `--mmproj`, one slot)
and answer the same OpenAI chat request: "Describe this image." and one JPEG as a `data:` URL,
`max_tokens` 1, so the answer's time is the time to its first token (the image decoded,
preprocessed, encoded, the prompt prefilled, one token drawn). Every round sends a picture neither
has seen (image_text_fidelity.py's gradients with a new seed), first to one server, then the other,
the order alternating by round; one untimed request each warms them first. Pictures are each
family's usual size: Gemma 3's 896 square, SmolVLM's 1536 square (3 x 3 tiles of 512 and the
overview), Qwen2.5-VL's 448 square (256 rows), Qwen3-VL's 768 square (576 rows). Prints per
family the prompt's tokens, each side's median seconds and the median of the rounds' ratios
(ours over llama.cpp's) with their range.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from image_text_fidelity import FAMILIES  # noqa: E402
from image_text_fidelity import noisy_picture as picture  # noqa: E402
from PIL import Image  # noqa: E402
from shaped_model import write_shaped  # noqa: E402

from bench.servers import exit_on_sigterm, post_json, start_llama_server, start_ours  # noqa: E402

# each family's released encoder depth and the (height, width) of its pictures
RELEASED = {"gemma3": (27, (896, 896)), "idefics3": (12, (1536, 1536)), "qwen2.5vl": (32, (448, 448)), "qwen3vl": (24, (768, 768))}


def jpeg(rgb) -> bytes:
    """A photo's format (a noisy picture's PNG at SmolVLM's size would pass the server's 8 MiB body limit)."""
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="JPEG", quality=90)
    return out.getvalue()


def chat(port: int, image: bytes) -> tuple[float, int]:
    """Seconds until the server's one-token answer to "Describe this image." and the picture, and its prompt's tokens."""
    url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": "Describe this image."}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    answer = post_json(port, "/v1/chat/completions", body)
    return time.perf_counter() - started, int(answer["usage"]["prompt_tokens"])


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--families", default=",".join(RELEASED))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4, help="the language model's layers")
    args = parser.parse_args()
    print("| family | picture | prompt tokens (ours / llama.cpp) | llama.cpp s | ours s | ours / llama.cpp (range) |")
    print("|---|---|---|---:|---:|---|")
    for name in args.families.split(","):
        family, (depth, (height, width)) = FAMILIES[name], RELEASED[name]
        with tempfile.TemporaryDirectory() as folder:
            model, projector = os.path.join(folder, f"{family.shape}.gguf"), os.path.join(folder, f"{name}.mmproj.gguf")
            write_shaped(family.shape, model, args.layers, deepstack=family.deepstack(depth) if family.deepstack else None)
            family.write_projector(projector, depth)
            env = {"LLM_MODEL": model, "LLM_MMPROJ": projector}
            with (
                start_ours(env=env) as ours,
                start_llama_server(args.llama_server, model, parallel=1, extra=("--mmproj", projector)) as theirs,
            ):
                for server in (ours, theirs):
                    chat(server.port, jpeg(picture(height, width, 1000)))
                times: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
                tokens = {}
                for round_ in range(args.rounds):
                    image = jpeg(picture(height, width, round_))
                    order = (("ours", ours), ("llama.cpp", theirs)) if round_ % 2 == 0 else (("llama.cpp", theirs), ("ours", ours))
                    for side, server in order:
                        seconds, tokens[side] = chat(server.port, image)
                        times[side].append(seconds)
            ratios = [a / b for a, b in zip(times["ours"], times["llama.cpp"], strict=True)]
            print(
                f"| {name} ({depth} encoder layers) | {width}x{height} | {tokens['ours']} / {tokens['llama.cpp']} "
                f"| {statistics.median(times['llama.cpp']):.2f} | {statistics.median(times['ours']):.2f} "
                f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
