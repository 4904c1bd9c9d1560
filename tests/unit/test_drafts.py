"""Prompt lookup: drafts are the tokens that followed the sequence's latest n-gram earlier on, as
many as the request's recent acceptance pays for."""

from webapp.engine.decoding.drafts import DRAFT_MAX, MIN_RATE, PromptLookup


def test_a_repeated_span_is_drafted_from_where_it_appeared_before():
    drafts = PromptLookup([5, 1, 2, 3, 4, 6, 7, 8, 9, 1, 2])  # "1 2" was followed by "3 4 6 ..."
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
    assert drafts.rate < MIN_RATE and drafts.propose(8) == []
    while drafts.rate < MIN_RATE:  # undrafted steps raise the rate again, so drafting is retried
        assert drafts.propose(8) == []
    assert drafts.propose(8) != []
