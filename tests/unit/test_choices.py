"""`n` > 1: several choices of one prompt, merged by `interleave` and run by the real engine's
scheduler (fake runner), where the choices share one prefill by copying the first one's cache.
The API's side is tests/integration/test_choices_api.py."""

from __future__ import annotations

import threading

import pytest
from support import drain_outputs, engine_over, wait_until
from support.fakes import FakeRunner

from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.serving.request import Finished, Request
from webapp.engine.serving.scheduler import COPY_AT_LEAST
from webapp.openai.choices import ChoiceOutputs, interleave


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
