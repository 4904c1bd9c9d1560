"""How far llama.cpp agrees with itself: the floor under bench/conformance.py's "same top-1".

Usage: .venv/bin/python bench/reference_noise.py --llama-server $BIN/llama-server --continuations FILE
           --workdir DIR [--flash-attn off] [--cases default,qwen3-0.6b:8:Q4_K_M,...]

FILE is a `bench/conformance.py --save` file (its llama-server ran with default settings, where the CPU
backend's flash attention is on) and DIR that run's `--workdir`. Each case's file is served again by
llama-server with `--flash-attn` set otherwise (off by default: ggml's unfused attention, the other
path of the same model), and the first run's greedy tokens are teacher-forced through it a position
at a time (`n_predict` 1 on the prompt and the tokens before that position, the prompt cached):
the share of positions where the second llama.cpp picks the first one's token. The two differ only
in how attention rounds (flash attention on the CPU rounds q to float16 and sums the values in
float16; the unfused path rounds q and the softmax's probabilities to float16 and sums in float32),
so what this share falls short of 100% is llama.cpp's own rounding at the near-ties of these files,
beside which our figure in the same file is shown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.conformance import BASELINE, ModelFiles  # noqa: E402
from bench.servers import llama_completion, start_llama_server  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402


def next_token(port: int, tokens: list[int]) -> int:
    """llama-server's greedy next token after `tokens`."""
    body = {
        "prompt": tokens,
        "n_predict": 1,
        "temperature": 0,
        "top_k": 1,
        "repeat_penalty": 1.0,
        "return_tokens": True,
        "cache_prompt": True,
    }
    return int(llama_completion(port, body, timeout=300)["tokens"][0])


def self_agreement(binary: str, path: str, flash_attn: str, prompts: list[list[int]], continuations: list[list[int]]) -> tuple[int, int]:
    """(positions where llama-server with `flash_attn` picks the saved token, positions)."""
    server = start_llama_server(binary, path, parallel=1, extra=("--flash-attn", flash_attn))
    try:
        same = total = 0
        for prompt, theirs in zip(prompts, continuations):
            for k, token in enumerate(theirs):
                same += next_token(server.port, prompt + theirs[:k]) == token
                total += 1
        return same, total
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True, metavar="PATH")
    ap.add_argument("--continuations", required=True, metavar="FILE", help="a bench/conformance.py --save file")
    ap.add_argument("--workdir", required=True, help="that run's --workdir (its model files)")
    ap.add_argument("--llama-quantize", metavar="PATH", default="llama-quantize", help="to write again a file the workdir lacks")
    ap.add_argument("--flash-attn", default="off", choices=("on", "off"), help="the second llama-server's setting (default off)")
    ap.add_argument("--cases", help="CASE,... of the file (default: all)")
    args = ap.parse_args(argv)
    saved = json.load(open(args.continuations))
    cases = args.cases.split(",") if args.cases else list(saved)
    files = ModelFiles(args.llama_quantize, args.workdir)
    print(f"| case | llama.cpp (flash attention {args.flash_attn}) = llama.cpp (default) | ours = llama.cpp (default) |")
    print("|---|---:|---:|")
    for case in cases:
        entry = saved[case]
        if "continuations" not in entry:
            continue
        theirs = [tokens for tokens, _stop in entry["continuations"]]
        if case == BASELINE:
            path = default_model_path()
        else:
            shape, layers, qtype = case.split(":")
            path = files.get(shape, int(layers), qtype)
        same, total = self_agreement(args.llama_server, path, args.flash_attn, entry["prompts"], theirs)
        ours = sum(map(sum, entry["matches"]))
        print(f"| {case} | {100 * same / total:.1f}% ({same}/{total}) | {100 * ours / total:.1f}% ({ours}/{total}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
