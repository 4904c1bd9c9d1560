"""`n` > 1 through the API: the real `openai` client and raw streams against a real engine over a
scripted runner behind a real Waitress server; each choice its own reply and seed, streamed choices
interleaved, a disconnect or a full queue aborting every choice."""

from __future__ import annotations

import pytest
from support import HELLO, Stream, wait_until
from support.fakes import Reply

from webapp.engine.serving.request import FinishReason, Status


def test_chat_choices_each_get_their_own_reply_and_seed(openai_client, fake_runner):
    fake_runner.replies.extend([Reply.text("one"), Reply.text("two"), Reply.text("three")])
    out = openai_client.chat.completions.create(model="m", messages=HELLO, n=3, seed=7, max_tokens=4)
    assert [(c.index, c.message.content) for c in out.choices] == [(0, "one"), (1, "two"), (2, "thre")]
    assert [c.finish_reason for c in out.choices] == ["stop", "stop", "length"]
    assert out.usage.completion_tokens == 3 + 3 + 4
    assert out.usage.prompt_tokens == fake_runner.requests[0].prompt_len  # the prompt counts once
    assert [r.params.seed for r in fake_runner.requests] == [7, 8, 9]
    assert len({r.id for r in fake_runner.requests}) == 3


def test_streamed_choices_interleave_each_with_its_opening_and_finish(fake_server, fake_runner):
    fake_runner.replies.extend([Reply.text("aaaa", delay=0.01), Reply.text("bb", delay=0.01)])
    events = Stream(fake_server, "/v1/chat/completions", {"messages": HELLO, "n": 2, "stream_options": {"include_usage": True}}).rest()
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    by_index = {i: [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i] for i in (0, 1)}
    for index, text in ((0, "aaaa"), (1, "bb")):
        choices = by_index[index]
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content") or "" for c in choices) == text
        assert [c["finish_reason"] for c in choices][-1] == "stop"
    assert {e["id"] for e in events[:-1]} == {events[0]["id"]}  # one completion, two choices
    assert events[-2]["usage"]["completion_tokens"] == 6


def test_completion_choices_stream_and_not(openai_client, fake_runner):
    fake_runner.replies.extend([Reply.text("x"), Reply.text("yy")])
    out = openai_client.completions.create(model="m", prompt="hi", n=2)
    assert [c.text for c in out.choices] == ["x", "yy"]
    fake_runner.replies.extend([Reply.text("x"), Reply.text("yy")])
    texts = {0: "", 1: ""}
    for chunk in openai_client.completions.create(model="m", prompt="hi", n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: "x", 1: "yy"}


def test_n_above_the_slot_count_is_400_naming_n(openai_client, fake_engine, fake_runner):
    with pytest.raises(Exception) as e:
        openai_client.chat.completions.create(model="m", messages=HELLO, n=fake_engine.n_slots + 1)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    assert fake_runner.requests == []


def test_a_disconnect_aborts_every_choice(fake_server, fake_runner):
    fake_runner.replies.extend([Reply([ord("x")], delay=0.01, forever=True) for _ in range(3)])
    stream = Stream(fake_server, "/v1/chat/completions", {"messages": HELLO, "n": 3})
    stream.next()
    assert wait_until(lambda: len(fake_runner.requests) == 3)
    stream.response.close()  # the response holds the socket too
    stream.conn.close()
    assert wait_until(lambda: [r.finish_reason for r in fake_runner.requests] == [FinishReason.CANCELLED] * 3)


def test_a_full_queue_midway_aborts_the_choices_already_queued(openai_client, fake_engine, monkeypatch):
    submit, submitted = fake_engine.submit, []

    def second_is_refused(request):
        submitted.append(request)
        submit(request)
        fake_engine.queue_limit = 0  # the queue is full from now on

    monkeypatch.setattr(fake_engine, "submit", second_is_refused)
    with pytest.raises(Exception) as e:
        openai_client.with_options(max_retries=0).chat.completions.create(model="m", messages=HELLO, n=2)
    assert e.value.status_code == 429
    first, refused = submitted
    assert wait_until(lambda: first.finish_reason == FinishReason.CANCELLED)
    assert refused.status is Status.WAITING  # never taken in
