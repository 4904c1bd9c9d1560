"""Concurrent streaming chat clients against OpenAI-compatible servers on 127.0.0.1, one table.

Usage: DEV=CPU .venv/bin/python bench/http_load.py [--url http://127.0.0.1:8000/v1] [--url2 URL]
           [--start-ours] [--start-llama-server PATH] [--model GGUF] [--levels 1,4,8,16]
           [--max-tokens 128] [--timeout 600] [--rounds R] [--prefill-tokens N]

For each server and each level N, N clients start together, each sending one different question
(streamed, greedy, `max_tokens` tokens with `ignore_eos`, which both our server and llama-server
accept), and read the SSE stream. Tokens are counted from the final `usage` chunk
(`stream_options.include_usage`), or by content chunks when a server sends none. Servers are measured
one after another, never at the same time. `--start-ours` runs the Makefile's `serve` target and
`--start-llama-server PATH` runs `PATH -m MODEL -np 8 -t <usable cores> -c <8 x 4096>`; each is started
just before its turn, its resident memory (RSS) printed when ready and after the load, and stopped
after its turn. Only 127.0.0.1 is accepted.

`--rounds R` (two servers): both are started first and stay loaded; each round runs every level on
each, the order alternating from round to round, and each round's ratio (first server over second)
is taken from measurements seconds apart, so a VM's drift between rounds cancels. The table gives
the median of each server's rounds; a second table the median of the per-round ratios and their
range. `--prefill-tokens N` adds a level of one request with a prompt of about N tokens and one
token out: its prompt tokens over its time to first token, each round's prompt new to both servers'
caches. Whether our server speculated (LLM_SPECULATIVE, on by default) is printed.

Columns: 'agg tok/s' = every generated token over the level's wall time (first request sent to last
stream closed); 'per-stream tok/s' = the mean over streams of (tokens - 1) / (last chunk - first chunk);
TTFT = request sent to first content chunk; ITL = gaps between content chunks, over all streams;
'errors' = requests that failed, returned an error event, or ran past --timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import statistics
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.servers import HOST, Launched, exit_on_sigterm, start_llama_server, start_ours, usable_cores  # noqa: E402
from bench.workload import QUESTIONS, pct  # noqa: E402

SPECULATION = os.environ.get("LLM_SPECULATIVE", "true (the default)")


@dataclass
class Stream:
    """One streamed chat request and what its client saw."""

    question: str
    started: float = 0.0
    ended: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with content
    finished: float | None = None  # arrival of the chunk with a finish_reason (a lone token may have no content: whitespace a parser holds)
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)


def parse_base_url(url: str) -> tuple[int, str]:
    """(port, path prefix) of an http://127.0.0.1:PORT/v1 URL; anything off this machine is refused."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in (HOST, "localhost"):
        raise SystemExit(f"--url must be http://{HOST}:PORT/...: this bench talks to this machine only, not {url!r}")
    return parts.port or 80, parts.path.rstrip("/")


def first_model_id(port: int, prefix: str) -> str:
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        conn.request("GET", f"{prefix}/models")
        body = json.loads(conn.getresponse().read())
        return body["data"][0]["id"]
    finally:
        conn.close()


def run_stream(stream: Stream, port: int, prefix: str, model: str, max_tokens: int, deadline: float) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": stream.question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection(HOST, port, timeout=max(1.0, deadline - time.monotonic()))
    stream.started = time.monotonic()
    try:
        conn.request("POST", f"{prefix}/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            stream.error = f"HTTP {response.status}: {response.read(300)!r}"
            return
        while line := response.readline():
            if time.monotonic() > deadline:
                stream.error = "timed out"
                return
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                stream.error = str(event["error"])[:300]
                return
            if any(c.get("delta", {}).get("content") for c in event.get("choices") or []):
                stream.chunk_times.append(time.monotonic())
            if stream.finished is None and any(c.get("finish_reason") for c in event.get("choices") or []):
                stream.finished = time.monotonic()
            if event.get("usage"):
                stream.usage_tokens = event["usage"]["completion_tokens"]
                stream.prompt_tokens = event["usage"].get("prompt_tokens")
        stream.error = "stream closed before [DONE]"
    except (OSError, ValueError, http.client.HTTPException) as e:
        stream.error = f"{type(e).__name__}: {e}"
    finally:
        stream.ended = time.monotonic()
        conn.close()


def run_level(port: int, prefix: str, model: str, clients: int, max_tokens: int, timeout: float, tag: str) -> dict:
    # a tag in every question: no level reuses another's cached prompt beyond the chat template's head
    streams = [Stream(f"({tag}.{i}) {QUESTIONS[i % len(QUESTIONS)]}") for i in range(clients)]
    deadline = time.monotonic() + timeout
    threads = [threading.Thread(target=run_stream, args=(s, port, prefix, model, max_tokens, deadline)) for s in streams]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    good = [s for s in streams if s.error is None and s.chunk_times]
    errors = [s.error or "no content" for s in streams if s not in good]
    rates = [(s.tokens - 1) / (s.chunk_times[-1] - s.chunk_times[0]) for s in good if len(s.chunk_times) > 1]
    itls = [b - a for s in good for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    ttfts = [s.chunk_times[0] - s.started for s in good]
    return {
        "clients": clients,
        "agg": sum(s.tokens for s in good) / wall,
        "tokens": sum(s.tokens for s in good),
        "ttft50": pct(ttfts, 0.5),
        "ttft95": pct(ttfts, 0.95),
        "per_stream": statistics.mean(rates) if rates else float("nan"),
        "itl50": pct(itls, 0.5),
        "itl95": pct(itls, 0.95),
        "errors": errors,
    }


def run_prefill(port: int, prefix: str, model: str, words: int, timeout: float, tag: str) -> dict:
    """One request of a ~`words`-token prompt and one token out: prompt tokens over time to first token."""
    text = " ".join(QUESTIONS[i % len(QUESTIONS)] for i in range(words // 8 + 1)).split()[:words]
    stream = Stream(f"({tag}) Summarize: " + " ".join(text))
    run_stream(stream, port, prefix, model, 1, time.monotonic() + timeout)
    first = stream.chunk_times[0] if stream.chunk_times else stream.finished
    good = stream.error is None and first is not None and stream.prompt_tokens
    seconds = first - stream.started if good else float("nan")
    return {
        "clients": f"prefill {stream.prompt_tokens or words}",
        "agg": stream.prompt_tokens / seconds if good else float("nan"),
        "tokens": stream.prompt_tokens or 0,
        "ttft50": seconds,
        "ttft95": seconds,
        "per_stream": float("nan"),
        "itl50": float("nan"),
        "itl95": float("nan"),
        "errors": [] if good else [stream.error or "no token or usage"],
    }


def measure(label: str, url: str, levels: list[int], max_tokens: int, timeout: float, prefill: int = 0, tag: str = "") -> list[dict]:
    port, prefix = parse_base_url(url)
    model = first_model_id(port, prefix)
    # one short request first: anything a server does lazily on its first request stays out of the table
    run_level(port, prefix, model, 1, 8, timeout, f"warm-up{tag}")
    rows = []
    if prefill:
        rows.append({"server": label, **run_prefill(port, prefix, model, prefill, timeout, f"P{tag}")})
        print(f"  {label}: prefill, {rows[-1]['agg']:.1f} tok/s", file=sys.stderr)
    for clients in levels:
        row = run_level(port, prefix, model, clients, max_tokens, timeout, f"L{clients}{tag}")
        rows.append({"server": label, **row})
        print(f"  {label}: {clients} clients, {row['agg']:.1f} tok/s, {len(row['errors'])} errors", file=sys.stderr)
    return rows


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """Each (server, level) row with every number the median of its rounds', the errors of all."""
    merged = []
    for same in zip(*rounds):
        row = dict(same[0])
        for key in ("agg", "tokens", "ttft50", "ttft95", "per_stream", "itl50", "itl95"):
            row[key] = statistics.median(r[key] for r in same)
        row["errors"] = [e for r in same for e in r["errors"]]
        merged.append(row)
    return merged


def print_ratios(first: str, second: str, rounds: list[list[dict]]) -> None:
    """The median and range over rounds of first's agg tok/s (prefill: prompt tok/s) over second's."""
    print(f"\n{len(rounds)} rounds, the order alternating; each round's ratio {first} / {second}:\n")
    print("| clients | agg tok/s ratio: median (range) | per round |")
    print("|---|---:|---|")
    ratios: dict = {}
    for rows in rounds:
        by = {(r["server"], str(r["clients"]).split(" ")[0]): r["agg"] for r in rows}
        for (server, clients), agg in by.items():
            if server == first and (second, clients) in by:
                ratios.setdefault(clients, []).append(agg / by[(second, clients)])
    for clients, each in ratios.items():
        spread = f"{statistics.median(each):.2f} ({min(each):.2f}-{max(each):.2f})"
        print(f"| {clients} | {spread} | {' '.join(f'{x:.2f}' for x in each)} |")


def print_table(rows: list[dict], max_tokens: int) -> None:
    print(
        f"\nMachine: {platform.machine()}, {usable_cores()} usable cores. Each client: one streamed chat request, {max_tokens} tokens, greedy, ignore_eos.\n"
    )
    print("| server | clients | agg tok/s | TTFT p50 / p95 (s) | per-stream tok/s | ITL p50 / p95 (ms) | tokens | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['server']} | {r['clients']} | {r['agg']:.1f} | {r['ttft50']:.2f} / {r['ttft95']:.2f} | {r['per_stream']:.1f} | "
            f"{r['itl50'] * 1000:.0f} / {r['itl95'] * 1000:.0f} | {r['tokens']} | {len(r['errors'])} |"
        )
    for r in rows:
        for e in sorted(set(r["errors"])):
            print(f"\n{r['server']}, {r['clients']} clients: {r['errors'].count(e)} x {e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="an OpenAI-compatible base URL on 127.0.0.1, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--url2", help="a second server's base URL, measured after the first")
    ap.add_argument("--start-ours", action="store_true", help="start this checkout's server (make serve) for the run")
    ap.add_argument("--start-llama-server", metavar="PATH", help="start this llama-server binary on --model for the run")
    ap.add_argument("--model", help="GGUF for the servers started here (default: LLM_MODEL, else our default model)")
    ap.add_argument("--levels", default="1,4,8,16", help="concurrent clients per level, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=600, help="seconds each level may take before its streams count as errors")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over two servers, both loaded, the order alternating")
    ap.add_argument("--prefill-tokens", type=int, default=0, help="add a level of one ~N-token prompt and one token out")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    levels = [int(x) for x in args.levels.split(",")]
    if max(levels) > 64 or min(levels) < 1:
        raise SystemExit("--levels: 1 to 64 clients per level")

    # (label, url or a function that starts the server); servers we start run only during their turn
    targets: list[tuple[str, object]] = []
    if args.start_ours:
        targets.append(("tinyserve", lambda: start_ours(model=args.model)))
    if args.start_llama_server:
        from webapp.engine.serving.settings import default_model_path

        model = args.model or os.environ.get("LLM_MODEL") or default_model_path()
        targets.append(("llama-server", lambda: start_llama_server(args.start_llama_server, model)))
    for url in (args.url, args.url2):
        if url:
            parse_base_url(url)
            targets.append((url, url))
    if not targets:
        raise SystemExit("nothing to measure: give --url, --url2, --start-ours or --start-llama-server")

    if args.rounds > 1:
        return alternate(targets, levels, args)
    rows, memory = [], {}
    for label, target in targets:
        if isinstance(target, str):
            rows += measure(label, target, levels, args.max_tokens, args.timeout, args.prefill_tokens)
            continue
        started = time.monotonic()
        server: Launched
        with target() as server:
            ready = server.rss_mb()
            print(f"  {label} ready in {time.monotonic() - started:.1f} s on {server.url}, RSS {ready:.0f} MiB", file=sys.stderr)
            rows += measure(label, server.url, levels, args.max_tokens, args.timeout, args.prefill_tokens)
            memory[label] = (ready, server.rss_mb())
    print_table(rows, args.max_tokens)
    print(f"\nOur server's speculation (LLM_SPECULATIVE): {SPECULATION}.")
    for label, (ready, after) in memory.items():
        print(f"\n{label} resident memory: {ready:.0f} MiB when ready, {after:.0f} MiB after the load")
    return 0 if not any(r["errors"] for r in rows) else 1


def alternate(targets: list[tuple[str, object]], levels: list[int], args) -> int:
    """--rounds: both servers up at once, every round over both in alternating order."""
    if len(targets) != 2:
        raise SystemExit("--rounds compares two servers: give two of --url, --url2, --start-ours, --start-llama-server")
    with contextlib.ExitStack() as running:
        urls = {}
        for label, target in targets:
            if isinstance(target, str):
                urls[label] = target
                continue
            server = running.enter_context(target())
            print(f"  {label} ready on {server.url}, RSS {server.rss_mb():.0f} MiB", file=sys.stderr)
            urls[label] = server.url
        rounds = []
        for round_ in range(args.rounds):
            order = list(urls) if round_ % 2 == 0 else list(urls)[::-1]
            rows = {
                label: measure(label, urls[label], levels, args.max_tokens, args.timeout, args.prefill_tokens, f"R{round_}")
                for label in order
            }
            rounds.append([row for label in urls for row in rows[label]])
    print_table(median_rows(rounds), args.max_tokens)
    print(f"\n(each number the median of {args.rounds} rounds; our server's speculation, LLM_SPECULATIVE: {SPECULATION})")
    print_ratios(*urls, rounds)
    return 0 if not any(r["errors"] for rows in rounds for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
