"""Speculative decoding changes no output: on the default model, a prompt that asks for its own text
again (which prompt lookup drafts well), each kind of sampling gives the same tokens and logprobs
with speculation as without, alone and beside other requests, and most drafts are confirmed."""

import pytest
from support import drain_outputs, wait_until
from support.tiny_models import default_model_path

from webapp.engine.decoding.constraints import json_schema_grammar
from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.loader import load_gguf_model
from webapp.engine.serving.request import Request

# a text the default model repeats greedily for the 60 tokens asked (76% of its drafts confirmed, with
# the kernels' activations rounded per 32 values or as llama.cpp rounds them; a schedule() function
# tried first was repeated for a line, then became other code)
TEXT = (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n"
)


@pytest.fixture(scope="module")
def engine():
    use_tinygrad_from_this_thread()
    eng = Engine(lambda: load_gguf_model(default_model_path(), slots=4, max_context=1024, prefill_chunk=32), slots=4, queue_limit=8)
    eng.start()
    assert wait_until(lambda: eng.state != "loading", timeout=300)
    assert eng.state == "ok", eng.error
    yield eng
    eng.stop(5)


def prompt(engine, text: str = TEXT) -> list[int]:
    messages = [{"role": "user", "content": f"Repeat this code exactly, with no comment:\n\n{text}"}]
    return engine.tokenizer.encode(engine.chat_template.render(messages, add_generation_prompt=True), special=True)


def params(engine, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=60, stop_token_ids=frozenset(engine.tokenizer.stop_ids), **kw)


def run(engine, speculate: bool, requests: list[Request]) -> list[tuple[list[int], list]]:
    engine.speculation.enabled = speculate  # read at admission: each request drafts or not for its whole life
    for request in requests:
        engine.submit(request)
    return [(drain_outputs(r, timeout=120, reraise=True)[0], [(e.token, e.logprob) for e in r.logprobs]) for r in requests]


KINDS = {
    "greedy": dict(temperature=0.0, logprobs=True, top_logprobs=2),
    "seeded": dict(temperature=0.8, top_p=0.95, seed=7, logprobs=True),
    "penalized": dict(temperature=0.6, seed=3, frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.1, top_k=20),
}


@pytest.mark.parametrize("kind", KINDS)
def test_speculation_gives_the_tokens_plain_decoding_gives(engine, kind):
    plain = run(engine, False, [Request(prompt(engine), params(engine, **KINDS[kind]))])
    drafted = Request(prompt(engine), params(engine, **KINDS[kind]))
    assert run(engine, True, [drafted]) == plain
    assert drafted.drafted_tokens > 0
    if kind == "greedy":
        assert drafted.accepted_tokens >= 0.5 * drafted.drafted_tokens, (drafted.accepted_tokens, drafted.drafted_tokens)


def test_a_constrained_request_follows_its_grammar_with_drafts(engine):
    grammar = json_schema_grammar({"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]})

    def request():
        return Request(prompt(engine), params(engine, temperature=0.0), constraint=engine.grammars.matcher(grammar))

    plain, drafted = run(engine, False, [request()]), run(engine, True, [request()])
    assert drafted == plain and engine.tokenizer.decode(drafted[0][0]).startswith('{"code": "')


def test_beside_other_requests_each_gets_what_it_gets_alone(engine):
    kinds = [KINDS["greedy"], KINDS["seeded"], dict(temperature=0.9, seed=11)]
    texts = [TEXT, TEXT.replace("slots", "lanes"), "print('hello')\n" * 3]

    def requests():
        return [Request(prompt(engine, t), params(engine, **k)) for t, k in zip(texts, kinds, strict=True)]

    alone = [run(engine, False, [r])[0] for r in requests()]
    together = requests()
    assert run(engine, True, together) == alone
    assert sum(r.accepted_tokens for r in together) > 0
    stats = engine.stats()
    assert stats["accepted_tokens_total"] > 0 and stats["drafted_tokens_total"] >= stats["accepted_tokens_total"]


def test_a_repeated_request_drafts_from_the_earlier_answer(engine):
    messages = [{"role": "user", "content": "Name three rivers of Europe, one line each."}]
    ids = engine.tokenizer.encode(engine.chat_template.render(messages, add_generation_prompt=True), special=True)
    first = Request(ids, params(engine, temperature=0.0))
    second = Request(ids, params(engine, temperature=0.0))
    assert run(engine, True, [first]) == run(engine, True, [second])
    assert second.accepted_tokens >= 0.6 * len(second.output_ids) > 0, (second.accepted_tokens, second.drafted_tokens)


def test_warm_up_times_what_drafted_lanes_cost(engine):
    """The verifications of 1..9 lanes the drafts are priced by (decoding/drafts.py StepCosts): every
    width timed, and 9 lanes cost more than one and less than 9 one-lane steps (they read the weights
    together)."""
    seconds = engine.loaded.runner.verify_seconds
    assert len(seconds) == 9 and all(t > 0 for t in seconds)
    costs = engine.speculation.costs(engine.loaded.runner)
    assert costs.lanes[0] == 1.0 and 1.0 < costs.step(9) < 9.0 and costs.step(12) > costs.step(9)
