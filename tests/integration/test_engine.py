"""The engine on a tiny random GGUF: batching, prefix reuse, seeds, abort and fault isolation."""

import threading

import pytest
from support import before_each_decode, drain_outputs, wait_until
from support.tiny_models import write_tiny_gguf

from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.serving.engine import Engine, QueueFull
from webapp.engine.serving.loader import load_gguf_model
from webapp.engine.serving.request import Request

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = [
    [1, 504, 3458, 282, 4649, 314, 253],
    [1, 300, 400],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [1, 999, 888, 777, 666],
    [1, 42],
]


def collect(request: Request) -> tuple[list[int], str]:
    """(token ids, finish reason) of a request; an engine failure forwarded to it is raised."""
    return drain_outputs(request, timeout=60, reraise=True)


def run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> Request:
    request = Request(list(prompt), params)
    engine.submit(request)
    return request


@pytest.fixture(scope="module", params=["f16", "q8_0"])
def tiny_engine(request, tmp_path_factory):
    """The real engine on a tiny random-weight llama in Q4_1 (4 slots, a queue of 6, 128 positions),
    with each KV cache type (the 8-bit one on heads of 32 values: a Q8_0 block)."""
    # Q4_1 matrices, as in the default model: on the CPU they run on the block kernels
    heads = {"n_heads": 2, "n_kv_heads": 1} if request.param == "q8_0" else {}
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("m") / "llama.gguf"), "llama", matrix_type="Q4_1", **heads)
    use_tinygrad_from_this_thread()
    load = lambda: load_gguf_model(path, slots=4, max_context=128, prefill_chunk=8, kv_type=request.param)  # noqa: E731
    eng = Engine(load, slots=4, queue_limit=6, prefill_chunk=8)
    eng.start()
    assert wait_until(lambda: eng.state != "loading", timeout=300)  # warm-up compiles: slow on a busy machine
    assert eng.state == "ok", eng.error
    yield eng
    eng.stop(5)


def test_batched_equals_alone_token_for_token(tiny_engine):
    alone = [collect(run(tiny_engine, p))[0] for p in PROMPTS]
    # now all together, joining at different times while others decode
    requests = []
    for prompt in PROMPTS:
        requests.append(run(tiny_engine, prompt))
        threading.Event().wait(0.02)
    together = [collect(r)[0] for r in requests]
    assert together == alone
    assert all(len(t) == 12 for t in alone)


def test_follow_up_reuses_the_cached_prefix_and_matches_a_fresh_run(tiny_engine):
    first = run(tiny_engine, PROMPTS[2])
    reply, _ = collect(first)
    follow_up = PROMPTS[2] + reply + [5, 6, 7]
    reused = run(tiny_engine, follow_up)
    reused_tokens, _ = collect(reused)
    assert reused.cached_tokens >= len(PROMPTS[2]) + len(reply) - 1
    assert reused.prefilled_tokens == len(follow_up) - reused.cached_tokens

    # evict that slot's contents by filling every slot with other prompts, then run fresh
    for r in [run(tiny_engine, [1, 77 + i, 3, 4]) for i in range(4)]:
        collect(r)
    fresh = run(tiny_engine, follow_up)
    fresh_tokens, _ = collect(fresh)
    assert fresh.cached_tokens <= 1  # only the shared BOS token
    assert fresh_tokens == reused_tokens


def test_seeded_sampling_is_repeatable_and_varies_by_seed(tiny_engine):
    def sampled(seed):
        return collect(run(tiny_engine, PROMPTS[0], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=seed)))[0]

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


def test_stop_token_ends_the_request_without_emitting_it(tiny_engine):
    tokens, _ = collect(run(tiny_engine, PROMPTS[0]))
    stop_at = tokens[3]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=frozenset({stop_at}))
    got, reason = collect(run(tiny_engine, PROMPTS[0], params))
    assert reason == "stop"
    assert got == tokens[: tokens.index(stop_at)]


def test_abort_frees_the_slot_within_a_step(tiny_engine):
    request = run(tiny_engine, PROMPTS[1], SamplingParams(max_tokens=100, temperature=0.0))
    assert isinstance(request.outputs.get(timeout=30), int)
    tiny_engine.abort(request)
    _, reason = collect(request)
    assert reason == "cancelled"
    assert all(s.owner is None for s in tiny_engine.scheduler.slots.slots)
    assert not tiny_engine.scheduler.running and not tiny_engine.scheduler.waiting


def test_queue_limit_rejects_at_once(tiny_engine):
    gate = threading.Event()
    with before_each_decode(tiny_engine, lambda batch: gate.wait(30)):
        try:
            params = SamplingParams(max_tokens=2, temperature=0.0)
            held = [run(tiny_engine, [1, 5 + i, 9], params) for i in range(4)]  # one per slot, stuck in decode
            for _ in range(300):
                if all(r.admitted_at for r in held):
                    break
                threading.Event().wait(0.02)
            held += [run(tiny_engine, [1, 50 + i, 9], params) for i in range(6)]  # fills the queue
            with pytest.raises(QueueFull) as excinfo:
                run(tiny_engine, [1, 2, 3])
            assert excinfo.value.retry_after >= 1
        finally:
            gate.set()
    for r in held:
        assert collect(r)[1] == "length"


def test_a_failing_step_fails_only_its_requests(tiny_engine):
    """A mixed step holding the failing prompt beside a good one runs again apart: only the bad one fails."""
    runner = tiny_engine.loaded.runner
    original = runner.run
    assert runner.mixes  # the CPU kernels' one-call steps

    def broken(parts):
        if any(part.request.prompt_ids[1] == 666 and not part.decoding for part in parts):
            raise RuntimeError("injected fault")
        return original(parts)

    runner.run = broken
    try:
        bad = run(tiny_engine, [1, 666, 2])
        good = run(tiny_engine, PROMPTS[0])
        with pytest.raises(RuntimeError, match="injected fault"):
            collect(bad)
        assert bad.finish_reason == "error"
        assert len(collect(good)[0]) == 12
    finally:
        runner.run = original
    assert tiny_engine.health()["status"] == "ok"
    assert len(collect(run(tiny_engine, PROMPTS[1]))[0]) == 12


def test_constrained_and_free_requests_share_steps_and_each_matches_alone(tiny_engine):
    from webapp.engine.decoding.constraints import json_schema_grammar

    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    stops = frozenset(tiny_engine.tokenizer.stop_ids)

    def constrained() -> Request:
        params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=stops)
        request = Request(list(PROMPTS[0]), params, constraint=tiny_engine.grammars.matcher(grammar))
        tiny_engine.submit(request)
        return request

    free = SamplingParams(
        max_tokens=12,
        temperature=0.8,
        seed=3,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias=((5, 2.0),),
        logprobs=True,
        top_logprobs=3,
    )
    alone = [collect(constrained())[0]] + [collect(r)[0] for r in [run(tiny_engine, p, free) for p in PROMPTS[1:2]]]
    alone += [collect(run(tiny_engine, p, free))[0] for p in PROMPTS[2:4]]
    requests = [constrained()] + [run(tiny_engine, p, free) for p in PROMPTS[1:4]]
    together = [collect(r)[0] for r in requests]
    assert together == alone
    assert tiny_engine.tokenizer.decode(together[0]).startswith('{"a": ')
    assert [e.token for e in requests[1].logprobs] == together[1] and len(requests[1].logprobs[0].top) == 3


def test_choices_sharing_a_copied_prompt_match_their_seeds_run_alone(tiny_engine):
    prompt = PROMPTS[2] + [7, 8, 9]  # longer than a piece past what any slot caches now
    seeds = [SamplingParams(max_tokens=10, temperature=0.9, seed=s) for s in (5, 6, 7)]
    choices = [run(tiny_engine, prompt, params) for params in seeds]
    together = [collect(r)[0] for r in choices]
    # copied: from the first's slot once it is prefilled, or (when a slot already holds all but a few
    # of its tokens) from that slot, prefilling the rest beside the first in the same step
    assert all(r.cached_tokens >= len(PROMPTS[2]) for r in choices[1:])
    alone = [collect(run(tiny_engine, prompt, params))[0] for params in seeds]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1
