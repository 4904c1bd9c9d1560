"""Drafts from a small second model (`LLM_DRAFT_MODEL`): its greedy continuation of each sequence,
batched over the requests that draft from it this step, and the choice per request between it and
prompt lookup.

Contract: `DraftModel(steps, slots, name)` holds the draft model's step strategy (one call on the CPU
kernels, like the served model's where drafts are verified) and a KV cache with the served model's
slot numbering: slot i of the draft caches a prefix of what slot i of the served model holds.
`continue_greedy(asks)` takes (slot, sequence, k) per request, its sequence being its prompt and
output so far, and returns each one's next k argmax tokens (none for a request still catching up,
below); `warm_up(target_steps, progress)` runs once and measures `step_cost`, a one-lane draft
step's time in one-lane steps of the served model. `Drafter(lookup, draft)` is one request's
drafting: each step it takes prompt lookup's draft or asks the draft model for k tokens, whichever
yields more tokens per unit of step time at that source's own acceptance (`plan`), and credits the
outcome to the source that drafted (`update`).

The draft's cache is filled lazily, not mirrored: `cached[slot]` lists the tokens whose K/V the
draft has written there, and before drafting a sequence feeds what it lacks of it (its common
prefix with the sequence is kept, or a longer one copied from another draft slot, as the served
model's prefix reuse does). So a request that never asks the draft (a full batch, prompt lookup's
drafts winning, speculation off, embeddings) costs it nothing, and nothing in the scheduler or the
served model's prefill changes. After a drafted step the draft lacks one or two tokens (the sample
that replaced its first refused draft, or its last draft and the bonus token): its first call feeds
them and yields the first draft in one step of all asking lanes, then k - 1 one-token steps of the
lanes that want more. A long gap (a new prompt) is fed CATCH_UP tokens a step, so a step stays short
for every other stream; such a request drafts once its cache has caught up.

A recurrent draft (qwen35) cannot cut its state back to a common prefix: a slot's row of state takes
in only what the catch-up feeds (tokens of the sequence), and the one-token steps run in rows of state
of their own (the model's spare rows: the first step takes the slot's state, each later one goes on
from its row), so the next call feeds the kept drafts and the sample again, from the slot's row. A
sequence fed from its start (SNAPSHOT_AT_LEAST tokens or more) stops its catch-up one token short of
its end once, where the slot's state is copied into the slot's snapshot row: a later sequence that
starts with those tokens (the same prompt again, in any slot) takes that state, and the attention
layers' keys and values from the snapshot's slot, instead of being fed again from its start.

The draft proposes; the served model's verification decides (webapp/engine/serving/engine.py), so
no output depends on what the draft says, how often it is asked, or whether it failed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from webapp.engine.decoding.drafts import Acceptance, PromptLookup
from webapp.engine.serving.kv_cache import reusable_prefix
from webapp.engine.serving.scheduler import COPY_AT_LEAST
from webapp.engine.serving.state_snapshots import SNAPSHOT_AT_LEAST

# tokens fed to the draft in one step, over all its lanes: on a 135M-shaped draft 64 took well over
# one one-lane step of a 1.7B-shaped served model, so 32 keep a new request's catch-up to about one
# decode step of the served model (bench/RESULTS.md, a draft model beside a 1.7B-shaped target, and
# figures moved out of code comments)
CATCH_UP = 32
TIMED_STEPS = 7  # one-lane steps of each model timed at warm-up, for step_cost (their medians)


class DraftModel:
    def __init__(self, steps, slots: int, name: str):
        self.steps, self.name = steps, name
        self.context = steps.model.context
        self.cached: list[list[int]] = [[] for _ in range(slots)]  # per slot, tokens whose K/V the draft holds, in order
        self.step_cost = 1.0  # a one-lane draft step in one-lane steps of the served model (measured at warm-up)
        # a recurrent draft (qwen35): its state takes in every token fed, so its drafts run in rows of
        # state of their own, and a slot's row holds only the sequence that was fed to it
        self.draft_rows = steps.spare_rows
        # and one snapshot a slot, in the first of the model's snapshot rows (after the slots' and the
        # scratch one: recurrent_config.snapshot_rows), which a draft model's engine never takes
        self.snapshots: dict[int, list[int]] = {}  # slot -> the tokens whose state its snapshot row holds
        self.marks: dict[int, int] = {}  # slot -> where its catch-up stops for that snapshot

    def warm_up(self, target_steps, progress: Callable[[str], None]) -> None:
        self.steps.warm_up(progress)
        target, draft = _median_steps(target_steps, self.steps)
        self.step_cost = draft / target
        progress(f"draft model {self.name}: a step costs {self.step_cost:.2f} of the served model's ({target * 1e3:.1f} ms)")

    def continue_greedy(self, asks: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """For each (slot, sequence, k): the draft's k argmax tokens after `sequence`, fewer where the
        context ends, none while the slot's cache is still catching up. On an exception the asking
        slots' caches count as unknown (emptied) and it propagates."""
        try:
            return self._continue(asks)
        except Exception:
            for slot, _, _ in asks:
                self.cached[slot].clear()
            raise

    def _continue(self, asks: list[tuple[int, list[int], int]]) -> list[list[int]]:
        budget, chunks, wanted = CATCH_UP, [], []
        fitting = [i for i, (_, sequence, _) in enumerate(asks) if len(sequence) < self.context]
        # every copy first: a slot fed in this call holds those rows only once the call has run
        haves = [self._reuse(asks[i][0], asks[i][1]) for i in fitting]
        for (slot, sequence, k), have in zip((asks[i] for i in fitting), haves):
            missing = len(sequence) - have
            end = have + max(1, min(missing, budget))  # at least the last token: its logits draft
            mark = self.marks.get(slot, 0)
            feed = sequence[have : mark if have < mark < end else end]
            budget -= len(feed)
            chunks.append((feed, slot, have))
            self.cached[slot][have:] = feed
            wanted.append(min(k, self.context - len(sequence)) if len(feed) == missing else 0)
        if not chunks:
            return [[] for _ in asks]
        firsts, _ = self.steps.prefill_and_decode(chunks, [], [], [])
        for _, slot, _ in chunks:
            if self.marks.get(slot) == len(self.cached[slot]):
                self.steps.copy_state(slot, self._snapshot_row(slot))
                self.snapshots[slot] = self.cached[slot][:]
                del self.marks[slot]
        drafts = [[int(np.argmax(row))] if k > 0 else [] for row, k in zip(firsts, wanted)]
        state_rows = {}  # a recurrent draft's: a row of state each lane that drafts on (those beyond the rows draft one)
        if self.draft_rows is not None:
            free = iter(self.draft_rows)
            for i in [i for i, k in enumerate(wanted) if k > 1]:
                row = next(free, None)
                if row is None:
                    wanted[i] = 1
                else:
                    state_rows[i] = row
        for step in range(max(wanted) - 1):  # one-token steps of the lanes that want more
            lanes = [i for i, draft in enumerate(drafts) if 0 < len(draft) < wanted[i]]
            slots = [chunks[i][1] for i in lanes]
            tokens = [drafts[i][-1] for i in lanes]
            positions = [chunks[i][2] + len(chunks[i][0]) + len(drafts[i]) - 1 for i in lanes]
            if self.draft_rows is None:
                out = self.steps.decode(tokens, slots, positions)
                for slot, token in zip(slots, tokens):
                    self.cached[slot].append(token)
            else:  # the first step takes each slot's state into the lane's row, later ones go on there
                out = self.steps.decode_in_rows(tokens, slots, positions, [state_rows[i] for i in lanes], resume=step > 0)
            for i, row in zip(lanes, out):
                drafts[i].append(int(np.argmax(row)))
        out = [[] for _ in asks]
        for i, draft in zip(fitting, drafts):
            out[i] = draft
        return out

    def _reuse(self, slot: int, sequence: list[int]) -> int:
        """How many of `sequence`'s tokens the slot's draft cache holds, after copying a longer prefix
        from another draft slot where that spares at least COPY_AT_LEAST tokens. A recurrent draft's
        state cannot be cut back: it holds the sequence only if it took in nothing else, else a
        snapshot serves (`_restore`)."""
        have = reusable_prefix(self.cached[slot], sequence)
        if self.draft_rows is not None:
            if have == 0 or have < len(self.cached[slot]):  # a fresh slot, or one that took in more
                have = self._restore(slot, sequence)
            return have
        del self.cached[slot][have:]
        others = ((reusable_prefix(cached, sequence), i) for i, cached in enumerate(self.cached) if i != slot)
        length, source = max(others, default=(0, None))
        if length - have >= COPY_AT_LEAST:
            self.steps.copy_prefix(source, slot, length)
            self.cached[slot][:] = sequence[:length]
            have = length
        return have

    def _snapshot_row(self, slot: int) -> int:
        return self.steps.model.slots + 1 + slot

    def _restore(self, slot: int, sequence: list[int]) -> int:
        """A recurrent draft's slot that is fresh or whose state holds more than a prefix of `sequence`:
        the longest snapshot that `sequence` starts with (its last token left to run) becomes the
        slot's state, with the attention layers' rows of the snapshot's slot, which must still hold
        its tokens; else the slot starts over (the kernels zero the state at position 0), a snapshot
        to be taken where its catch-up is a token short of `sequence`."""
        serving = [
            (len(tokens), source)
            for source, tokens in self.snapshots.items()
            if len(tokens) < len(sequence) and sequence[: len(tokens)] == tokens == self.cached[source][: len(tokens)]
        ]
        length, source = max(serving, default=(0, None))
        if source is None:
            self.cached[slot].clear()
            if len(sequence) - 1 >= SNAPSHOT_AT_LEAST:
                self.marks[slot] = len(sequence) - 1
            return 0
        if source != slot:
            self.steps.copy_prefix(source, slot, length)
        self.steps.copy_state(self._snapshot_row(source), slot)
        self.cached[slot][:] = sequence[:length]
        self.marks.pop(slot, None)
        return length


def _median_steps(*each) -> list[float]:
    """Median seconds of a one-lane decode step on the scratch slot, of each steps object in turn
    (alternated, so a busy moment of the machine weighs on both alike)."""
    times = [[] for _ in each]
    for _ in range(TIMED_STEPS):
        for steps, spent in zip(each, times):
            started = time.perf_counter()
            steps.decode([0], [steps.model.slots], [0])
            spent.append(time.perf_counter() - started)
    return [statistics.median(spent) for spent in times]


class Drafter:
    """One request's drafting: prompt lookup always, the draft model where one is loaded (with its own
    acceptance, each token costing a draft step)."""

    def __init__(self, lookup: PromptLookup, draft: DraftModel | None = None):
        self.lookup = lookup
        self.model = Acceptance(draft.step_cost, lookup.costs) if draft is not None else None
        self.source: Acceptance | None = None  # who drafted this step's proposal

    def extend(self, tokens) -> None:
        self.lookup.extend(tokens)

    def plan(self, limit: int, batch: int = 1, before: int = 0) -> tuple[list[int], int]:
        """(prompt lookup's draft, 0), or ([], k) to ask the draft model for k tokens: whichever source
        yields more tokens per unit of step time at its own acceptance; ([], 0) when neither pays."""
        draft = self.lookup.propose(limit, batch, before)
        k = self.model.length(limit, batch, before) if self.model is not None else 0
        if k and (not draft or self.model.gain(k, batch, before) > self.lookup.gain(len(draft), batch, before)):
            self.source = self.model
            return [], k
        self.source = self.lookup if draft else None
        return draft, 0

    def update(self, drafted: int, accepted: int) -> None:
        if self.source is not None:
            self.source.update(drafted, accepted)
