"""Drafting policies replayed on recorded outputs: speculation's speed-up in model time, free of this
machine's noise.

Usage: DEV=CPU .venv/bin/python bench/speculative_replay.py [--model PATH] [--outputs FILE] [--save FILE]
       [--seeds 10] [--tokens 320] [--positions 32,600] [--max-ngram 4,8]

Speculation never changes an output, so a request's tokens are the same with drafts or without, and
which drafts a policy would have made, and how many of them the model would have confirmed, follow
from the recorded tokens alone. This records, with speculation off, each kind of request of
bench/speculative.py (greedy, and seeds 1..n at temperature 0.7 with top-p 0.95), and times a
verification of 1..9 lanes of one sequence at each of `--positions` (interleaved rounds, each
width's median, in one-lane steps); `--outputs` replays a file that `--save` wrote instead. Then it
replays prompt lookup step by step as the engine drives it (decoding/drafts.py, one stream), its
drafts priced by the first position's table as the engine's warm-up prices them (at position 32),
each step paid at each position's table in turn, and prints the speed-up over one-lane steps for
each value of MAX_NGRAM, beside an oracle's: one that drafts exactly the tokens the model will
confirm, as many as pay at that table (what better drafting could still gain). A seeded row is its
seeds' tokens over their steps' cost. On a shared VM whose speed drifts by 10-20% between runs, a
drafting change shows here and nowhere else; bench/speculative.py says what the whole engine makes
of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import speculative  # noqa: E402  (prepares tinygrad before the engine's imports)

from webapp.engine.decoding import drafts  # noqa: E402
from webapp.engine.serving.engine import Engine  # noqa: E402
from webapp.engine.serving.loader import load_gguf_model  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402
from webapp.engine.serving.speculation import DRAFTED_LANES  # noqa: E402

STOPPED = -2  # never a token: the stop token a finished output sampled last


def record(path: str, tokens: int, seeds: int, positions: list[int]) -> dict:
    """Every kind's prompt and outputs, decoded without drafts, and the verification tables."""
    engine = Engine(lambda: load_gguf_model(path, 8, 4096, 32), slots=8, prefill_chunk=32).start()
    while engine.state == "loading":
        time.sleep(0.2)
    assert engine.state == "ok", engine.error
    kinds = {}
    samplings = [("greedy", dict(temperature=0.0))] + [
        (f"seed {s}", dict(temperature=0.7, top_p=0.95, seed=s)) for s in range(1, seeds + 1)
    ]
    for kind, prompt in zip(speculative.KINDS, speculative.prompts_of(engine), strict=True):
        runs = []
        for name, sampling in samplings:
            _, request = speculative.run(engine, prompt, tokens, "plain", sampling)
            runs.append([name, request.output_ids, len(request.output_ids) < tokens])
        kinds[kind] = {"prompt": prompt, "runs": runs}
    tables = [(at, verification_table(engine, at)) for at in positions]
    engine.stop(5)
    return {"model": os.path.basename(path), "tokens": tokens, "tables": tables, "kinds": kinds}


def verification_table(engine: Engine, at: int, rounds: int = 7) -> list[float]:
    """Seconds of a verification of 1..DRAFT_MAX + 1 lanes of one sequence at position `at`, each width's
    median of `rounds` interleaved rounds (the model thread is idle: these run on the scratch slot)."""
    steps = engine.loaded.runner.steps
    scratch, widths = steps.model.slots, range(1, drafts.DRAFT_MAX + 2)
    seconds = {n: [] for n in widths}
    for n in widths:
        steps.verify([[0] * n], [scratch], [at])  # a width's first call sizes its buffers
    for _ in range(rounds):
        for n in widths:
            started = time.perf_counter()
            steps.verify([[0] * n], [scratch], [at])
            seconds[n].append(time.perf_counter() - started)
    return [statistics.median(seconds[n]) for n in widths]


def replay(
    prompt: list[int], output: list[int], stopped: bool, tokens: int, policy: drafts.StepCosts, paid: drafts.StepCosts, oracle: bool
):
    """(steps' cost in one-lane steps, plain decoding's, drafted, confirmed) of one request: its decode
    steps as the engine takes them (the first token came from the prefill), each draft asked of
    PromptLookup with the engine's limit (priced by `policy`), or the oracle's; each step paid at
    `paid`'s costs."""
    wanted = output[1:] + ([STOPPED] if stopped else [])
    lookup = drafts.PromptLookup(prompt, None, policy)
    lookup.extend(output[:1])
    done = cost = drafted = confirmed = 0
    while done < len(wanted):
        limit = min(DRAFTED_LANES - 1, tokens - (1 + done) - 1)
        draft = (best_confirmed(lookup, wanted[done:], limit, paid) if oracle else lookup.propose(limit)) if limit > 0 else []
        accepted = confirmed_prefix(draft, wanted[done:])
        made = wanted[done : done + accepted + 1]
        lookup.extend([t for t in made if t != STOPPED])
        if draft:
            lookup.update(len(draft), accepted)
        done += len(made)
        cost += paid.step(len(draft) + 1)
        drafted, confirmed = drafted + len(draft), confirmed + accepted
    return cost, len(wanted), drafted, confirmed


def best_confirmed(lookup: drafts.PromptLookup, wanted: list[int], limit: int, costs: drafts.StepCosts) -> list[int]:
    """The confirmed part of the longest draft lookup could make, cut where tokens per unit of cost peak."""
    after = drafts.latest_repeat_end(lookup.tokens, lookup.tokens)
    candidate = lookup.tokens[after : after + limit].tolist() if after is not None else []
    good = confirmed_prefix(candidate, wanted)
    return candidate[: max(range(good + 1), key=lambda k: (k + 1) / costs.step(k + 1))]


def confirmed_prefix(draft: list[int], wanted: list[int]) -> int:
    """How many of the draft's tokens the model confirms: those equal to what it went on to make."""
    good = 0
    while good < len(draft) and good < len(wanted) and draft[good] == wanted[good]:
        good += 1
    return good


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--outputs", default=None, help="replay this file (from --save) instead of recording")
    ap.add_argument("--save", default=None, help="write the recorded outputs and tables here")
    ap.add_argument("--seeds", type=int, default=10, help="seeded requests at temperature 0.7 per kind")
    ap.add_argument("--tokens", type=int, default=320)
    ap.add_argument("--positions", default="32,600", help="positions of the verification tables (the first prices drafts)")
    ap.add_argument("--max-ngram", default=f"4,{drafts.MAX_NGRAM}", help="values of MAX_NGRAM to replay side by side")
    args = ap.parse_args()
    if args.outputs:
        with open(args.outputs) as f:
            recorded = json.load(f)
    else:
        recorded = record(args.model or default_model_path(), args.tokens, args.seeds, [int(p) for p in args.positions.split(",")])
    if args.save:
        with open(args.save, "w") as f:
            json.dump(recorded, f)
    tables = [(at, drafts.StepCosts(seconds)) for at, seconds in recorded["tables"]]
    policy, ngrams = tables[0][1], [int(n) for n in args.max_ngram.split(",")]
    print(f"# drafting replayed on {recorded['model']}'s recorded outputs ({recorded['tokens']} tokens a request at most)\n")
    print("| verification of n lanes at position | " + " | ".join(str(n) for n in range(1, len(policy.lanes) + 1)) + " |")
    print("|---" * (1 + len(policy.lanes)) + "|")
    for at, costs in tables:
        print(f"| {at} (one-lane steps) | " + " | ".join(f"{c:.2f}" for c in costs.lanes) + " |")
    columns = [(at, n) for at, _ in tables for n in ngrams + [None]]  # None: the oracle
    heads = [f"paid at {at}: " + (f"n-gram {n}" if n else "oracle") for at, n in columns]
    print("\n| request | sampling | tokens | " + " | ".join(heads) + " | drafted / confirmed (paid at the first) |")
    print("|---" * (4 + len(heads)) + "|")
    keep = drafts.MAX_NGRAM
    for kind, entry in recorded["kinds"].items():
        for sampling, runs in (("greedy", entry["runs"][:1]), ("temperature 0.7", entry["runs"][1:])):
            cells, counts = [], []
            for (at, n), paid in zip(columns, [costs for _, costs in tables for _ in ngrams + [None]], strict=True):
                drafts.MAX_NGRAM = n or keep
                sums = np.sum(
                    [replay(entry["prompt"], ids, stopped, recorded["tokens"], policy, paid, n is None) for _, ids, stopped in runs], axis=0
                )
                cells.append(f"{sums[1] / sums[0]:.2f}x")
                if at == tables[0][0] and n:
                    counts.append(f"{int(sums[2])} / {sums[3] / max(sums[2], 1):.0%}")
            drafts.MAX_NGRAM = keep
            made = sum(len(ids) for _, ids, _ in runs)
            print(f"| {kind} | {sampling} | {made} | " + " | ".join(cells) + " | " + ", ".join(counts) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
