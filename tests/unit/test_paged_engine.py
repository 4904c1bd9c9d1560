"""The real engine on a paged KV cache, over a fake model that keeps its keys in the pool's blocks
(support/paged_fakes.py): requests share a prefix's blocks, wait for blocks rather than slots, are
preempted when the pool runs dry and computed again, and every one's tokens are those it gets alone."""

import random

import pytest
from support import drain_outputs, wait_until
from support.paged_fakes import PagedFakeRunner

from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.model.kv_types import KvPool
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.errors import PromptTooLong
from webapp.engine.serving.request import Request
from webapp.engine.serving.scheduler import COPY_AT_LEAST

BLOCK = 4


def started(pool: KvPool, prefill_chunk: int = 8) -> Engine:
    runner = PagedFakeRunner(pool)
    engine = Engine(runner.loaded, queue_limit=64, prefill_chunk=prefill_chunk).start()
    assert wait_until(lambda: engine.state == "ok")
    return engine


def request(prompt, max_tokens=12):
    return Request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def run_all(engine: Engine, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    requests = [request(p, max_tokens) for p in prompts]
    for r in requests:
        engine.submit(r)
    outputs = [drain_outputs(r, timeout=20) for r in requests]
    assert all(r.finish_reason == "length" for r in requests), [r.finish_reason for r in requests]
    return [tokens for tokens, _ in outputs]


def alone(prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    """Each prompt's tokens in a roomy pool, one request at a time."""
    engine = started(KvPool(blocks=256, rows=2, positions=256, block_positions=BLOCK))
    try:
        return [run_all(engine, [p], max_tokens)[0] for p in prompts]
    finally:
        engine.stop(5)


@pytest.fixture
def prompts():
    rng = random.Random(0)
    system = [rng.randrange(50) for _ in range(20)]
    return [system + [rng.randrange(50) for _ in range(rng.randrange(1, 15))] for _ in range(10)]


def test_many_requests_on_a_small_pool_all_complete_with_their_own_tokens(prompts):
    """Ten requests, four rows, a pool that holds about three of them: admission waits for blocks,
    the newest is preempted as the others grow, and each output is the one it gets alone."""
    engine = started(KvPool(blocks=30, rows=4, positions=119, block_positions=BLOCK))
    try:
        together = run_all(engine, prompts, max_tokens=40)
        stats = engine.stats()
        assert stats["kv_pool"]["preemptions_total"] > 0
        assert stats["kv_pool"]["blocks_used"] == 0  # every block back once all ended
    finally:
        engine.stop(5)
    assert together == alone(prompts, max_tokens=40)


def test_requests_sharing_a_system_prompt_hold_its_blocks_once(prompts):
    engine = started(KvPool(blocks=200, rows=8, positions=199, block_positions=BLOCK))
    try:
        first = request(prompts[0])
        engine.submit(first)
        drain_outputs(first, timeout=20)
        shared_at = []
        engine.loaded.runner.on_step = lambda: shared_at.append(engine.scheduler.slots.pool.shared)
        rest = [request(p, 30) for p in prompts[1:]]
        for r in rest:
            engine.submit(r)
        for r in rest:
            drain_outputs(r, timeout=20)
        # the system prompt's 5 whole blocks were filed by the first request; each later one holds them
        assert all(r.cached_tokens == 20 for r in rest), [r.cached_tokens for r in rest]
        assert max(shared_at) >= 5
    finally:
        engine.stop(5)


def test_the_choices_of_one_prompt_prefill_it_once():
    prompt = list(range(30))
    engine = started(KvPool(blocks=100, rows=4, positions=99, block_positions=BLOCK))
    try:
        runner = engine.loaded.runner
        together = run_all(engine, [prompt] * 3)
        assert together[0] == together[1] == together[2]
        # the first whole prompt; the others share its filed blocks, waiting for them while that saves
        # a prefill piece (COPY_AT_LEAST tokens), and compute only the rest
        assert engine.stats()["prefill_tokens_total"] <= 30 + 2 * (COPY_AT_LEAST + BLOCK)
        assert runner.steps > 0
    finally:
        engine.stop(5)


def test_a_prompt_the_pool_cannot_hold_alone_is_refused_before_it_starts():
    engine = started(KvPool(blocks=10, rows=2, positions=39, block_positions=BLOCK))
    try:
        with pytest.raises(PromptTooLong):
            engine.submit(request(range(45)))
        assert run_all(engine, [list(range(5))])  # nothing else is lost
    finally:
        engine.stop(5)


def test_a_long_conversation_uses_more_positions_than_any_slot_had():
    """One request may reach the whole pool: here 5x what each of 4 slots of the same memory held."""
    engine = started(KvPool(blocks=50, rows=4, positions=199, block_positions=BLOCK))
    try:
        tokens = run_all(engine, [list(range(150))], max_tokens=45)[0]
        assert len(tokens) == 45
    finally:
        engine.stop(5)
