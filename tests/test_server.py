"""The real engine on a tiny random GGUF behind a real Waitress server: openai client, prefix reuse
through the API, a client that disconnects mid-stream, and overload."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from conftest import slots_idle, slowed_decode, tiny_engine_server, wait_until
from tiny_models import write_tiny_gguf

SLOTS, QUEUE_LIMIT = 2, 2


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("m") / "llama.gguf"), "llama", context=256)
    with tiny_engine_server(path, SLOTS, QUEUE_LIMIT) as (engine, srv):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield engine, srv, client
        client.close()


def test_chat_stream_and_follow_up_reuse_the_cache(real):
    engine, _, client = real
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 8

    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More!"}]
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert usage.completion_tokens == 5
    # the whole first turn (system prompt, question and most of the reply) came from the KV cache
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


@pytest.fixture
def slow_decode(real):
    with slowed_decode(real[0], 0.03):
        yield


def test_disconnecting_mid_stream_frees_the_slot(real, slow_decode):
    engine, srv, _ = real
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "Go on forever"}], "max_tokens": 200, "stream": True, "ignore_eos": True}
    )
    sock = socket.create_connection((srv.host, srv.port), timeout=30)
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {srv.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    stream = sock.makefile("rb")
    assert b" 200 " in stream.readline()
    headers = iter(stream.readline, b"\r\n")
    assert any(h.lower().startswith(b"content-type: text/event-stream") for h in headers)
    events = 0
    while events < 4:  # the role chunk, then a few content deltas (in chunked transfer encoding)
        events += stream.readline().startswith(b"data: ")
    assert wait_until(lambda: engine.stats()["running"] == 1)
    stream.close()
    sock.close()
    assert wait_until(lambda: slots_idle(engine)), engine.stats()
    assert engine.stats()["requests_total"]["cancelled"] >= 1


def test_overload_gets_429_with_retry_after_and_health_still_answers(real):
    engine, srv, client = real
    gate = threading.Event()
    decode = engine.loaded.runner.decode

    def stalled_decode(batch, positions):
        if len(batch) == SLOTS:  # stall once every slot is taken, so all of them get admitted first
            gate.wait(30)
        time.sleep(0.02)  # keep early requests running until the others arrive
        return decode(batch, positions)

    engine.loaded.runner.decode = stalled_decode
    results = []

    def ask(i):
        try:
            r = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=20, extra_body={"ignore_eos": True}
            )
            results.append(r.choices[0].finish_reason)
        except openai.APIError as e:
            results.append(e)

    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(SLOTS)]
        for t in threads:
            t.start()
        assert wait_until(lambda: engine.stats()["running"] == SLOTS)
        threads += [threading.Thread(target=ask, args=(i,)) for i in range(SLOTS, SLOTS + QUEUE_LIMIT)]
        for t in threads[SLOTS:]:
            t.start()
        assert wait_until(lambda: engine._waiting == QUEUE_LIMIT)

        request = urllib.request.Request(
            f"{srv.url}/v1/chat/completions",
            json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "one too many"}]}).encode(),
            {"Content-Type": "application/json"},
        )
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as excinfo:
            urllib.request.urlopen(request, timeout=5)
        assert time.monotonic() - started < 1.0
        assert excinfo.value.code == 429
        assert int(excinfo.value.headers["Retry-After"]) >= 1
        assert json.load(excinfo.value)["error"]["code"] == "queue_full"

        started = time.monotonic()
        with urllib.request.urlopen(f"{srv.url}/health", timeout=5) as health:
            assert json.load(health)["status"] == "ok"
        assert time.monotonic() - started < 1.0
    finally:
        gate.set()
        engine.loaded.runner.decode = decode
        for t in threads:
            t.join(30)
    assert results == ["length"] * (SLOTS + QUEUE_LIMIT)
    assert wait_until(lambda: slots_idle(engine))
