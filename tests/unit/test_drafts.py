"""Prompt lookup: drafts are the tokens that followed the sequence's latest n-gram earlier on, as
many as the request's recent acceptance pays for."""

import numpy as np

from webapp.engine.decoding.drafts import (
    DRAFT_MAX,
    LANE_COST,
    MARGIN,
    MAX_NGRAM,
    MIN_NGRAM,
    Acceptance,
    PromptLookup,
    RecentOutputs,
    StepCosts,
    draft_length,
    gain,
)


def test_a_repeated_span_is_drafted_from_where_it_appeared_before():
    drafts = PromptLookup([5, 1, 2, 3, 4, 6, 7, 8, 9, 1, 2])  # "1 2" was followed by "3 4 6 ..."
    drafts.rate = 0.95  # drafts have been confirmed: long ones pay
    assert drafts.propose(3) == [3, 4, 6]
    drafts.extend([3])  # the longest matching n-gram wins: "1 2 3"
    assert drafts.propose(2) == [4, 6]


def test_nothing_is_drafted_without_an_earlier_occurrence():
    assert PromptLookup([1, 2, 3, 4]).propose(4) == []
    assert PromptLookup([7]).propose(4) == []


def test_the_draft_length_follows_acceptance_and_recovers():
    drafts = PromptLookup(list(range(20)) * 2)
    for _ in range(10):
        drafts.update(8, 8)
    assert len(drafts.propose(100)) == DRAFT_MAX
    for _ in range(10):
        drafts.update(8, 0)
    assert drafts.propose(8) == []
    while draft_length(drafts.rate) == 0:  # undrafted steps raise the rate again, so drafting is retried
        assert drafts.propose(8) == []
    assert drafts.propose(8) != []


def test_the_length_is_what_pays_for_its_lanes():
    """Expected tokens per unit of step time: none when drafts are mostly refused, more as they are confirmed."""
    lengths = [draft_length(p) for p in (0.1, 0.3, 0.7, 0.8, 0.95)]
    assert lengths[0] == 0 and lengths == sorted(lengths) and lengths[-1] == DRAFT_MAX
    assert draft_length(0.95, limit=3) == 3


def test_a_refusal_counts_as_one_failed_trial():
    drafts = PromptLookup([])
    drafts.rate = 0.5
    drafts.update(8, 3)  # three confirmed, the fourth refused: p's sample is 3 / 4, not 3 / 8
    assert abs(drafts.rate - (0.7 * 0.5 + 0.3 * 0.75)) < 1e-9


def test_a_repeated_request_drafts_from_the_servers_earlier_answer():
    recent = RecentOutputs()
    recent.add([7, 8, 9] + [20, 21, 22, 23, 24, 25])  # a prompt's last tokens, then its answer
    drafts = PromptLookup([1, 2, 7, 8, 9], recent)  # the same request again
    drafts.rate = 0.95
    assert drafts.propose(4) == [20, 21, 22, 23]
    drafts.extend([20, 21])
    assert drafts.propose(3) == [22, 23, 24]
    assert PromptLookup([1, 2, 3], recent).propose(4) == []


def test_recent_outputs_keep_at_most_their_capacity_newest_first():
    recent = RecentOutputs(capacity=10)
    recent.add([1, 2, 3, 4, 5, 6])
    recent.add([1, 2, 9, 9, 9, 9])  # the newer occurrence of "1 2" wins, and the older text goes
    assert recent.size == 6 and recent.draft([1, 2], 2) == [9, 9] and recent.draft([3, 4], 2) == []
    assert recent.draft([5, 9, 9, 9], 8) == [9]  # the longest n-gram's latest occurrence, within its answer


def test_recent_outputs_draft_what_followed_the_latest_occurrence_of_the_longest_ngram():
    rng = np.random.default_rng(1)
    recent, texts = RecentOutputs(capacity=200), []
    for _ in range(12):  # 12 answers of 30: the oldest go
        texts.append(rng.integers(0, 6, size=30).tolist())
        recent.add(texts[-1])
        kept = texts[-(200 // 30) :]
        for tail in (rng.integers(0, 6, size=4).tolist() for _ in range(20)):
            assert recent.draft(tail, 5) == latest_in_texts(kept, tail, 5)


def test_a_fuller_step_needs_likelier_drafts():
    assert draft_length(0.5, batch=1) == 1 and draft_length(0.5, batch=8) == 0
    assert [draft_length(0.9, batch=b) for b in (1, 2, 4, 8)] == sorted([draft_length(0.9, batch=b) for b in (1, 2, 4, 8)], reverse=True)


def test_measured_step_costs_choose_the_lengths_the_kernels_make_cheap():
    """The default model's verifications here: a second lane costs 2% of a step, a fifth starts another
    pass over the weights. Measured, a token is drafted even at p = 0.1 (where LANE_COST's constant
    drafts none), and a likely draft stops short of the fifth lane where the constant goes on."""
    measured = StepCosts([5.6, 5.7, 6.7, 8.4, 10.5, 11.7, 13.1, 14.4, 16.5])
    assert draft_length(0.1) == 0 and draft_length(0.1, costs=measured) == 1
    assert draft_length(0.85) >= 4 and draft_length(0.85, costs=measured) == 2
    assert draft_length(0.95, costs=measured) == 7


def test_step_costs_never_fall_with_lanes_and_go_on_past_the_measured_ones():
    """Noise only adds time: one lane timed slower than two, or 4 slower than 5, cost what the wider
    step does, and no wider step is made to look free by them."""
    costs = StepCosts([10.0, 9.0, 12.0, 15.0, 14.0, 16.0])
    assert [costs.step(n) for n in range(1, 7)] == [1.0, 1.0, 12 / 9, 14 / 9, 14 / 9, 16 / 9]
    slope = (16 - 9) / 9 / 4  # over the last four lanes
    assert abs(costs.step(8) - (16 / 9 + 2 * slope)) < 1e-9
    assert abs(StepCosts().step(5) - (1 + 4 * LANE_COST)) < 1e-9
    # k drafted lanes against one sequence's share of a batch of 4: (step(4 + k) - step(4)) * 4 / step(4)
    assert abs(costs.drafted(2, batch=4) - (16 / 9 - 14 / 9) * 4 / (14 / 9)) < 1e-9


def test_a_draft_pays_for_the_lanes_it_adds_after_the_other_sequences_drafts():
    """Three sequences decoding together at p = 0.95: the first's 5 drafts make a step of 8 lanes, so
    a second's lanes start past them, beyond the measured ones, where none pays."""
    measured = StepCosts([5.6, 5.7, 6.7, 8.4, 10.5, 11.7, 13.1, 14.4, 16.5])
    first = draft_length(0.95, batch=3, costs=measured)
    assert first == 5
    assert draft_length(0.95, batch=3, costs=measured, before=first) == 0
    assert draft_length(0.95, batch=3, before=first) == draft_length(0.95, batch=3)  # a constant cost a lane: no matter


def test_a_step_of_many_sequences_asks_a_draft_for_a_margin_of_the_whole_step():
    """Measured here: six sequences' step, two drafted lanes more, costs a ninth more of the step.
    At p = 0.95 those two lanes promise 9% more of their sequence's tokens, 1.5% of the step's:
    within the cost model's error, so none is drafted; one stream drafts."""
    measured = StepCosts([1.0, 1.02, 1.2, 1.5, 1.9, 1.96, 2.32, 2.49, 2.91])
    assert gain(0.95, 2, measured.drafted(2, batch=6)) > 1.05
    assert draft_length(0.95, batch=6, costs=measured) == 0
    assert draft_length(0.95, batch=1, costs=measured) > 0


def test_a_refused_draft_is_retried_less_often_in_a_step_of_more_sequences():
    """A retry costs lanes in the whole step: p climbs back b times slower beside b sequences."""
    alone, among_four = Acceptance(), Acceptance()
    alone.rate = among_four.rate = 0.05
    assert alone.length(8, batch=1) == 0 and among_four.length(8, batch=4) == 0
    assert abs((alone.rate - 0.05) - 4 * (among_four.rate - 0.05)) < 1e-12 and among_four.rate > 0.05


def test_a_run_of_confirmed_drafts_never_makes_the_next_one_sure():
    """p near 1 after a streak is priced as SUREST: beside six sequences, lanes at LANE_COST never
    pay then, where p = 0.999 would have drafted 8 of them."""
    streak = Acceptance()
    for _ in range(30):
        streak.update(8, 8)
    assert streak.rate > 0.999
    assert streak.length(8, batch=6) == 0 and streak.length(8, batch=1) == 8
    assert (1 - 0.999**9) / (1 - 0.999) / (1 + StepCosts().drafted(8, batch=6)) > 1 + MARGIN * 6  # uncapped, it paid


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_occurrence_of_the_longest_ngram():
    rng = np.random.default_rng(0)
    k = draft_length(0.95)
    for vocab in (2, 3, 7, 50):  # small vocabularies: many repeats, overlapping ones too
        tokens = rng.integers(0, vocab, size=80).tolist()
        lookup = PromptLookup(tokens[:10])
        for i in range(10, len(tokens)):
            lookup.rate = 0.95
            assert lookup.propose(8) == latest_in_texts([tokens[:i]], tokens[:i], k)  # its own text, before its end
            lookup.extend(tokens[i : i + 1])


def latest_in_texts(texts: list[list[int]], tail: list[int], k: int) -> list[int]:
    """The reference: the k tokens (within its text) after the latest occurrence, newest text first,
    of the longest of tail's last MAX_NGRAM..MIN_NGRAM tokens that occurs followed by a token."""
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        for text in reversed(texts):
            for end in range(len(text) - 1, n - 1, -1):
                if text[end - n : end] == tail[-n:]:
                    return text[end : end + k]
    return []
