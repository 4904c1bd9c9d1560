"""What every way of running a step offers, and the two things they share: the prefix copy between
slots and a jit that captures on its first call.

Contract (`Steps`): `prefill(tokens, slot, start)` writes a prompt chunk into `slot` from position
`start` and returns its last token's logits (vocab,); `decode(tokens, slots, positions)` advances
each lane by one token, (len(tokens), vocab); `score(tokens, slot, start)` is prefill with every
token's logits, (len(tokens), vocab), equal to what generating them would give; `hidden(tokens,
slot, start)` is prefill with every token's final norm output (len(tokens), dim) instead, what
embeddings pool; `verify(lanes, slots, positions)` feeds each lane several tokens from its position
(a decoding sequence's last token, then tokens drafted after it), every one's logits, each equal to
what decoding it alone gives (only where `speculates`; no more drafted tokens a step than
`drafted_limit` where one is set), after which `kept(slot, n)` says how many of the slot's lanes
were kept (a recurrent state then goes on from the nth, not from the last); `prefill_and_decode`
runs prompt chunks and a decode step as one step, only where `mixes`; `copy_prefix(source, target,
length)` copies K/V rows between slots; `warm_up(progress)` compiles what the steps will run (and,
where `speculates`, times `verify_seconds`, what drafted lanes cost: decoding/drafts.py). `how`
says in words how a step runs, for the start-up log; `tunable` is whether tinygrad's BEAM search
(`make tune`) can change any kernel a step runs; `pages`, whether the cache is a paged pool whose
blocks `block_rows` and `write_block_rows` move (the prefix store's contract). All logits are
float32 NumPy arrays.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tinygrad import Device, TinyJit, UOp

Chunk = tuple[list[int], int, int]  # prompt tokens, slot, start position


class Steps:
    how: str = ""
    tunable: bool = True
    mixes: bool = False  # prompt chunks and a decode step run as one step (`prefill_and_decode`)
    speculates: bool = False  # `verify` runs drafted tokens as lanes whose logits equal a lone decode's
    drafted_limit: int | None = None  # the drafted tokens a verification may hold (None: the lanes bound them)
    verify_seconds: list[float] | None = None  # `verify` of 1, 2, .. lanes of one sequence, timed at warm-up
    spare_rows: range | None = None  # rows of recurrent state for drafted tokens (None: no recurrent layers)
    pages: bool = False  # the KV cache is a paged pool's blocks, read through block tables, and `block_rows` moves them

    def __init__(self, model):
        self.model = model
        self._prefix_copy = PrefixCopy(model)

    def prefill(self, tokens: list[int], slot: int, start: int) -> np.ndarray:
        raise NotImplementedError

    def decode(self, tokens: list[int], slots: list[int], positions: list[int]) -> np.ndarray:
        raise NotImplementedError

    def score(self, tokens: list[int], slot: int, start: int) -> np.ndarray:
        """One decode lane per token, a whole decode step each (more per token than a prefill's
        pieces): a prefill keeps only the last token's logits; a position's logits are those
        generating it gives."""
        assert tokens and start + len(tokens) <= self.model.context
        return np.stack([self.decode([t], [slot], [start + i])[0] for i, t in enumerate(tokens)])

    def hidden(self, tokens: list[int], slot: int, start: int) -> np.ndarray:
        raise NotImplementedError

    def verify(self, lanes: list[list[int]], slots: list[int], positions: list[int]) -> list[np.ndarray]:
        raise NotImplementedError(f"{type(self).__name__} does not verify drafted tokens")

    def prefill_and_decode(
        self, chunks: list[Chunk], decoding: list[int], slots: list[int], positions: list[int]
    ) -> tuple[list[np.ndarray], np.ndarray]:
        raise NotImplementedError(f"{type(self).__name__} does not mix prompt chunks into decode steps")

    def prefill_and_verify(
        self, chunks: list[Chunk], lanes: list[list[int]], slots: list[int], positions: list[int]
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        raise NotImplementedError(f"{type(self).__name__} does not verify drafted tokens beside prompt chunks")

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Copy the K/V of positions 0..length-1 from slot `source` to slot `target`, every layer."""
        self._prefix_copy(source, target, length)

    def kept(self, slot: int, lanes: int) -> None:
        """The first `lanes` of `slot`'s lanes in the last verification were kept: the cache holds what
        they wrote, and what later lanes wrote is written again before it is read."""

    def copy_state(self, source: int, target: int) -> None:
        """Copy every recurrent layer's state from row `source` to row `target` of its cache (a slot's
        row, or a snapshot's after the slots' and the scratch one: delta_block.GatedDeltaBlock)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no recurrent state")

    def warm_up(self, progress: Callable[[str], None]) -> None:
        raise NotImplementedError

    # where `pages`: a paged pool's blocks as arrays, every layer's (serving/prefix_store.py saves and restores them)
    def block_row_shapes(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """Each layer's rows of one block: (k|v, kv heads, positions, row) and their dtype."""
        raise NotImplementedError(f"{type(self).__name__} keeps no paged pool")

    def block_rows(self, blocks: list[int]) -> list[np.ndarray]:
        """A copy of the given blocks' rows, a (len(blocks), *shape) array a layer."""
        raise NotImplementedError(f"{type(self).__name__} keeps no paged pool")

    def write_block_rows(self, blocks: list[int], rows: list[np.ndarray]) -> None:
        """Write `rows` (as `block_rows` gives them) into the given blocks."""
        raise NotImplementedError(f"{type(self).__name__} keeps no paged pool")


class PrefixCopy:
    """Slot-to-slot K/V copies as one captured tinygrad step, whichever way the model's steps run."""

    def __init__(self, model):
        self.model = model
        self.v_source = UOp.variable("source", 0, model.slots)
        self.v_target = UOp.variable("slot", 0, model.slots)
        self.v_length = UOp.variable("length", 1, model.context)
        self._jit: TinyJit | None = None
        # the CPU kernels' steps read the caches outside tinygrad's queue: they must see the copy done
        self.synchronize = False

    def __call__(self, source: int, target: int, length: int) -> None:
        assert source != target and 0 < length <= self.model.context
        if self._jit is None:
            self._jit = capturing_jit(self.model.copy_prefix_rows)
        self._jit(self.v_source.bind(source), self.v_target.bind(target), self.v_length.bind(length))
        if self.synchronize:
            Device[Device.DEFAULT].synchronize()


def capturing_jit(fn) -> TinyJit:
    """A TinyJit that captures on its first call. By default it first runs once eagerly, which
    schedules and compiles the whole step only for the capture to do it again: skipping that run
    takes that scheduling and compiling off warm-up (bench/RESULTS.md, figures moved out of code
    comments)."""
    jit = TinyJit(fn)
    jit.cnt = 1
    return jit


def prompt_lanes(slot: int, start: int, n: int) -> list[int]:
    """The kernels' lanes for n prompt tokens of `slot` from position `start`: their slots, then their positions."""
    return [slot] * n + list(range(start, start + n))
