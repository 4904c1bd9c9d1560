"""The watchdog on the real engine loop over a fake runner: /health turns 503 while a step stalls
past the bound and recovers after it, and when the model thread dies. The faults that reach a tiny
model behind Waitress are tests/integration/test_engine_faults.py."""

from __future__ import annotations

import time

import pytest
from support import engine_over, wait_until
from support.fakes import FakeChatTemplate, FakeRunner, FakeTokenizer

from webapp import create_app
from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.request import Finished, Request


class ThreadKiller(BaseException):
    """Not an Exception: the engine's per-step isolation does not catch it, so the thread dies."""


@pytest.fixture
def watchdog_engine():
    """The real engine over a FakeRunner, its watchdog's bound 0.3 s: (engine, runner)."""
    runner = FakeRunner(vocab=258, next_token=lambda last: 0)  # token 0 every time
    limits = dict(slots=2, queue_limit=4, prefill_chunk=8, stall_seconds=0.3)
    with engine_over(runner, tokenizer=FakeTokenizer(), template=FakeChatTemplate(), **limits) as engine:
        yield engine, runner


def test_health_turns_503_while_a_step_stalls_and_recovers(watchdog_engine):
    engine, runner = watchdog_engine
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
def test_health_turns_503_when_the_model_thread_dies(watchdog_engine):
    engine, runner = watchdog_engine
    client = create_app({"TESTING": True}, engine=engine).test_client()
    runner.fault = ThreadKiller()
    engine.submit(Request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0)))
    assert wait_until(lambda: not engine._thread.is_alive())
    r = client.get("/health")
    assert r.status_code == 503 and r.get_json()["status"] == "error"


def test_a_model_that_failed_to_load_answers_503_model_load_failed():
    """One model (`LLM_MODEL` alone) whose load raised: its requests get the loader's error, with no
    Retry-After, since waiting will not mend the file; /health says so too."""

    def load():
        raise ValueError("not a GGUF")

    engine = Engine(load, slots=1).start()
    try:
        assert engine.settled.wait(10) and engine.state == "error"
        client = create_app({"TESTING": True}, engine=engine).test_client()
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503 and "Retry-After" not in response.headers
        error = response.get_json()["error"]
        assert error["code"] == "model_load_failed" and error["message"] == "the model failed to load: ValueError: not a GGUF"
        assert client.get("/health").status_code == 503
    finally:
        engine.stop(5)
