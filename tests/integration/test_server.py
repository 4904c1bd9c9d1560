"""The real engine on a tiny random GGUF behind a real Waitress server: openai client, prefix reuse
through the API, a client that disconnects mid-stream, and overload."""

import threading
import time

import openai
import pytest
from support import TINY_QUEUE_LIMIT, TINY_SLOTS, before_each_decode, get, post, raw_request, slots_idle, slowed_decode, wait_until

SLOTS, QUEUE_LIMIT = TINY_SLOTS, TINY_QUEUE_LIMIT


@pytest.fixture(scope="module")
def tiny_openai_client(tiny_llama_server):
    """The real `openai` client pointed at `tiny_llama_server`."""
    _, srv = tiny_llama_server
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_chat_stream_and_follow_up_reuse_the_cache(tiny_openai_client):
    client = tiny_openai_client
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
def slowed_steps(tiny_llama_server):
    """Stretch the tiny model's decode steps by 30 ms each."""
    with slowed_decode(tiny_llama_server[0], 0.03):
        yield


def test_disconnecting_mid_stream_frees_the_slot(tiny_llama_server, slowed_steps):
    engine, srv = tiny_llama_server
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Go on forever"}],
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    sock = raw_request(srv, "/v1/chat/completions", body, timeout=30)
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


def test_overload_gets_429_with_retry_after_and_health_still_answers(tiny_llama_server, tiny_openai_client):
    (engine, srv), client = tiny_llama_server, tiny_openai_client
    gate = threading.Event()

    def stall_once_full(batch):
        if len(batch) == SLOTS:  # stall once every slot is taken, so all of them get admitted first
            gate.wait(30)
        time.sleep(0.02)  # keep early requests running until the others arrive

    results = []

    def ask(i):
        try:
            r = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=20, extra_body={"ignore_eos": True}
            )
            results.append(r.choices[0].finish_reason)
        except openai.APIError as e:
            results.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(SLOTS + QUEUE_LIMIT)]
    try:
        with before_each_decode(engine, stall_once_full):
            try:
                for t in threads[:SLOTS]:
                    t.start()
                assert wait_until(lambda: engine.stats()["running"] == SLOTS)
                for t in threads[SLOTS:]:
                    t.start()
                assert wait_until(lambda: engine._waiting == QUEUE_LIMIT)

                started = time.monotonic()
                status, headers, body = post(
                    srv, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "one too many"}]}, timeout=5
                )
                assert time.monotonic() - started < 1.0
                assert status == 429 and int(headers["Retry-After"]) >= 1
                assert body["error"]["code"] == "queue_full"

                started = time.monotonic()
                assert get(srv, "/health", timeout=5)[2]["status"] == "ok"
                assert time.monotonic() - started < 1.0
            finally:
                gate.set()
    finally:
        for t in threads:
            if t.ident is not None:
                t.join(30)
    assert results == ["length"] * (SLOTS + QUEUE_LIMIT)
    assert wait_until(lambda: slots_idle(engine))
