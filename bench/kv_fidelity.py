"""The 8-bit KV cache (LLM_KV_TYPE=q8_0) against the float16 one: fidelity, scale precision, decode speed.

Usage: DEV=CPU .venv/bin/python bench/kv_fidelity.py [--model GGUF] [--sequences 3] [--length 4096]
       [--positions 2000] [--rounds 5] [--steps 12]

The same file is loaded twice in this process, once with each cache (the server's slots, prefill
chunk and kernels; 4,096 positions a slot), and both run the same work one after the other.

Fidelity: real text, this repository's README and docs/ (English prose with tables, code and
figures), tokenized and cut into --sequences sequences of --length tokens, is teacher-forced
through both: every position's logits come from `steps.score` (a prompt chunk at a time, each
position's logits those decoding it would give). Per range of positions: the share where q8_0's
top-1 token is float16's, each one's top-1 agreement with the text's next token, and the mean KL
divergence of q8_0's next-token distribution from float16's.

Scale precision: the last sequence's keys and values as the float16 cache holds them, every layer,
quantized to Q8_0 rows with the scale kept as float16 (the cache's layout) and as float32: each one's
RMS error relative to the values' RMS, the worst block's, and the share of blocks whose scale is
below float16's normal range (6.1e-5, where it loses precision).

Speed: both models' eight slots filled to --positions (slot 0 holds the text already, copied to the
others), then decode steps of 1 and of 8 streams at that position, float16 and q8_0 alternating
--rounds times, --steps steps each: the median step's tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import usable_cores  # noqa: E402
from webapp.engine.model.tinygrad_setup import prepare_tinygrad  # noqa: E402

prepare_tinygrad()  # before anything imports tinygrad, which reads HCQ2 then

from webapp.engine.device.buffers import host_address  # noqa: E402
from webapp.engine.serving.loader import load_gguf_model  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402

SLOTS, CONTEXT, CHUNK = 8, 4096, 32  # the server's defaults (engine_settings), the context fixed
SCORE_CHUNK = 64  # positions scored per call
RANGES = ((0, 512), (512, 1024), (1024, 2048), (2048, 4096))
F16_NORMAL = 2.0**-14


def text_sequences(tokenizer, count: int, length: int) -> list[list[int]]:
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    tokens = tokenizer.encode(text)
    return [tokens[i * length : (i + 1) * length] for i in range(min(count, len(tokens) // length))]


def scored(steps, tokens: list[int]) -> np.ndarray:
    """Every position's logits (len(tokens), vocab), the sequence in slot 0."""
    return np.concatenate([steps.score(tokens[s : s + SCORE_CHUNK], 0, s) for s in range(0, len(tokens), SCORE_CHUNK)])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def fidelity(models: dict, sequences: list[list[int]]) -> list[tuple]:
    """Per position: (position, q8_0 top-1 == f16 top-1, f16 right, q8_0 right, KL(f16 || q8_0))."""
    rows = []
    for n, tokens in enumerate(sequences):
        started = time.monotonic()
        f16, q8 = (scored(models[name].runner.steps, tokens) for name in ("f16", "q8_0"))
        for s in range(0, len(tokens) - 1, SCORE_CHUNK):
            a, b = f16[s : s + SCORE_CHUNK], q8[s : s + SCORE_CHUNK]
            la, lb = log_softmax(a), log_softmax(b)
            kl = (np.exp(la) * (la - lb)).sum(-1)
            for i in range(len(a)):
                if s + i + 1 < len(tokens):
                    following = tokens[s + i + 1]
                    rows.append((s + i, a[i].argmax() == b[i].argmax(), a[i].argmax() == following, b[i].argmax() == following, kl[i]))
        print(f"  sequence {n}: {len(tokens)} tokens scored twice in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return rows


def layer_values(model, positions: int) -> list[np.ndarray]:
    """Each layer's float16 keys and values of slot 0's first `positions` positions, float32 (2, KvH, P, Hd)."""
    out = []
    for block in model.blocks:
        cache = block.cache
        view = np.ctypeslib.as_array((ctypes.c_uint8 * cache.nbytes()).from_address(host_address(cache)))
        out.append(view.view(np.float16).reshape(cache.shape)[:, 0, :, :positions].astype(np.float32))
    return out


def scale_errors(values: list[np.ndarray]) -> dict[str, tuple[float, float]]:
    """(RMS error / RMS value, the worst block's) of Q8_0 with a float16 and with a float32 scale."""
    x = np.concatenate([v.reshape(-1, 32) for v in values])
    d = np.abs(x).max(-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        q = np.rint(x * np.where(d > 0, np.float32(1) / d, np.float32(0)))
    out = {}
    for name, scale in (("float16", d.astype(np.float16).astype(np.float32)), ("float32", d)):
        error = q * scale - x
        block_rms = np.sqrt((error**2).mean(-1)) / np.maximum(np.sqrt((x**2).mean(-1)), 1e-30)
        out[name] = (float(np.sqrt((error**2).mean() / (x**2).mean())), float(block_rms.max()))
    out["subnormal"] = (float(((d > 0) & (d < F16_NORMAL)).mean()), 0.0)
    return out


def decode_speed(models: dict, positions: int, rounds: int, steps_per_round: int) -> dict[tuple[str, int], list[float]]:
    for loaded in models.values():
        for slot in range(1, SLOTS):
            loaded.runner.steps.copy_prefix(0, slot, positions)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for lanes in (1, SLOTS):
            for name, loaded in models.items():
                steps, took = loaded.runner.steps, []
                for _ in range(steps_per_round):
                    started = time.perf_counter()
                    steps.decode([42] * lanes, list(range(lanes)), [positions] * lanes)
                    took.append(time.perf_counter() - started)
                times.setdefault((name, lanes), []).append(statistics.median(took))
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: our default model)")
    ap.add_argument("--sequences", type=int, default=3, help="sequences of real text")
    ap.add_argument("--length", type=int, default=CONTEXT, help="tokens a sequence")
    ap.add_argument("--positions", type=int, default=2000, help="the decode steps' position")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12, help="decode steps per round and width")
    args = ap.parse_args(argv)
    path = args.model or default_model_path()
    models = {name: load_gguf_model(path, SLOTS, CONTEXT, CHUNK, kv_type=name) for name in ("f16", "q8_0")}
    sequences = text_sequences(models["f16"].tokenizer, args.sequences, min(args.length, CONTEXT))
    assert sequences and len(sequences[-1]) > args.positions, "not enough text for the sequences asked"

    rows = fidelity(models, sequences)
    errors = scale_errors(layer_values(models["f16"].runner.steps.model, len(sequences[-1])))
    times = decode_speed(models, args.positions, args.rounds, args.steps)

    print(f"\nModel: {os.path.basename(path)}; {platform.machine()}, {usable_cores()} usable cores; load {os.getloadavg()[0]:.1f}")
    per_token = {name: loaded.kv_bytes_per_token for name, loaded in models.items()}
    print(f"KV bytes a token: f16 {per_token['f16']:,}, q8_0 {per_token['q8_0']:,} ({per_token['q8_0'] / per_token['f16']:.1%})\n")
    print(f"Teacher-forced over {len(sequences)} sequences of real text ({sum(map(len, sequences)):,} tokens):\n")
    print("| positions | scored | q8_0 top-1 = f16 top-1 | f16 top-1 = text | q8_0 top-1 = text | mean KL(f16 ‖ q8_0) |")
    print("|---|---:|---:|---:|---:|---:|")
    for low, high in (*RANGES, (0, CONTEXT)):
        part = [r for r in rows if low <= r[0] < high]
        if part:
            same, f16_right, q8_right, kl = (np.mean([r[i] for r in part]) for i in range(1, 5))
            label = "all" if (low, high) == (0, CONTEXT) else f"{low}-{high - 1}"
            print(f"| {label} | {len(part):,} | {same:.2%} | {f16_right:.2%} | {q8_right:.2%} | {kl:.5f} |")
    print("\nQ8_0 of the float16 cache's keys and values (every layer, the last sequence):\n")
    print("| scale kept as | RMS error / RMS value | worst block |")
    print("|---|---:|---:|")
    for name in ("float16", "float32"):
        print(f"| {name} | {errors[name][0]:.4%} | {errors[name][1]:.3%} |")
    print(f"\nBlocks whose scale is below float16's normal range: {errors['subnormal'][0]:.4%}")
    print(f"\nDecode at position {args.positions}, {args.rounds} rounds alternating, median of {args.steps} steps each:\n")
    print("| streams | f16 tok/s | q8_0 tok/s | q8_0 / f16 |")
    print("|---:|---:|---:|---:|")
    for lanes in (1, SLOTS):
        f16, q8 = (lanes / statistics.median(times[name, lanes]) for name in ("f16", "q8_0"))
        print(f"| {lanes} | {f16:.1f} | {q8:.1f} | {q8 / f16:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
