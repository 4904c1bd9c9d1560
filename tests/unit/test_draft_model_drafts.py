"""The draft model's drafts, on fake steps that keep a real per-slot cache (each next token depends on
every cached token before it, so a stale or missing cache row shows): its greedy continuation after
feeding what its cache lacks, batched over the asking requests, a long gap fed a budget at a time, a
prefix copied from another draft slot, a failed step forgetting the caches; each request's choice
between prompt lookup and the draft model; and through the engine on the fake runner, outputs that
are plain decoding's whether the draft agrees with the served model or not."""

from types import SimpleNamespace

import numpy as np
import pytest
from support import drain_outputs, engine_over
from support.fakes import FakeRunner

from webapp.engine.decoding.drafts import PromptLookup, draft_length
from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.serving import draft_model
from webapp.engine.serving.draft_model import Drafter, DraftModel
from webapp.engine.serving.request import Request

VOCAB = 50


def by_sum(prefix: list[int]) -> int:
    return sum(prefix) % VOCAB


class FakeSteps:
    """One-call steps of a model whose next token is `rule(every token up to the position)`, read from
    its own cache rows (unwritten rows are -1, and reading one fails)."""

    def __init__(self, slots: int = 3, context: int = 200, rule=by_sum):
        self.model = SimpleNamespace(slots=slots, context=context)
        self.cache = np.full((slots + 1, context), -1)
        self.rule, self.calls, self.fault = rule, [], None
        self.spare_rows = None  # no recurrent state

    def _row(self, slot: int, position: int) -> np.ndarray:
        prefix = self.cache[slot, : position + 1]
        assert (prefix >= 0).all(), f"slot {slot} reads an unwritten row below {position}"
        row = np.zeros(VOCAB, dtype=np.float32)
        row[self.rule(prefix.tolist())] = 1.0
        return row

    def prefill_and_decode(self, chunks, decoding, slots, positions):
        assert not decoding and len({slot for _, slot, _ in chunks}) == len(chunks)
        if self.fault:
            raise self.fault
        self.calls.append(("chunks", tuple((slot, start, len(tokens)) for tokens, slot, start in chunks)))
        for tokens, slot, start in chunks:
            self.cache[slot, start : start + len(tokens)] = tokens
        return [self._row(slot, start + len(tokens) - 1) for tokens, slot, start in chunks], np.zeros((0, VOCAB))

    def decode(self, tokens, slots, positions):
        self.calls.append(("decode", tuple(slots)))
        for token, slot, position in zip(tokens, slots, positions):
            self.cache[slot, position] = token
        return np.stack([self._row(s, p) for s, p in zip(slots, positions)])

    def copy_prefix(self, source, target, length):
        self.calls.append(("copy", source, target, length))
        self.cache[target, :length] = self.cache[source, :length]

    def warm_up(self, progress):
        pass


def greedy(sequence: list[int], k: int, rule=by_sum) -> list[int]:
    out = list(sequence)
    for _ in range(k):
        out.append(rule(out))
    return out[len(sequence) :]


def test_a_new_sequence_is_fed_whole_then_drafted_one_token_step_at_a_time():
    steps = FakeSteps()
    draft = DraftModel(steps, slots=3, name="draft")
    sequence = [3, 1, 4, 1, 5]
    assert draft.continue_greedy([(0, sequence, 4)]) == [greedy(sequence, 4)]
    assert steps.calls == [("chunks", ((0, 0, 5),)), ("decode", (0,)), ("decode", (0,)), ("decode", (0,))]
    assert draft.cached[0] == sequence + greedy(sequence, 3)  # the last draft was never fed


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_after_a_verification_only_what_the_cache_lacks_is_fed(accepted):
    steps = FakeSteps()
    draft = DraftModel(steps, slots=3, name="draft")
    sequence = [3, 1, 4, 1, 5]
    drafted = draft.continue_greedy([(0, sequence, 4)])[0]
    steps.calls.clear()
    sequence = sequence + drafted[:accepted] + [7]  # the confirmed drafts and the token sampled after them
    assert draft.continue_greedy([(0, sequence, 2)]) == [greedy(sequence, 2)]
    fed = 1 + (accepted == 4)  # all four confirmed: the last draft was never fed
    assert steps.calls[0] == ("chunks", ((0, len(sequence) - fed, fed),))


def test_requests_draft_together_each_as_many_as_it_asks():
    steps = FakeSteps()
    draft = DraftModel(steps, slots=3, name="draft")
    asks = [(0, [1, 2, 3], 3), (2, [9, 8], 1), (1, [5, 5, 5, 5], 2)]
    assert draft.continue_greedy(asks) == [greedy(s, k) for _, s, k in asks]
    assert steps.calls == [("chunks", ((0, 0, 3), (2, 0, 2), (1, 0, 4))), ("decode", (0, 1)), ("decode", (0,))]


def test_a_long_gap_is_fed_a_budget_a_step_and_drafts_once_it_caught_up(monkeypatch):
    monkeypatch.setattr(draft_model, "CATCH_UP", 8)
    steps = FakeSteps()
    draft = DraftModel(steps, slots=3, name="draft")
    long, short = list(range(1, 21)), [4, 4]
    assert draft.continue_greedy([(0, long, 2), (1, short, 2)]) == [[], []]  # 8 tokens of the long, then one of the short
    assert steps.calls == [("chunks", ((0, 0, 8), (1, 0, 1)))]
    assert draft.continue_greedy([(0, long, 2)]) == [[]]
    assert draft.continue_greedy([(0, long, 2), (1, short, 2)]) == [greedy(long, 2), greedy(short, 2)]


def test_a_longer_prefix_in_another_draft_slot_is_copied_first():
    steps = FakeSteps()
    draft = DraftModel(steps, slots=3, name="draft")
    system = list(range(1, 31))
    draft.continue_greedy([(1, system + [40], 1)])
    steps.calls.clear()
    sequence = system + [41, 42]
    assert draft.continue_greedy([(0, sequence, 2)]) == [greedy(sequence, 2)]
    assert steps.calls[:2] == [("copy", 1, 0, 30), ("chunks", ((0, 30, 2),))]


def test_the_context_bounds_the_drafts():
    draft = DraftModel(FakeSteps(context=10), slots=3, name="draft")
    assert draft.continue_greedy([(0, list(range(1, 8)), 8), (1, list(range(1, 11)), 3)]) == [greedy(list(range(1, 8)), 3), []]


def test_a_failed_step_forgets_the_asking_slots_caches():
    steps = FakeSteps()
    draft = DraftModel(steps, slots=3, name="draft")
    draft.continue_greedy([(0, [1, 2, 3], 2), (1, [4, 5], 2)])
    steps.fault = RuntimeError("broken")
    with pytest.raises(RuntimeError):
        draft.continue_greedy([(0, [1, 2, 3, 6], 2)])
    assert draft.cached[0] == [] and draft.cached[1] == [4, 5, greedy([4, 5], 1)[0]]


def test_each_request_drafts_from_the_source_that_pays_more():
    model = SimpleNamespace(step_cost=0.1)
    drafter = Drafter(PromptLookup([1, 2, 3, 4, 1, 2]), model)  # "1 2" was followed by "3 4"
    drafter.model.rate = drafter.lookup.rate = 0.9
    assert drafter.plan(4) == ([3, 4, 1, 2], 0)  # lookup's drafts cost no draft step
    drafter.lookup.rate = 0.3
    draft, ask = drafter.plan(4)
    assert draft == [] and ask == draft_length(0.9, 4, draft_cost=0.1) > 0
    lookup_rate = drafter.lookup.rate  # 0.3, or a little more where its undrafted step raised it
    drafter.update(ask, 0)  # credited to the draft model
    assert drafter.model.rate < 0.9 and drafter.lookup.rate == lookup_rate
    drafter.model.rate = 0.0
    assert drafter.plan(4) == ([3], 0) and drafter.source is drafter.lookup  # one token pays at p 0.3
    drafter.lookup.rate = 0.0
    assert drafter.plan(4) == ([], 0) and drafter.source is None


@pytest.mark.parametrize(("rule", "confirmed"), [(lambda prefix: (prefix[-1] + 1) % VOCAB, True), (lambda prefix: 0, False)])
def test_through_the_engine_outputs_are_plain_decodings_whether_the_draft_agrees_or_not(rule, confirmed):
    """The fake runner's next token is the last one plus one: a draft with that rule is always
    confirmed, one always saying 0 never; the tokens are those of plain decoding either way."""
    draft = DraftModel(FakeSteps(slots=2, context=64, rule=rule), slots=2, name="draft")
    draft.step_cost = 0.0  # drafting costs nothing here, so the draft is asked whenever p allows
    runner = FakeRunner(vocab=VOCAB, speculates=True, draft=draft)
    with engine_over(runner, context=64, slots=2, queue_limit=2, prefill_chunk=4) as engine:

        def run(speculate: bool) -> tuple[list[list[int]], list[Request]]:
            engine.speculation.enabled = speculate
            requests = [Request([1, 2], SamplingParams(max_tokens=12, temperature=0.0)), Request([7], SamplingParams(max_tokens=9, seed=5))]
            for request in requests:
                engine.submit(request)
            return [drain_outputs(r)[0] for r in requests], requests

        plain, _ = run(False)
        outputs, requests = run(True)
    assert plain[0] == list(range(3, 15)) and outputs == plain  # the seeded one samples at temperature 1
    greedy_one = requests[0]
    assert greedy_one.drafted_tokens > 0
    assert greedy_one.accepted_tokens == (greedy_one.drafted_tokens if confirmed else 0)
