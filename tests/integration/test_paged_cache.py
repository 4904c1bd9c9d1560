"""The paged KV cache on the real default model: its tokens are the slot cache's, bit for bit, alone,
among others, after preemption and from another user's blocks; and a real server on it serves 32
concurrent chats with 8 lanes and a 7,000-token conversation through the openai client."""

import concurrent.futures
import random
import urllib.request

import openai
import pytest
from support import drain_outputs, running_server, wait_until
from support.tiny_models import default_model_path

from webapp import create_app
from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.loader import load_gguf_model
from webapp.engine.serving.request import Request

pytestmark = pytest.mark.skipif(default_model_path() is None, reason="the default model's wheel is not installed")


def engine_on(paging, slots: int = 2, context: int = 1024) -> Engine:
    use_tinygrad_from_this_thread()
    path = default_model_path()
    engine = Engine(lambda: load_gguf_model(path, slots, context, 32, paging=paging), slots=slots, prefill_chunk=32).start()
    assert wait_until(lambda: engine.state != "loading", timeout=300)
    assert engine.state == "ok", engine.error
    return engine


def page(srv, path: str) -> str:
    with urllib.request.urlopen(srv.url + path, timeout=10) as response:
        return response.read().decode()


def greedy(prompt: list[int], max_tokens: int) -> Request:
    return Request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_paged_tokens_are_the_slot_caches_alone_among_others_and_after_preemption():
    rng = random.Random(3)
    system = [rng.randrange(100, 20000) for _ in range(150)]
    prompts = [system + [rng.randrange(100, 20000) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    slots = engine_on(None)
    try:
        alone = []
        for prompt in prompts:
            r = greedy(prompt, 48)
            slots.submit(r)
            alone.append(drain_outputs(r, timeout=120)[0])
    finally:
        slots.stop(5)
    # 6 requests of ~220 positions each in a pool of 400 positions: they share the system prompt's
    # blocks and still run out, so the newest are preempted and computed again
    paged = engine_on((6, ("positions", 400)))
    try:
        requests = [greedy(p, 48) for p in prompts]
        for r in requests:
            paged.submit(r)
        together = [drain_outputs(r, timeout=300)[0] for r in requests]
        pool = paged.stats()["kv_pool"]
    finally:
        paged.stop(5)
    assert pool["preemptions_total"] > 0
    assert any(r.cached_tokens >= 144 for r in requests[1:])  # the system prompt's 9 whole blocks, shared
    assert together == alone


@pytest.fixture(scope="module")
def paged_server():
    """The default model on a paged cache of 12,000 positions, 8 lanes, behind Waitress."""
    use_tinygrad_from_this_thread()
    app = create_app({"TESTING": True, "MAX_BATCH": 8, "KV_BUDGET": "12000", "QUEUE_LIMIT": 64, "PREFILL_CHUNK": 128})
    engine = app.extensions["engine"]
    with running_server(app, threads=48) as srv:
        assert wait_until(lambda: engine.state != "loading", timeout=300)
        assert engine.state == "ok", engine.error
        yield engine, srv
    engine.stop(5)


def test_thirty_two_concurrent_chats_on_eight_lanes_all_complete(paged_server):
    engine, srv = paged_server

    def one(i: int) -> str:
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            reply = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}], max_tokens=16, temperature=0
            )
        return reply.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        reasons = list(pool.map(one, range(32)))
    assert all(reason in ("stop", "length") for reason in reasons)
    stats = engine.stats()
    assert stats["slots_total"] == 8 and stats["requests_total"]["stop"] + stats["requests_total"]["length"] >= 32
    metrics = page(srv, "/metrics")
    assert 'llm_kv_blocks{state="used"} 0.0' in metrics and "llm_preemptions_total" in metrics
    assert "KV pool" in page(srv, "/admin")


def test_a_seven_thousand_token_conversation_fits_the_default_models_trained_context(paged_server):
    engine, srv = paged_server
    assert engine.max_context == 8192  # the default model's trained context, not a slot's 4,096
    paragraph = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. "
    text = paragraph * 370
    assert 6800 < len(engine.tokenizer.encode(text)) < 7600
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        reply = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": text + "\nWhat animal jumps?"}], max_tokens=8, temperature=0
        )
    assert reply.usage.prompt_tokens > 6800 and reply.choices[0].message.content
