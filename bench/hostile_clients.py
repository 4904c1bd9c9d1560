"""Hostile clients: does the server keep answering while a crowd holds connections and never finishes?

Usage: .venv/bin/python bench/hostile_clients.py [--idle 3000] [--slow-bodies 200] [--unread 4]
           [--seconds 20] [--model tiny|default|PATH]

Our server is started here as `make serve` starts it (its Waitress flags), on 127.0.0.1: by default
on a tiny random-weight GGUF. Then, all at once and held for `--seconds`:

  idle         connections that send nothing at all
  slow bodies  requests whose headers promise a large body that then comes one byte a second each
               (a slowloris keeps every socket just busy enough not to be timed out)
  unread       streaming chat requests whose client never reads a byte of the answer

Once the server has answered a first /health (it accepts the crowd first), a well-behaved client
asks `/health` and `/admin` twice a second and makes one chat completion a second; the table gives their latency (p50, p99, max) and failures, and how many of
the hostile connections the server still held at the end. `run(port, ...)` does the same against a
running server and returns the dict; the test in tests/e2e/test_hostile_clients.py passes it the
server it started.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servers import HOST, ROOT, exit_on_sigterm, start_ours  # noqa: E402

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def _connect_many(port: int, count: int, first: bytes = b"", receive_buffer: int = 0) -> list[socket.socket]:
    """Up to `count` connections, each sent `first`; stops at the first the server does not take
    (a full accept backlog: the connect times out)."""
    opened = []
    for _ in range(count):
        s = socket.socket()
        s.settimeout(3)
        if receive_buffer:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        try:
            s.connect((HOST, port))
            s.sendall(first)
        except OSError:
            s.close()
            break
        opened.append(s)
    return opened


def _still_open(s: socket.socket) -> bool:
    """Whether the server has not closed this socket (nothing to read and no end of stream)."""
    s.setblocking(False)  # a socket with a timeout would wait for data first
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _timed(port: int, method: str, path: str, body: dict | None = None) -> tuple[float, int | str]:
    started = time.monotonic()
    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        conn.request(method, path, json.dumps(body) if body else None, {"Content-Type": "application/json"} if body else {})
        response = conn.getresponse()
        response.read()
        outcome: int | str = response.status
    except OSError as e:
        outcome = type(e).__name__
    finally:
        conn.close()
    return time.monotonic() - started, outcome


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(port: int, idle: int = 3000, slow_bodies: int = 200, unread: int = 4, seconds: float = 20) -> dict:
    """Holds the hostile connections on the server at `port` for `seconds` while timing a good client."""
    hostile: dict[str, list[socket.socket]] = {"idle": [], "slow bodies": [], "unread": []}
    stop = threading.Event()
    try:
        hostile["idle"] = _connect_many(port, idle)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
        hostile["slow bodies"] = _connect_many(port, slow_bodies, head)
        stream = json.dumps({**CHAT, "max_tokens": 100000, "ignore_eos": True, "stream": True}).encode()
        request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(
            stream
        )
        # a small receive buffer: the answer piles up on the server's side
        hostile["unread"] = _connect_many(port, unread, request + stream, receive_buffer=4096)

        def trickle():
            while not stop.wait(1.0):
                for s in hostile["slow bodies"]:
                    with contextlib.suppress(OSError):
                        s.send(b" ")

        threading.Thread(target=trickle, daemon=True).start()
        settled = _timed(port, "GET", "/health")  # answered once Waitress has accepted the whole crowd
        timings: dict[str, list[tuple[float, int | str]]] = {"/health": [], "/admin": [], "chat": []}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            tick = time.monotonic()
            timings["/health"].append(_timed(port, "GET", "/health"))
            timings["/admin"].append(_timed(port, "GET", "/admin"))
            if len(timings["chat"]) < (tick + seconds - deadline):
                timings["chat"].append(_timed(port, "POST", "/v1/chat/completions", CHAT))
            time.sleep(max(0.0, 0.5 - (time.monotonic() - tick)))
        held = {kind: sum(_still_open(s) for s in socks) for kind, socks in hostile.items()}
    finally:
        stop.set()
        for socks in hostile.values():
            for s in socks:
                s.close()
    asked = {"idle": idle, "slow bodies": slow_bodies, "unread": unread}
    report: dict = {"held": held, "opened": {k: len(v) for k, v in hostile.items()}, "asked": asked, "settled": settled}
    for what, got in timings.items():
        latencies = [t for t, _ in got]
        report[what] = {
            "requests": len(got),
            "failed": sum(not isinstance(o, int) or o >= 500 for _, o in got),
            "p50": _percentile(latencies, 0.5),
            "p99": _percentile(latencies, 0.99),
            "max": max(latencies, default=float("nan")),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--idle", type=int, default=3000)
    parser.add_argument("--slow-bodies", type=int, default=200)
    parser.add_argument("--unread", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--connections", type=int, help="the server's connection limit (the Makefile's CONNECTIONS)")
    parser.add_argument("--model", default="tiny", help="tiny (a random-weight GGUF), default, or a GGUF path")
    args = parser.parse_args()
    exit_on_sigterm()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this client holds every socket too
    with tempfile.TemporaryDirectory() as tmp:
        model = None if args.model == "default" else args.model
        if args.model == "tiny":
            sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
            from support.tiny_models import write_tiny_gguf

            model = write_tiny_gguf(os.path.join(tmp, "tiny.gguf"), "llama", context=256)
        env = {"LLM_LOG_LEVEL": "warning", **({"CONNECTIONS": str(args.connections)} if args.connections else {})}
        with start_ours(model=model, env=env) as ours:
            report = run(ours.port, args.idle, args.slow_bodies, args.unread, args.seconds)
    opened = ", ".join(f"{report['opened'][k]}/{n} {k}" for k, n in report["asked"].items())
    print(f"hostile connections opened: {opened}; still open after {args.seconds:.0f} s: {report['held']}")
    print(f"first /health after the crowd arrived: {1e3 * report['settled'][0]:.0f} ms ({report['settled'][1]})")
    print("\n| a good client's | requests | failed | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|---|")
    for what in ("/health", "/admin", "chat"):
        r = report[what]
        print(f"| {what} | {r['requests']} | {r['failed']} | {1e3 * r['p50']:.1f} | {1e3 * r['p99']:.1f} | {1e3 * r['max']:.1f} |")


if __name__ == "__main__":
    main()
