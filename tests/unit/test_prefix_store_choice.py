"""Which filed blocks a saved prefix cache keeps (serving/prefix_store.py): within the cap, from a
sequence's start, never a block whose sequence start was evicted."""

from webapp.engine.serving.block_pool import BlockPool
from webapp.engine.serving.prefix_store import PrefixStore


def _filed(pool, *runs):
    """A sequence's blocks filed in order, then let go (cached)."""
    ids, parent = [], None
    for tokens in runs:
        block = pool.allocate()
        pool.seal(block, parent, tokens)
        ids.append(block)
        parent = block
    for block in ids:
        pool.drop(block)
    return ids


def test_blocks_within_the_cap_from_each_sequences_start_most_recent_first():
    pool = BlockPool(8, 2)
    a = _filed(pool, (1, 2), (3, 4), (5, 6))
    b = _filed(pool, (7, 8), (9, 10))
    store = PrefixStore("unused", 10**9, "unused.gguf")
    assert store._chosen(pool, block_bytes=1) == a + b  # in the order they were filed: parents first
    store.cap = 3
    assert store._chosen(pool, block_bytes=1) == [*a[:1], *b]  # b's last used: all of it, then a's start
    store.cap = 1
    assert store._chosen(pool, block_bytes=1) == b[:1]


def test_a_block_whose_start_was_evicted_is_left_out():
    pool = BlockPool(4, 2)
    a = _filed(pool, (1, 2), (3, 4), (5, 6))
    pool.allocate(), pool.allocate()  # the free block, then the least recently used cached one: a's start
    assert pool.blocks[a[0]].seal == 0 and pool.blocks[a[2]].seal
    assert PrefixStore("unused", 10**9, "unused.gguf")._chosen(pool, block_bytes=1) == []
