"""Accepted requests through shutdown and slow clients (a real engine over a scripted runner behind a
real Waitress): a drain
lets them finish or ends them with a clear error and refuses new ones, a second signal cancels at
once, and a reader that stalls holds only its own thread."""

from __future__ import annotations

import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from support import (
    HELLO,
    Stream,
    assert_error_shape,
    finish_reason,
    get,
    post,
    running_server,
    unread_stream,
    wait_until,
)
from support.fakes import Reply

from webapp import create_app
from webapp.engine.serving.request import FinishReason

# --- draining ------------------------------------------------------------------------------------


@pytest.fixture
def drain_server(fake_server, fake_app):
    return SimpleNamespace(server=fake_server, lifecycle=fake_app.extensions["lifecycle"])


def test_drain_lets_accepted_requests_finish_and_refuses_new_ones(drain_server, fake_runner):
    srv, lifecycle = drain_server.server, drain_server.lifecycle
    # slow steps: both requests are still generating while the drain is checked
    fake_runner.replies.append(Reply.text("slow but sure", delay=0.05))
    fake_runner.replies.append(Reply.text("queued reply", delay=0.05))
    stream = Stream(srv, "/v1/chat/completions", {"messages": HELLO})
    stream.next()  # the role chunk: the request is in flight
    waiting = {}
    t = threading.Thread(target=lambda: waiting.update(r=post(srv, "/v1/completions", {"prompt": "hi"})))
    t.start()
    assert wait_until(lambda: len(fake_runner.requests) == 2)

    result = {}
    drainer = threading.Thread(target=lambda: result.update(lifecycle.drain(10)))
    drainer.start()
    assert wait_until(lambda: lifecycle.draining)
    status, headers, body = post(srv, "/v1/chat/completions", {"messages": HELLO})
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert_error_shape(body, "server_error", "server_shutting_down")
    # each API refuses in its own shape: Anthropic's overloaded_error, which Claude Code retries
    status, headers, body = post(srv, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error" and "shutting down" in body["error"]["message"]
    status, _, body = get(srv, "/health")
    assert (status, body["status"]) == (503, "draining")

    events = stream.rest()
    assert events[-1] == "[DONE]" and finish_reason(events) == "stop"
    t.join(10)
    assert waiting["r"][0] == 200 and waiting["r"][2]["choices"][0]["text"] == "queued reply"
    drainer.join(10)
    assert result["cancelled"] == 0 and result["unfinished"] == 0 and result["in_flight_at_start"] == 2


def test_tokenize_is_drained_like_the_api(drain_server):
    """Outside /v1 yet an API family: refused once draining begins, in OpenAI's shape, with the
    headers every response carries."""
    srv, lifecycle = drain_server.server, drain_server.lifecycle
    assert post(srv, "/tokenize", {"content": "hi"})[0] == 200
    lifecycle.drain(0)
    status, headers, body = post(srv, "/tokenize", {"content": "hi"})
    assert status == 503 and int(headers["Retry-After"]) >= 1 and headers["X-Content-Type-Options"] == "nosniff"
    assert_error_shape(body, "server_error", "server_shutting_down")
    assert post(srv, "/detokenize", {"tokens": [104]})[0] == 503


def test_drain_cancels_what_outlives_its_bound(drain_server, fake_runner):
    srv, lifecycle = drain_server.server, drain_server.lifecycle
    fake_runner.replies.append(Reply([ord("a")] * 3 + [ord("b")], delay=0.01, forever=True))
    fake_runner.replies.append(Reply([ord("n")], delay=0.01, forever=True))
    stream = Stream(srv, "/v1/completions", {"prompt": "go", "max_tokens": 2000})
    stream.next()
    waiting = {}
    t = threading.Thread(target=lambda: waiting.update(r=post(srv, "/v1/chat/completions", {"messages": HELLO})))
    t.start()
    assert wait_until(lambda: len(fake_runner.requests) == 2)

    summary = lifecycle.drain(0.3)
    assert summary["cancelled"] == 2 and summary["unfinished"] == 0
    events = stream.rest()
    assert events[-1] == "[DONE]"
    assert_error_shape(events[-2], "server_error", "server_shutting_down")
    t.join(10)
    status, headers, body = waiting["r"]
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert_error_shape(body, "server_error", "server_shutting_down")
    assert all(r.cancel_reason == "shutdown" for r in fake_runner.requests)


def test_a_second_signal_cancels_at_once_and_a_third_exits(fake_engine, fake_runner):
    """The handlers' state machine, called directly: no real signal reaches this test process."""
    app = create_app({"TESTING": True, "DRAIN_SECONDS": 60}, engine=fake_engine)
    lifecycle = app.extensions["lifecycle"]
    fake_runner.replies.append(Reply([ord("n")], delay=0.01, forever=True))
    with running_server(app) as srv:
        waiting = {}
        t = threading.Thread(target=lambda: waiting.update(r=post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2000})))
        t.start()
        assert wait_until(lambda: fake_runner.requests)
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
        assert fake_runner.requests[-1].cancel_reason == FinishReason.SHUTDOWN


# --- slow readers ---------------------------------------------------------------------------------


def test_a_reader_that_stalls_holds_only_its_own_thread(fake_engine, fake_runner):
    """The stalled client's handler blocks once Waitress's buffer for it is full; the other threads
    keep serving, and the blocked one is freed when the client goes."""
    app = create_app({"TESTING": True}, engine=fake_engine)
    listener = socket.socket()
    # Small send buffers (inherited by accepted sockets), or the kernel swallows the whole stream.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    with running_server(app, threads=3, outbuf_high_watermark=32 * 1024, sockets=[listener]) as srv:
        fake_runner.replies.append(Reply([ord("z")], forever=True))  # as fast as it can, up to max_tokens
        sock = unread_stream(srv, "/v1/completions", {"prompt": "flood"})
        assert wait_until(lambda: fake_runner.requests)
        flood = fake_runner.requests[-1]
        # ~4,000 events of ~190 bytes: far more than the buffers hold, so its handler is stuck
        assert wait_until(lambda: isinstance(flood.finish_reason, str))
        assert flood.outputs.qsize() > 1000
        for _ in range(5):  # more requests than the threads left, one after another
            status, _, body = post(srv, "/v1/chat/completions", {"messages": HELLO}, timeout=10)
            assert status == 200 and body["choices"][0]["message"]["content"]
        assert flood.outputs.qsize() > 1000  # still stuck: nobody read
        sock.close()
        # its handler leaves once the client has gone: a drain finds nothing left to cancel
        summary = app.extensions["lifecycle"].drain(5)
        assert (summary["cancelled"], summary["unfinished"]) == (0, 0)
