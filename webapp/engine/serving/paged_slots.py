"""The paged KV cache's sequences: each running request holds a row of the block table, naming the
pool's blocks (block_pool.py) that hold its positions in order.

Contract: the scheduler's table (as kv_cache.SlotTable is for a cache of whole slots), over a
`BlockPool` and the block table the CPU kernels read (`table`, int32 (rows + 1, width); the last row
is the warm-up's scratch). `admits(prompt)` says whether a new request fits beside those running;
`acquire(owner, prompt)` gives it a free row holding every cached block of its prompt's prefix
(however many sequences hold them too); `reserve(row, positions)` gives a row blocks for positions
0..positions-1 (False when the pool has too few); `extend(row, tokens)` records positions the model
wrote, filing each block it fills under its contents for later requests; `release(row)` gives a
row's blocks back (filed ones stay findable until the pool needs them). A row's `lineage` (a LoRA
adapter's load) roots its blocks' keys: they serve only prompts of the same lineage. Invariant, as for slots:
`row.tokens` are exactly the positions whose K/V the model has written for the row, in order, and a
block more than one row holds is full and never written again: a row writes only positions at or
past its tokens, and `acquire` leaves the prompt's last token to be computed in a block of its own.

Entries of a row past its blocks name `trash`, a block outside the pool: a write there (a warm-up's,
a padded lane's) can never land in another sequence's positions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from webapp.engine.serving.block_pool import BlockPool
from webapp.engine.serving.kv_cache import Slot


@dataclass
class SequenceRow(Slot):
    """A slot's bookkeeping (its tokens, owner, last use), its positions in the pool's `blocks`."""

    blocks: list[int] = field(default_factory=list)


class PagedSlots:
    ring = None  # paged layers attend the whole context: no rings (kv_cache.RingRows)

    def __init__(self, pool: BlockPool, table: np.ndarray):
        self.pool, self.table = pool, table
        self.block_positions = pool.block_positions
        self.trash = len(pool.blocks)
        self.slots = [SequenceRow(i) for i in range(table.shape[0] - 1)]
        self.table[:] = self.trash
        self._clock = itertools.count(1)

    @property
    def positions(self) -> int:
        """The most positions one sequence's table row names."""
        return self.table.shape[1] * self.block_positions

    @property
    def free(self) -> list[SequenceRow]:
        return [s for s in self.slots if s.owner is None]

    def _shareable(self, prompt: list[int], lineage: str | None) -> list[int]:
        """The cached blocks `prompt` of `lineage` can start from: whole blocks, its last token left to compute."""
        return self.pool.match(prompt, lineage)[: (len(prompt) - 1) // self.block_positions]

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_positions)

    def admits(self, prompt: list[int], running: int = 0, lineage: str | None = None) -> bool:
        """Whether `prompt` and its first output fit in what the pool can still give, beside its shared
        blocks (a cached one it holds is one fewer for everyone else), leaving a block for each of the
        `running` requests' next positions: else a new request would only be preempted again soon."""
        shared = self._shareable(prompt, lineage)
        taken_from_cache = sum(1 for b in shared if self.pool.blocks[b].refs == 0)
        needed = self.blocks_for(len(prompt) + 1) - len(shared)
        return needed + running <= self.pool.available - taken_from_cache

    def acquire(self, owner, prompt: list[int], lineage: str | None = None) -> tuple[SequenceRow, int]:
        free = self.free
        if not free:
            raise RuntimeError("no free sequence row")
        row = free[0]
        row.owner, row.last_used, row.lineage = owner, next(self._clock), lineage
        return row, self._adopt(row, prompt)

    def elsewhere(self, row: SequenceRow, prompt: list[int]) -> tuple[None, int]:
        """How many of `prompt`'s positions filed blocks hold (any sequence's, running or ended): no
        copy's source, as sharing them copies nothing."""
        return None, len(self._shareable(prompt, row.lineage)) * self.block_positions

    def take_prefix(self, row: SequenceRow, prompt: list[int], length: int, source: None) -> None:
        """Hold the filed blocks of `prompt`'s first `length` positions past those `row` holds (before
        its first prefill: its tokens are a prefix of `prompt` in whole blocks)."""
        held = self._adopt(row, prompt)
        assert held >= length, "filed blocks went away between finding and holding them"

    def _adopt(self, row: SequenceRow, prompt: list[int]) -> int:
        shared = self._shareable(prompt, row.lineage)
        have = len(row.tokens) // self.block_positions
        if len(shared) <= have:
            return len(row.tokens)
        assert row.tokens == prompt[: len(row.tokens)] and len(row.tokens) == have * self.block_positions
        for block in row.blocks[have:]:  # reserved, never written: give them back
            self.pool.drop(block)
        for block in shared[have:]:
            self.pool.hold(block)
        self.pool.touch(shared)
        row.blocks = row.blocks[:have] + shared[have:]
        self._write_row(row)
        row.tokens = list(prompt[: len(shared) * self.block_positions])
        return len(row.tokens)

    def reserve(self, row: SequenceRow, positions: int) -> bool:
        """Blocks for `row`'s positions 0..positions-1, as many as the pool gives; True when all."""
        positions = min(positions, self.positions)
        start = len(row.blocks)
        while len(row.blocks) * self.block_positions < positions:
            block = self.pool.allocate()
            if block is None:
                break
            row.blocks.append(block)
        self.table[row.index, start : len(row.blocks)] = row.blocks[start:]
        return len(row.blocks) * self.block_positions >= positions

    def room(self, row: SequenceRow) -> int:
        """Positions `row` may write now: those its blocks hold."""
        return len(row.blocks) * self.block_positions

    def extend(self, row: SequenceRow, tokens: list[int]) -> None:
        before = len(row.tokens)
        row.tokens.extend(tokens)
        assert len(row.tokens) <= self.room(row), "positions written past a row's blocks"
        size = self.block_positions
        for i in range(before // size, len(row.tokens) // size):
            self.pool.seal(row.blocks[i], row.blocks[i - 1] if i else None, tuple(row.tokens[i * size : (i + 1) * size]), row.lineage)

    def reset(self, row: SequenceRow) -> None:
        """Start `row` over from position 0 (a prompt that must compute every position)."""
        self._drop_blocks(row)
        row.tokens.clear()

    def forget(self, row: SequenceRow) -> None:
        """After a failed step: what the row held past its filed blocks is unknown, and it ends anyway."""
        self.reset(row)

    def release(self, row: SequenceRow) -> None:
        self.reset(row)
        row.owner, row.last_used = None, next(self._clock)

    def _drop_blocks(self, row: SequenceRow) -> None:
        for block in row.blocks:
            self.pool.drop(block)
        row.blocks = []
        self._write_row(row)

    def _write_row(self, row: SequenceRow) -> None:
        self.table[row.index, :] = self.trash
        self.table[row.index, : len(row.blocks)] = row.blocks

    def describe(self) -> dict:
        """The pool's blocks for the dashboard and /metrics."""
        pool = self.pool
        return {
            "block_positions": self.block_positions,
            "blocks_total": len(pool.blocks),
            "blocks_used": pool.used,
            "blocks_cached": pool.cached,
            "blocks_free": pool.free,
            "blocks_shared": pool.shared,
        }
