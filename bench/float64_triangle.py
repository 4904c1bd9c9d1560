"""Noise or error? Our top-1 and llama.cpp's, each judged against a float64 forward pass of the same file.

Usage: DEV=CPU .venv/bin/python bench/float64_triangle.py --llama-server $BIN/llama-server --llama-quantize $BIN/llama-quantize
           [--files qwen3-1.7b:8:Q4_K_M,default] [--prompts 8] [--tokens 64] [--top 10] [--workdir DIR]

At every position of llama.cpp's greedy continuation of each chat prompt (teacher-forced, as in
bench/fidelity.py) there are three top-1 tokens: llama.cpp's (its greedy token), ours (the logits of
fidelity.py's `teacher_forced_logits`) and float64's (`tests/support/tiny_models.Reference`:
the file's blocks dequantized by the `gguf` package, every product in float64, the K/V rounded to
float16 as both servers cache them). Printed per file:

- the three pairwise agreements, over all positions and by the float64 top-2 logit gap (in units of
  the float64 logits' standard deviation at that position): a gap under 1% of it is a near-tie;
- where we and llama.cpp differ, which of us float64 sides with;
- how far the logits are from float64's: ours over the whole vocabulary, and both servers' log
  probabilities at llama.cpp's `--top` tokens (llama-server `/completion` with `n_probs`, a softmax
  over every logit), where the two can be compared like for like.

Files are SHAPE:LAYERS:TYPE[:INIT] (bench/shaped_model.py's shapes, drawn from its random
initialisation INIT, default "default", quantized by llama-quantize, kept in `--workdir` as
bench/conformance.py keeps them) or `default` (the default model, real weights).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from support.tiny_deepseek2 import LatentReference  # noqa: E402
from support.tiny_models import Reference  # noqa: E402
from support.tiny_qwen35 import Qwen35Reference  # noqa: E402

from bench.conformance import BASELINE, ModelFiles, chat_prompts, parse_shape, type_mix  # noqa: E402
from bench.fidelity import CHUNK, CONTEXT, SLOTS, teacher_forced_logits  # noqa: E402
from bench.servers import exit_on_sigterm, llama_completion, start_llama_server  # noqa: E402
from webapp.engine.model.gguf import read_gguf  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402

GAP_BUCKETS = (0.0, 0.01, 0.03, 0.1, np.inf)  # float64 top-2 gap / float64 logits' std
NEAR_TIE = 0.01  # of the std
NEAR_TIE_ABS = 0.05  # logits


def llama_with_probs(port: int, prompt: list[int], n: int, top: int) -> tuple[list[int], list[dict[int, float]]]:
    """llama.cpp's greedy continuation and, at each of its positions, its `top` log probabilities {token: logprob}."""
    body = {
        "prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "repeat_penalty": 1.0, "return_tokens": True,
        "cache_prompt": False, "stream": False, "n_probs": top,
    }  # fmt: skip
    answer = llama_completion(port, body)
    probs = [{int(p["id"]): float(p["logprob"]) for p in step["top_logprobs"]} for step in answer["completion_probabilities"]]
    tokens = [int(t) for t in answer["tokens"]]
    return tokens[: len(probs)], probs


def our_logits(path: str, prompts, continuations) -> list[np.ndarray]:
    from webapp.engine.serving.loader import load_gguf_model

    steps = load_gguf_model(path, SLOTS, CONTEXT, CHUNK).runner.steps
    return [teacher_forced_logits(steps, CHUNK, prompt, theirs) for prompt, theirs in zip(prompts, continuations)]


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def analyse(ours: np.ndarray, exact: np.ndarray, llama_tokens: np.ndarray, llama_probs: list[dict[int, float]]) -> dict:
    """All positions of one file at once: ours, exact (positions, vocab); llama.cpp's tokens and top log-probs."""
    top2 = np.sort(exact, axis=-1)[:, -2:]
    gap, std = top2[:, 1] - top2[:, 0], exact.std(-1)
    o, e, ll = ours.argmax(-1), exact.argmax(-1), llama_tokens
    lp_ours, lp_exact = log_softmax(ours.astype(np.float64)), log_softmax(exact)
    ours_err, llama_err, between, margin_ours, margin_llama, close = [], [], [], [], [], []
    first, second = np.argsort(exact, axis=-1)[:, -1], np.argsort(exact, axis=-1)[:, -2]
    for i, probs in enumerate(llama_probs):
        ids = np.array(list(probs))
        lp_llama = np.array(list(probs.values()))
        llama_err.append(np.abs(lp_llama - lp_exact[i, ids]).mean())
        ours_err.append(np.abs(lp_ours[i, ids] - lp_exact[i, ids]).mean())
        between.append(np.abs(lp_ours[i, ids] - lp_llama).mean())
        if first[i] in probs and second[i] in probs:  # the float64 top two's margin, as each server has it
            margin_llama.append(abs(probs[first[i]] - probs[second[i]] - gap[i]))
            margin_ours.append(abs(ours[i, first[i]] - ours[i, second[i]] - gap[i]))
            close.append(gap[i] < 0.1 * std[i])
    err = ours - exact
    differ = o != ll
    return {
        "n": len(e),
        "agree": {"ours-llama": (o == ll), "ours-f64": (o == e), "llama-f64": (ll == e)},
        "rel_gap": gap / std,
        "near_tie": gap < NEAR_TIE * std,
        "near_tie_abs": gap < NEAR_TIE_ABS,
        "std": std,
        "gap": gap,
        "differ": {"n": int(differ.sum()), "ours": int((differ & (o == e)).sum()), "llama": int((differ & (ll == e)).sum())},
        "logit_err": np.abs(err).mean(-1),
        "centred_err": np.abs(err - err.mean(-1, keepdims=True)).mean(-1),  # a shift of every logit changes no choice
        "margin_err": {"ours": np.array(margin_ours), "llama": np.array(margin_llama), "close": np.array(close, dtype=bool)},
        "lp_err": {"ours": np.array(ours_err), "llama": np.array(llama_err), "ours-llama": np.array(between)},
    }


def print_file(name: str, mix: str, a: dict, top: int) -> None:
    n, pct = a["n"], lambda mask: f"{mask.mean():.1%} ({int(mask.sum())})"  # noqa: E731
    print(f"\n### {name} ({mix}): {n} positions\n")
    print("| positions (float64 top-2 gap / its logits' std) | n | ours = llama.cpp | ours = float64 | llama.cpp = float64 |")
    print("|---|---:|---:|---:|---:|")
    print(f"| all | {n} | " + " | ".join(pct(a["agree"][k]) for k in ("ours-llama", "ours-f64", "llama-f64")) + " |")
    for low, high in zip(GAP_BUCKETS, GAP_BUCKETS[1:]):
        mask = (a["rel_gap"] >= low) & (a["rel_gap"] < high)
        if mask.any():
            label = f"gap {low:g}-{high:g}" if np.isfinite(high) else f"gap >= {low:g}"
            cells = " | ".join(f"{a['agree'][k][mask].mean():.1%}" for k in ("ours-llama", "ours-f64", "llama-f64"))
            print(f"| {label} | {int(mask.sum())} | {cells} |")
    d = a["differ"]
    print(
        f"\nNear-ties (float64 top-2 gap < {NEAR_TIE:.0%} of the std, median std {np.median(a['std']):.2f}): {pct(a['near_tie'])}; "
        f"gap < {NEAR_TIE_ABS} logits: {pct(a['near_tie_abs'])}; median gap {np.median(a['gap']):.3f} "
        f"({np.median(a['rel_gap']):.3f} std)."
    )
    print(
        f"Where ours and llama.cpp differ ({d['n']}): float64 picks ours at {d['ours']}, llama.cpp's at {d['llama']}, "
        f"another token at {d['n'] - d['ours'] - d['llama']}."
    )
    le, me = a["lp_err"], a["margin_err"]
    print(
        f"Mean |logit - float64| of ours over the vocabulary: {a['logit_err'].mean():.4f} "
        f"({(a['logit_err'] / a['std']).mean():.2%} of the std); less each position's mean difference: {a['centred_err'].mean():.4f}. "
        f"Mean |log-prob - float64| at llama.cpp's top {top} tokens: ours {le['ours'].mean():.4f}, llama.cpp "
        f"{le['llama'].mean():.4f}; ours - llama.cpp {le['ours-llama'].mean():.4f}. Error in the float64 top two's margin "
        f"(at the {len(me['ours'])} positions where both are in llama.cpp's top {top}): ours mean {me['ours'].mean():.4f} / "
        f"p95 {np.percentile(me['ours'], 95):.4f}, llama.cpp mean {me['llama'].mean():.4f} / p95 {np.percentile(me['llama'], 95):.4f}."
    )


def print_summary(results: list[tuple[str, dict]], top: int) -> None:
    print(f"\n### Summary (near-tie: float64 top-2 gap < {NEAR_TIE:.0%} of its logits' std)\n")
    print(
        "| file | positions | ours = llama.cpp | ours = float64 | llama.cpp = float64 | near-ties | gap < 0.1 std | "
        "differ: float64 sides with ours / llama.cpp / neither | log-prob error, ours / llama.cpp | "
        "margin error, ours / llama.cpp | margin error at gaps < 0.1 std |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---|---|---|")
    for name, a in results:
        agree = " | ".join(f"{a['agree'][k].mean():.1%}" for k in ("ours-llama", "ours-f64", "llama-f64"))
        d, le, me = a["differ"], a["lp_err"], a["margin_err"]
        print(
            f"| {name} | {a['n']} | {agree} | {a['near_tie'].mean():.1%} | {(a['rel_gap'] < 0.1).mean():.1%} | "
            f"{d['n']}: {d['ours']} / {d['llama']} / {d['n'] - d['ours'] - d['llama']} | "
            f"{le['ours'].mean():.3f} / {le['llama'].mean():.3f} | {me['ours'].mean():.3f} / {me['llama'].mean():.3f} | "
            f"{me['ours'][me['close']].mean():.3f} / {me['llama'][me['close']].mean():.3f} |"
        )


def reference_for(path: str) -> Reference:
    """The float64 forward pass of the file's architecture: latent attention's decompresses its heads,
    Qwen3.5's runs the delta rule a token at a time."""
    kv, _ = read_gguf(path)
    arch = kv.get("general.architecture")
    return {"deepseek2": LatentReference, "qwen35": Qwen35Reference, "qwen35moe": Qwen35Reference}.get(arch, Reference)(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", metavar="PATH", required=True)
    ap.add_argument("--llama-quantize", metavar="PATH", default="llama-quantize")
    ap.add_argument(
        "--files",
        default="qwen3-1.7b:8:Q4_K_M,default",
        help="SHAPE:LAYERS:TYPE[:INIT] (INIT one of shaped_model.py's INITS) or default, comma-separated",
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=10, help="llama.cpp's log probabilities per position (n_probs)")
    ap.add_argument("--workdir", help="model files kept here (bench/conformance.py's --workdir)")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    files = ModelFiles(args.llama_quantize, args.workdir)
    results = []
    try:
        for spec in args.files.split(","):
            started = time.monotonic()
            if spec == BASELINE:
                name, path = "SmolLM2-135M Q4_1 (default model, real weights)", default_model_path()
            else:
                shape, layers, qtype, *init = spec.split(":")
                shape, layers = parse_shape(f"{shape}:{layers}")
                drawn = f", init {init[0]}" if init else ""
                name, path = f"{shape}, {layers} layers, {qtype}{drawn}", files.get(shape, layers, qtype, *init)
            prompts = chat_prompts(path, args.prompts)
            with start_llama_server(args.llama_server, path, parallel=1, context=CONTEXT) as server:
                llama = [llama_with_probs(server.port, p, args.tokens, args.top) for p in prompts]
            print(f"  {spec}: llama.cpp done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
            theirs = [tokens for tokens, _ in llama]
            ours = our_logits(path, prompts, theirs)
            print(f"  {spec}: ours done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
            reference = reference_for(path)
            exact = [reference.logits(p + t[:-1])[len(p) - 1 :] for p, t in zip(prompts, theirs)]  # (len(t), vocab) each
            del reference
            print(f"  {spec}: float64 done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
            result = analyse(np.concatenate(ours), np.concatenate(exact), np.concatenate(theirs), [p for _, ps in llama for p in ps])
            print_file(name, type_mix(path), result, args.top)
            sys.stdout.flush()
            results.append((name, result))
    finally:
        files.close()
    print_summary(results, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
