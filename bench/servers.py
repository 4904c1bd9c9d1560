"""Server processes for the benchmarks: ours (`waitress-serve wsgi:app`) and llama.cpp's `llama-server`.

Contract: `start_ours(port)` and `start_llama_server(binary, model, port, ...)` return a `Launched`
that is serving (its /health answered 200) on 127.0.0.1 only; `Launched.stop()` ends exactly the
process it started, with its own process group (our server's compile workers go with it), and
nothing else. Both are context managers. Standard library only, so the HTTP benches import no
tinygrad.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
HOST = "127.0.0.1"


def exit_on_sigterm() -> None:
    """Turn SIGTERM (from `timeout`, or a supervisor) into SystemExit, so the `with` blocks that own
    started servers stop them instead of leaving them running."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def usable_cores() -> int:
    """The cores this process may run on (what llama.cpp gets as -t, the same our engine may use)."""
    return len(os.sched_getaffinity(0))


def rss_mb(pid: int | str = "self") -> float:
    """Resident memory of a process in MiB, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def health_status(port: int) -> int | None:
    """The status of GET /health, or None when nothing answers yet."""
    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return None
    finally:
        conn.close()


class Launched:
    """One server process this bench started; `url` is its OpenAI base URL."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict | None = None, cwd: str = ROOT):
        self.name, self.port = name, port
        self.launcher_is_make = os.path.basename(argv[0]) == "make"
        fd, self.log_path = tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.process = subprocess.Popen(
                argv, cwd=cwd, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def wait_ready(self, timeout: float) -> float:
        """Seconds until /health answered 200; raises with the log's tail if it exits or times out."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if health_status(self.port) == 200:
                return time.monotonic() - started
            time.sleep(0.25)  # a child process's readiness has no event to wait on
        raise TimeoutError(f"{self.name} was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def rss_mb(self) -> float:
        """Resident memory of the server itself: for `make serve`, of the process make started."""
        pid = self.process.pid
        if self.launcher_is_make:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                pid = int(f.read().split()[0])
        return rss_mb(pid)

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to the group this process leads (it was started in a new session), SIGKILL if it lingers."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log_path)

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_ours(
    port: int = 0, timeout: float = 900, model: str | None = None, env: dict | None = None, cwd: str = ROOT, name: str = "tinyserve"
) -> Launched:
    """The Makefile's `serve` target (its Waitress flags live there) on 127.0.0.1, ready, with `env`
    added to the environment; `cwd` another installed checkout to serve from. `-o install` skips the
    install step: the bench runs from an installed checkout and must not touch the venv."""
    port = port or free_port()
    argv = ["make", "-s", "-o", "install", "serve", f"HOST={HOST}", f"PORT={port}"]
    env = {**({"LLM_MODEL": model} if model else {}), **(env or {})}
    return _ready(Launched(name, argv, port, env or None, cwd=cwd), timeout)


def start_llama_server(
    binary: str, model: str, port: int = 0, parallel: int = 8, context: int = 4096, timeout: float = 300, extra: tuple[str, ...] = ()
) -> Launched:
    """`llama-server` on `model` with `parallel` slots of `context` tokens each, every usable core,
    and `extra` arguments after those."""
    port = port or free_port()
    argv = [
        binary, "-m", model, "-np", str(parallel), "-t", str(usable_cores()), "-c", str(parallel * context),
        "--port", str(port), "--host", HOST, *extra,
    ]  # fmt: skip
    return _ready(Launched("llama-server", argv, port), timeout)


def post_json(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    """The server's JSON answer to `body` posted to `path`, or RuntimeError with what it said."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"{path} answered {response.status}: {answer}")
        return answer
    finally:
        conn.close()


def llama_completion(port: int, body: dict, timeout: float = 600) -> dict:
    """llama-server's /completion answer to `body` (its JSON), or RuntimeError with what it said."""
    return post_json(port, "/completion", body, timeout)


def _ready(server: Launched, timeout: float) -> Launched:
    """`server` once it answers /health; stopped if it never does (or the wait is interrupted)."""
    try:
        server.wait_ready(timeout)
    except BaseException:
        server.stop()
        raise
    return server
