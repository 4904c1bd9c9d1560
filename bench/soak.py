"""Soak test: a real `waitress-serve` process under N requests, C at a time, some clients hanging up.

Usage: DEV=CPU .venv/bin/python bench/soak.py [--requests 200] [--concurrency 16] [--disconnect 0.3]
           [--model tiny|default|PATH] [--max-tokens 32] [--slots 4] [--seed 0]

The server is started here on a free 127.0.0.1 port: by default on a tiny random-weight GGUF (fast,
the output is gibberish), with `--model default` on the shipped model, or on a GGUF path. Every
request picks chat or completion, streamed or not, a prompt and a `max_tokens` at random; a
`--disconnect` share of the clients hang up on purpose at a random point (before the answer, or
after some stream events). Each request ends as one of:

  completed  a full answer: a finish_reason, and for a stream every event JSON and `[DONE]` last
  cancelled  this client hung up on purpose
  rejected   429 or 503 (queue full, shutting down): refused at once, with Retry-After
  errors     any other HTTP error, or an error event in a stream
  lost       neither an answer nor an error: a reset, a truncated stream, a timeout

Then it waits for the server to go idle and reports what the engine saw (finish reasons, from
/admin/stats.json when it is open), the free slots, the server's thread count and
RSS at start, before (after one warm-up wave of C requests) and after, and finally sends SIGTERM and
reports the exit code and how long shutdown took. `run(...)` does the same and returns the dict;
tests pass it a `Server` they started (and shut down themselves).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WORDS = (
    "river",
    "lamp",
    "orange",
    "quiet",
    "engine",
    "paper",
    "stone",
    "cloud",
    "music",
    "garden",
    "window",
    "silver",
    "tiger",
    "bread",
    "winter",
    "rocket",
    "candle",
    "forest",
    "ocean",
    "letter",
    "mirror",
    "bridge",
    "spark",
    "violet",
)
OUTCOMES = ("completed", "cancelled", "rejected", "errors", "lost")


def tiny_model(directory: str) -> str:
    """A tiny random-weight llama GGUF with the SmolLM2 tokenizer (the tests' own model writer)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from support.tiny_models import write_tiny_gguf

    return write_tiny_gguf(os.path.join(directory, "tiny.gguf"), "llama", context=256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_stats(pid: int) -> dict:
    """Threads and resident memory of a process, from /proc (Linux)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return {"threads": int(fields["Threads"][0]), "rss_mb": int(fields["VmRSS"][0]) / 1024}


@dataclass
class Server:
    """A `waitress-serve wsgi:app` subprocess on 127.0.0.1; `model` None means the default model."""

    model: str | None
    env: dict = field(default_factory=dict)
    threads: int = 48
    port: int = 0
    log_path: str | None = None

    def start(self) -> Server:
        self.port = self.port or free_port()
        env = {**os.environ, "DEV": os.environ.get("DEV", "CPU"), **self.env}
        if self.model:
            env["LLM_MODEL"] = self.model
        self._own_log = self.log_path is None
        if self._own_log:
            fd, self.log_path = tempfile.mkstemp(prefix="soak-server-", suffix=".log")
            self._log = os.fdopen(fd, "wb")
        else:
            self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed by close()
        self.process = subprocess.Popen(
            [
                os.path.join(os.path.dirname(sys.executable), "waitress-serve"),
                f"--listen=127.0.0.1:{self.port}",
                f"--threads={self.threads}",
                "--channel-request-lookahead=1",  # notice clients that hang up on non-streamed calls
                "wsgi:app",
            ],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: its compile workers go with it
        )
        return self

    def wait_ready(self, timeout: float = 600) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if self.get("/health")[0] == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready after {timeout} s:\n{self.log()}")

    def get(self, path: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"{}")
        finally:
            conn.close()

    def wait_idle(self, timeout: float = 30) -> dict:
        """The health dict once nothing runs or waits (or whatever it is when time is up)."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.get("/health")[1]
            if (health.get("running"), health.get("queue_depth")) == (
                0,
                0,
            ) or time.monotonic() > deadline:
                return health
            time.sleep(0.1)

    def stats(self) -> dict:
        return process_stats(self.process.pid)

    def finished(self) -> dict:
        """The engine's count of finished requests by reason (from the dashboard's JSON)."""
        try:
            status, body = self.get("/admin/stats.json")
        except (OSError, ValueError):
            return {}
        return dict(body.get("requests_total", {})) if status == 200 else {}

    def terminate(self, timeout: float = 60, group: bool = False) -> tuple[int, float]:
        """SIGTERM to the server (as docker and Kubernetes send it) or to its whole process group
        (as systemd and `timeout` do); (exit code, seconds until the process was gone)."""
        started = time.monotonic()
        if group:
            os.killpg(self.process.pid, signal.SIGTERM)
        else:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout)
        return code, time.monotonic() - started

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the server and whatever it started
        self.process.wait()
        self._log.close()
        if self._own_log:
            os.unlink(self.log_path)


def one_request(port: int, rng: random.Random, disconnect: float, max_tokens: int, timeout: float) -> str:
    """Send one random request; return its outcome (one of OUTCOMES)."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.6
    text = " ".join(rng.choices(WORDS, k=rng.randint(1, 40)))
    body: dict = {
        "max_tokens": rng.randint(1, max_tokens),
        "stream": stream,
        "temperature": rng.choice([0, 0.7, 1.0]),
    }
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    hang_up = rng.random() < disconnect
    path = "/v1/chat/completions" if chat else "/v1/completions"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        if hang_up and (not stream or rng.random() < 0.3):
            time.sleep(rng.uniform(0, 0.2))  # gone before (or while) the answer is made
            return "cancelled"
        response = conn.getresponse()
        if response.status in (429, 503):
            response.read()
            return "rejected"
        if response.status != 200:
            response.read()
            return "errors"
        if not stream:
            answer = json.loads(response.read())
            return "completed" if answer["choices"][0]["finish_reason"] else "lost"
        stop_after = rng.randint(1, body["max_tokens"] + 2) if hang_up else None
        return _read_stream(response, stop_after)
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return "lost"
    finally:
        conn.close()  # for a client hanging up mid-stream, this is the hang-up


def _read_stream(response, stop_after: int | None) -> str:
    events, finished = 0, False
    while True:
        line = response.readline()
        if not line:
            return "lost"  # the stream ended without [DONE]
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :].strip()
        if data == b"[DONE]":
            return "completed" if finished else "lost"
        event = json.loads(data)
        if "error" in event:
            return "errors"
        finished = finished or any(c.get("finish_reason") for c in event.get("choices", []))
        events += 1
        if stop_after is not None and events >= stop_after:
            return "cancelled"


def soak(
    port: int,
    requests: int,
    concurrency: int,
    disconnect: float,
    max_tokens: int,
    seed: int,
    timeout: float = 120,
) -> dict:
    counts = dict.fromkeys(OUTCOMES, 0)
    seeds = random.Random(seed)
    jobs = [random.Random(seeds.getrandbits(64)) for _ in range(requests)]
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for outcome in pool.map(lambda rng: one_request(port, rng, disconnect, max_tokens, timeout), jobs):
            counts[outcome] += 1
    return {**counts, "seconds": round(time.monotonic() - started, 2)}


def run(
    requests: int = 200,
    concurrency: int = 16,
    disconnect: float = 0.3,
    model: str = "tiny",
    max_tokens: int = 32,
    slots: int = 4,
    seed: int = 0,
    server: Server | None = None,
) -> dict:
    """Start a server, soak it, shut it down with SIGTERM; the report as a dict.

    Given a started `server`, soak that one instead and leave it running (no exit code then).
    """
    if server is not None:
        return _measure(server, requests, concurrency, disconnect, max_tokens, seed)
    with tempfile.TemporaryDirectory() as tmp:
        env = {"LLM_SLOTS": str(slots)}
        if model == "tiny":
            path = tiny_model(tmp)
            env["LLM_MAX_CONTEXT"] = "256"
        else:
            path = None if model == "default" else model
        server = Server(path, env, threads=max(48, concurrency + 16)).start()
        try:
            ready_s = server.wait_ready()
            report = {"model": model, "ready_s": round(ready_s, 1)}
            report.update(_measure(server, requests, concurrency, disconnect, max_tokens, seed))
            exit_code, shutdown_s = server.terminate()
        finally:
            server.close()
    return {**report, "exit_code": exit_code, "shutdown_s": round(shutdown_s, 2)}


def _measure(server: Server, requests: int, concurrency: int, disconnect: float, max_tokens: int, seed: int) -> dict:
    at_start = server.stats()
    soak(server.port, concurrency, concurrency, 0.0, max_tokens, seed + 1)  # warm-up wave
    server.wait_idle()
    before, finished_before = server.stats(), server.finished()
    counts = soak(server.port, requests, concurrency, disconnect, max_tokens, seed)
    health = server.wait_idle()
    after, finished_after = server.stats(), server.finished()
    server_view = {k: v - finished_before.get(k, 0) for k, v in finished_after.items()}
    slots_total = health.get("slots_total", 0)
    return {
        "requests": requests,
        "concurrency": concurrency,
        "disconnect_share": disconnect,
        **counts,
        "slots_free": slots_total - health.get("running", 0),
        "slots_total": slots_total,
        "queue_depth_after": health.get("queue_depth"),
        # What the engine saw: requests that ended "cancelled" are the hang-ups it noticed mid-way.
        "server_finished": server_view,
        "threads_start": at_start["threads"],
        "threads_before": before["threads"],
        "threads_after": after["threads"],
        "rss_mb_start": round(at_start["rss_mb"], 1),
        "rss_mb_before": round(before["rss_mb"], 1),
        "rss_mb_after": round(after["rss_mb"], 1),
        "rss_growth_pct": round(100 * (after["rss_mb"] - before["rss_mb"]) / before["rss_mb"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--disconnect", type=float, default=0.3, help="share of clients that hang up early")
    parser.add_argument("--model", default="tiny", help="tiny (default), default (the shipped model) or a GGUF path")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = run(
        args.requests,
        args.concurrency,
        args.disconnect,
        args.model,
        args.max_tokens,
        args.slots,
        args.seed,
    )
    width = max(map(len, report))
    for key, value in report.items():
        print(f"{key:<{width}}  {value}")
    healthy = report["errors"] == report["lost"] == 0 and report["slots_free"] == report["slots_total"] and report["exit_code"] == 0
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
