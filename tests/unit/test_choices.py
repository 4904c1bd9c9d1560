"""`n` > 1: several choices of one prompt, through the API (fake engine) and the real engine's
scheduler (fake runner), where the choices share one prefill by copying the first one's cache."""

from __future__ import annotations

import threading

import pytest
from support import HELLO, Stream, drain_outputs, engine_over, wait_until
from support.fakes import FakeRunner, Reply

from webapp.engine.serving.request import Finished, Request, SamplingParams
from webapp.engine.serving.scheduler import COPY_AT_LEAST
from webapp.openai.choices import ChoiceOutputs, interleave


def test_chat_choices_each_get_their_own_reply_and_seed(openai_client, fake_engine):
    fake_engine.replies.extend([Reply.text("one"), Reply.text("two"), Reply.text("three")])
    out = openai_client.chat.completions.create(model="m", messages=HELLO, n=3, seed=7, max_tokens=4)
    assert [(c.index, c.message.content) for c in out.choices] == [(0, "one"), (1, "two"), (2, "thre")]
    assert [c.finish_reason for c in out.choices] == ["stop", "stop", "length"]
    assert out.usage.completion_tokens == 3 + 3 + 4
    assert out.usage.prompt_tokens == fake_engine.submitted[0].prompt_len  # the prompt counts once
    assert [r.params.seed for r in fake_engine.submitted] == [7, 8, 9]
    assert len({r.id for r in fake_engine.submitted}) == 3


def test_streamed_choices_interleave_each_with_its_opening_and_finish(fake_server, fake_engine):
    fake_engine.replies.extend([Reply.text("aaaa", delay=0.01), Reply.text("bb", delay=0.01)])
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


def test_completion_choices_stream_and_not(openai_client, fake_engine):
    fake_engine.replies.extend([Reply.text("x"), Reply.text("yy")])
    out = openai_client.completions.create(model="m", prompt="hi", n=2)
    assert [c.text for c in out.choices] == ["x", "yy"]
    fake_engine.replies.extend([Reply.text("x"), Reply.text("yy")])
    texts = {0: "", 1: ""}
    for chunk in openai_client.completions.create(model="m", prompt="hi", n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: "x", 1: "yy"}


def test_n_above_the_slot_count_is_400_naming_n(openai_client, fake_engine):
    with pytest.raises(Exception) as e:
        openai_client.chat.completions.create(model="m", messages=HELLO, n=fake_engine.n_slots + 1)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    assert fake_engine.submitted == []


def test_a_disconnect_aborts_every_choice(fake_server, fake_engine):
    fake_engine.replies.extend([Reply([ord("x")], delay=0.01, forever=True) for _ in range(3)])
    stream = Stream(fake_server, "/v1/chat/completions", {"messages": HELLO, "n": 3})
    stream.next()
    stream.response.close()  # the response holds the socket too
    stream.conn.close()
    assert wait_until(lambda: len(fake_engine.aborted) == 3)


def test_a_full_queue_midway_aborts_the_choices_already_queued(openai_client, fake_engine, monkeypatch):
    submit = fake_engine.submit

    def second_is_refused(request):
        if fake_engine.submitted:
            fake_engine.queue_full_retry_after = 1
        submit(request)

    monkeypatch.setattr(fake_engine, "submit", second_is_refused)
    fake_engine.replies.append(Reply.text("held", hold=True))
    with pytest.raises(Exception) as e:
        openai_client.with_options(max_retries=0).chat.completions.create(model="m", messages=HELLO, n=2)
    assert e.value.status_code == 429
    assert fake_engine.aborted == fake_engine.submitted and len(fake_engine.submitted) == 1


def test_interleave_sends_whichever_choice_has_output():
    outputs = ChoiceOutputs(2)

    def events(index):
        yield f"open {index}"
        while not isinstance(item := outputs.get(index, timeout=5), Finished):
            yield f"{index}:{item}"

    merged = interleave([events(0), events(1)], outputs)
    assert [next(merged), next(merged)] == ["open 0", "open 1"]
    outputs.outbox(1).put(10)
    outputs.outbox(1).put(11)
    assert [next(merged), next(merged)] == ["1:10", "1:11"]  # choice 0 has nothing: not waited on
    for index in (0, 1):
        outputs.outbox(index).put(Finished("stop"))
    assert list(merged) == []


# --- the engine: one prefill, then copies --------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["apart", "mixed"])
def three_slot_engine(request):
    """The real engine over a FakeRunner with three slots, its steps apart or mixed: (engine, runner)."""
    runner = FakeRunner(vocab=50, mixes=request.param)
    with engine_over(runner, slots=3, queue_limit=8, prefill_chunk=16) as engine:
        yield engine, runner


def test_choices_prefill_the_prompt_once_and_copy_it(three_slot_engine):
    """Where steps mix, the other choices wait for the first one's prompt rather than run beside it."""
    engine, runner = three_slot_engine
    prompt = list(range(1, 31))  # two 16-token chunks
    runner.gate.clear()  # admit all three before any step runs
    choices = [Request(prompt, SamplingParams(max_tokens=2, temperature=0.0)) for _ in range(3)]
    for request in choices:
        engine.submit(request)
    assert wait_until(lambda: len(engine.scheduler.running) == 3)
    runner.gate.set()
    assert [drain_outputs(r)[0] for r in choices] == [[31, 32]] * 3
    first, *others = choices
    prefills = runner.prompt_calls()
    assert prefills[:2] == [("prefill", first.id, 0, 16), ("prefill", first.id, 16, 14)]
    for request in others:
        assert ("copy", request.id, first.slot, 29) in prefills
        assert ("prefill", request.id, 29, 1) in prefills
        assert request.cached_tokens == 29
    assert len(prefills) == 2 + 2 * len(others)


def test_a_short_shared_prefix_is_prefilled_not_copied(three_slot_engine):
    engine, runner = three_slot_engine
    runner.gate.clear()
    prompt = list(range(1, COPY_AT_LEAST + 1))  # copying would save only COPY_AT_LEAST - 1 tokens
    choices = [Request(prompt, SamplingParams(max_tokens=1, temperature=0.0)) for _ in range(2)]
    for request in choices:
        engine.submit(request)
    assert wait_until(lambda: len(engine.scheduler.running) == 2)
    runner.gate.set()
    for request in choices:
        drain_outputs(request)
    assert not [c for c in runner.calls if c[0] == "copy"]


def test_a_running_requests_cache_serves_a_new_prompt_sharing_its_prefix(three_slot_engine):
    engine, runner = three_slot_engine
    system = list(range(1, 25))
    held = threading.Event()
    runner.next_token = lambda last: 0 if held.is_set() else 40
    runner.step_s = 0.01  # the context's 100 free positions last a second
    long_runner = Request(system + [40], SamplingParams(max_tokens=1000, temperature=0.0, stop_token_ids=frozenset({0})))
    engine.submit(long_runner)
    assert wait_until(lambda: len(long_runner.output_ids) > 2)
    follower = Request(system + [41, 42], SamplingParams(max_tokens=1, temperature=0.0))
    engine.submit(follower)
    drain_outputs(follower)
    assert ("copy", follower.id, long_runner.slot, 24) in runner.calls
    assert long_runner.status.value == "decode" and follower.slot != long_runner.slot
    held.set()
    assert drain_outputs(long_runner)[1] == "stop"
