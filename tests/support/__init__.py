"""What the tests share besides fixtures, each defined once: the repository's root, waiting and
draining helpers, the real engine over a fake runner or on a tiny GGUF behind Waitress, a real
Waitress server on a free local port, requests over a real connection (JSON, SSE streams, raw
sockets), the chat call of the `openai` client, /metrics parsed back, and the browser's constants
and axe-core audit.

Beside this module: the fakes and a settable clock (`support.fakes`), the tiny random-weight GGUF
writer and its float64 reference (`support.tiny_models`), the K-quant block writers
(`support.k_quants`). Fixtures live in the `conftest.py` files; no test imports a `conftest`.
"""

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

import waitress
from prometheus_client.parser import text_string_to_metric_families
from waitress import wasyncore

from webapp import create_app
from webapp.engine.serving.request import Finished

ROOT = Path(__file__).resolve().parents[2]  # the repository
HELLO = [{"role": "user", "content": "hello"}]
USAGE = {"stream_options": {"include_usage": True}}
# the engine of the `tiny_llama_server` fixture: slots, queue limit, context
TINY_SLOTS, TINY_QUEUE_LIMIT, TINY_CONTEXT = 2, 2, 256


def wait_until(predicate, timeout=10.0) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def drain_outputs(request, timeout: float = 10, reraise: bool = False) -> tuple[list[int], str]:
    """Read a request's outputs up to its `Finished`: (token ids, finish reason). A forwarded
    exception is skipped (its `Finished("error")` follows), or raised with `reraise`."""
    tokens = []
    while not isinstance(item := request.outputs.get(timeout=timeout), Finished):
        if isinstance(item, BaseException) and reraise:
            raise item
        if isinstance(item, int):
            tokens.append(item)
    return tokens, item.reason


# --- the real engine ---------------------------------------------------------------------------------


@contextlib.contextmanager
def engine_over(runner, context: int = 128, tokenizer=None, template=None, **settings):
    """The real engine over a fake runner (support.fakes.FakeRunner), started and ready; stopped after."""
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
def before_each_decode(engine, hook):
    """Call `hook(batch)` ahead of each of the engine's steps that decode, `batch` their decoding
    requests (to slow them down or hold them); the runner's own `run` comes back on exit."""
    run = engine.loaded.runner.run

    def hooked(parts):
        batch = [part.request for part in parts if part.decoding]
        if batch:
            hook(batch)
        return run(parts)

    engine.loaded.runner.run = hooked
    try:
        yield
    finally:
        engine.loaded.runner.run = run


def slowed_decode(engine, seconds: float):
    """Tiny-model decode steps take a few ms; stretch each by `seconds` so a test can act mid-request."""
    return before_each_decode(engine, lambda batch: time.sleep(seconds))


def slots_idle(engine) -> bool:
    """No request holds a slot, per the engine's stats snapshot."""
    snap = engine.stats()
    return snap["running"] == 0 and all(s["request_id"] is None for s in snap["slots"])


# --- servers -----------------------------------------------------------------------------------------


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
def tiny_engine_server(
    path: str,
    slots: int,
    queue_limit: int,
    context: int = 256,
    pooling: str = "auto",
    draft: str | None = None,
    kv_type: str = "f16",
    mmproj: str | None = None,
    lora_dir: str | None = None,
    paging: tuple | None = None,
    config: dict | None = None,
    cpu_kernels: bool = True,
):
    """The real engine on the GGUF at `path` (prefill chunks of 8; `draft`, a draft model's GGUF;
    `kv_type`, the KV cache's rows; `mmproj`, a projector's; `lora_dir`, LoRA adapters'; `paging`,
    load_gguf_model's; `cpu_kernels` False: tinygrad's path) behind a real Waitress server with the
    app's `config` added, ready to serve; yields (engine, server)."""
    from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
    from webapp.engine.serving.engine import Engine
    from webapp.engine.serving.loader import load_gguf_model

    use_tinygrad_from_this_thread()
    engine = Engine(
        lambda: load_gguf_model(
            path,
            slots,
            context,
            8,
            pooling=pooling,
            draft=draft,
            kv_type=kv_type,
            mmproj=mmproj,
            lora_dir=lora_dir,
            paging=paging,
            cpu_kernels=cpu_kernels,
        ),
        slots=slots,
        queue_limit=queue_limit,
        prefill_chunk=8,
    )
    app = create_app({"TESTING": True, **(config or {})}, engine=engine)
    engine.start()
    try:
        with running_server(app, threads=16) as srv:
            assert wait_until(lambda: engine.state != "loading", timeout=300)
            assert engine.state == "ok", engine.error
            yield engine, srv
    finally:
        engine.stop(5)
        use_tinygrad_from_this_thread()  # the model thread opened tinygrad's cache connection: the next user reopens it


# --- requests over a real connection -----------------------------------------------------------------


def assert_error_shape(body: dict, type="invalid_request_error", code=None):
    """`body` is an OpenAI error object of that type (and code, when given)."""
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and body["error"]["type"] == type
    if code is not None:
        assert body["error"]["code"] == code


def call(server, method: str, path: str, body=None, headers=None, timeout=30):
    """(status, headers, parsed JSON) of one request over a real connection; a body that is not
    bytes is sent as JSON."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        if body is None:
            conn.request(method, path, headers=headers or {})
        else:
            data = body if isinstance(body, bytes) else json.dumps(body)
            conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.headers, json.loads(response.read())
    finally:
        conn.close()


def post(server, path, body, headers=None, timeout=30):
    """(status, headers, parsed JSON) of one POST over a real connection."""
    return call(server, "POST", path, body, headers, timeout)


def get(server, path, timeout=10):
    """(status, headers, parsed JSON) of one GET over a real connection."""
    return call(server, "GET", path, timeout=timeout)


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
    """The first finish reason in a stream's events."""
    reasons = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])]
    return next((r for r in reasons if r), None)


def raw_request(server, path: str, body: dict, receive_buffer: int | None = None, timeout: float = 10) -> socket.socket:
    """POST `body` as JSON from a bare socket (with a receive buffer of `receive_buffer` bytes when
    given) and return the socket, its answer unread."""
    sock = socket.socket()
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(timeout)
    sock.connect((server.host, int(server.port)))
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
    )
    return sock


def unread_stream(server, path: str, body: dict) -> socket.socket:
    """Send a streamed request from a socket with a tiny receive buffer that is never read."""
    return raw_request(server, path, {**body, "stream": True}, receive_buffer=4096)


def chat(client, stream=False, messages=HELLO, **kw):
    """One chat completion through the `openai` client (a stream when `stream`)."""
    return client.chat.completions.create(model="test-model", messages=messages, stream=stream, **kw)


def metric_families(client, **headers) -> dict:
    """/metrics through a Flask test client, parsed back by prometheus_client: {name: family}."""
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(response.get_data(as_text=True))}


# --- the browser -------------------------------------------------------------------------------------

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
DESKTOP = {"width": 1280, "height": 860}
PHONE = {"width": 390, "height": 844}
SHOTS = ROOT / "test-output"
AXE = ROOT / "tests" / "vendor" / "axe-core-4.14.1" / "axe.min.js"


def send_message(page, text):
    """Type `text` into the chat page's composer and send it."""
    page.fill("#input", text)
    page.press("#input", "Enter")


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
