"""What a chat's later requests find cached, over HTTP: a recurrent model's state snapshots (Qwen3.5)
or any model's cached prefix, against llama-server (its context checkpoints) on the same file.

Usage: DEV=CPU .venv/bin/python bench/chat_reuse.py --model FILE [--llama-server BIN] [--before DIR] [--rounds 2]
       [--restart-dir DIR]

One chat, each server started afresh each round (servers alternate, round by round):
  first turn    a ~1,000-token system prompt and a question (nothing cached yet)
  next turn     the first turn, its 32-token answer and a second question
  same again    the next turn's messages once more (a regenerated answer)
  another user  the same system prompt and another question
Each timed request asks for one token, so its latency is the prompt's prefill. Prints, per server,
the median latency and the prompt tokens the server said it found cached (ours: usage's
`cached_tokens`; llama-server: `timings.cache_n`), and ours over llama-server's latency. `--before
DIR` adds a checkout (an older commit, installed) as a third server: what the change bought.
`--restart-dir DIR` serves ours with LLM_PREFIX_CACHE_DIR=DIR (emptied first) and adds a row: ours
stopped (SIGTERM: it drains and saves) and started again, then another user's question once more
(a paged cache's filed blocks restored from the file; the other servers' cells are left empty).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.servers import Launched, exit_on_sigterm, post_json, start_llama_server, start_ours  # noqa: E402
from bench.workload import QUESTIONS  # noqa: E402

SCENARIOS = ("first turn", "next turn", "same again", "another user", "another user, after a restart")
SYSTEM = "You are the help desk of a science museum. Answer visitors in one paragraph. " + " ".join(
    f"Rule {i + 1}: when asked '{q}', answer from the museum's own exhibits and name the hall." for i, q in enumerate(QUESTIONS * 3)
)


def chat(port: int, messages: list[dict], max_tokens: int) -> tuple[float, str, int, int]:
    """One chat completion at temperature 0: seconds, its text, prompt tokens, cached prompt tokens."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    started = time.monotonic()
    answer = post_json(port, "/v1/chat/completions", body, timeout=900)
    seconds = time.monotonic() - started
    usage = answer.get("usage", {})
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = answer.get("timings", {}).get("cache_n", 0)
    return seconds, answer["choices"][0]["message"]["content"] or "", usage.get("prompt_tokens", 0), cached


SYSTEM_MESSAGE = {"role": "system", "content": SYSTEM}


def one_chat(port: int) -> dict[str, tuple[float, int, int]]:
    system = SYSTEM_MESSAGE
    first = [system, {"role": "user", "content": QUESTIONS[0]}]
    seen = {"first turn": chat(port, first, 1)}
    _, answer, _, _ = chat(port, first, 32)  # the answer the next turn's history holds (untimed)
    turn = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": QUESTIONS[1]}]
    seen["next turn"] = chat(port, turn, 1)
    seen["same again"] = chat(port, turn, 1)
    seen["another user"] = chat(port, [system, {"role": "user", "content": QUESTIONS[2]}], 1)
    return {name: (seconds, prompt, cached) for name, (seconds, _, prompt, cached) in seen.items()}


def start(name: str, args) -> Launched:
    if name == "ours":
        return start_ours(model=args.model, env={"LLM_PREFIX_CACHE_DIR": args.restart_dir} if args.restart_dir else None)
    if name == "before":
        return start_ours(model=args.model, cwd=args.before, name="before")
    return start_llama_server(args.llama_server, args.model, parallel=4)


def main() -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--llama-server", help="llama-server binary, for a column of its own")
    parser.add_argument("--before", help="another installed checkout of this project, for a column of its own")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--restart-dir", help="a scratch folder for ours' LLM_PREFIX_CACHE_DIR: adds the row after a restart")
    args = parser.parse_args()
    names = ["ours"] + (["before"] if args.before else []) + (["llama-server"] if args.llama_server else [])
    seen: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            if name == "ours" and args.restart_dir:
                shutil.rmtree(args.restart_dir, ignore_errors=True)
            with start(name, args) as server:
                seen[name].append(one_chat(server.port))
            if name == "ours" and args.restart_dir:
                with start(name, args) as server:
                    seconds, _, prompt, cached = chat(server.port, [SYSTEM_MESSAGE, {"role": "user", "content": QUESTIONS[3]}], 1)
                    seen[name][-1]["another user, after a restart"] = (seconds, prompt, cached)
            print(f"round {round_ + 1}: {name} done", file=sys.stderr)
    header = "| request | prompt tokens | " + " | ".join(f"{n} s | {n} cached" for n in names)
    header += " | ours / llama-server |" if "llama-server" in names else " |"
    print(header)
    print("|" + "---|" * (2 + 2 * len(names) + ("llama-server" in names)))
    for scenario in SCENARIOS:
        if scenario not in seen["ours"][-1]:
            continue
        ran = [n for n in names if scenario in seen[n][-1]]
        median = {n: statistics.median(r[scenario][0] for r in seen[n]) for n in ran}
        cells = [f"{median[n]:.2f} | {seen[n][-1][scenario][2]}" if n in ran else " | " for n in names]
        row = f"| {scenario} | {seen['ours'][-1][scenario][1]} | " + " | ".join(cells)
        row += f" | {median['ours'] / median['llama-server']:.2f} |" if "llama-server" in ran else " |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
