"""The engine's acceptance of drafted tokens, with a scripted drafter on the fake runner (whose next
token is always the last one plus one): every draft confirmed (and the step's bonus token), none,
the first refused, the last refused; outputs always those of plain decoding; drafts verified in the
step that also prefills another request's prompt; a request cancelled during a verification step
frees its slot and its drafter."""

import pytest
from support import drain_outputs, engine_over, wait_until
from support.fakes import FakeRunner

from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.serving import speculation
from webapp.engine.serving.request import Request

VOCAB = 50


class ScriptedDrafter:
    """Proposes its script's drafts in turn (then nothing), and remembers what it was told."""

    def __init__(self, script):
        self.script, self.updates, self.batches = list(script), [], []

    def __call__(self, prompt_ids, recent=None, costs=None):  # stands in for PromptLookup(prompt_ids, recent, costs)
        self.costs = costs
        return self

    def extend(self, tokens):
        pass

    def propose(self, limit, batch=1, before=0):
        self.batches.append(batch)
        return self.script.pop(0)[:limit] if self.script else []

    def update(self, drafted, accepted):
        self.updates.append((drafted, accepted))


def generate(script, max_tokens=8, gate=None):
    drafter = ScriptedDrafter(script)
    runner = FakeRunner(vocab=VOCAB, speculates=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculation, "PromptLookup", drafter)
        with engine_over(runner, context=64, slots=2, queue_limit=2, prefill_chunk=4) as engine:
            request = Request([1, 2], SamplingParams(max_tokens=max_tokens, temperature=0.0))
            engine.submit(request)
            tokens, reason = drain_outputs(request)
    return tokens, reason, request, drafter, [c for c in runner.calls if c[0] == "drafted"]


PLAIN = [3, 4, 5, 6, 7, 8, 9, 10]


@pytest.mark.parametrize(
    ("script", "accepted", "steps"),
    [
        ([[4, 5, 6]], [(3, 3)], 5),  # all confirmed: 4 5 6 and the bonus 7 in one step
        ([[9, 9, 9]], [(3, 0)], 7),  # none: the step gives 4 alone
        ([[9, 5, 6]], [(3, 0)], 7),  # the first refused: later matches do not count
        ([[4, 5, 9]], [(3, 2)], 6),  # the last refused: 4 5, then the sample 6 where the draft said 9
        ([[4, 5], [], [8, 9]], [(2, 2), (2, 2)], 4),  # 4 5 +6, then 7 plainly, then 8 9 +10
    ],
)
def test_drafts_are_kept_while_the_samples_equal_them(script, accepted, steps):
    tokens, reason, request, drafter, drafted = generate(script)
    assert (tokens, reason) == (PLAIN, "length")  # what plain decoding gives, whatever was drafted
    assert drafter.updates == accepted
    assert (request.drafted_tokens, request.accepted_tokens) == tuple(map(sum, zip(*accepted)))
    assert len(drafted) == len(accepted)


def test_drafts_stop_at_max_tokens():
    tokens, _, _, drafter, drafted = generate([[4, 5, 6, 7, 8, 9]], max_tokens=4)
    assert tokens == [3, 4, 5, 6] and drafted[0][2] == ((4, 5),)  # 2 drafts + the token fed + the bonus = 4


def test_drafts_are_verified_in_the_step_that_prefills_another_prompt():
    runner = FakeRunner(vocab=VOCAB, speculates=True, mixes=True)
    drafter = ScriptedDrafter([[], [5, 6, 9], [8, 9, 10]])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculation, "PromptLookup", drafter)
        with engine_over(runner, context=64, slots=2, queue_limit=2, prefill_chunk=4) as engine:
            runner.gate.clear()
            first = Request([1, 2], SamplingParams(max_tokens=12, temperature=0.0))
            second = Request(list(range(20, 32)), SamplingParams(max_tokens=1, temperature=0.0))
            engine.submit(first)
            engine.submit(second)  # 12 prompt tokens: chunks of 4, beside the first's decode lane
            runner.gate.set()
            assert drain_outputs(first) == ([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "length")  # as plain decoding gives
            assert drain_outputs(second) == ([32], "length")
    mixed = [c for c in runner.calls if c[0] == "mixed drafted"]
    assert mixed and mixed[0][2] == (first.id,) and mixed[0][3] == ((5, 6, 9),)
    assert drafter.updates[0] == (3, 2)  # 5 6 confirmed, then the sample 7 where the draft said 9
    # the prefilling request counts as one that will decode beside the first: drafts must pay as in a batch of two
    assert drafter.batches[:2] == [2, 2]


def test_a_request_cancelled_while_its_drafts_are_verified_frees_its_slot_and_drafter():
    runner = FakeRunner(vocab=VOCAB, speculates=True)

    class Holding(ScriptedDrafter):
        def propose(self, limit, batch=1, before=0):
            runner.gate.clear()  # the verification step about to run waits at the gate
            return super().propose(limit, batch, before)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculation, "PromptLookup", Holding([[4, 5, 6]]))
        with engine_over(runner, context=64, slots=2, queue_limit=2, prefill_chunk=4) as engine:
            request = Request([1, 2], SamplingParams(max_tokens=40, temperature=0.0))
            engine.submit(request)
            assert wait_until(lambda: not runner.gate.is_set())
            engine.abort(request)
            runner.gate.set()
            assert drain_outputs(request)[1] == "cancelled"
            assert wait_until(lambda: not engine.scheduler.running)
            assert request.drafter is None and all(s.owner is None for s in engine.scheduler.slots.slots)
