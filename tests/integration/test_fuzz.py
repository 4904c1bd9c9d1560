"""Fuzzing the API with hypothesis: malformed bodies, odd parameter combinations, raw bytes and
garbage HTTP. Whatever comes in, the answer is never a 5xx and never a hang; every 4xx is an OpenAI
error object; every 200 is a well-formed completion, or a stream of JSON events ending in [DONE].

Thousands of examples go through Flask's test client against a real engine over a scripted runner
(fast); a smaller run
goes through a real Waitress server. A hang is turned into a failure with a traceback by
`faulthandler` rather than a stuck test run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import http.client
import json
import socket
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support import running_server

from webapp import create_app
from webapp.openai.chat_messages import ROLES

HANG_S = 120  # far beyond any example; only a real hang gets here

FUZZ = settings(
    deadline=None,  # timing varies with the machine's load; hangs are caught by faulthandler
    database=None,  # write no .hypothesis/ folder into the repository
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

# --- strategies -----------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)  # json.dumps writes NaN/Infinity; Python reads them
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
texts = st.text(max_size=40) | st.sampled_from(
    [
        "",
        " ",
        "<think>",
        "</think>",
        "<tool_call>",
        "<|im_end|>",
        "<s>",
        "</s>",
        "!template-error",
        "\u0000",
        "é" * 5,
    ]
)


def bodies(plausible: bool):
    """(chat, completion) body strategies. Plausible: every field has the right JSON type (values may
    still be out of range); otherwise any field may hold any JSON at all."""

    def maybe(valid):
        return valid if plausible else st.one_of(valid, valid, json_values)

    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), min_size=1, max_size=3)
    if not plausible:
        parts = st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": texts}) | json_values,
            max_size=3,
        )
    function = st.fixed_dictionaries(
        {"name": texts},
        optional={"arguments": st.one_of(texts, st.dictionaries(texts, json_values, max_size=2))},
    )
    calls = st.lists(
        st.fixed_dictionaries({"type": st.just("function"), "function": function}, optional={"id": texts}),
        max_size=2,
    )
    roles = st.sampled_from(sorted(ROLES)) if plausible else st.sampled_from(sorted(ROLES) + ["robot", ""]) | json_values
    message = st.fixed_dictionaries(
        {
            "role": roles,
            "content": st.one_of(texts, parts) if plausible else st.one_of(texts, parts, st.none(), json_values),
        },
        optional={
            "tool_calls": maybe(calls),
            "name": maybe(texts),
            "tool_call_id": maybe(texts),
            "reasoning_content": maybe(texts),
        },
    )
    schema = st.fixed_dictionaries(
        {
            "type": st.just("object"),
            "properties": st.dictionaries(
                texts,
                st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "object"])}),
                max_size=3,
            ),
        }
    )
    tool = st.fixed_dictionaries(
        {
            "type": maybe(st.just("function")),
            "function": maybe(
                st.fixed_dictionaries(
                    {"name": st.text(min_size=1, max_size=10)},
                    optional={"description": maybe(texts), "parameters": maybe(schema)},
                )
            ),
        }
    )
    common = {
        "model": maybe(texts),
        "max_tokens": maybe(st.integers(-3, 2**40)),
        "temperature": maybe(st.floats(-1, 3) | st.integers(0, 2)),
        "top_p": maybe(st.floats(-0.5, 1.5)),
        "top_k": maybe(st.integers(-3, 300)),
        "seed": maybe(st.integers(-(2**65), 2**65)),
        "stop": maybe(st.one_of(texts, st.lists(texts, max_size=6), st.text(min_size=250, max_size=260))),
        "stream": maybe(st.booleans()),
        "stream_options": maybe(st.fixed_dictionaries({}, optional={"include_usage": maybe(st.booleans())})),
        "n": maybe(st.integers(0, 3)),
        "frequency_penalty": maybe(st.floats(-3, 3)),
        "presence_penalty": maybe(st.floats(-3, 3)),
        "logprobs": maybe(st.booleans() | st.integers(0, 3)),
        "ignore_eos": maybe(st.booleans()),
        "user": maybe(texts),
        "metadata": json_values,
        "store": json_values,
    }
    chat = st.fixed_dictionaries(
        {"messages": maybe(st.lists(message, min_size=1 if plausible else 0, max_size=5))},
        optional={
            **common,
            "max_completion_tokens": maybe(st.integers(-3, 2**40)),
            "tools": maybe(st.lists(tool, max_size=3)),
            "tool_choice": maybe(st.sampled_from(["auto", "none", "required"])),
            "response_format": maybe(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
            **({} if plausible else {"surprise": json_values}),
        },
    )
    prompts = st.one_of(
        texts,
        st.lists(texts, min_size=1, max_size=1),
        st.lists(st.integers(0, 300), min_size=1, max_size=8),
    )
    if not plausible:
        prompts = st.one_of(
            prompts,
            st.lists(texts, max_size=2),
            st.lists(st.integers(-5, 300), max_size=8),
            json_values,
        )
    completion = st.fixed_dictionaries(
        {"prompt": prompts},
        optional={
            **common,
            "echo": maybe(st.booleans()),
            **({} if plausible else {"suppress": json_values}),
        },
    )
    return chat, completion


chat_bodies, completion_bodies = bodies(plausible=False)
plausible_chat_bodies, plausible_completion_bodies = bodies(plausible=True)
raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.sampled_from(
        [
            b"",
            b"{",
            b"null",
            b"[]",
            b'{"messages": [',
            b'{"prompt": "\\ud800"}',
            b"\xff\xfe{}",
            b'{"a": 1e999999}',
            b"[" * 5000,
        ]
    ),
)
endpoints = st.sampled_from(["/v1/chat/completions", "/v1/completions"])


# --- checks ---------------------------------------------------------------------------------------


def check_answer(status: int, content_type: str, data: bytes) -> None:
    event(f"HTTP {status}")  # `pytest --hypothesis-show-statistics` shows how far bodies get
    assert status < 500, data[:500]
    if status >= 400:
        body = json.loads(data)
        assert set(body) == {"error"} and set(body["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        assert body["error"]["type"] in ("invalid_request_error", "rate_limit_exceeded")
        return
    assert status == 200
    if content_type.startswith("text/event-stream"):
        text = data.decode()
        assert text.endswith("data: [DONE]\n\n"), text[-300:]
        events = text.split("\n\n")[:-1]
        assert all(e.startswith("data: ") for e in events)
        parsed = [json.loads(e[len("data: ") :]) for e in events[:-1]]
        assert all("error" not in e for e in parsed), parsed[-1]
        assert any(c.get("finish_reason") for e in parsed for c in e.get("choices", []))
    else:
        body = json.loads(data)
        assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), body


@contextlib.contextmanager
def hang_guard():
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# A small context so that random max_tokens values hit the cap and prompts can overflow it.
pytestmark = pytest.mark.parametrize("fake_engine", [{"max_context": 512}], indirect=True)


@pytest.fixture
def fuzz_client(fake_engine):
    return create_app({"TESTING": True, "MAX_MESSAGES": 4}, engine=fake_engine).test_client()


def answer_of(client, path, data: bytes):
    """(status, content type, body) of a POST through Flask's test client."""
    response = client.post(path, data=data, content_type="application/json")
    return response.status_code, response.content_type, response.get_data()


# --- the test client ------------------------------------------------------------------------------


@settings(FUZZ, max_examples=600)
@given(body=chat_bodies)
def test_malformed_chat_bodies(fuzz_client, body):
    with hang_guard():
        check_answer(*answer_of(fuzz_client, "/v1/chat/completions", json.dumps(body).encode()))


@settings(FUZZ, max_examples=600)
@given(body=plausible_chat_bodies)
def test_chat_parameter_combinations(fuzz_client, body):
    with hang_guard():
        check_answer(*answer_of(fuzz_client, "/v1/chat/completions", json.dumps(body).encode()))


@settings(FUZZ, max_examples=400)
@given(body=completion_bodies)
def test_malformed_completion_bodies(fuzz_client, body):
    with hang_guard():
        check_answer(*answer_of(fuzz_client, "/v1/completions", json.dumps(body).encode()))


@settings(FUZZ, max_examples=500)
@given(body=plausible_completion_bodies)
def test_completion_parameter_combinations(fuzz_client, body):
    with hang_guard():
        check_answer(*answer_of(fuzz_client, "/v1/completions", json.dumps(body).encode()))


@settings(FUZZ, max_examples=600)
@given(path=endpoints, data=raw_bodies)
def test_raw_bodies(fuzz_client, path, data):
    with hang_guard():
        check_answer(*answer_of(fuzz_client, path, data))


@settings(FUZZ, max_examples=300)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    # "//x" would be read by the test client as a host name; test_hardening sends it over a socket
    path=st.from_regex(r"\A/(v1/|admin|metrics|static/|health)?[a-zA-Z0-9_./%-]{0,20}\Z").filter(lambda p: not p.startswith("//")),
    auth=st.sampled_from([None, "Bearer x", "Bearer k", "Basic Og==", "bearer", "\u00e9"]),
)
def test_any_route_any_method(fake_engine, method, path, auth):
    client = create_app({"TESTING": True, "API_KEY": "k", "ADMIN_TOKEN": "t"}, engine=fake_engine).test_client()
    headers = {"Authorization": auth} if auth else {}
    with hang_guard():
        response = client.open(path, method=method, headers=headers, data=b"{}", content_type="application/json")
    assert response.status_code < 500, (method, path, response.get_data()[:300])
    if response.status_code >= 400 and method != "HEAD" and not path.startswith("/static/"):
        body = response.get_json()
        assert set(body) == {"error"}, body


# --- a real Waitress server -----------------------------------------------------------------------


@pytest.fixture
def fuzz_server(fake_engine):
    """A real Waitress server for an app set up as `fuzz_client`'s, over `fake_engine`."""
    app = create_app({"TESTING": True, "MAX_MESSAGES": 4}, engine=fake_engine)
    with running_server(app) as srv:
        yield srv
        app.extensions["lifecycle"].drain(0)  # as a shutdown does: what a handler still reads ends


def answer_over_http(server, path: str, data: bytes):
    """(status, content type, body) of a POST over a real connection."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.headers.get("Content-Type", ""), response.read()
    finally:
        conn.close()


@settings(FUZZ, max_examples=150)
@given(
    path=endpoints,
    body=st.one_of(chat_bodies, plausible_chat_bodies, completion_bodies, plausible_completion_bodies).map(json.dumps).map(str.encode)
    | raw_bodies,
)
def test_bodies_through_waitress(fuzz_server, path, body):
    with hang_guard():
        check_answer(*answer_over_http(fuzz_server, path, body))


@settings(FUZZ, max_examples=100)
@given(
    request=st.one_of(
        st.binary(min_size=1, max_size=300),
        st.builds(
            lambda method, target, headers, body: method + b" " + target + b" HTTP/1.1\r\n" + headers + b"\r\n" + body,
            st.sampled_from([b"POST", b"GET", b"BREW", b""]),
            st.sampled_from(
                [
                    b"/v1/chat/completions",
                    b"/v1/completions",
                    b"/health",
                    b"*",
                    b"http://x/v1/models",
                    b"/%ff",
                ]
            ),
            st.sampled_from(
                [
                    b"Content-Length: 5\r\n",
                    b"Content-Length: -1\r\n",
                    b"Transfer-Encoding: chunked\r\n",
                    b"Content-Length: 99999999999999999999\r\n",
                    b"X: \xff\r\n",
                    b"",
                ]
            ),
            st.binary(max_size=50),
        ),
    )
)
def test_garbage_http_leaves_the_server_serving(fuzz_server, request):
    with hang_guard():
        sock = socket.create_connection((fuzz_server.host, fuzz_server.port), timeout=5)
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            with contextlib.suppress(OSError):
                while sock.recv(65536):
                    pass
        finally:
            sock.close()
        conn = http.client.HTTPConnection(fuzz_server.host, fuzz_server.port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
