"""Prefix reuse for a recurrent model (Qwen3.5's Gated DeltaNet layers): snapshots of a slot's state.

A recurrent layer keeps one state a sequence, that of every token the sequence ran; unlike keys and
values it cannot be cut back to a shorter prefix. So where a prompt chunk ends at one of its
request's *marks* (the ends of its chat messages, which the web layer finds: `Request.message_ends`;
else its last token but one), the engine copies the slot's state aside into a snapshot row
(recurrent_config.snapshot_rows of them, after the slots' rows and the scratch one). A later prompt
that starts with a snapshot's tokens copies that state into its slot, and takes the attention
layers' keys and values of those positions from the snapshot's slot, as any cached prefix.

Contract (`RecurrentSlots`, a kv_cache.SlotTable): `reusable`, `acquire`, `elsewhere` and
`take_prefix` count a slot's own state (its whole sequence) and every valid snapshot. Where a
snapshot serves, `restore(slot)` gives, once, the row whose state the slot takes before its next
chunk runs (the scheduler's PrefixCopy carries it). `marks(request)` are the positions where its
chunks end; after such a chunk `snapshot(slot)` gives the row to copy the slot's state into (None:
a valid snapshot already holds these tokens, or every row awaits a restore).

A snapshot is valid while its slot's cache holds its tokens' keys and values, that is while
`slot.tokens` starts with its tokens (positions written again with the same tokens hold the same
numbers). Stale snapshots' rows are taken first, then the least recently used; never one that a
slot is still to restore.
"""

from __future__ import annotations

from dataclasses import dataclass

from webapp.engine.serving.kv_cache import Slot, SlotTable

# a mark this early in a prompt is not worth a row: prefilling its tokens again costs less than the copies
SNAPSHOT_AT_LEAST = 32


@dataclass
class Snapshot:
    row: int
    slot: int  # whose cache holds the attention layers' keys and values of `tokens`
    tokens: list[int]
    last_used: int


class RecurrentSlots(SlotTable):
    def __init__(self, n_slots: int, n_snapshots: int):
        super().__init__(n_slots)
        first = n_slots + 1  # after the slots' rows and the scratch one
        self.rows = list(range(first, first + n_snapshots))
        self.snapshots: dict[int, Snapshot] = {}  # by row
        self._restores: dict[int, int] = {}  # slot index -> the snapshot row it takes before its next chunk
        self.taken = self.restored = 0

    def _valid(self, snapshot: Snapshot) -> bool:
        tokens = self.slots[snapshot.slot].tokens
        return tokens[: len(snapshot.tokens)] == snapshot.tokens

    def _serving(self, slot: Slot, prompt: list[int]) -> tuple[int, Snapshot | None]:
        """The most of `prompt` that `slot`'s states serve, and the snapshot that does (None: the
        slot's own, its whole sequence's); the prompt's last token always runs."""
        limit = len(prompt) - 1
        own = len(slot.tokens)
        # a slot still to restore a snapshot holds no state of its tokens yet
        whole = own <= limit and slot.index not in self._restores and prompt[:own] == slot.tokens
        best: tuple[int, Snapshot | None] = (own if whole else 0, None)
        for snapshot in self.snapshots.values():
            n = len(snapshot.tokens)
            if snapshot.slot == slot.index and best[0] < n <= limit and prompt[:n] == snapshot.tokens and self._valid(snapshot):
                best = (n, snapshot)
        return best

    def reusable(self, slot: Slot, prompt: list[int]) -> int:
        return self._serving(slot, prompt)[0]

    def acquire(self, owner, prompt: list[int], lineage: str | None = None) -> tuple[Slot, int]:
        """A free slot for `prompt`: one whose whole sequence it goes on from, else an empty one, else
        the one whose states serve the most of it (then the least recently used). An empty slot
        rather than one whose longer cache it would cut: a snapshot's few rows are soon gone, and
        the prefix can be copied from there (`elsewhere`)."""
        assert lineage is None, "LoRA adapters are not loaded for a model with recurrent states"
        free = self.free
        if not free:
            raise RuntimeError("no free slot")
        options = [(self._serving(s, prompt), s) for s in free]
        whole = [option for option in options if option[0][1] is None and option[0][0] == len(option[1].tokens) > 0]
        empty = [option for option in options if not option[1].tokens]
        (reused, snapshot), best = max(whole or empty or options, key=lambda pair: (pair[0][0], -pair[1].last_used))
        del best.tokens[reused:]
        if snapshot is not None:
            self._restore_from(best, snapshot)
        best.owner = owner
        best.last_used = next(self._clock)
        return best, reused

    def elsewhere(self, slot: Slot, prompt: list[int]) -> tuple[Slot | None, int]:
        others = ((self._serving(s, prompt)[0], s) for s in self.slots if s is not slot)
        length, source = max(others, key=lambda pair: pair[0], default=(0, None))
        return source, length

    def take_prefix(self, slot: Slot, prompt: list[int], length: int, source: Slot) -> None:
        """The attention layers' first `length` positions were copied from `source`, and its whole
        state with them; a snapshot's state, where one serves, is copied in after them."""
        served, snapshot = self._serving(source, prompt)
        assert served == length, (served, length)
        slot.tokens[:] = prompt[:length]
        self._restores.pop(slot.index, None)  # superseded by the source's
        if snapshot is not None:
            self._restore_from(slot, snapshot)

    def _restore_from(self, slot: Slot, snapshot: Snapshot) -> None:
        self._restores[slot.index] = snapshot.row
        snapshot.last_used = next(self._clock)

    def restore(self, slot: Slot) -> int | None:
        """The snapshot row whose state `slot` must take before its next chunk runs, once; None if none."""
        row = self._restores.pop(slot.index, None)
        self.restored += row is not None  # counted here: a restore superseded before it ran is not one
        return row

    def release(self, slot: Slot) -> None:
        if self._restores.pop(slot.index, None) is not None:
            slot.tokens.clear()  # its state was never restored: it is not its tokens'
        super().release(slot)

    def reset(self, slot: Slot) -> None:
        self._restores.pop(slot.index, None)
        super().reset(slot)

    def forget(self, slot: Slot) -> None:
        self._restores.pop(slot.index, None)
        super().forget(slot)

    # --- taking snapshots --------------------------------------------------------------------------

    def marks(self, request) -> list[int]:
        """Where `request`'s prompt chunks end, for its snapshots: its messages' ends, else its last
        token but one (the same prompt again); none for a prompt whose every position is kept."""
        if request.every_position:
            return []
        last = len(request.prompt_ids) - 1
        marks = {m for m in request.message_ends if SNAPSHOT_AT_LEAST <= m <= last}
        return sorted(marks or ({last} if last >= SNAPSHOT_AT_LEAST else set()))

    def snapshot(self, slot: Slot) -> int | None:
        """The row to copy `slot`'s state into now that a chunk ended at a mark; None when a valid
        snapshot holds these tokens already, or every row awaits a restore."""
        tokens = slot.tokens
        for snapshot in self.snapshots.values():
            if snapshot.tokens == tokens and self._valid(snapshot):
                snapshot.last_used = next(self._clock)
                return None
        awaited = set(self._restores.values())
        rows = [r for r in self.rows if r not in awaited]
        if not rows:
            return None
        stale = [r for r in rows if r not in self.snapshots or not self._valid(self.snapshots[r])]
        row = stale[0] if stale else min(rows, key=lambda r: self.snapshots[r].last_used)
        self.snapshots[row] = Snapshot(row, slot.index, list(tokens), next(self._clock))
        self.taken += 1
        return row

    def drop(self, row: int) -> None:
        """The copy into `row` failed: it holds no snapshot."""
        self.snapshots.pop(row, None)

    def describe_snapshots(self) -> dict:
        """For the dashboard and /metrics: rows, those holding a valid snapshot, taken and restored so far."""
        held = sum(1 for s in self.snapshots.values() if self._valid(s))
        return {"rows": len(self.rows), "held": held, "taken_total": self.taken, "restored_total": self.restored}
