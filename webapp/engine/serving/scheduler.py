"""Continuous-batching policy: who waits, who runs, and what the next engine step computes.

Pure bookkeeping on the model thread, no tensors. `plan(mixes)` returns the whole of the next step
as a `StepPlan`: the prompt chunks (at most `prefill_chunk` tokens in all, from one request or, where
the runner mixes steps, several; each with the prefix copy that must run before it), the decode
lanes to advance by one token, and whether chunks and lanes run as one model step. The engine runs
the plan and reports back with `prefilled()`, `decoded()` and `finish()`. A bounded prompt budget
per step beside the batched decode step (in the same model call where the runner mixes steps) keeps
a long new prompt from freezing the streams already running.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from webapp.engine.serving.kv_cache import Slot, SlotTable, reusable_prefix
from webapp.engine.serving.request import Request, Status

# Fewer prompt tokens than this are prefilled rather than copied from another slot: one 8-token
# prefill piece costs about what the copy's 30 small kernels do.
COPY_AT_LEAST = 8


@dataclass(frozen=True)
class PrefixCopy:
    """K/V rows to copy into a request's slot before its chunk runs."""

    source: int  # the slot holding them
    length: int  # positions 0..length-1
    saved: int  # prompt tokens the copy spares beyond what the request's own slot cached


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
    mixed: bool  # chunks and lanes as one model step (`Runner.prefill_and_decode`)

    def lanes_after_prefill(self) -> list[Request]:
        """The lanes of a step whose chunks ran on their own: those decoding before, and the requests
        whose prompts the chunks completed (their first token sampled), less any that ended meanwhile."""
        joined = [c.request for c in self.chunks if c.request.output_ids]
        return [r for r in (*self.decode, *joined) if r.status is Status.DECODE]


class Scheduler:
    def __init__(self, slots: SlotTable, prefill_chunk: int):
        self.slots = slots
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; prefilling ones first come first served

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
        """Move waiting requests FCFS into free slots; each reuses what its slot already caches."""
        admitted = []
        while self.waiting and self.slots.free:
            request = self.waiting.popleft()
            slot, reused = self.slots.acquire(request, request.prompt_ids)
            if request.every_position and reused:  # scoring and embeddings need every prompt position: none from the cache
                slot.tokens.clear()
                reused = 0
            request.slot, request.cached_tokens = slot.index, reused
            request.status, request.admitted_at = Status.PREFILL, time.monotonic()
            self.running.append(request)
            admitted.append(request)
        return admitted

    def prefilling(self) -> list[Request]:
        """Admitted requests whose prompts are not all in the cache yet, oldest first."""
        return [r for r in self.running if r.status is Status.PREFILL]

    def plan(self, mixes: bool) -> StepPlan:
        """The next step. Where the runner `mixes`, prompt chunks and decode lanes run as one model
        step whenever there is more than one part, unless the chunk scores its prompt (which needs
        every position's logits, so it runs alone)."""
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
            if chunks and (not several or budget <= 0 or request.every_position):
                break
            if self.would_copy_from(request, [c.request for c in chunks]):
                continue
            copy = None
            shared = self.prefix_elsewhere(request)
            if shared is not None:
                source, length = shared
                copy = PrefixCopy(source.index, length, length - request.cached_tokens)
                self.copied(request, length, source)  # the engine runs the copy before the chunk, or fails the request
            start = self.position(request)
            tokens = request.prompt_ids[start : start + budget]
            chunks.append(PromptChunk(request, tokens, start, copy))
            budget -= len(tokens)
            if request.every_position:
                break
        return chunks

    def would_copy_from(self, request: Request, others: list[Request]) -> bool:
        """Whether `request` could copy a prompt prefix from one of `others` once they are prefilled,
        beyond what it can copy now: then it waits for them rather than prefill that prefix again
        beside them (the `n` choices of a request, a second chat on the same long document)."""
        have = self.position(request)
        shared = self.prefix_elsewhere(request)
        if shared is not None:
            have = max(have, shared[1])
        return any(reusable_prefix(other.prompt_ids, request.prompt_ids) - have >= COPY_AT_LEAST for other in others)

    def prefix_elsewhere(self, request: Request) -> tuple[Slot, int] | None:
        """Another slot, busy or free, caching more of this request's prompt than its own slot does,
        and how many tokens to copy from it; None when copying would not save a prefill piece.

        Asked before a request's first prefill chunk, so the `n` choices of one prompt (admitted
        together, prefilled one after another) prefill it once, and a prompt sharing a long system
        prompt with a running request starts from that request's cache.
        """
        if request.prefilled_tokens or request.every_position:
            return None
        others = ((self.slots.reusable(s, request.prompt_ids), s) for s in self.slots.slots if s.index != request.slot)
        length, source = max(others, key=lambda pair: pair[0], default=(0, None))
        return (source, length) if length - self.position(request) >= COPY_AT_LEAST else None

    def copied(self, request: Request, length: int, source: Slot) -> None:
        """The first `length` prompt tokens' K/V were copied into the request's slot from `source`'s
        (a sliding-window layer's whole ring: what the source overwrote is gone in the copy too)."""
        slot = self.slot_of(request)
        slot.tokens[:] = request.prompt_ids[:length]
        slot.high = source.reach
        request.cached_tokens = length

    def prefilled(self, request: Request, tokens: list[int]) -> bool:
        """Record a prefilled chunk; True when the whole prompt is in the cache."""
        slot = self.slot_of(request)
        slot.tokens.extend(tokens)
        request.prefilled_tokens += len(tokens)
        if len(slot.tokens) == request.prompt_len:
            request.status = Status.DECODE
            return True
        return False

    def decoding(self) -> list[Request]:
        return [r for r in self.running if r.status is Status.DECODE]

    def decoded(self, request: Request) -> None:
        """The request's last output token has just been written to its slot's cache."""
        self.slot_of(request).tokens.append(request.output_ids[-1])

    def finish(self, request: Request, reason: str) -> None:
        """Retire a request; its slot keeps the cached tokens for prefix reuse."""
        request.status, request.finish_reason, request.finished_at = Status.FINISHED, reason, time.monotonic()
        if request in self.running:
            self.running.remove(request)
            self.slots.release(self.slot_of(request))
        elif request in self.waiting:
            self.waiting.remove(request)

    def forget_slot(self, request: Request) -> None:
        """After a failed step the slot's cache contents are unknown: reuse none of it."""
        if request.slot is not None:
            self.slot_of(request).tokens.clear()
