"""Fixtures: the app around a scripted `FakeEngine`, Flask's test client, a real Waitress server on
a free local port, and the real `openai` client pointed at that server."""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

from webapp.engine.tinygrad_setup import prepare_tinygrad

# tinygrad reads HCQ2 at import, and some test modules import it before the engine loads a model
prepare_tinygrad()

import openai  # noqa: E402
import pytest  # noqa: E402
import waitress  # noqa: E402
from fakes import FakeEngine  # noqa: E402
from waitress import wasyncore  # noqa: E402

from webapp import create_app  # noqa: E402


@pytest.fixture
def engine():
    engine = FakeEngine()
    yield engine
    engine.close()


@pytest.fixture
def app(engine):
    return create_app({"TESTING": True}, engine=engine)


@pytest.fixture
def client(app):
    return app.test_client()


def wait_until(predicate, timeout=10.0) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@contextlib.contextmanager
def slowed_decode(engine, seconds: float):
    """Tiny-model decode steps take a few ms; stretch each by `seconds` so a test can act mid-request."""
    decode = engine.loaded.runner.decode

    def slowed(batch, positions):
        time.sleep(seconds)
        return decode(batch, positions)

    engine.loaded.runner.decode = slowed
    try:
        yield
    finally:
        engine.loaded.runner.decode = decode


@contextlib.contextmanager
def running_server(app, threads: int = 16, **adjustments):
    """A real Waitress server for `app` on a free 127.0.0.1 port, closed on exit.

    `adjustments` are further waitress settings (e.g. `outbuf_high_watermark`, or `sockets` with a
    listening socket of the test's own making instead of a free port)."""
    where = {} if "sockets" in adjustments else {"host": "127.0.0.1", "port": 0}
    # channel_request_lookahead=1 lets Waitress keep reading a connection while its request runs,
    # which is how it notices a client that hangs up on a non-streamed request.
    srv = waitress.create_server(
        app, threads=threads, channel_request_lookahead=1, **where, **adjustments
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        yield SimpleNamespace(
            host="127.0.0.1", port=srv.effective_port, url=f"http://127.0.0.1:{srv.effective_port}"
        )
    finally:
        srv.task_dispatcher.shutdown(timeout=5)
        # Sockets are closed on the loop's own thread, so its select() never sees a closed descriptor.
        srv.trigger.pull_trigger(lambda: wasyncore.close_all(srv._map))
        thread.join(timeout=5)


@contextlib.contextmanager
def tiny_engine_server(path: str, slots: int, queue_limit: int, context: int = 256):
    """The real engine on the GGUF at `path` (prefill chunks of 8) behind a real Waitress server,
    ready to serve; yields (engine, server)."""
    from webapp.engine.engine import Engine
    from webapp.engine.loader import load_gguf_model
    from webapp.engine.model import use_tinygrad_from_this_thread

    use_tinygrad_from_this_thread()
    engine = Engine(lambda: load_gguf_model(path, slots, context, 8), slots=slots, queue_limit=queue_limit, prefill_chunk=8)
    app = create_app({"TESTING": True}, engine=engine)
    engine.start()
    try:
        with running_server(app, threads=16) as srv:
            assert wait_until(lambda: engine.state != "loading", timeout=300)
            assert engine.state == "ok", engine.error
            yield engine, srv
    finally:
        engine.stop(5)


def slots_idle(engine) -> bool:
    """No request holds a slot, per the engine's stats snapshot."""
    snap = engine.stats()
    return snap["running"] == 0 and all(s["request_id"] is None for s in snap["slots"])


@pytest.fixture
def server(app, engine):
    with running_server(app) as srv:
        yield srv
        engine.close()  # finishes any request a handler thread is still reading


@pytest.fixture
def openai_client(server):
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="test-key", max_retries=0, timeout=10
    )
    yield client
    client.close()
