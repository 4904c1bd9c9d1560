"""A recurrent model's prefix reuse (serving/state_snapshots.py): which prefixes a slot's own state
and its snapshots serve, where snapshots are taken, and which rows they take."""

from webapp.engine.serving.request import Request
from webapp.engine.serving.state_snapshots import SNAPSHOT_AT_LEAST, RecurrentSlots

SYSTEM = list(range(100, 140))  # a system prompt past SNAPSHOT_AT_LEAST
FIRST = SYSTEM + [1, 2, 3, 4, 5]


def _ran(table, slot, tokens, snapshot_at=()):
    """What the scheduler and engine do for a prompt: its chunks, a snapshot where one ends at a mark."""
    rows = []
    for end in [*snapshot_at, len(tokens)]:
        table.extend(slot, tokens[len(slot.tokens) : end])
        if end in snapshot_at:
            rows.append(table.snapshot(slot))
    return rows


def test_a_slots_own_state_serves_its_whole_sequence_only():
    table = RecurrentSlots(2, 4)
    slot, reused = table.acquire("a", [1, 2, 3, 4])
    table.extend(slot, [1, 2, 3, 4, 5])  # the prompt and an output fed back
    table.release(slot)
    assert table.reusable(slot, [1, 2, 3, 4, 5, 6, 7]) == 5  # a follow-up turn: all of it
    assert table.reusable(slot, [1, 2, 3, 9]) == 0  # parts earlier: the state is not that prefix's
    assert table.reusable(slot, [1, 2, 3, 4, 5]) == 0  # the same prompt again: its last token must run
    assert table.restore(slot) is None


def test_a_snapshot_serves_a_prompt_that_parts_after_it_once_restored():
    table = RecurrentSlots(1, 4)
    slot, _ = table.acquire("a", FIRST)
    [row] = _ran(table, slot, FIRST, snapshot_at=(len(SYSTEM),))
    assert row == 2  # after the slot's row and the scratch one
    table.release(slot)
    again, reused = table.acquire("b", SYSTEM + [9, 9])
    assert (again, reused) == (slot, len(SYSTEM)) and slot.tokens == SYSTEM
    assert table.restore(slot) == row and table.restore(slot) is None  # the engine copies it in once
    assert table.describe_snapshots() == {"rows": 4, "held": 1, "taken_total": 1, "restored_total": 1}


def test_a_new_prompt_takes_an_empty_slot_and_copies_rather_than_cut_a_longer_cache():
    table = RecurrentSlots(2, 4)
    a, _ = table.acquire("a", FIRST)
    _ran(table, a, FIRST, snapshot_at=(len(SYSTEM), len(FIRST) - 1))
    table.release(a)
    b, reused = table.acquire("b", SYSTEM + [9, 9])  # another user after the same system prompt
    assert b is not a and reused == 0 and table.elsewhere(b, SYSTEM + [9, 9]) == (a, len(SYSTEM))
    table.release(b)
    again, reused = table.acquire("c", FIRST + [6])  # a's follow-up still finds its whole sequence
    assert again is a and reused == len(FIRST)


def test_another_slots_snapshot_serves_with_its_keys_and_values():
    table = RecurrentSlots(2, 4)
    a, _ = table.acquire("a", FIRST)
    [row] = _ran(table, a, FIRST, snapshot_at=(len(SYSTEM),))  # a is still running
    b, reused = table.acquire("b", SYSTEM + [7, 8])
    assert b is not a and reused == 0
    source, length = table.elsewhere(b, SYSTEM + [7, 8])
    assert (source, length) == (a, len(SYSTEM))
    table.take_prefix(b, SYSTEM + [7, 8], length, source)
    assert b.tokens == SYSTEM and table.restore(b) == row


def test_a_snapshot_goes_stale_with_its_slots_keys_and_its_row_is_taken_first():
    table = RecurrentSlots(1, 2)
    slot, _ = table.acquire("a", FIRST)
    [row] = _ran(table, slot, FIRST, snapshot_at=(len(SYSTEM),))
    table.release(slot)
    other = list(range(500, 560))
    slot, reused = table.acquire("b", other)  # the only slot: its keys of SYSTEM are overwritten
    assert reused == 0
    _ran(table, slot, other)
    assert table.reusable(slot, SYSTEM + [9]) == 0
    assert table.snapshot(slot) == row  # the stale row, not the free one after it
    assert table.describe_snapshots()["held"] == 1


def test_the_least_recently_used_row_goes_and_never_one_awaiting_its_restore():
    table = RecurrentSlots(2, 2)
    a, _ = table.acquire("a", FIRST)
    rows = _ran(table, a, FIRST, snapshot_at=(len(SYSTEM), len(SYSTEM) + 2))
    assert rows == [3, 4]
    c, _ = table.acquire("c", list(range(600, 650)))  # the empty slot
    table.release(a)
    b, reused = table.acquire("b", SYSTEM + [9])  # a's slot, the only free one, restores the first row
    assert b is a and reused == len(SYSTEM) and table._restores == {a.index: 3}
    table.extend(c, list(range(600, 640)))
    assert table.snapshot(c) == 4  # a's second one went stale with b's prefix; row 3 awaits its restore
    table.extend(c, [1])
    assert table.snapshot(c) == 4  # the least recently used of the rows it may take: c's own first
    assert table.restore(b) == 3


def test_a_slot_released_before_its_restore_serves_nothing():
    table = RecurrentSlots(1, 2)
    slot, _ = table.acquire("a", FIRST)
    _ran(table, slot, FIRST, snapshot_at=(len(SYSTEM),))
    table.release(slot)
    slot, reused = table.acquire("b", SYSTEM + [9])
    assert reused == len(SYSTEM)
    table.release(slot)  # cancelled before its first chunk ran: the state is still the old sequence's
    assert slot.tokens == [] and table.reusable(slot, FIRST + [1]) == 0
    assert table._restores == {}  # nothing awaits a restore now: every row may be taken


def test_tokens_a_valid_snapshot_holds_take_no_second_row():
    table = RecurrentSlots(1, 2)
    slot, _ = table.acquire("a", FIRST)
    table.extend(slot, SYSTEM)
    assert table.snapshot(slot) == 2
    assert table.snapshot(slot) is None


def test_marks_are_a_requests_message_ends_else_its_last_token_but_one():
    table = RecurrentSlots(1, 2)
    prompt = list(range(200, 280))
    assert table.marks(Request(prompt, message_ends=(5, 40, 70, 80))) == [40, 70]  # too early, in range, the end
    assert table.marks(Request(prompt)) == [79]
    assert table.marks(Request(prompt[:SNAPSHOT_AT_LEAST])) == []  # too short to be worth a row
    scoring = Request(prompt, message_ends=(40,))
    scoring.pooling = "mean"  # every position is kept: nothing comes from a cache
    assert table.marks(scoring) == []
