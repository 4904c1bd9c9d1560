"""Which token sequence each KV-cache slot holds, and which slot a new request should take.

The model owns the cache tensors; this table owns the bookkeeping. A slot keeps its tokens after its
request ends, so a later request that shares a prefix (a follow-up turn, a shared system prompt)
prefills only the rest. Invariant: `slot.tokens` are exactly the positions whose K/V the model has
written for that slot, in order.

A sliding-window model's local layers keep a ring of positions, not the whole sequence
(`RingRows`): a prefix of a slot's tokens is reusable only while the window of keys before its end
is still in the ring, that is within `RingRows.keep` positions of the furthest the slot's sequence
reached (`Slot.reach`). Other prompts are prefilled again from the start. A slot's `lineage` says
what besides the model computed its K/V (a LoRA adapter's load, serving/adapters.py; None: nothing):
a prompt of another lineage reuses none of it. A recurrent model's table
(state_snapshots.RecurrentSlots) serves prefixes from its slots' states and their snapshots.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable_prefix(cached: list[int], prompt: list[int]) -> int:
    """How many of `prompt`'s tokens a cache holding `cached` can serve. At least the last prompt
    token must run through the model: its logits pick the first output."""
    return min(common_prefix_len(cached, prompt), len(prompt) - 1)


@dataclass(frozen=True)
class RingRows:
    """What a ring of positions keeps: a prefix ending `keep` or fewer positions before the slot's
    reach still has its window of keys, and a slot that never reached past `whole` positions never
    overwrote a row (made by the model: Transformer.ring_rows)."""

    keep: int
    whole: int

    def serves(self, reach: int, length: int) -> bool:
        return reach <= self.whole or reach - length <= self.keep


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)
    owner: object | None = None  # the Request running here, None when free
    last_used: int = 0
    high: int = 0  # the longest its sequence was since it last started from position 0 (RingRows)
    lineage: str | None = None  # what besides the model its K/V were computed with (a LoRA adapter's load)

    @property
    def reach(self) -> int:
        return max(self.high, len(self.tokens))


class SlotTable:
    def __init__(self, n_slots: int, ring: RingRows | None = None):
        self.slots = [Slot(i) for i in range(n_slots)]
        self.ring = ring
        self._clock = itertools.count(1)

    @property
    def free(self) -> list[Slot]:
        return [s for s in self.slots if s.owner is None]

    def reusable(self, slot: Slot, prompt: list[int], lineage: str | None = None) -> int:
        """How many of `prompt`'s tokens `slot`'s cache can serve: reusable_prefix, if the ring kept it
        and the slot's lineage is the prompt's."""
        if slot.lineage != lineage:
            return 0
        length = reusable_prefix(slot.tokens, prompt)
        return length if self.ring is None or self.ring.serves(slot.reach, length) else 0

    def acquire(self, owner, prompt: list[int], lineage: str | None = None) -> tuple[Slot, int]:
        """Give `owner` the free slot sharing the longest prefix with `prompt` of `lineage` (else the
        least recently used one); returns the slot and how many prompt tokens are already cached there."""
        free = self.free
        if not free:
            raise RuntimeError("no free slot")
        reused, best = max(((self.reusable(s, prompt, lineage), s) for s in free), key=lambda pair: (pair[0], -pair[1].last_used))
        best.high = best.reach if reused else 0
        del best.tokens[reused:]
        best.lineage = lineage
        best.owner = owner
        best.last_used = next(self._clock)
        return best, reused

    def release(self, slot: Slot) -> None:
        slot.owner = None
        slot.last_used = next(self._clock)

    # --- what the scheduler asks of any table (paged_slots.PagedSlots answers the same) ----------

    def admits(self, prompt: list[int], running: int = 0, lineage: str | None = None) -> bool:
        """A free slot holds any prompt that fits the context."""
        return bool(self.free)

    def reserve(self, slot: Slot, positions: int) -> bool:
        return True  # a slot holds the whole context from the start

    def room(self, slot: Slot) -> int | None:
        return None  # as far as the context

    def extend(self, slot: Slot, tokens: list[int]) -> None:
        slot.tokens.extend(tokens)

    def reset(self, slot: Slot) -> None:
        slot.tokens.clear()

    def forget(self, slot: Slot) -> None:
        """After a failed step the slot's cache contents are unknown: reuse none of it."""
        slot.tokens.clear()

    def elsewhere(self, slot: Slot, prompt: list[int]) -> tuple[Slot | None, int]:
        """The other slot, busy or free, caching the most of `prompt`, and how much: a copy's source."""
        others = ((self.reusable(s, prompt, slot.lineage), s) for s in self.slots if s is not slot)
        length, source = max(others, key=lambda pair: pair[0], default=(0, None))
        return source, length

    def take_prefix(self, slot: Slot, prompt: list[int], length: int, source: Slot) -> None:
        """`prompt`'s first `length` positions were copied into `slot` from `source` (a sliding-window
        layer's whole ring: what the source overwrote is gone in the copy too)."""
        slot.tokens[:] = prompt[:length]
        slot.high = source.reach

    def describe(self) -> dict | None:
        return None  # no pool of blocks
