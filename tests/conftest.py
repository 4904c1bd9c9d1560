"""Fixtures: the app around a scripted `FakeEngine`, Flask's test client, a real Waitress server on
a free local port, the real `openai` client pointed at that server, and Debian's Chromium driven by
Playwright for the browser tests (with axe-core, vendored under tests/vendor/, to audit pages)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from webapp.engine.model.tinygrad_setup import prepare_tinygrad

# tinygrad reads HCQ2 at import, and some test modules import it before the engine loads a model
prepare_tinygrad()

import openai  # noqa: E402
import pytest  # noqa: E402
import waitress  # noqa: E402
from fakes import FakeEngine  # noqa: E402
from waitress import wasyncore  # noqa: E402

from webapp import create_app  # noqa: E402
from webapp.engine.serving.request import Finished  # noqa: E402

HELLO = [{"role": "user", "content": "hello"}]
USAGE = {"stream_options": {"include_usage": True}}


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


class Clock:
    """A settable clock for code that takes one (`EngineMetrics(clock=...)`)."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def drain_outputs(request, timeout: float = 10) -> tuple[list[int], str]:
    """Read a request's outputs up to its `Finished`: (token ids, finish reason); a forwarded
    exception is skipped (its `Finished("error")` follows)."""
    tokens = []
    while not isinstance(item := request.outputs.get(timeout=timeout), Finished):
        if isinstance(item, int):
            tokens.append(item)
    return tokens, item.reason


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
def engine_over(runner, context: int = 128, tokenizer=None, template=None, **settings):
    """The real engine over a fake runner (tests/fakes.FakeRunner), started and ready; stopped after."""
    from webapp.engine.serving.engine import Engine
    from webapp.engine.serving.loaded_model import LoadedModel

    engine = Engine(lambda: LoadedModel(runner, tokenizer, template, "fake", context, "FAKE"), **settings).start()
    assert wait_until(lambda: engine.state == "ok")
    try:
        yield engine
    finally:
        runner.gate.set()
        engine.stop(5)


@contextlib.contextmanager
def running_server(app, threads: int = 16, **adjustments):
    """A real Waitress server for `app` on a free 127.0.0.1 port, closed on exit.

    `adjustments` are further waitress settings (e.g. `outbuf_high_watermark`, or `sockets` with a
    listening socket of the test's own making instead of a free port)."""
    where = {} if "sockets" in adjustments else {"host": "127.0.0.1", "port": 0}
    # channel_request_lookahead=1 lets Waitress keep reading a connection while its request runs,
    # which is how it notices a client that hangs up on a non-streamed request.
    srv = waitress.create_server(app, threads=threads, channel_request_lookahead=1, **where, **adjustments)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        yield SimpleNamespace(host="127.0.0.1", port=srv.effective_port, url=f"http://127.0.0.1:{srv.effective_port}")
    finally:
        srv.task_dispatcher.shutdown(timeout=5)
        try:
            # Sockets are closed on the loop's own thread, so its select() never sees a closed descriptor.
            srv.trigger.pull_trigger(lambda: wasyncore.close_all(srv._map))
        except OSError:
            # Its trigger is closed already: the server closed itself (Waitress closes a dispatcher
            # whose handler raised, and the listening one takes the trigger with it; seen in 2 of ~10
            # full runs). Whatever is left in its map is closed from here.
            if not srv.trigger._closed:
                raise
            wasyncore.close_all(srv._map, ignore_all=True)
        thread.join(timeout=5)


@contextlib.contextmanager
def tiny_engine_server(path: str, slots: int, queue_limit: int, context: int = 256):
    """The real engine on the GGUF at `path` (prefill chunks of 8) behind a real Waitress server,
    ready to serve; yields (engine, server)."""
    from webapp.engine.model.loader import load_gguf_model
    from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
    from webapp.engine.serving.engine import Engine

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
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="test-key", max_retries=0, timeout=10)
    yield client
    client.close()


# --- helpers over a real connection --------------------------------------------------------------


def assert_error_shape(body: dict, type="invalid_request_error", code=None):
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and body["error"]["type"] == type
    if code is not None:
        assert body["error"]["code"] == code


def post(server, path, body, headers=None, timeout=30):
    """(status, headers, parsed JSON) of one POST over a real connection."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body)
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.headers, json.loads(response.read())
    finally:
        conn.close()


def get(server, path, timeout=10):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.headers, json.loads(response.read())
    finally:
        conn.close()


class Stream:
    """A streamed request read event by event over its own connection."""

    def __init__(self, server, path, body, timeout=60):
        self.conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
        self.conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200, self.response.read()
        self.events: list = []

    def next(self):
        while True:
            line = self.response.readline()
            if not line:
                return None
            if line.startswith(b"data: "):
                data = line[len(b"data: ") :].strip()
                event = "[DONE]" if data == b"[DONE]" else json.loads(data)
                self.events.append(event)
                return event

    def rest(self) -> list:
        while self.next() not in (None, "[DONE]"):
            pass
        self.conn.close()
        return self.events


def finish_reason(events: list) -> str | None:
    reasons = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])]
    return next((r for r in reasons if r), None)


def unread_stream(server, path: str, body: dict) -> socket.socket:
    """Send a streamed request from a socket with a tiny receive buffer that is never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((server.host, int(server.port)))
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
    )
    return sock


# --- the browser ------------------------------------------------------------------------------------

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
DESKTOP = {"width": 1280, "height": 860}
PHONE = {"width": 390, "height": 844}
SHOTS = Path(__file__).resolve().parent.parent / "test-output"
AXE = Path(__file__).resolve().parent / "vendor" / "axe-core-4.14.1" / "axe.min.js"


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def pages(browser):
    """Opens pages in a fresh context and fails the test on any console error or page exception
    that the test did not list in `pages.expected` (substrings). `pages.context` is the context."""
    context = browser.new_context(viewport=DESKTOP)
    errors, expected = [], []

    def open_page(url, **kw):
        page = context.new_page(**kw)
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
        page.goto(url)
        return page

    open_page.expected = expected
    open_page.context = context
    yield open_page
    context.close()
    unexpected = [e for e in errors if not any(x in e for x in expected)]
    assert not unexpected, unexpected


def axe_violations(page, impacts=("serious", "critical")) -> list[str]:
    """axe-core's violations of those impacts on the page as it stands, one line each. The script is
    served from the page's own origin (a routed URL), so it runs under the page's strict CSP."""
    url = page.url.split("/", 3)[:3]
    axe_url = "/".join(url) + "/__axe-core-for-tests.js"
    page.route(axe_url, lambda route: route.fulfill(path=str(AXE), content_type="text/javascript"))
    page.add_script_tag(url=axe_url)
    found = page.evaluate(
        "async () => (await axe.run(document, {resultTypes: ['violations']})).violations"
        ".map(v => ({id: v.id, impact: v.impact, nodes: v.nodes.map(n => n.target.join(' ')).slice(0, 5)}))"
    )
    return [json.dumps(v) for v in found if v["impact"] in impacts]
