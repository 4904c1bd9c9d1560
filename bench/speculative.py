"""Speculative decoding's speed-up, one stream at a time, with the outputs checked equal.

Usage: DEV=CPU .venv/bin/python bench/speculative.py [--model PATH] [--draft PATH] [--tokens 320] [--rounds 3]
       [--kinds "code edit,free chat"] [--samplings greedy] [--no-streams] [--beside-prompts] [--costs] [--repeat] [--seeds 5]

For each kind of request (a code edit that repeats a whole file with one change, from
bench/workloads/inventory.py; a summary of a text, a JSON extraction, a free chat answer) and each
sampling (greedy; temperature 0.7, `--seeds` requests seeded 1..n, one sampled text being one
draw of how much of it repeats the prompt), the same request
runs without drafts, with prompt-lookup drafts ("n-gram") and, given `--draft` (a draft model of the
same vocabulary, LLM_DRAFT_MODEL), with the draft model beside prompt lookup, alternating them
`--rounds` times in one engine (the settings are read per request at admission). Printed per row:
decode tok/s of each (median, from the first token on, so the prompt's prefill is left out), the
ratio to plain decoding (of the medians, and the median of each round's ratio, whose runs are
neighbours in time), drafted tokens, the share of them confirmed (a seeded row's rate is its seeds'
tokens over their time, its counts their sums), and whether every run of a seed gave the same tokens
(they must: speculation changes no output). Then, unless --no-streams, 8 streams at once
(two of each kind, temperature 0.7, seeded), on and off alternating: the aggregate tok/s from the
first token to the last, the issue's "no lower than without" (the ratio of the medians, and the
median of each round's ratio, whose two runs are neighbours in time: this shared machine's speed
drifts by 10-20% between rounds).

`--beside-prompts` adds the code edit (greedy) while another client keeps a long prompt in prefill
at every moment, so most of its steps also prefill a chunk (drafts are verified in those steps too).

`--repeat` makes every row a repeated request: each run first answers the request once, untimed,
then the timed run drafts from that answer in the server's recent outputs (where a model of random
weights, whose text never repeats itself, still drafts).

`--constant-costs` adds a column of prompt lookup whose lanes are priced at LANE_COST each, as
before the warm-up timed them (decoding/drafts.py StepCosts), and a row of it at 8 streams.

`--costs` measures the served model's verification step of 1..9 lanes of one sequence and the draft
model's steps (its catch-up of two tokens, which yields the first draft, and a one-token step), then
prints the speed-up that drafting at per-token acceptance p gives from those costs: k drafts yield
(1 - p^(k+1)) / (1 - p) tokens in a verification of k + 1 lanes plus the k draft steps that made
them (none for prompt lookup), at the best k. That is the ceiling a draft model of that acceptance
reaches on this machine, whatever its weights.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from webapp.engine.model.tinygrad_setup import prepare_tinygrad  # noqa: E402

prepare_tinygrad()

from webapp.engine.decoding.drafts import DRAFT_MAX, RecentOutputs  # noqa: E402
from webapp.engine.decoding.sampling_params import SamplingParams  # noqa: E402
from webapp.engine.serving.draft_model import CATCH_UP  # noqa: E402
from webapp.engine.serving.engine import Engine  # noqa: E402
from webapp.engine.serving.loader import load_gguf_model  # noqa: E402
from webapp.engine.serving.request import Finished, Request  # noqa: E402
from webapp.engine.serving.settings import default_model_path  # noqa: E402

# a whole file of ~350 tokens that never changes (a slice of the project's own code drifted with every
# edit of it and began mid-word)
CODE = open(os.path.join(os.path.dirname(__file__), "workloads", "inventory.py")).read()
ARTICLE = (
    "The city council met on Tuesday to discuss the new bus routes. Residents of the northern districts "
    "asked for more frequent service in the mornings, while shop owners in the centre worried about "
    "parking. The council agreed to test a route through the market square for three months, starting "
    "in May, and to publish the number of riders every week. A final vote on the routes is planned for "
    "the autumn, after the test ends."
)
KINDS = {
    "code edit": f"Here is a Python file:\n\n```python\n{CODE}```\n\nRewrite the whole file with the method `remove` renamed to `take`. Change nothing else.",
    "summary": f"Summarize this article in three sentences, reusing its words:\n\n{ARTICLE}",
    "JSON extraction": f"From this article, give JSON with the keys when, who, what and where:\n\n{ARTICLE}",
    "free chat": "Tell me about the history of the bicycle.",
}
SAMPLINGS = {"greedy": dict(temperature=0.0), "temperature 0.7": dict(temperature=0.7, top_p=0.95, seed=1)}


# what each column runs: speculation on, and the draft model beside prompt lookup
MODES = {
    "plain": (False, False, True),
    "n-gram": (True, False, True),
    "draft model": (True, True, True),
    "constant costs": (True, False, False),
}


def run(engine: Engine, prompt: list[int], tokens: int, mode: str, sampling: dict, repeat: bool = False):
    engine.speculation.enabled, engine.speculation.use_draft_model, engine.speculation.measured_costs = MODES[mode]
    # each run drafts from its own text: with the server's recent answers, a later round would draft
    # the earlier round's answer to the same prompt (the repeated-request case, asked for by `repeat`)
    engine.speculation.recent = RecentOutputs()
    params = SamplingParams(max_tokens=tokens, stop_token_ids=frozenset(engine.tokenizer.stop_ids), **sampling)
    if repeat:
        first = Request(prompt, params)
        engine.submit(first)
        while not isinstance(item := first.outputs.get(), Finished):
            if isinstance(item, Exception):
                raise item
    request = Request(prompt, params)
    engine.submit(request)
    times = []
    while not isinstance(item := request.outputs.get(), Finished):
        if isinstance(item, Exception):
            raise item
        times.append(time.monotonic())
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    return rate, request


def run_seeds(engine: Engine, prompt: list[int], tokens: int, mode: str, sampling: dict, seeds: int, repeat: bool):
    """One run of each seed (a sampling without one: a single run): their tokens over their decode
    time, and the requests."""
    runs = (
        [run(engine, prompt, tokens, mode, dict(sampling, seed=seed), repeat) for seed in range(1, seeds + 1)]
        if "seed" in sampling
        else [run(engine, prompt, tokens, mode, sampling, repeat)]
    )
    made = sum(len(r.output_ids) - 1 for _, r in runs)
    return made / sum((len(r.output_ids) - 1) / rate for rate, r in runs), [r for _, r in runs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="a draft model's GGUF (LLM_DRAFT_MODEL)")
    ap.add_argument("--tokens", type=int, default=320)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    ap.add_argument("--samplings", default=",".join(SAMPLINGS), help="comma-separated: " + ", ".join(SAMPLINGS))
    ap.add_argument("--streams", action=argparse.BooleanOptionalAction, default=True, help="the 8-stream row")
    ap.add_argument("--constant-costs", action="store_true", help="prompt lookup with LANE_COST a lane too (see above)")
    ap.add_argument("--seeds", type=int, default=5, help="seeds of each sampled row (1..n)")
    ap.add_argument("--repeat", action="store_true", help="each timed run follows the same request's answer (see above)")
    ap.add_argument("--costs", action="store_true", help="step costs and the speed-up they allow at each acceptance")
    ap.add_argument("--beside-prompts", action="store_true", help="the code edit while other prompts keep arriving (see above)")
    args = ap.parse_args()
    path = args.model or default_model_path()
    engine = Engine(lambda: load_gguf_model(path, 8, 4096, 32, draft=args.draft), slots=8, prefill_chunk=32).start()
    while engine.state == "loading":
        time.sleep(0.2)
    assert engine.state == "ok", engine.error
    modes = ["plain", "n-gram"] + (["draft model"] if args.draft else []) + (["constant costs"] if args.constant_costs else [])
    draft = engine.loaded.runner.draft
    beside = f", draft {draft.name} (a step costs {draft.step_cost:.2f} of the served model's)" if draft else ""
    print(f"# speculation on {os.path.basename(path)}{beside}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")
    heads = [f"{m} tok/s" for m in modes] + [
        f"{m} {what}" for m in modes[1:] for what in ("ratio", "each round's ratio", "drafted", "confirmed")
    ]
    print("| request | sampling | tokens | " + " | ".join(heads) + " | same output |")
    print("|---" * (4 + len(heads)) + "|")
    for kind in args.kinds.split(","):
        text = KINDS[kind]
        prompt = engine.tokenizer.encode(
            engine.chat_template.render([{"role": "user", "content": text}], add_generation_prompt=True), special=True
        )
        for name in args.samplings.split(","):
            rates, last, outputs = {m: [] for m in modes}, {}, set()
            for _ in range(args.rounds):
                for mode in modes:
                    rate, last[mode] = run_seeds(engine, prompt, args.tokens, mode, SAMPLINGS[name], args.seeds, args.repeat)
                    rates[mode].append(rate)
                    outputs.add(tuple(tuple(r.output_ids) for r in last[mode]))
            medians = {m: statistics.median(r) for m, r in rates.items()}
            cells = [f"{medians[m]:.1f}" for m in modes]
            for m in modes[1:]:
                drafted, confirmed = sum(r.drafted_tokens for r in last[m]), sum(r.accepted_tokens for r in last[m])
                share = confirmed / drafted if drafted else 0.0
                cells += [
                    f"{medians[m] / medians['plain']:.2f}x",
                    f"{each_rounds_ratio(rates[m], rates['plain']):.2f}x",
                    str(drafted),
                    f"{share:.0%}",
                ]
            same = "yes" if len(outputs) == 1 else "NO"
            label = f"{kind}, again" if args.repeat else kind
            made = sum(len(r.output_ids) for r in last["plain"])
            print(f"| {label} | {name} | {made} | " + " | ".join(cells) + f" | {same} |")
    if args.beside_prompts:
        beside_prompts(engine, args.tokens, args.rounds)
    if args.streams:
        eight_streams(engine, args.tokens, args.rounds, args.constant_costs)
    if args.costs:
        costs(engine)
    engine.stop(5)
    return 0


def beside_prompts(engine: Engine, tokens: int, rounds: int) -> None:
    """The code edit (greedy) while another client keeps one long prompt in prefill at every moment
    (its ~300 tokens, one token answered, then the next): most of the edit's steps then also prefill
    a chunk, and drafts must be verified in those mixed steps to help at all."""
    print("\n| code edit, greedy, beside arriving prompts | plain tok/s | n-gram tok/s | ratio | drafted | confirmed | same output |")
    print("|---|---|---|---|---|---|---|")
    render, encode = engine.chat_template.render, engine.tokenizer.encode
    edit = encode(render([{"role": "user", "content": KINDS["code edit"]}], add_generation_prompt=True), special=True)

    def keep_prefilling(done: threading.Event) -> None:
        for n in itertools.count():  # a new opening each time: no cached prefix serves it
            text = f"Article {n}, from the archive of {n * 7 % 31} years ago. " + ARTICLE * 3
            other = Request(
                encode(render([{"role": "user", "content": text}], add_generation_prompt=True), special=True), SamplingParams(max_tokens=1)
            )
            engine.submit(other)
            while not isinstance(other.outputs.get(), Finished):
                pass
            if done.is_set():
                return

    rates, outputs, last = {"plain": [], "n-gram": []}, set(), None
    for _ in range(rounds):
        for mode in rates:
            done = threading.Event()
            background = threading.Thread(target=keep_prefilling, args=(done,))
            background.start()
            time.sleep(0.5)  # the first filler prompt is in prefill
            rate, last = run(engine, edit, tokens, mode, SAMPLINGS["greedy"])
            done.set()
            background.join()
            rates[mode].append(rate)
            outputs.add(tuple(last.output_ids))
    plain, drafted = statistics.median(rates["plain"]), statistics.median(rates["n-gram"])
    share = last.accepted_tokens / last.drafted_tokens if last.drafted_tokens else 0.0
    same = "yes" if len(outputs) == 1 else "NO"
    print(
        f"| {len(last.output_ids)} tokens | {plain:.1f} | {drafted:.1f} | {drafted / plain:.2f}x | {last.drafted_tokens} | {share:.0%} | {same} |"
    )


def eight_streams(engine: Engine, tokens: int, rounds: int, constant_costs: bool = False) -> None:
    print(
        "\n| 8 streams, 2 of each kind, temperature 0.7 | aggregate tok/s plain | with drafts | ratio | each round's ratio (median) | drafted | confirmed | same outputs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    prompts = [p for p in prompts_of(engine) for _ in range(2)]
    modes = [(True, True)] + ([(True, False)] if constant_costs else [])  # (speculate, measured costs)
    plain, drafted, last, same = [], {m: [] for m in modes}, {}, True
    for _ in range(rounds):
        rate_a, a = streams(engine, prompts, tokens, False)
        plain.append(rate_a)
        for mode in modes:
            rate_b, last[mode] = streams(engine, prompts, tokens, *mode)
            drafted[mode].append(rate_b)
            same &= [r.output_ids for r in a] == [r.output_ids for r in last[mode]]
    p = statistics.median(plain)
    for mode in modes:
        d, b = statistics.median(drafted[mode]), last[mode]
        n, ok = sum(r.drafted_tokens for r in b), sum(r.accepted_tokens for r in b)
        label = "prompt lookup" + ("" if mode[1] else ", constant costs")
        paired = each_rounds_ratio(drafted[mode], plain)
        print(
            f"| {label} | {p:.1f} | {d:.1f} | {d / p:.2f}x | {paired:.2f}x | {n} | {ok / n if n else 0:.0%} | {'yes' if same else 'NO'} |"
        )


def timed(step, times: int = 9) -> float:
    """Median seconds of `step()`."""
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        step()
        spent.append(time.perf_counter() - started)
    return statistics.median(spent)


def costs(engine: Engine) -> None:
    """The step costs of one sequence's drafting and verification, and the speed-up they allow at each
    acceptance p (the model thread is idle: these run on the scratch slot from this thread)."""
    steps, draft = engine.loaded.runner.steps, engine.loaded.runner.draft
    scratch, at = steps.model.slots, 200
    verify = {n: timed(lambda n=n: steps.verify([[0] * n], [scratch], [at])) for n in range(1, DRAFT_MAX + 2)}
    print("\n| lanes of one sequence in a verification | " + " | ".join(map(str, verify)) + " |")
    print("|---" * (1 + len(verify)) + "|")
    print("| ms | " + " | ".join(f"{t * 1e3:.1f}" for t in verify.values()) + " |")
    print("| in one-lane steps | " + " | ".join(f"{t / verify[1]:.2f}" for t in verify.values()) + " |")
    first = step = 0.0
    if draft is not None:
        first = timed(lambda: draft.steps.prefill_and_decode([([0, 0], scratch, at)], [], [], []))
        step = timed(lambda: draft.steps.decode([0], [scratch], [at]))
        catch_up = timed(lambda: draft.steps.prefill_and_decode([([0] * CATCH_UP, scratch, at)], [], [], []), 3)
        print(
            f"\ndraft model: catch-up of 2 tokens + first draft {first * 1e3:.1f} ms, each further draft {step * 1e3:.1f} ms, "
            f"a new prompt's {CATCH_UP} tokens a step {catch_up * 1e3:.1f} ms"
        )
    print("\n| acceptance p | " + ("draft model: best k, speed-up | " if draft else "") + "free drafts (prompt lookup): best k, speed-up |")
    print("|---|" + ("---|" if draft else "") + "---|")
    for p in (0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0):
        cells = [best_speedup(p, verify, first, step)] if draft else []
        cells.append(best_speedup(p, verify, 0.0, 0.0))
        print(f"| {p:.2f} | " + " | ".join(f"k = {k}, {x:.2f}x" for k, x in cells) + " |")


def best_speedup(p: float, verify: dict, first: float, step: float) -> tuple[int, float]:
    """The k that makes the most tokens per second at acceptance p, and its speed-up over plain decoding:
    (1 - p^(k+1)) / (1 - p) tokens (k + 1 at p = 1) from a verification of k + 1 lanes and k drafts."""
    best = (0, 1.0)
    for k in range(1, DRAFT_MAX + 1):
        tokens = k + 1 if p >= 1 else (1 - p ** (k + 1)) / (1 - p)
        seconds = verify[k + 1] + (first + (k - 1) * step if first else 0.0)
        best = max(best, (k, tokens * verify[1] / seconds), key=lambda b: b[1])
    return best


def each_rounds_ratio(rates: list[float], plain: list[float]) -> float:
    """The median of each round's ratio: a round's two runs are neighbours in time, where the medians
    of all rounds are taken apart by this machine's drift."""
    return statistics.median(x / y for x, y in zip(rates, plain, strict=True))


def prompts_of(engine) -> list[list[int]]:
    render = engine.chat_template.render
    return [
        engine.tokenizer.encode(render([{"role": "user", "content": t}], add_generation_prompt=True), special=True) for t in KINDS.values()
    ]


def streams(engine: Engine, prompts: list[list[int]], tokens: int, speculate: bool, measured_costs: bool = True):
    """All prompts at once (seeded, temperature 0.7); aggregate tok/s from the first token to the last."""
    engine.speculation.enabled, engine.speculation.use_draft_model, engine.speculation.measured_costs = speculate, True, measured_costs
    engine.speculation.recent = RecentOutputs()
    stops = frozenset(engine.tokenizer.stop_ids)
    requests = [Request(p, SamplingParams(max_tokens=tokens, stop_token_ids=stops, temperature=0.7, seed=i)) for i, p in enumerate(prompts)]
    for request in requests:
        engine.submit(request)
    for request in requests:
        while not isinstance(item := request.outputs.get(), Finished):
            if isinstance(item, Exception):
                raise item
    first = min(r.first_token_at for r in requests)
    last = max(r.last_token_at for r in requests)
    return sum(len(r.output_ids) for r in requests) / (last - first), requests


if __name__ == "__main__":
    sys.exit(main())
