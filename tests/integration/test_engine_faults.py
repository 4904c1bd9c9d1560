"""Faults reaching the real engine loop on a tiny random GGUF behind an in-process Waitress: a
hostile chat template, failing prefill and decode steps, a client that never reads and odd text
through the real tokenizer. The watchdog on a fake runner is tests/unit/test_engine_watchdog.py."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import (
    HELLO,
    USAGE,
    Stream,
    assert_error_shape,
    finish_reason,
    get,
    post,
    slots_idle,
    tiny_engine_server,
    unread_stream,
    wait_until,
)
from support.tiny_models import write_tiny_gguf


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
def hostile_template_server(tmp_path_factory):
    """The real engine on a tiny llama whose chat template attempts attacks, behind Waitress:
    (engine, server, the file an attack would create)."""
    tmp = tmp_path_factory.mktemp("hardening")
    marker = str(tmp / "pwned")
    path = write_tiny_gguf(str(tmp / "hostile.gguf"), "llama", context=256, chat_template=hostile_template(marker))
    with tiny_engine_server(path, slots=2, queue_limit=4) as (engine, srv):
        yield SimpleNamespace(engine=engine, server=srv, marker=marker)


@pytest.fixture
def patch_runner(hostile_template_server):
    """Replace runner methods for one test: `patch_runner("run", make)`, make(original) the new one; restored afterwards."""
    runner = hostile_template_server.engine.loaded.runner
    saved = {}

    def patch(name, make):
        saved.setdefault(name, getattr(runner, name))
        setattr(runner, name, make(saved[name]))

    yield patch
    for name, original in saved.items():
        setattr(runner, name, original)


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_hostile_chat_template_is_a_400_and_the_server_keeps_serving(hostile_template_server, attack):
    srv = hostile_template_server.server
    status, _, body = post(
        srv,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": f"attack:{attack}"}], "max_tokens": 2},
    )
    assert status == 400
    assert_error_shape(body)
    assert body["error"]["param"] == "messages"
    assert not os.path.exists(hostile_template_server.marker)
    status, _, body = post(srv, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert get(srv, "/health")[0] == 200


def test_a_failing_prefill_fails_only_its_request(hostile_template_server, patch_runner):
    engine, srv = hostile_template_server.engine, hostile_template_server.server

    def broken(original):  # a step with the prompt fails, mixed with the healthy stream's decode or alone
        def run(parts):
            if any(666 in part.request.prompt_ids and not part.decoding for part in parts):
                raise RuntimeError("injected prefill fault")
            if any(part.decoding for part in parts):
                time.sleep(0.02)
            return original(parts)

        return run

    patch_runner("run", broken)
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

    failing = Stream(srv, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 5})  # fine: no 666
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


def test_a_failing_decode_fails_its_step_and_the_next_requests_succeed(hostile_template_server, patch_runner):
    engine, srv = hostile_template_server.engine, hostile_template_server.server

    def broken(original):
        def run(parts):
            if any(666 in part.request.prompt_ids and part.decoding for part in parts):
                raise RuntimeError("injected decode fault")
            return original(parts)

        return run

    patch_runner("run", broken)
    events = Stream(srv, "/v1/completions", {"prompt": [1, 666, 2], "max_tokens": 8, "ignore_eos": True}).rest()
    assert events[-1] == "[DONE]"
    assert_error_shape(events[-2], "server_error", "engine_error")
    status, _, body = post(srv, "/v1/completions", {"prompt": [1, 666, 3], "max_tokens": 8, "ignore_eos": True})
    assert status == 500 and body["error"]["code"] == "engine_error"
    for _ in range(2):
        status, _, body = post(srv, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 6, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 6
    assert engine._thread.is_alive() and get(srv, "/health")[0] == 200
    assert wait_until(lambda: slots_idle(engine))


def test_a_client_that_never_reads_stalls_neither_the_model_nor_others(hostile_template_server):
    engine, srv = hostile_template_server.engine, hostile_template_server.server
    ran_out = engine.stats()["requests_total"]["length"]
    sock = unread_stream(srv, "/v1/completions", {"prompt": "Never read me", "max_tokens": 150, "ignore_eos": True})
    try:
        started = time.monotonic()
        status, _, body = post(srv, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 8, "ignore_eos": True})
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
def test_odd_text_through_the_real_tokenizer_and_template(hostile_template_server, text):
    srv = hostile_template_server.server
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ("/v1/completions", {"prompt": text}),
    ):
        status, _, answer = post(srv, path, {**body, "max_tokens": 2, "temperature": 0})
        assert status in (200, 400), answer
        if status == 400:  # text the vocabulary cannot express at all ("", some control bytes)
            assert_error_shape(answer)
            assert path == "/v1/completions" and answer["error"]["message"] == "The prompt is empty."
