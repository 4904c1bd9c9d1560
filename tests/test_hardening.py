"""A server on a network: authentication, limits, security headers, hostile templates, engine faults,
the watchdog, slow readers, draining on shutdown, and a soak of a real `waitress-serve` process.

Web-layer checks use the scripted FakeEngine (fast, deterministic); engine-level ones use the real
engine, either on a tiny random GGUF behind an in-process Waitress (faults, hostile template, slow
reader) or on the fake runner (watchdog); the last tests start `waitress-serve` itself, soak it with
`bench/soak.py` and stop it with SIGTERM while a stream runs.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from conftest import running_server, slots_idle, tiny_engine_server, wait_until
from fakes import FakeChatTemplate, FakeRunner, FakeTokenizer, Reply
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import write_tiny_gguf

from bench import soak
from webapp import create_app
from webapp.engine.engine import Engine
from webapp.engine.loader import LoadedModel
from webapp.engine.request import Finished, Request, SamplingParams
from webapp.security import listen_hosts, warn_if_exposed

HELLO = [{"role": "user", "content": "hello"}]
USAGE = {"stream_options": {"include_usage": True}}
TOKEN = "letmein-admin"


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
        self.conn.request(
            "POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
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
    reasons = [
        c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])
    ]
    return next((r for r in reasons if r), None)


# --- authentication -------------------------------------------------------------------------------


def test_api_key_guards_every_v1_route_but_not_health(engine):
    client = create_app({"TESTING": True, "API_KEY": "sekret"}, engine=engine).test_client()
    routes = [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/nope"),
    ]
    wrong = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer sekre"},
        {"Authorization": "sekret"},
        {"Authorization": "Basic sekret"},
    ]
    for method, path in routes:
        for headers in wrong:
            r = client.open(
                path, method=method, json={"messages": HELLO, "prompt": "x"}, headers=headers
            )
            assert r.status_code == 401, (path, headers)
            assert_error_shape(r.get_json(), code="invalid_api_key")
            assert r.headers["WWW-Authenticate"] == "Bearer"
    right = {"Authorization": "Bearer sekret"}
    assert client.get("/v1/models", headers=right).status_code == 200
    assert (
        client.post("/v1/chat/completions", json={"messages": HELLO}, headers=right).status_code
        == 200
    )
    assert client.get("/v1/nope", headers=right).status_code == 404
    assert client.get("/health").status_code == 200
    assert client.get("/").status_code == 200


def test_secrets_from_the_environment_are_taken_verbatim(engine, monkeypatch):
    monkeypatch.setenv("LLM_API_KEY", "1e3")  # JSON would make this the float 1000.0
    monkeypatch.setenv("LLM_ADMIN_TOKEN", "true")
    app = create_app({"TESTING": True}, engine=engine)
    assert (app.config["API_KEY"], app.config["ADMIN_TOKEN"]) == ("1e3", "true")
    assert (
        app.test_client().get("/v1/models", headers={"Authorization": "Bearer 1e3"}).status_code
        == 200
    )


@pytest.fixture
def admin_client(engine):
    """An app with an admin token and probe routes of its own under both guarded prefixes, so these
    tests depend only on the guard, not on what the dashboard blueprints do."""
    app = create_app({"TESTING": True, "ADMIN_TOKEN": TOKEN}, engine=engine)
    app.add_url_rule("/admin/probe", "admin_probe", lambda: "admin ok")
    app.add_url_rule("/metrics/probe", "metrics_probe", lambda: "metrics ok")
    return app.test_client()


def test_admin_token_guards_admin_and_metrics(admin_client):
    for path in (
        "/admin",
        "/admin/",
        "/admin/stats.json",
        "/admin/probe",
        "/metrics",
        "/metrics/probe",
        "/admin/nope",
    ):
        r = admin_client.get(path, headers={"Accept": "application/json"})
        assert r.status_code == 401, path
        assert_error_shape(r.get_json(), code="invalid_admin_token")
        assert r.headers["WWW-Authenticate"] == "Bearer"
        r = admin_client.get(path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, path
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert admin_client.get("/admin/probe", headers=bearer).get_data(as_text=True) == "admin ok"
    assert admin_client.get("/metrics/probe", headers=bearer).get_data(as_text=True) == "metrics ok"
    basic = {"Authorization": "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()}
    assert admin_client.get("/admin/probe", headers=basic).status_code == 200
    # the API and the pages do not want the admin token
    assert admin_client.get("/v1/models").status_code == 200
    assert admin_client.get("/health").status_code == 200


def test_a_browser_is_sent_to_the_login_form_and_its_cookie_opens_both_prefixes(admin_client):
    r = admin_client.get(
        "/admin/probe", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    )
    assert r.status_code == 303
    assert r.headers["Location"] == "/admin/login?next=/admin/probe"

    page = admin_client.get("/admin/login?next=/metrics/probe")
    assert page.status_code == 200 and page.mimetype == "text/html"
    html = page.get_data(as_text=True)
    assert 'method="post"' in html and 'name="token"' in html and "<script" not in html
    assert "form-action 'self'" in page.headers["Content-Security-Policy"]

    wrong = admin_client.post("/admin/login", data={"token": "nope", "next": "/metrics/probe"})
    assert wrong.status_code == 401 and "not right" in wrong.get_data(as_text=True)
    assert "Set-Cookie" not in wrong.headers

    right = admin_client.post("/admin/login", data={"token": TOKEN, "next": "/metrics/probe"})
    assert right.status_code == 303 and right.headers["Location"] == "/metrics/probe"
    cookie = right.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    assert TOKEN not in cookie  # the cookie carries a MAC of the token, not the token
    assert admin_client.get("/metrics/probe").get_data(as_text=True) == "metrics ok"
    assert admin_client.get("/admin/probe").get_data(as_text=True) == "admin ok"

    out = admin_client.post("/admin/logout")
    assert out.status_code == 303
    assert (
        admin_client.get("/admin/probe", headers={"Accept": "application/json"}).status_code == 401
    )


def test_doubled_slashes_do_not_slip_past_the_guard(engine):
    app = create_app({"TESTING": True, "ADMIN_TOKEN": TOKEN}, engine=engine)
    app.add_url_rule("/admin/probe", "admin_probe", lambda: "admin ok")
    with running_server(app) as srv:
        for path in ("//admin/probe", "/admin//probe", "///metrics", "//admin"):
            conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
            conn.request("GET", path, headers={"Accept": "application/json"})
            response = conn.getresponse()
            body = response.read()
            conn.close()
            assert response.status in (308, 401), (path, response.status)
            assert b"admin ok" not in body


@pytest.mark.parametrize(
    "target",
    ["https://evil.example/", "//evil.example/x", "/\\evil.example", "javascript:alert(1)"],
)
def test_login_only_redirects_within_the_site(admin_client, target):
    r = admin_client.post("/admin/login", data={"token": TOKEN, "next": target})
    assert r.status_code == 303 and r.headers["Location"] == "/admin"


def test_without_an_admin_token_the_pages_are_open_and_login_steps_aside(engine):
    app = create_app({"TESTING": True}, engine=engine)
    app.add_url_rule("/admin/probe", "admin_probe", lambda: "admin ok")
    client = app.test_client()
    assert client.get("/admin/probe").status_code == 200
    r = client.get("/admin/login?next=/admin/probe")
    assert r.status_code == 303 and r.headers["Location"] == "/admin/probe"


def test_the_start_up_warns_loudly_when_exposed_without_an_admin_token(caplog):
    with caplog.at_level(logging.WARNING, logger="webapp.security"):
        assert warn_if_exposed({"ADMIN_TOKEN": None, "API_KEY": None}, ["0.0.0.0"])
    text = caplog.text
    assert "LLM_ADMIN_TOKEN is not set" in text and "0.0.0.0" in text and "LLM_API_KEY" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="webapp.security"):
        assert not warn_if_exposed({"ADMIN_TOKEN": None}, ["127.0.0.1", "::1"])
        assert not warn_if_exposed({"ADMIN_TOKEN": None}, ["unix"])
        assert not warn_if_exposed({"ADMIN_TOKEN": None, "HOST": "127.0.0.1"}, None)
        assert not warn_if_exposed({"ADMIN_TOKEN": "t", "API_KEY": "k"}, ["0.0.0.0"])
    assert caplog.text == ""
    assert warn_if_exposed(
        {}, None
    )  # not started by waitress-serve and no LLM_HOST: assume exposed


@pytest.mark.parametrize(
    "argv, hosts",
    [
        (["waitress-serve", "--threads=96", "--listen=0.0.0.0:8000", "wsgi:app"], ["0.0.0.0"]),
        (["/venv/bin/waitress-serve", "wsgi:app"], ["0.0.0.0"]),  # waitress's own default
        (
            ["waitress-serve", "--listen=127.0.0.1:8000", "--listen=[::1]:8001", "wsgi:app"],
            ["127.0.0.1", "::1"],
        ),
        (["waitress-serve", "--host=127.0.0.1", "--port=9000", "wsgi:app"], ["127.0.0.1"]),
        (["waitress-serve", "--unix-socket=/tmp/llm.sock", "wsgi:app"], ["unix"]),
        (["pytest", "-q"], None),
    ],
)
def test_listen_hosts_reads_the_waitress_command_line(argv, hosts):
    assert listen_hosts(argv) == hosts


# --- headers and HTML -----------------------------------------------------------------------------


def test_every_response_carries_security_headers(client):
    for path in ("/", "/admin/login", "/health", "/v1/models", "/no/such/page"):
        r = client.get(path)
        assert r.headers["X-Content-Type-Options"] == "nosniff", path
        assert r.headers["X-Frame-Options"] == "DENY", path
        assert r.headers["Referrer-Policy"] == "no-referrer", path
    for path in ("/", "/admin/login"):
        csp = client.get(path).headers["Content-Security-Policy"]
        assert (
            "frame-ancestors 'none'" in csp
            and "script-src 'self'" in csp
            and "unsafe-inline" not in csp
        )


def test_user_text_never_comes_back_as_html(engine):
    app = create_app({"TESTING": True, "ADMIN_TOKEN": TOKEN}, engine=engine)
    client = app.test_client()
    evil = '/x"><script>alert(1)</script>'
    html = client.get("/admin/login", query_string={"next": evil}).get_data(as_text=True)
    assert "<script>alert(1)" not in html and "&lt;script&gt;" in html
    r = client.get("/<script>alert(1)</script>")
    assert r.status_code == 404 and r.mimetype == "application/json"
    engine.replies.append(Reply.text("<img src=x onerror=alert(1)>"))
    r = client.post("/v1/chat/completions", json={"messages": HELLO})
    assert r.mimetype == "application/json"


# --- limits ---------------------------------------------------------------------------------------


def test_too_many_messages_is_400(engine):
    client = create_app({"TESTING": True, "MAX_MESSAGES": 3}, engine=engine).test_client()
    assert client.post("/v1/chat/completions", json={"messages": HELLO * 3}).status_code == 200
    r = client.post("/v1/chat/completions", json={"messages": HELLO * 4})
    assert r.status_code == 400
    assert_error_shape(r.get_json(), code="array_above_max_length")
    assert r.get_json()["error"]["param"] == "messages"


def test_default_message_limit(client):
    r = client.post("/v1/chat/completions", json={"messages": HELLO * 1001})
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "array_above_max_length"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        (
            {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
            "tools",
        ),
    ],
)
def test_oversized_parameters_are_400(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": HELLO, **body})
    assert r.status_code == 400
    assert_error_shape(r.get_json())
    assert r.get_json()["error"]["param"] == param


def test_longest_stop_string_is_accepted(client):
    assert (
        client.post(
            "/v1/chat/completions", json={"messages": HELLO, "stop": ["x" * 256] * 4}
        ).status_code
        == 200
    )


def test_max_tokens_is_capped_to_the_context(client, engine):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 10**12})
    assert r.status_code == 200
    request = engine.submitted[-1]
    assert request.params.max_tokens == engine.max_context - request.prompt_len


def test_prompt_token_limit(engine):
    client = create_app({"TESTING": True, "MAX_PROMPT_TOKENS": 16}, engine=engine).test_client()
    assert (
        client.post("/v1/completions", json={"prompt": "x" * 15}).status_code == 200
    )  # + BOS = 16
    r = client.post("/v1/completions", json={"prompt": "x" * 16})
    assert r.status_code == 400
    assert_error_shape(r.get_json(), code="context_length_exceeded")
    r = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 50}]}
    )
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "messages"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate
        b'{"prompt": "ok", "user": "\\udfff"}',
        b'{"prompt": "x", "metadata": '
        + b'{"a": ' * 80
        + b"1"
        + b"}" * 80
        + b"}",  # deep but parseable
        b'{"prompt": "x", "metadata": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}",  # beyond the C decoder
    ],
)
def test_malformed_json_values_are_400(client, raw):
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = client.post(path, data=raw, content_type="application/json")
        assert r.status_code == 400, r.get_json()
        assert_error_shape(r.get_json(), code="invalid_json")


def test_chunked_body_over_the_limit_is_413(engine):
    app = create_app({"TESTING": True, "MAX_CONTENT_LENGTH": 64 * 1024}, engine=engine)
    with running_server(app) as srv:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
        body = json.dumps({"prompt": "x" * 100_000}).encode()
        chunks = (body[i : i + 8192] for i in range(0, len(body), 8192))
        conn.request(
            "POST",
            "/v1/completions",
            chunks,
            {"Content-Type": "application/json"},
            encode_chunked=True,
        )
        response = conn.getresponse()
        assert response.status == 413
        assert_error_shape(json.loads(response.read()))
        conn.close()
        assert get(srv, "/health")[0] == 200


# --- draining (FakeEngine behind a real Waitress) -------------------------------------------------


@pytest.fixture
def drain_server(app, engine):
    with running_server(app) as srv:
        yield SimpleNamespace(server=srv, lifecycle=app.extensions["lifecycle"])
        engine.close()


def test_drain_lets_accepted_requests_finish_and_refuses_new_ones(drain_server, engine):
    srv, lifecycle = drain_server.server, drain_server.lifecycle
    engine.replies.append(Reply.text("slow but sure", delay=0.05))
    engine.replies.append(Reply.text("queued reply", hold=True))
    stream = Stream(srv, "/v1/chat/completions", {"messages": HELLO})
    stream.next()  # the role chunk: the request is in flight
    waiting = {}
    t = threading.Thread(
        target=lambda: waiting.update(r=post(srv, "/v1/completions", {"prompt": "hi"}))
    )
    t.start()
    assert wait_until(lambda: len(engine.submitted) == 2)

    result = {}
    drainer = threading.Thread(target=lambda: result.update(lifecycle.drain(10)))
    drainer.start()
    assert wait_until(lambda: lifecycle.draining)
    status, headers, body = post(srv, "/v1/chat/completions", {"messages": HELLO})
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert_error_shape(body, "server_error", "server_shutting_down")
    status, _, body = get(srv, "/health")
    assert (status, body["status"]) == (503, "draining")

    engine.release(engine.submitted[1])
    events = stream.rest()
    assert events[-1] == "[DONE]" and finish_reason(events) == "stop"
    t.join(10)
    assert waiting["r"][0] == 200 and waiting["r"][2]["choices"][0]["text"] == "queued reply"
    drainer.join(10)
    assert (
        result["cancelled"] == 0 and result["unfinished"] == 0 and result["in_flight_at_start"] == 2
    )


def test_drain_cancels_what_outlives_its_bound(drain_server, engine):
    srv, lifecycle = drain_server.server, drain_server.lifecycle
    engine.replies.append(Reply([ord("a")] * 3 + [ord("b")], delay=0.01, forever=True))
    engine.replies.append(Reply.text("never", hold=True))
    stream = Stream(srv, "/v1/completions", {"prompt": "go", "max_tokens": 2000})
    stream.next()
    waiting = {}
    t = threading.Thread(
        target=lambda: waiting.update(r=post(srv, "/v1/chat/completions", {"messages": HELLO}))
    )
    t.start()
    assert wait_until(lambda: len(engine.submitted) == 2)

    summary = lifecycle.drain(0.3)
    assert summary["cancelled"] == 2 and summary["unfinished"] == 0
    events = stream.rest()
    assert events[-1] == "[DONE]"
    assert_error_shape(events[-2], "server_error", "server_shutting_down")
    t.join(10)
    status, headers, body = waiting["r"]
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert_error_shape(body, "server_error", "server_shutting_down")
    assert all(r.cancel_reason == "shutdown" for r in engine.submitted)


def test_a_second_signal_cancels_at_once_and_a_third_exits(engine):
    """The handlers' state machine, called directly: no real signal reaches this test process."""
    app = create_app({"TESTING": True, "DRAIN_SECONDS": 60}, engine=engine)
    lifecycle = app.extensions["lifecycle"]
    engine.replies.append(Reply.text("never", hold=True))
    with running_server(app) as srv:
        waiting = {}
        t = threading.Thread(
            target=lambda: waiting.update(r=post(srv, "/v1/completions", {"prompt": "hi"}))
        )
        t.start()
        assert engine.submitted_event.wait(10)
        started = time.monotonic()
        lifecycle._on_signal(signal.SIGTERM, None)  # starts draining, for up to 60 s
        assert wait_until(lambda: lifecycle.draining)
        lifecycle._on_signal(signal.SIGINT, None)  # do not wait: cancel now
        t.join(10)
        assert waiting["r"][0] == 503 and waiting["r"][2]["error"]["code"] == "server_shutting_down"
        assert time.monotonic() - started < 10
        with pytest.raises(SystemExit) as exit_info:
            lifecycle._on_signal(signal.SIGTERM, None)
        assert exit_info.value.code == 0
        # Without installed handlers the drain thread ends the process neither way.
        lifecycle.drain_thread.join(10)
        assert not lifecycle.drain_thread.is_alive()
        engine.close()


# --- slow readers ---------------------------------------------------------------------------------


def _unread_stream(server, path: str, body: dict) -> socket.socket:
    """Send a streamed request from a socket with a tiny receive buffer that is never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((server.host, int(server.port)))
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_a_reader_that_stalls_holds_only_its_own_thread(engine):
    """The stalled client's handler blocks once Waitress's buffer for it is full; the other threads
    keep serving, and the blocked one is freed (and its request aborted) when the client goes."""
    app = create_app({"TESTING": True}, engine=engine)
    listener = socket.socket()
    # Small send buffers (inherited by accepted sockets), or the kernel swallows the whole stream.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    with running_server(app, threads=3, outbuf_high_watermark=32 * 1024, sockets=[listener]) as srv:
        engine.replies.append(
            Reply([ord("z")], forever=True)
        )  # as fast as it can, up to max_tokens
        sock = _unread_stream(srv, "/v1/completions", {"prompt": "flood"})
        assert engine.submitted_event.wait(10)
        flood = engine.submitted[-1]
        # ~4,000 events of ~190 bytes: far more than the buffers hold, so its handler is stuck
        assert wait_until(lambda: isinstance(flood.finish_reason, str))
        assert flood.outputs.qsize() > 1000
        for _ in range(5):  # more requests than the threads left, one after another
            status, _, body = post(srv, "/v1/chat/completions", {"messages": HELLO}, timeout=10)
            assert status == 200 and body["choices"][0]["message"]["content"]
        assert flood.outputs.qsize() > 1000  # still stuck: nobody read
        sock.close()
        assert engine.aborted_event.wait(10)
        assert engine.aborted == [flood]
        engine.close()


# --- the watchdog (real engine loop, fake runner) ------------------------------------------------


class ThreadKiller(BaseException):
    """Not an Exception: the engine's per-step isolation does not catch it, so the thread dies."""


@pytest.fixture
def stub_engine():
    runner = FakeRunner(vocab=258, next_token=lambda last: 0)  # token 0 every time
    loaded = LoadedModel(runner, FakeTokenizer(), FakeChatTemplate(), "stub", 128, "none")
    engine = Engine(
        lambda: loaded, slots=2, queue_limit=4, prefill_chunk=8, stall_seconds=0.3
    ).start()
    assert wait_until(lambda: engine.state == "ok")
    yield engine, runner
    runner.gate.set()
    engine.stop(5)


def test_health_turns_503_while_a_step_stalls_and_recovers(stub_engine):
    engine, runner = stub_engine
    client = create_app({"TESTING": True}, engine=engine).test_client()
    time.sleep(0.5)  # idle for longer than the bound: sleeping on an empty inbox is no stall
    assert client.get("/health").status_code == 200
    runner.gate.clear()
    request = Request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    engine.submit(request)
    assert wait_until(lambda: client.get("/health").status_code == 503, timeout=5)
    body = client.get("/health").get_json()
    assert body["status"] == "stalled" and "has not finished a step" in body["error"]
    runner.gate.set()
    while not isinstance(request.outputs.get(timeout=5), Finished):
        pass
    assert wait_until(lambda: client.get("/health").status_code == 200, timeout=5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_turns_503_when_the_model_thread_dies(stub_engine):
    engine, runner = stub_engine
    client = create_app({"TESTING": True}, engine=engine).test_client()
    runner.fault = ThreadKiller()
    engine.submit(Request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0)))
    assert wait_until(lambda: not engine._thread.is_alive())
    r = client.get("/health")
    assert r.status_code == 503 and r.get_json()["status"] == "error"


# --- the real engine on a tiny GGUF with a hostile chat template ----------------------------------


def hostile_template(marker: str) -> str:
    """ChatML, except for a first message that names an attack: then the template tries it."""
    attacks = {
        "mro": "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "globals": "{{ cycler.__init__.__globals__.os.system('touch " + marker + "') }}",
        "mutate": "{{ messages.append({'role': 'system', 'content': 'owned'}) }}",
        "format": "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
        "range": "{% for i in range(10**9) %}x{% endfor %}",
        "raise": "{{ raise_exception('this template refuses') }}",
    }
    branches = "".join(
        f"{'{% if' if i == 0 else '{% elif'} messages[0]['content'] == 'attack:{name}' %}}{body}"
        for i, (name, body) in enumerate(attacks.items())
    )
    chatml = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    return branches + "{% else %}" + chatml + "{% endif %}"


ATTACKS = ["mro", "globals", "mutate", "format", "range", "raise"]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    marker = str(tmp / "pwned")
    path = write_tiny_gguf(
        str(tmp / "hostile.gguf"), "llama", context=256, chat_template=hostile_template(marker)
    )
    with tiny_engine_server(path, slots=2, queue_limit=4) as (engine, srv):
        yield SimpleNamespace(engine=engine, server=srv, marker=marker)


@pytest.fixture
def patched(real):
    """Replace runner methods for one test: `patched("decode", fn)`; restored afterwards."""
    runner = real.engine.loaded.runner
    saved = {}

    def patch(name, make):
        saved.setdefault(name, getattr(runner, name))
        setattr(runner, name, make(saved[name]))

    yield patch
    for name, original in saved.items():
        setattr(runner, name, original)


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_hostile_chat_template_is_a_400_and_the_server_keeps_serving(real, attack):
    srv = real.server
    status, _, body = post(
        srv,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": f"attack:{attack}"}], "max_tokens": 2},
    )
    assert status == 400
    assert_error_shape(body)
    assert body["error"]["param"] == "messages"
    assert not os.path.exists(real.marker)
    status, _, body = post(
        srv, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 3, "temperature": 0}
    )
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert get(srv, "/health")[0] == 200


def test_a_failing_prefill_fails_only_its_request(real, patched):
    engine, srv = real.engine, real.server

    def broken(original):
        def prefill(request, tokens, start):
            if 666 in request.prompt_ids:
                raise RuntimeError("injected prefill fault")
            return original(request, tokens, start)

        return prefill

    def slowed(original):
        def decode(batch, positions):
            time.sleep(0.02)
            return original(batch, positions)

        return decode

    patched("prefill", broken)
    patched("decode", slowed)
    healthy = Stream(
        srv,
        "/v1/completions",
        {"prompt": "A long and healthy story", "max_tokens": 40, "ignore_eos": True, **USAGE},
    )
    healthy.next()
    healthy.next()  # decoding now

    status, _, body = post(srv, "/v1/completions", {"prompt": [1, 666, 2], "max_tokens": 5})
    assert status == 500
    assert_error_shape(body, "server_error", "engine_error")
    assert "injected" not in body["error"]["message"]  # internals stay in the log

    failing = Stream(
        srv, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 5}
    )  # fine: no 666
    assert finish_reason(failing.rest()) in ("stop", "length")
    failing = Stream(srv, "/v1/completions", {"prompt": [1, 666, 2], "max_tokens": 5})
    events = failing.rest()
    assert events[-1] == "[DONE]"
    assert_error_shape(events[-2], "server_error", "engine_error")

    events = healthy.rest()
    assert events[-1] == "[DONE]" and finish_reason(events) == "length"
    assert events[-2]["usage"]["completion_tokens"] == 40
    assert engine._thread.is_alive()
    assert wait_until(lambda: slots_idle(engine))


def test_a_failing_decode_fails_its_step_and_the_next_requests_succeed(real, patched):
    engine, srv = real.engine, real.server

    def broken(original):
        def decode(batch, positions):
            if any(666 in r.prompt_ids for r in batch):
                raise RuntimeError("injected decode fault")
            return original(batch, positions)

        return decode

    patched("decode", broken)
    events = Stream(
        srv, "/v1/completions", {"prompt": [1, 666, 2], "max_tokens": 8, "ignore_eos": True}
    ).rest()
    assert events[-1] == "[DONE]"
    assert_error_shape(events[-2], "server_error", "engine_error")
    status, _, body = post(
        srv, "/v1/completions", {"prompt": [1, 666, 3], "max_tokens": 8, "ignore_eos": True}
    )
    assert status == 500 and body["error"]["code"] == "engine_error"
    for _ in range(2):
        status, _, body = post(
            srv, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 6, "ignore_eos": True}
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 6
    assert engine._thread.is_alive() and get(srv, "/health")[0] == 200
    assert wait_until(lambda: slots_idle(engine))


def test_a_client_that_never_reads_stalls_neither_the_model_nor_others(real):
    engine, srv = real.engine, real.server
    ran_out = engine.stats()["requests_total"]["length"]
    sock = _unread_stream(
        srv, "/v1/completions", {"prompt": "Never read me", "max_tokens": 150, "ignore_eos": True}
    )
    try:
        started = time.monotonic()
        status, _, body = post(
            srv, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 8, "ignore_eos": True}
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        assert time.monotonic() - started < 20
        # the unread request runs to its end on the model thread all the same
        assert wait_until(lambda: slots_idle(engine), timeout=30)
        assert engine.stats()["requests_total"]["length"] == ran_out + 2  # it ran to max_tokens
    finally:
        sock.close()
    assert get(srv, "/health")[0] == 200


@settings(max_examples=60, deadline=None, database=None)
@given(
    text=st.text(max_size=60)
    | st.sampled_from(
        [
            "<|im_start|>",
            "<|im_end|>",
            "<|endoftext|>",
            "\u0000",
            "\ufeff",
            "\U0001f600" * 3,
            "a\u0301" * 5,
        ]
    )
)
def test_odd_text_through_the_real_tokenizer_and_template(real, text):
    srv = real.server
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ("/v1/completions", {"prompt": text}),
    ):
        status, _, answer = post(srv, path, {**body, "max_tokens": 2, "temperature": 0})
        assert status in (200, 400), answer
        if status == 400:  # text the vocabulary cannot express at all ("", some control bytes)
            assert_error_shape(answer)
            assert (
                path == "/v1/completions" and answer["error"]["message"] == "The prompt is empty."
            )


# --- a real waitress-serve process: soak, then SIGTERM while streaming ----------------------------


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """`waitress-serve wsgi:app` on a tiny GGUF, as `make serve` runs it."""
    path = write_tiny_gguf(
        str(tmp_path_factory.mktemp("spawned") / "tiny.gguf"), "llama", context=256
    )
    server = soak.Server(
        path, {"LLM_SLOTS": "2", "LLM_MAX_CONTEXT": "256", "LLM_DRAIN_SECONDS": "30"}
    ).start()
    try:
        server.wait_ready(300)
        yield server
    finally:
        server.close()


def test_soak_loses_nothing_and_leaks_nothing(spawned):
    report = soak.run(
        requests=40, concurrency=8, disconnect=0.3, max_tokens=16, seed=1, server=spawned
    )
    assert report["errors"] == report["lost"] == report["rejected"] == 0, report
    assert (
        report["completed"] + report["cancelled"] == 40
        and report["completed"] > 0
        and report["cancelled"] > 0
    )
    assert report["slots_free"] == report["slots_total"] == 2 and report["queue_depth_after"] == 0
    assert report["threads_after"] == report["threads_before"]
    assert report["rss_growth_pct"] < 10, report


def test_sigterm_lets_streams_finish_then_exits_0(spawned):
    """Must run after the other tests on `spawned`: it shuts that server down. The signal goes to
    the whole process group, as systemd and `timeout` send it: tinygrad's compile workers die with
    it, which would hang Python's own exit without the lifecycle's safety net."""
    srv = SimpleNamespace(host="127.0.0.1", port=spawned.port)
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
    os.killpg(spawned.process.pid, signal.SIGTERM)
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
    assert spawned.process.wait(30) == 0
    assert time.monotonic() - started < 30
    log = spawned.log()
    assert "SIGTERM: shutting down gracefully" in log and "'cancelled': 0" in log
