"""The sampler against NumPy references (penalties, logit_bias, min_p, logprobs), and grammar
constraints on the real SmolLM2 vocabulary, without a model."""

import json

import numpy as np
import pytest

from webapp.engine.decoding.constraints import GrammarCompiler, GrammarError, json_schema_grammar, lark_grammar
from webapp.engine.decoding.sampling import RequestSampler, log_softmax, sample, token_logprobs
from webapp.engine.decoding.sampling_params import SamplingParams

V = 50


def row(seed=0):
    return np.random.default_rng(seed).standard_normal(V).astype(np.float32) * 3


def test_logit_bias_and_penalties_match_a_numpy_reference():
    params = SamplingParams(
        temperature=0, presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias=((4, 5.0), (9, -100.0))
    )
    prompt = [1, 2, 3]
    sampler = RequestSampler(params, prompt)
    outputs = []
    for step in range(6):
        logits = row(step)
        expected = logits.astype(np.float64).copy()
        expected[4] += 5.0
        expected[9] -= 100.0
        seen = sorted(set(prompt + outputs))
        expected[seen] = np.where(expected[seen] > 0, expected[seen] / 1.3, expected[seen] * 1.3)
        counts = np.bincount(outputs, minlength=V).astype(np.float64)
        expected -= counts * 0.3 + (counts > 0) * 0.7
        np.testing.assert_allclose(sampler.adjusted(logits), expected, rtol=1e-5, atol=1e-5)
        token, _ = sampler.choose(logits)
        assert token == int(np.argmax(expected))
        outputs.append(token)


def test_free_greedy_row_is_untouched():
    sampler = RequestSampler(SamplingParams(temperature=0), [1, 2])
    logits = row()
    assert sampler.adjusted(logits) is logits


def test_min_p_drops_tokens_below_its_share_of_the_best():
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04]))
    params = SamplingParams(temperature=1.0, min_p=0.25)
    rng = np.random.default_rng(0)
    drawn = {sample(logits, params, rng) for _ in range(400)}
    assert drawn == {0, 1}  # 0.1 < 0.25 * 0.5


def reference_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The probabilities the sampler should draw from, by the definitions: full sort, full softmax."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = order[:top_k] if top_k else order
    p = np.exp(x[keep] - x[keep].max())
    if top_p < 1.0:
        head = int(np.searchsorted(np.cumsum(p / p.sum()), top_p)) + 1
        keep, p = keep[:head], p[:head]
    if min_p:
        keep, p = keep[p >= min_p], p[p >= min_p]
    dist = np.zeros(logits.shape[0])
    dist[keep] = p / p.sum()
    return dist


@pytest.mark.parametrize("vocab", [50, 3000])  # one block of the draw's running sums, and several
@pytest.mark.parametrize("cuts", [{}, {"top_k": 7}, {"top_p": 0.8}, {"top_k": 20, "top_p": 0.9}, {"top_p": 0.95, "min_p": 0.02}], ids=str)
def test_draws_follow_the_cut_softmax(vocab, cuts):
    logits = np.random.default_rng(vocab).standard_normal(vocab).astype(np.float32) * 2
    logits[:10] += 6  # a peaked head, as language models' rows are
    params = SamplingParams(temperature=0.8, **cuts)
    rng = np.random.default_rng(2)
    draws = np.bincount([sample(logits, params, rng) for _ in range(8000)], minlength=vocab) / 8000
    expected = reference_distribution(logits, 0.8, **cuts)
    assert set(np.flatnonzero(draws)) <= set(np.flatnonzero(expected))  # nothing outside the cuts
    # the ten most likely tokens each, the rest in 20 ranges of ids (a long tail of rare tokens
    # would measure the draws' noise, not the sampler)
    groups = np.minimum(np.arange(vocab), 10)
    groups[10:] += np.arange(vocab - 10) * 20 // (vocab - 10)
    by_group = [np.bincount(groups, weights=d) for d in (draws, expected)]
    assert 0.5 * np.abs(by_group[0] - by_group[1]).sum() < 0.03  # total variation distance


def test_masked_tokens_are_never_drawn():
    logits = row()
    logits[::2] = -np.inf
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=1.5, top_k=10, top_p=0.95)
    assert all(sample(logits, params, rng) % 2 == 1 for _ in range(200))


def test_logprobs_are_a_distribution_and_top_is_ordered():
    logits = row(3)
    logp = log_softmax(logits)
    np.testing.assert_allclose(np.exp(logp).sum(), 1.0, rtol=1e-9)
    chosen = int(np.argsort(logits)[-3])
    entry = token_logprobs(logits, chosen, 5)
    assert entry.token == chosen and entry.logprob == pytest.approx(logp[chosen])
    values = [lp for _, lp in entry.top]
    assert values == sorted(values, reverse=True) and len(values) == 5
    assert [t for t, _ in entry.top] == list(np.argsort(-logp)[:5])
    assert chosen in [t for t, _ in entry.top[:3]]


def test_sampler_reports_logprobs_of_the_raw_row_when_asked():
    params = SamplingParams(temperature=0, logprobs=True, top_logprobs=2, logit_bias=((7, 50.0),))
    token, entry = RequestSampler(params, [1]).choose(row())
    assert token == 7
    assert entry.logprob == pytest.approx(log_softmax(row())[7])  # before the bias
    assert RequestSampler(SamplingParams(temperature=0), [1]).choose(row())[1] is None


# --- grammar constraints on the real vocabulary --------------------------------------------------


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return GrammarCompiler(smollm2_tokenizer)


def walk(constraint, ids, width):
    for t in ids:
        mask = constraint.allowed(width)
        assert mask[t]
        assert constraint.accept(t)
    return constraint.allowed(width)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}


def test_json_schema_constraint_accepts_a_valid_document_then_only_stop(smollm2_tokenizer, compiler):
    c = compiler.matcher(json_schema_grammar(SCHEMA))
    doc = json.dumps({"name": "Ada", "n": 3, "tags": ["a", "b"]})
    width = smollm2_tokenizer.vocab_size + 7  # a padded output head: ids past the vocabulary are never allowed
    end = walk(c, smollm2_tokenizer.encode(doc, special=False), width)
    assert set(np.flatnonzero(end)) <= set(smollm2_tokenizer.stop_ids) and end.any()


def test_json_schema_constraint_forbids_what_the_schema_forbids(smollm2_tokenizer, compiler):
    c = compiler.matcher(json_schema_grammar(SCHEMA))
    mask = walk(c, smollm2_tokenizer.encode('{"name": "Ada", "n": ', special=False), smollm2_tokenizer.vocab_size)
    assert not mask[smollm2_tokenizer.encode('"', special=False)[0]]  # n is an integer
    assert mask[smollm2_tokenizer.encode("4", special=False)[0]]
    assert not mask[sorted(smollm2_tokenizer.special_ids)[0]]  # special tokens never spell grammar text


def test_any_json_object_and_lark_grammars(smollm2_tokenizer, compiler):
    c = compiler.matcher(json_schema_grammar({"type": "object"}))
    mask = c.allowed(smollm2_tokenizer.vocab_size)
    assert mask[smollm2_tokenizer.encode("{", special=False)[0]] and not mask[smollm2_tokenizer.encode("[", special=False)[0]]
    yes_no = compiler.matcher(lark_grammar('start: "yes" | "no"'))
    end = walk(yes_no, smollm2_tokenizer.encode("no", special=False), smollm2_tokenizer.vocab_size)
    assert set(np.flatnonzero(end)) <= set(smollm2_tokenizer.stop_ids)


def test_bad_grammar_raises(compiler):
    with pytest.raises(GrammarError):
        compiler.matcher(lark_grammar("start: ("))


def test_constrained_sampler_draws_only_allowed_tokens(smollm2_tokenizer, compiler):
    params = SamplingParams(temperature=1.0, seed=5, stop_token_ids=frozenset(smollm2_tokenizer.stop_ids))
    sampler = RequestSampler(params, [1], compiler.matcher(json_schema_grammar(SCHEMA)))
    rng = np.random.default_rng(0)
    # random logits: every draw must still be a token the grammar allows (accept() raises otherwise)
    out = [sampler.choose(rng.standard_normal(smollm2_tokenizer.vocab_size).astype(np.float32))[0] for _ in range(12)]
    assert smollm2_tokenizer.decode(out).startswith('{"name": "')


@pytest.mark.parametrize("temperature", [1e-50, 1e-40])
def test_a_temperature_below_float32s_range_samples_greedily(temperature):
    logits = np.array([-3.0, -1.0, -2.0, -np.inf], dtype=np.float32)  # scaled, every one overflows or is 0 / 0
    assert sample(logits, SamplingParams(temperature=temperature), np.random.default_rng(0)) == 1


@pytest.mark.filterwarnings("error")
def test_scaled_logits_further_apart_than_float32_holds_draw_the_best_without_a_warning():
    # at this temperature the scaled logits are finite, but 6e38 apart: the lowest one's weight is 0
    logits = np.array([-1.0, 1.0, 0.99], dtype=np.float32)
    assert sample(logits, SamplingParams(temperature=1 / 3e38), np.random.default_rng(0)) == 1


OPEN, CLOSE = (7,), (8, 9)  # a thinking template's markers as token ids


def _greedy_run(sampler: RequestSampler, script: list[int]) -> list[int]:
    """Each choice's row prefers the script's token at that output position."""
    out = []
    for want in script:
        row = np.zeros(16, np.float32)
        row[want] = 10.0
        out.append(sampler.choose(row)[0])
    return out


@pytest.mark.parametrize(
    "opened, script, budget, expected",
    [
        (True, [5, 5, 5, 5, 5, 5, 5], 3, [5, 5, 5, 8, 9, 5, 5]),  # spent: the closing marker is forced, then the answer
        (True, [5, 8, 9, 5, 5, 5, 5], 3, [5, 8, 9, 5, 5, 5, 5]),  # closed in time by the model: untouched
        (True, [5, 5, 5, 5], 0, [8, 9, 5, 5]),  # no thinking at all
        (False, [7, 5, 5, 5, 5, 5], 2, [7, 5, 5, 8, 9, 5]),  # the output opens it itself
        (False, [5, 5, 5, 5, 5, 5], 2, [5, 5, 5, 5, 5, 5]),  # an answer that never thinks
    ],
)
def test_a_spent_thinking_budget_forces_the_closing_marker_once(opened, script, budget, expected):
    params = SamplingParams(temperature=0, reasoning_budget=budget, reasoning_markers=(OPEN, CLOSE), reasoning_open=opened)
    assert _greedy_run(RequestSampler(params, [1, 2]), script) == expected


def test_without_a_budget_or_a_closing_marker_nothing_is_forced():
    script = [5] * 6
    assert _greedy_run(RequestSampler(SamplingParams(temperature=0, reasoning_open=True), [1]), script) == script
    params = SamplingParams(temperature=0, reasoning_budget=1, reasoning_markers=((), ()), reasoning_open=True)
    assert _greedy_run(RequestSampler(params, [1]), script) == script
