"""Which token sequence each KV-cache slot holds, and which slot a new request should take.

The model owns the cache tensors; this table owns the bookkeeping. A slot keeps its tokens after its
request ends, so a later request that shares a prefix (a follow-up turn, a shared system prompt)
prefills only the rest. Invariant: `slot.tokens` are exactly the positions whose K/V the model has
written for that slot, in order.
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


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)
    owner: object | None = None  # the Request running here, None when free
    last_used: int = 0


class SlotTable:
    def __init__(self, n_slots: int):
        self.slots = [Slot(i) for i in range(n_slots)]
        self._clock = itertools.count(1)

    @property
    def free(self) -> list[Slot]:
        return [s for s in self.slots if s.owner is None]

    def acquire(self, owner, prompt: list[int]) -> tuple[Slot, int]:
        """Give `owner` the free slot sharing the longest prefix with `prompt` (else the least recently
        used one); returns the slot and how many prompt tokens are already cached there."""
        free = self.free
        if not free:
            raise RuntimeError("no free slot")
        reused, best = max(((reusable_prefix(s.tokens, prompt), s) for s in free), key=lambda pair: (pair[0], -pair[1].last_used))
        del best.tokens[reused:]
        best.owner = owner
        best.last_used = next(self._clock)
        return best, reused

    def release(self, slot: Slot) -> None:
        slot.owner = None
        slot.last_used = next(self._clock)
