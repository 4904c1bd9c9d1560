"""The paged KV cache's bookkeeping: the block pool (allocate, share, free, evict the least recently
used, an index that compares tokens) and the sequences' block table (paged_slots.py)."""

import numpy as np
import pytest

from webapp.engine.serving.block_pool import BlockPool
from webapp.engine.serving.paged_slots import PagedSlots

B = 4  # positions a block


def paged(blocks: int, rows: int = 3, width: int = 8) -> PagedSlots:
    return PagedSlots(BlockPool(blocks, B), np.zeros((rows + 1, width), np.int32))


def test_blocks_are_given_until_the_pool_is_held_then_none():
    pool = BlockPool(3, B)
    got = [pool.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and pool.allocate() is None
    assert (pool.used, pool.free, pool.cached) == (3, 0, 0)
    pool.drop(got[1])  # never sealed: free again, and given first
    assert pool.free == 1 and pool.allocate() == got[1]


def test_a_sealed_block_nobody_holds_stays_findable_until_the_pool_needs_it():
    pool = BlockPool(2, B)
    a = pool.allocate()
    pool.seal(a, None, (1, 2, 3, 4))
    pool.drop(a)
    assert (pool.cached, pool.free) == (1, 1)
    assert pool.match([1, 2, 3, 4, 5]) == [a]
    other = pool.allocate()  # the free block goes first
    assert other != a and pool.match([1, 2, 3, 4]) == [a]
    pool.allocate()  # now the cached one is evicted, and unfiled
    assert pool.match([1, 2, 3, 4]) == []


def test_eviction_takes_the_least_recently_used_cached_block():
    pool = BlockPool(2, B)
    first, second = pool.allocate(), pool.allocate()
    pool.seal(first, None, (1, 1, 1, 1))
    pool.seal(second, None, (2, 2, 2, 2))
    pool.drop(first)
    pool.drop(second)
    pool.touch([first])  # just matched: evicted last
    assert pool.allocate() == second
    assert pool.match([1, 1, 1, 1]) == [first]


def filed_chain(pool: BlockPool) -> tuple[int, int]:
    """Two blocks filed as one prefix: (1, 2, 3, 4), then (5, 6, 7, 8)."""
    a, b = pool.allocate(), pool.allocate()
    pool.seal(a, None, (1, 2, 3, 4))
    pool.seal(b, a, (5, 6, 7, 8))
    return a, b


def test_the_index_matches_a_chain_block_by_block_comparing_tokens():
    pool = BlockPool(4, B)
    a, b = filed_chain(pool)
    assert pool.match([1, 2, 3, 4, 5, 6, 7, 8, 9]) == [a, b]
    assert pool.match([1, 2, 3, 4, 5, 6, 7, 0]) == [a]  # one token differs: the second block is not it
    assert pool.match([0, 2, 3, 4, 5, 6, 7, 8]) == []  # the same second block after another first is not it
    assert pool.match([1, 2, 3]) == []  # no whole block


def test_a_child_of_an_evicted_block_is_never_matched_again():
    """Its key names its parent's seal number, which no later block gets, even one with the same tokens."""
    pool = BlockPool(2, B)
    a, b = filed_chain(pool)
    pool.drop(a)
    pool.drop(b)
    again = pool.allocate()  # evicts a, the least recently used
    assert again == a and pool.blocks[b].seal
    pool.seal(again, None, (1, 2, 3, 4))  # the same first block, computed again
    assert pool.match([1, 2, 3, 4, 5, 6, 7, 8]) == [again]  # b's key still names the old a


def test_a_second_block_with_the_same_prefix_stays_unfiled():
    pool = BlockPool(3, B)
    a, twin = pool.allocate(), pool.allocate()
    pool.seal(a, None, (1, 2, 3, 4))
    pool.seal(twin, None, (1, 2, 3, 4))
    assert pool.match([1, 2, 3, 4]) == [a]
    pool.drop(twin)
    assert pool.free == 2  # freed, not cached: nothing could find it


def test_a_row_holds_the_cached_prefix_in_whole_blocks_and_computes_the_last_token():
    table = paged(6)
    row, reused = table.acquire("a", list(range(10)))
    assert reused == 0
    assert table.reserve(row, 11)
    table.extend(row, list(range(10)))
    assert table.table[row.index, :3].tolist() == row.blocks and table.table[row.index, 3] == table.trash
    table.release(row)
    assert table.pool.cached == 2  # two full blocks filed; the partial third freed
    second, reused = table.acquire("b", list(range(8)))
    assert reused == 4  # 8 positions are two blocks, but the last token needs computing: one block
    third, reused = table.acquire("c", list(range(12)))
    assert reused == 8 and third.blocks[0] == second.blocks[0]  # shared by reference
    assert table.pool.shared == 1


def test_admission_counts_the_cached_blocks_a_prompt_would_take_from_others():
    table = paged(3)
    row, _ = table.acquire("a", list(range(8)))
    table.reserve(row, 9)
    table.extend(row, list(range(8)))
    assert not table.admits(list(range(100, 104)))  # 2 blocks needed, none free
    table.release(row)
    assert table.admits(list(range(100, 108)))  # 3 blocks: the cached ones are evicted for it
    assert table.admits(list(range(11)))  # 2 of its 3 blocks are the cached ones
    assert not table.admits(list(range(12)))  # its 4th block is one too many


def test_reserve_gives_what_the_pool_has_and_says_when_it_is_not_all():
    table = paged(2)
    row, _ = table.acquire("a", [1])
    assert not table.reserve(row, 3 * B)
    assert table.room(row) == 2 * B
    other, _ = table.acquire("b", [2])
    assert not table.reserve(other, 1) and table.room(other) == 0


def test_writes_past_a_rows_blocks_are_refused():
    table = paged(2)
    row, _ = table.acquire("a", [1])
    table.reserve(row, B)
    with pytest.raises(AssertionError):
        table.extend(row, [1] * (B + 1))


def test_adopting_later_blocks_gives_back_the_reserved_ones():
    table = paged(6)
    writer, _ = table.acquire("w", list(range(12)))
    reader, reused = table.acquire("r", list(range(12)))
    assert reused == 0
    table.reserve(reader, 5)  # one block, not written
    table.reserve(writer, 13)
    table.extend(writer, list(range(12)))
    source, length = table.elsewhere(reader, list(range(12)))
    assert (source, length) == (None, 8)
    table.take_prefix(reader, list(range(12)), length, source)
    assert reader.tokens == list(range(8)) and reader.blocks == writer.blocks[:2]
    assert table.pool.shared == 2 and table.pool.used == 4  # the writer's 4, the reader's reserved one given back
