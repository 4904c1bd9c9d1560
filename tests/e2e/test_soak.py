"""A real `waitress-serve` process on a tiny GGUF: soaked with `bench/soak.py` (nothing lost, nothing
leaked), then stopped with SIGTERM while a stream runs (it finishes, the process exits 0)."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
from support import (
    HELLO,
    USAGE,
    Stream,
    assert_error_shape,
    finish_reason,
    get,
    post,
    wait_until,
)
from support.tiny_models import write_tiny_gguf

from bench import soak

# --- a real waitress-serve process: soak, then SIGTERM while streaming ----------------------------


@pytest.fixture(scope="module")
def waitress_process(tmp_path_factory):
    """`waitress-serve wsgi:app` on a tiny GGUF, as `make serve` runs it."""
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("spawned") / "tiny.gguf"), "llama", context=256)
    server = soak.Server(path, {"LLM_SLOTS": "2", "LLM_MAX_BATCH": "2", "LLM_MAX_CONTEXT": "256", "LLM_DRAIN_SECONDS": "30"}).start()
    try:
        server.wait_ready(300)
        yield server
    finally:
        server.close()


def test_soak_loses_nothing_and_leaks_nothing(waitress_process):
    report = soak.run(requests=40, concurrency=8, disconnect=0.3, max_tokens=16, seed=1, server=waitress_process)
    assert report["errors"] == report["lost"] == report["rejected"] == 0, report
    assert report["completed"] + report["cancelled"] == 40 and report["completed"] > 0 and report["cancelled"] > 0
    assert report["slots_free"] == report["slots_total"] == 2 and report["queue_depth_after"] == 0
    assert report["threads_after"] == report["threads_before"]
    assert report["rss_growth_pct"] < 10, report


def test_sigterm_lets_streams_finish_then_exits_0(waitress_process):
    """Must run after the other tests on `waitress_process`: it shuts that server down. The signal goes to
    the whole process group, as systemd and `timeout` send it: tinygrad's compile workers die with
    it, which would hang Python's own exit without the lifecycle's safety net."""
    srv = SimpleNamespace(host="127.0.0.1", port=waitress_process.port)
    first = Stream(
        srv,
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True, **USAGE},
    )
    first.next()
    second = {}
    t = threading.Thread(
        target=lambda: second.update(
            r=post(
                srv,
                "/v1/chat/completions",
                {"messages": HELLO, "max_tokens": 60, "ignore_eos": True},
            )
        )
    )
    t.start()
    assert wait_until(lambda: get(srv, "/health")[2].get("running") == 2)

    started = time.monotonic()
    os.killpg(waitress_process.process.pid, signal.SIGTERM)
    assert wait_until(lambda: get(srv, "/health")[0] == 503, timeout=5)
    status, headers, body = post(srv, "/v1/completions", {"prompt": "too late"})
    assert status == 503 and headers["Retry-After"]
    assert_error_shape(body, "server_error", "server_shutting_down")

    events = first.rest()
    assert events[-1] == "[DONE]" and finish_reason(events) == "length"
    assert events[-2]["usage"]["completion_tokens"] == 120
    t.join(30)
    status, _, body = second["r"]
    assert status == 200 and body["usage"]["completion_tokens"] == 60
    assert waitress_process.process.wait(30) == 0
    assert time.monotonic() - started < 30
    log = waitress_process.log()
    assert "SIGTERM: shutting down gracefully" in log and "'cancelled': 0" in log
