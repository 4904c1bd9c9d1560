"""A server on a network, seen from the web layer (a real engine over a scripted runner): the API key and the admin
token, the login form, the start-up warning when exposed, the security headers and the limits on
what a request may hold. What only a real connection can send is
tests/integration/test_security_on_the_wire.py."""

from __future__ import annotations

import base64
import json
import logging

import pytest
from support import (
    HELLO,
    assert_error_shape,
)
from support.fakes import Reply

from webapp import create_app
from webapp.ops.exposure import listen_hosts, warn_if_exposed

TOKEN = "letmein-admin"


# --- authentication -------------------------------------------------------------------------------


def test_api_key_guards_every_v1_route_but_not_health(fake_engine):
    client = create_app({"TESTING": True, "API_KEY": "sekret"}, engine=fake_engine).test_client()
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
            r = client.open(path, method=method, json={"messages": HELLO, "prompt": "x"}, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert_error_shape(r.get_json(), code="invalid_api_key")
            assert r.headers["WWW-Authenticate"] == "Bearer"
    right = {"Authorization": "Bearer sekret"}
    assert client.get("/v1/models", headers=right).status_code == 200
    assert client.post("/v1/chat/completions", json={"messages": HELLO}, headers=right).status_code == 200
    assert client.get("/v1/nope", headers=right).status_code == 404
    assert client.get("/health").status_code == 200
    assert client.get("/").status_code == 200


def test_secrets_from_the_environment_are_taken_verbatim(fake_engine, monkeypatch):
    monkeypatch.setenv("LLM_API_KEY", "1e3")  # JSON would make this the float 1000.0
    monkeypatch.setenv("LLM_ADMIN_TOKEN", "true")
    app = create_app({"TESTING": True}, engine=fake_engine)
    assert (app.config["API_KEY"], app.config["ADMIN_TOKEN"]) == ("1e3", "true")
    assert app.test_client().get("/v1/models", headers={"Authorization": "Bearer 1e3"}).status_code == 200


@pytest.fixture
def admin_client(fake_engine):
    """An app with an admin token and probe routes of its own under both guarded prefixes, so these
    tests depend only on the guard, not on what the dashboard blueprints do."""
    app = create_app({"TESTING": True, "ADMIN_TOKEN": TOKEN}, engine=fake_engine)
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
    for path in ("/admin", "/admin/stats.json", "/metrics"):  # the real pages, behind the same guard
        assert admin_client.get(path, headers=bearer).status_code == 200, path
    basic = {"Authorization": "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()}
    assert admin_client.get("/admin/probe", headers=basic).status_code == 200
    # the API and the pages do not want the admin token
    assert admin_client.get("/v1/models").status_code == 200
    assert admin_client.get("/health").status_code == 200


def test_a_browser_is_sent_to_the_login_form_and_its_cookie_opens_both_prefixes(admin_client):
    r = admin_client.get("/admin/probe", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
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
    assert admin_client.get("/admin/probe", headers={"Accept": "application/json"}).status_code == 401


@pytest.mark.parametrize(
    "target",
    ["https://evil.example/", "//evil.example/x", "/\\evil.example", "javascript:alert(1)"],
)
def test_login_only_redirects_within_the_site(admin_client, target):
    r = admin_client.post("/admin/login", data={"token": TOKEN, "next": target})
    assert r.status_code == 303 and r.headers["Location"] == "/admin"


def test_without_an_admin_token_the_pages_are_open_and_login_steps_aside(fake_engine):
    app = create_app({"TESTING": True}, engine=fake_engine)
    app.add_url_rule("/admin/probe", "admin_probe", lambda: "admin ok")
    client = app.test_client()
    assert client.get("/admin/probe").status_code == 200
    r = client.get("/admin/login?next=/admin/probe")
    assert r.status_code == 303 and r.headers["Location"] == "/admin/probe"


def test_the_start_up_warns_loudly_when_exposed_without_an_admin_token(caplog):
    with caplog.at_level(logging.WARNING, logger="webapp.ops.exposure"):
        assert warn_if_exposed({"ADMIN_TOKEN": None, "API_KEY": None}, ["0.0.0.0"])
    text = caplog.text
    assert "LLM_ADMIN_TOKEN is not set" in text and "0.0.0.0" in text and "LLM_API_KEY" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="webapp.ops.exposure"):
        assert not warn_if_exposed({"ADMIN_TOKEN": None}, ["127.0.0.1", "::1"])
        assert not warn_if_exposed({"ADMIN_TOKEN": None}, ["unix"])
        assert not warn_if_exposed({"ADMIN_TOKEN": None, "HOST": "127.0.0.1"}, None)
        assert not warn_if_exposed({"ADMIN_TOKEN": "t", "API_KEY": "k"}, ["0.0.0.0"])
    assert caplog.text == ""
    assert warn_if_exposed({}, None)  # not started by waitress-serve and no LLM_HOST: assume exposed


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


def test_every_response_carries_security_headers(fake_client):
    for path in ("/", "/admin/login", "/health", "/v1/models", "/no/such/page"):
        r = fake_client.get(path)
        assert r.headers["X-Content-Type-Options"] == "nosniff", path
        assert r.headers["X-Frame-Options"] == "DENY", path
        assert r.headers["Referrer-Policy"] == "no-referrer", path
    for path in ("/", "/admin/login"):
        csp = fake_client.get(path).headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp


def test_user_text_never_comes_back_as_html(fake_engine):
    app = create_app({"TESTING": True, "ADMIN_TOKEN": TOKEN}, engine=fake_engine)
    client = app.test_client()
    evil = '/x"><script>alert(1)</script>'
    html = client.get("/admin/login", query_string={"next": evil}).get_data(as_text=True)
    assert "<script>alert(1)" not in html and "&lt;script&gt;" in html
    r = client.get("/<script>alert(1)</script>")
    assert r.status_code == 404 and r.mimetype == "application/json"
    fake_engine.loaded.runner.replies.append(Reply.text("<img src=x onerror=alert(1)>"))
    r = client.post("/v1/chat/completions", json={"messages": HELLO})
    assert r.mimetype == "application/json" and r.get_json()["choices"][0]["message"]["content"] == "<img src=x onerror=alert(1)>"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": HELLO, "stream": True}),
        ("/v1/responses", {"input": "hi", "stream": True}),
        ("/v1/messages", {"model": "m", "max_tokens": 16, "messages": HELLO, "stream": True}),
    ],
)
def test_streamed_text_with_unicode_line_breaks_stays_one_line_per_event(fake_client, fake_engine, path, body):
    # U+2028, U+2029 and U+0085 end a line for str.splitlines; JSON leaves them raw unless escaped
    fake_engine.loaded.runner.replies.append(Reply.text("a\u2028b\u2029c\x85d"))
    r = fake_client.post(path, json=body)
    events = [line[6:] for line in r.get_data(as_text=True).splitlines() if line.startswith("data: ")]
    parsed = [json.loads(e) for e in events if e != "[DONE]"]
    sent = json.dumps(parsed, ensure_ascii=False)
    assert all(c in sent for c in "\u2028\u2029\x85")


# --- limits ---------------------------------------------------------------------------------------


def test_too_many_messages_is_400(fake_engine):
    client = create_app({"TESTING": True, "MAX_MESSAGES": 3}, engine=fake_engine).test_client()
    assert client.post("/v1/chat/completions", json={"messages": HELLO * 3}).status_code == 200
    r = client.post("/v1/chat/completions", json={"messages": HELLO * 4})
    assert r.status_code == 400
    assert_error_shape(r.get_json(), code="array_above_max_length")
    assert r.get_json()["error"]["param"] == "messages"


def test_default_message_limit(fake_client):
    r = fake_client.post("/v1/chat/completions", json={"messages": HELLO * 1001})
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
def test_oversized_parameters_are_400(fake_client, body, param):
    r = fake_client.post("/v1/chat/completions", json={"messages": HELLO, **body})
    assert r.status_code == 400
    assert_error_shape(r.get_json())
    assert r.get_json()["error"]["param"] == param


def test_longest_stop_string_is_accepted(fake_client):
    assert fake_client.post("/v1/chat/completions", json={"messages": HELLO, "stop": ["x" * 256] * 4}).status_code == 200


def test_max_tokens_is_capped_to_the_context(fake_client, fake_engine):
    r = fake_client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 10**12})
    assert r.status_code == 200
    request = fake_engine.loaded.runner.requests[-1]
    assert request.params.max_tokens == fake_engine.max_context - request.prompt_len


def test_prompt_token_limit(fake_engine):
    client = create_app({"TESTING": True, "MAX_PROMPT_TOKENS": 16}, engine=fake_engine).test_client()
    assert client.post("/v1/completions", json={"prompt": "x" * 15}).status_code == 200  # + BOS = 16
    r = client.post("/v1/completions", json={"prompt": "x" * 16})
    assert r.status_code == 400
    assert_error_shape(r.get_json(), code="context_length_exceeded")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 50}]})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "messages"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate
        b'{"prompt": "ok", "user": "\\udfff"}',
        b'{"prompt": "x", "metadata": ' + b'{"a": ' * 80 + b"1" + b"}" * 80 + b"}",  # deep but parseable
        b'{"prompt": "x", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # beyond the C decoder
    ],
)
def test_malformed_json_values_are_400(fake_client, raw):
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = fake_client.post(path, data=raw, content_type="application/json")
        assert r.status_code == 400, r.get_json()
        assert_error_shape(r.get_json(), code="invalid_json")
