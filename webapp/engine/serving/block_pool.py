"""The paged KV cache's bookkeeping: one pool of fixed-size blocks of positions, shared between
sequences by reference count, its full blocks found again by their contents.

Contract: `BlockPool(blocks, block_positions)` hands out block ids 0..blocks-1. `allocate()` gives
an unused block (a free one, else the least recently used cached one, which leaves the index), or
None when every block is held. `hold(b)` and `drop(b)` count a sequence's references; a block no
sequence holds is free, or cached while the index knows it. `seal(b, parent, tokens)` files a full
block under its contents: the tokens it holds after the block `parent` (None: the sequence's start).
`match(tokens)` is the longest run of cached or held blocks holding `tokens`' first positions, block
by block, which a new sequence then holds instead of computing them.

Why the index is collision-proof: a block's key is (its parent's seal number, its tokens), compared
in full by the dict, and seal numbers are never reused, so a key names one prefix. When a block is
evicted its children's keys name a seal number no later block gets: they are never matched again and
leave the index when they are evicted in turn.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    id: int
    refs: int = 0
    seal: int = 0  # its seal number while the index holds it (0: not sealed)
    key: tuple | None = None


class BlockPool:
    def __init__(self, blocks: int, block_positions: int):
        if blocks < 1 or block_positions < 1:
            raise ValueError("a block pool needs at least one block of at least one position")
        self.block_positions = block_positions
        self.blocks = [Block(i) for i in range(blocks)]
        # a stack: the block freed last is given first, its pages already committed (block 0 first of all)
        self._free: list[int] = list(reversed(range(blocks)))
        self._cached: OrderedDict[int, None] = OrderedDict()  # sealed, held by no sequence; least recently used first
        self._index: dict[tuple, int] = {}
        self._seals = itertools.count(1)

    # --- counts, for admission and the dashboard ------------------------------------------------

    @property
    def free(self) -> int:
        """Blocks holding nothing anyone can find."""
        return len(self._free)

    @property
    def cached(self) -> int:
        """Blocks no sequence holds whose contents the index still finds (evicted as the pool needs them)."""
        return len(self._cached)

    @property
    def available(self) -> int:
        """Blocks `allocate` can still give: free and cached."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        return len(self.blocks) - self.available

    @property
    def shared(self) -> int:
        """Blocks more than one sequence holds."""
        return sum(1 for b in self.blocks if b.refs > 1)

    # --- allocation -----------------------------------------------------------------------------

    def allocate(self) -> int | None:
        """A block for one sequence (held once), or None when every block is held."""
        if self._free:
            block = self.blocks[self._free.pop()]
        elif self._cached:
            block = self.blocks[self._cached.popitem(last=False)[0]]
            self._unseal(block)
        else:
            return None
        block.refs = 1
        return block.id

    def hold(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.refs == 0:
            self._cached.pop(block_id, None)
        block.refs += 1

    def drop(self, block_id: int) -> None:
        """One sequence lets go; a block nobody holds stays findable (cached) if sealed, else is free."""
        block = self.blocks[block_id]
        assert block.refs > 0, f"block {block_id} dropped more often than held"
        block.refs -= 1
        if block.refs == 0:
            if block.seal:
                self._cached[block_id] = None
            else:
                self._free.append(block_id)

    def forget(self, block_id: int) -> None:
        """Its contents are no longer what its key says (a failed step wrote it): unfile it."""
        block = self.blocks[block_id]
        if block.seal:
            self._unseal(block)
            if block.refs == 0:
                self._cached.pop(block_id, None)
                self._free.append(block_id)

    # --- the index ------------------------------------------------------------------------------

    def seal(self, block_id: int, parent: int | None, tokens: tuple[int, ...], root: str | None = None) -> None:
        """File a full block under its contents. Where another block already holds the same prefix,
        this one stays unfiled (and is freed, not cached, when its sequence ends). `root`: what a
        sequence's first block is filed under besides its tokens (a LoRA adapter's load; None: 0)."""
        assert len(tokens) == self.block_positions
        block = self.blocks[block_id]
        if block.seal:
            return
        key = ((root or 0) if parent is None else self.blocks[parent].seal, tokens)
        if key[0] == 0 and parent is not None:
            return  # its parent is unfiled: a key after it could never be matched from the start
        if key in self._index:
            return
        block.seal, block.key = next(self._seals), key
        self._index[key] = block_id

    def match(self, tokens: list[int], root: str | None = None) -> list[int]:
        """The blocks holding `tokens`' first positions, whole blocks in order, as far as the index
        knows them, the first filed under `root` (seal's)."""
        found, parent_seal, size = [], root or 0, self.block_positions
        for start in range(0, len(tokens) - size + 1, size):
            block_id = self._index.get((parent_seal, tuple(tokens[start : start + size])))
            if block_id is None:
                break
            found.append(block_id)
            parent_seal = self.blocks[block_id].seal
        return found

    def cached_order(self) -> list[int]:
        """The cached blocks, least recently used first."""
        return list(self._cached)

    def touch(self, block_ids: list[int]) -> None:
        """These cached blocks were just useful: evict them last."""
        for block_id in block_ids:
            if block_id in self._cached:
                self._cached.move_to_end(block_id)

    def _unseal(self, block: Block) -> None:
        if self._index.get(block.key) == block.id:
            del self._index[block.key]
        block.seal, block.key = 0, None
