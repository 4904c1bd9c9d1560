"""Continuous-batching policy: who waits, who runs, and what the next engine step computes.

Pure bookkeeping on the model thread, no tensors. `plan(mixes)` returns the whole of the next step
as a `StepPlan`: the prompt chunks (at most `prefill_chunk` tokens in all, from one request or, where
the runner mixes steps, several; each with the prefix copy that must run before it), the decode
lanes to advance by one token, and whether chunks and lanes run as one model step. The engine runs
the plan and reports back with `prefilled()`, `decoded()` and `finish()`. A bounded prompt budget
per step beside the batched decode step (in the same model call where the runner mixes steps) keeps
a long new prompt from freezing the streams already running.

The table is a cache of whole slots (kv_cache.SlotTable) or, on a paged KV cache, rows of a block
table (paged_slots.PagedSlots). With blocks, every position a step writes is reserved first: a
decoding sequence's next ones, a chunk's. When the pool runs dry the newest running request gives
its blocks back (`preempt`) and waits at the head of the queue, to be computed again from its
prompt and its output so far (`Request.resume_ids`), much of it from the blocks it filed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from webapp.engine.serving.kv_cache import Slot, SlotTable, reusable_prefix
from webapp.engine.serving.paged_slots import PagedSlots
from webapp.engine.serving.request import Request, Status
from webapp.engine.serving.state_snapshots import RecurrentSlots

# Fewer prompt tokens than this are prefilled rather than copied from another slot: one 8-token
# prefill piece costs about what the copy's 30 small kernels do.
COPY_AT_LEAST = 8
# A decoding sequence's blocks reach this many positions past its next one where the pool allows: a
# step's drafted lanes write there
DECODE_AHEAD = 16


@dataclass(frozen=True)
class PrefixCopy:
    """K/V rows to copy into a request's slot before its chunk runs."""

    source: int | None  # the slot holding them; None: blocks now shared, or the slot's own, nothing to copy
    length: int  # positions 0..length-1
    saved: int  # prompt tokens the copy spares beyond what the request's own slot cached
    state: int | None = None  # a snapshot row whose recurrent states the slot takes after the copy (state_snapshots.py)


@dataclass(frozen=True)
class PromptChunk:
    request: Request
    tokens: list[int]
    start: int  # the position of tokens[0]
    copy: PrefixCopy | None = None  # run first; already counted in the slot's tokens


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[PromptChunk, ...]
    decode: tuple[Request, ...]  # the lanes decoding now, each with a token to feed
    mixed: bool  # chunks and lanes as one model step (one `Runner.run`)

    def lanes_after_prefill(self) -> list[Request]:
        """The lanes of a step whose chunks ran on their own: those decoding before, and the requests
        whose prompts the chunks completed (their first token sampled), less any that ended meanwhile."""
        joined = [c.request for c in self.chunks if c.request.output_ids]
        return [r for r in (*self.decode, *joined) if r.status is Status.DECODE]


def whole_images(request: Request, start: int, end: int, grow: bool = True) -> int:
    """Where a chunk of `request`'s prompt from `start` ends so that it cuts no image whose positions
    attend each other both ways (vision.py's PreparedImage.both_ways): `end`, or before the image it
    would cut, or where the chunk begins inside that image and `grow`, past its end (over the step's
    prompt budget, as llama.cpp decodes such an image in one batch)."""
    for span in request.images:
        first, last = span.start, span.start + span.image.tokens
        if span.image.both_ways and first < end < last:
            return last if grow and first <= start else max(first, start)
    return end


class Scheduler:
    def __init__(self, slots: SlotTable | PagedSlots, prefill_chunk: int, clock: Callable[[], float] = time.monotonic):
        self.slots = slots
        self.clock = clock  # stamps admissions and finishes: the engine's clock
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; prefilling ones first come first served
        self.preemptions = 0
        # whether a waiting request may be admitted (Runner.ready: its images encoded); one that may
        # not yet lets those behind it pass
        self.ready: Callable[[Request], bool] = lambda request: True

    def slot_of(self, request: Request) -> Slot:
        """The KV-cache slot an admitted request holds."""
        return self.slots.slots[request.slot]

    def position(self, request: Request) -> int:
        """Where the request's next token goes: how many of its tokens its slot's cache holds."""
        return len(self.slot_of(request).tokens)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def cancelled(self) -> list[Request]:
        """Requests someone asked to stop, waiting or running."""
        return [r for r in (*self.waiting, *self.running) if r.cancel_reason is not None]

    def admit(self) -> list[Request]:
        """Move waiting requests FCFS into free slots (with blocks: while the pool holds their prompts),
        passing over those not `ready`; each reuses what the cache already holds. A preempted request
        resumes: not admitted anew."""
        admitted = []
        while self.slots.free:
            request = next((r for r in self.waiting if self.ready(r)), None)
            if request is None or not self.slots.admits(request.resume_ids, len(self.running), request.lineage):
                break
            self.waiting.remove(request)
            slot, reused = self.slots.acquire(request, request.resume_ids, request.lineage)
            if request.every_position and reused:  # scoring and embeddings need every prompt position: none from the cache
                self.slots.reset(slot)
                reused = 0
            request.slot, request.status = slot.index, Status.PREFILL
            if not request.preemptions:
                request.cached_tokens, request.admitted_at = reused, self.clock()
                admitted.append(request)
            self.running.append(request)
        return admitted

    def prefilling(self) -> list[Request]:
        """Admitted requests whose prompts are not all in the cache yet, oldest first."""
        return [r for r in self.running if r.status is Status.PREFILL]

    def plan(self, mixes: bool) -> StepPlan:
        """The next step. Where the runner `mixes`, prompt chunks and decode lanes run as one model
        step whenever there is more than one part, unless the chunk scores its prompt (which needs
        every position's logits, so it runs alone)."""
        self._make_room()
        chunks = self._chunks(several=mixes)
        lanes = tuple(r for r in self.decoding() if r.output_ids)
        mixed = mixes and bool(chunks) and (bool(lanes) or len(chunks) > 1) and not chunks[0].request.every_position
        return StepPlan(tuple(chunks), lanes, mixed)

    def _chunks(self, several: bool) -> list[PromptChunk]:
        """This step's prompt chunks, oldest request first, at most the prefill chunk's tokens in all:
        one request's unless `several`. A request first copies its prefix from another slot where
        that saves work; one that could copy more from a request chunked here waits for it. A prompt
        being scored runs alone."""
        chunks: list[PromptChunk] = []
        budget = self.prefill_chunk
        for request in self.prefilling():
            if request.status is not Status.PREFILL:
                continue  # preempted for an older request's chunk just now
            if chunks and (not several or budget <= 0 or request.every_position):
                break
            if self.would_copy_from(request, [c.request for c in chunks]):
                continue
            copy = None
            shared = self.prefix_elsewhere(request)
            if shared is not None:
                source, length = shared
                copy = PrefixCopy(None if source is None else source.index, length, length - request.cached_tokens)
                self.copied(request, length, source)  # the engine runs the copy before the chunk, or fails the request
            state = self.slots.restore(self.slot_of(request)) if isinstance(self.slots, RecurrentSlots) else None
            if state is not None:
                copy = PrefixCopy(copy.source if copy else None, self.position(request), copy.saved if copy else 0, state)
            start = self.position(request)
            end = whole_images(request, start, min(start + budget, len(request.resume_ids)))
            mark = self._next_mark(request, start)
            if mark is not None:
                end = min(end, mark)  # a snapshot of the state is taken where this chunk ends
            # the chunk that ends the prompt also needs the first decode step's position
            finishes = end == len(request.resume_ids)
            room = self._room_for(request, end + finishes)
            if room < end + finishes:
                end = whole_images(request, start, max(start, room - finishes), grow=False)
            tokens = request.resume_ids[start:end]
            if not tokens:
                break  # the pool holds no more for the oldest prompt: it waits for blocks, first in line
            chunks.append(PromptChunk(request, tokens, start, copy))
            budget -= len(tokens)
            if request.every_position:
                break
        return chunks

    def _next_mark(self, request: Request, start: int) -> int | None:
        """The first of a recurrent model's snapshot marks past `start` (state_snapshots.py), else None."""
        if not isinstance(self.slots, RecurrentSlots):
            return None
        return next((m for m in self.slots.marks(request) if m > start), None)

    def snapshot_due(self, request: Request) -> int | None:
        """After a prefilled chunk: the snapshot row to copy the request's recurrent states into, where
        the chunk ended at one of its marks; else None."""
        if not isinstance(self.slots, RecurrentSlots) or request.status is not Status.PREFILL:
            return None
        slot = self.slot_of(request)
        return self.slots.snapshot(slot) if len(slot.tokens) in self.slots.marks(request) else None

    def would_copy_from(self, request: Request, others: list[Request]) -> bool:
        """Whether `request` could copy a prompt prefix from one of `others` once they are prefilled,
        beyond what it can copy now: then it waits for them rather than prefill that prefix again
        beside them (the `n` choices of a request, a second chat on the same long document)."""
        have = self.position(request)
        shared = self.prefix_elsewhere(request)
        if shared is not None:
            have = max(have, shared[1])
        return any(
            reusable_prefix(other.prompt_ids, request.prompt_ids) - have >= COPY_AT_LEAST
            for other in others
            if other.lineage == request.lineage
        )

    def prefix_elsewhere(self, request: Request) -> tuple[Slot | None, int] | None:
        """Another slot, busy or free, caching more of this request's prompt than its own slot does,
        and how many tokens to copy from it (with blocks: filed blocks to share, source None); None
        when that would not save a prefill piece.

        Asked before a request's first prefill chunk, so the `n` choices of one prompt (admitted
        together, prefilled one after another) prefill it once, and a prompt sharing a long system
        prompt with a running request starts from that request's cache.
        """
        if request.prefilled_tokens or request.every_position or request.preemptions:
            return None
        source, length = self.slots.elsewhere(self.slot_of(request), request.prompt_ids)
        return (source, length) if length - self.position(request) >= COPY_AT_LEAST else None

    def copied(self, request: Request, length: int, source: Slot | None) -> None:
        """The first `length` prompt tokens' K/V are in the request's slot now, copied from `source`'s
        or shared blocks."""
        self.slots.take_prefix(self.slot_of(request), request.prompt_ids, length, source)
        request.cached_tokens = length

    def prefilled(self, request: Request, tokens: list[int]) -> bool:
        """Record a prefilled chunk; True when the whole prompt is in the cache."""
        slot = self.slot_of(request)
        self.slots.extend(slot, tokens)
        request.prefilled_tokens += len(tokens)
        if len(slot.tokens) == len(request.resume_ids):
            request.status = Status.DECODE
            return True
        return False

    def decoding(self) -> list[Request]:
        return [r for r in self.running if r.status is Status.DECODE]

    def decoded(self, request: Request) -> None:
        """The request's last output token has just been written to its slot's cache."""
        self.slots.extend(self.slot_of(request), [request.output_ids[-1]])

    def finish(self, request: Request, reason: str) -> None:
        """Retire a request; its slot keeps the cached tokens for prefix reuse."""
        request.status, request.finish_reason, request.finished_at = Status.FINISHED, reason, self.clock()
        if request in self.running:
            self.running.remove(request)
            self.slots.release(self.slot_of(request))
        elif request in self.waiting:
            self.waiting.remove(request)

    def forget_slot(self, request: Request) -> None:
        """After a failed step the slot's cache contents are unknown: reuse none of it."""
        if request.slot is not None:
            self.slots.forget(self.slot_of(request))

    # --- blocks: reserved before a step writes them -----------------------------------------------

    def room(self, request: Request) -> int | None:
        """The positions a running request's step may write (its blocks'); None: the whole context."""
        return self.slots.room(self.slot_of(request))

    def _make_room(self) -> None:
        """Blocks for every decoding sequence's next position, oldest first, the newest giving theirs
        back while the pool has too few; then, where it has more, room for a step's drafts."""
        for request in self.decoding():
            if request.status is not Status.DECODE:
                continue  # preempted by an older one just now
            slot, position = self.slot_of(request), self.position(request)
            if self._room_for(request, position + 1) > position:  # else it was preempted itself
                self.slots.reserve(slot, position + DECODE_AHEAD)

    def _room_for(self, request: Request, positions: int) -> int:
        """Reserve `request`'s positions up to `positions`, preempting newer requests while the pool
        has too few; the positions it may write then (after its own preemption: 0)."""
        slot = self.slot_of(request)
        while not self.slots.reserve(slot, positions):
            victim = self.running[-1]
            if victim is request:
                if self.slots.room(slot) > self.position(request):
                    break  # some positions, if not all: its chunk runs shorter
                self.preempt(request)
                return 0
            self.preempt(victim)
        room = self.slots.room(slot)
        return positions if room is None else min(room, positions)

    def preempt(self, request: Request) -> None:
        """Its blocks go back to the pool (the full ones stay findable); it waits first in line and is
        computed again from `resume_ids` when admitted: its client sees a pause, never an error."""
        self.slots.release(self.slot_of(request))
        self.running.remove(request)
        request.status, request.slot, request.prefilled_tokens = Status.WAITING, None, 0
        if request.every_position:  # what its chunks gathered is gathered again from position 0
            request.prompt_logprobs = request.embedding = None
        request.preemptions += 1
        self.waiting.appendleft(request)
        self.preemptions += 1

    def state_snapshots(self) -> dict | None:
        """A recurrent model's snapshots of its states (rows, held, taken, restored); None for other models."""
        return self.slots.describe_snapshots() if isinstance(self.slots, RecurrentSlots) else None

    def kv_pool(self) -> dict | None:
        """A paged cache's blocks (used, cached, free, shared) and the preemptions so far; None for slots."""
        blocks = self.slots.describe()
        return None if blocks is None else blocks | {"preemptions_total": self.preemptions}
