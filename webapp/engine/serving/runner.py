"""Turns the engine's requests into model steps and returns their logits.

`Runner` is the contract the engine programs against (`LoadedModel.runner`); `ModelRunner` fulfils
it with the model's step strategy (`webapp.engine.model.steps`), the tests' `FakeRunner` without a
model. The runner maps requests to their slots and last tokens; how a step runs (one call, padded
pieces and widths, compiled jits) is the strategy's. Sampling happens elsewhere
(webapp/engine/decoding/sampling.py), on the NumPy logits rows returned here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from webapp.engine.serving.request import Request

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What the engine's model thread calls, and nothing else calls."""

    def prefill(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        """Write `tokens` of `request`'s prompt, from position `start`, into its slot; logits (vocab,) of the last."""

    def prompt_logits(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        """Like prefill, but logits (len(tokens), vocab) for every token (prompt scoring)."""

    def hidden_states(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        """Like prefill, but every token's final norm output (len(tokens), dim): what embeddings pool."""

    def decode(self, batch: list[Request], positions: list[int]) -> np.ndarray:
        """Feed each request's last output token at its position; logits (len(batch), vocab)."""

    # True when `prefill_and_decode` runs as one model step; the engine calls it only then
    mixes: bool
    # True when `decode_drafted` (and, where `mixes`, `prefill_and_verify`) gives each drafted
    # position the logits decoding it alone would
    speculates: bool
    # the draft model (serving/draft_model.py) where LLM_DRAFT_MODEL loaded one, else None
    draft: object

    def decode_drafted(self, batch: list[Request], drafts: list[list[int]], positions: list[int]) -> list[np.ndarray]:
        """Feed each request its last output token and then its drafted tokens, from its position; per
        request, logits (1 + len(draft), vocab): of that token, then of each draft."""

    # the most drafted tokens one verification may hold, all requests together (None: no bound but the step's lanes)
    drafted_limit: int | None
    verify_seconds: list[float] | None  # a verification of 1, 2, .. lanes of one sequence, timed at warm-up

    def kept(self, request: Request, lanes: int) -> None:
        """The first `lanes` of `request`'s lanes in the last verification were kept (decode_drafted,
        prefill_and_verify): its cache goes on from the last of them (a recurrent state, which
        took in every lane, is set back to that one's)."""

    def prefill_and_decode(
        self, chunks: list[tuple[Request, list[int], int]], batch: list[Request], positions: list[int]
    ) -> tuple[list[np.ndarray], np.ndarray]:
        """`prefill(request, tokens, start)` for each chunk and `decode(batch, positions)` in one model
        step: each chunk's logits (vocab,), and the batch's (len(batch), vocab)."""

    def prefill_and_verify(
        self, chunks: list[tuple[Request, list[int], int]], batch: list[Request], drafts: list[list[int]], positions: list[int]
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """`prefill_and_decode` with `decode_drafted`'s lanes: each chunk's logits (vocab,), and per
        request (1 + len(draft), vocab)."""

    def copy_prefix(self, request: Request, source_slot: int, length: int) -> None:
        """Copy the K/V of positions 0..length-1 from `source_slot` into `request`'s slot."""

    def save_state(self, request: Request, row: int) -> None:
        """Copy the recurrent states of `request`'s slot into snapshot row `row` (serving/state_snapshots.py)."""

    def restore_state(self, request: Request, row: int) -> None:
        """Copy snapshot row `row`'s recurrent states into `request`'s slot."""

    def warm_up(self, progress: Callable[[str], None]) -> float:
        """Compile everything the steps will run, reporting through `progress`; the seconds it took."""

    # True when the KV cache is a paged pool's blocks (the steps' `pages`); then the prefix store
    # (serving/prefix_store.py) saves and restores blocks through the three calls below
    pages: bool

    def block_row_shapes(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """Each layer's rows of one block, and their dtype."""

    def block_rows(self, blocks: list[int]) -> list[np.ndarray]:
        """A copy of the given blocks' rows, an array a layer."""

    def write_block_rows(self, blocks: list[int], rows: list[np.ndarray]) -> None:
        """Write `rows` (as `block_rows` gives them) into the given blocks."""


class ModelRunner:
    def __init__(self, steps, beam: int = 0, draft=None):
        self.steps = steps
        self.beam = beam  # tinygrad BEAM search width for compiling kernels at warm-up (0: default kernels)
        self.draft = draft  # a DraftModel, run on this thread beside the served model

    @property
    def mixes(self) -> bool:
        return self.steps.mixes

    @property
    def speculates(self) -> bool:
        return self.steps.speculates

    @property
    def pages(self) -> bool:
        return self.steps.pages

    @property
    def drafted_limit(self) -> int | None:
        return self.steps.drafted_limit

    @property
    def verify_seconds(self) -> list[float] | None:
        return self.steps.verify_seconds

    def kept(self, request: Request, lanes: int) -> None:
        self.steps.kept(request.slot, lanes)

    def decode_drafted(self, batch: list[Request], drafts: list[list[int]], positions: list[int]) -> list[np.ndarray]:
        """Each request's last output token and its drafted tokens as one lane group each, one model
        step for all; per request the logits of every fed token (1 + len(draft), vocab)."""
        lanes = [[r.output_ids[-1], *draft] for r, draft in zip(batch, drafts, strict=True)]
        return self.steps.verify(lanes, [r.slot for r in batch], positions)

    def prefill(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        """Run one chunk of `request`'s prompt; logits (vocab,) of its last token."""
        return self.steps.prefill(tokens, request.slot, start)

    def prompt_logits(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        """Like `prefill`, but logits (len(tokens), vocab) for every token, for prompt scoring."""
        return self.steps.score(tokens, request.slot, start)

    def hidden_states(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        """Like `prefill`, but every token's final norm output (len(tokens), dim), for embeddings."""
        return self.steps.hidden(tokens, request.slot, start)

    def decode(self, batch: list[Request], positions: list[int]) -> np.ndarray:
        """Feed each request's last output token at its position; logits (len(batch), vocab)."""
        return self.steps.decode([r.output_ids[-1] for r in batch], [r.slot for r in batch], positions)

    def prefill_and_decode(
        self, chunks: list[tuple[Request, list[int], int]], batch: list[Request], positions: list[int]
    ) -> tuple[list[np.ndarray], np.ndarray]:
        """Prompt chunks and a decode step as one model step (only where `mixes`): each chunk's last
        token's logits (vocab,) and the batch's (len(batch), vocab)."""
        decoding, slots = [r.output_ids[-1] for r in batch], [r.slot for r in batch]
        return self.steps.prefill_and_decode([(t, r.slot, s) for r, t, s in chunks], decoding, slots, positions)

    def prefill_and_verify(
        self, chunks: list[tuple[Request, list[int], int]], batch: list[Request], drafts: list[list[int]], positions: list[int]
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Prompt chunks and a verification (`decode_drafted`) as one model step (where `mixes` and `speculates`)."""
        lanes = [[r.output_ids[-1], *draft] for r, draft in zip(batch, drafts, strict=True)]
        return self.steps.prefill_and_verify([(t, r.slot, s) for r, t, s in chunks], lanes, [r.slot for r in batch], positions)

    def copy_prefix(self, request: Request, source_slot: int, length: int) -> None:
        self.steps.copy_prefix(source_slot, request.slot, length)

    def block_row_shapes(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        return self.steps.block_row_shapes()

    def block_bytes(self) -> int:
        """One block's rows in every layer."""
        return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self.block_row_shapes())

    def block_rows(self, blocks: list[int]) -> list[np.ndarray]:
        return self.steps.block_rows(blocks)

    def write_block_rows(self, blocks: list[int], rows: list[np.ndarray]) -> None:
        self.steps.write_block_rows(blocks, rows)

    def save_state(self, request: Request, row: int) -> None:
        self.steps.copy_state(request.slot, row)

    def restore_state(self, request: Request, row: int) -> None:
        self.steps.copy_state(row, request.slot)

    def warm_up(self, progress=log.info) -> float:
        """Compile every kernel the server will run, on the scratch slot, before any user arrives."""
        from tinygrad.engine.worker import terminate_worker_pool
        from tinygrad.helpers import Context

        started = time.monotonic()
        with Context(BEAM=self.beam):
            self.steps.warm_up(progress)
            if self.draft is not None:
                self.draft.warm_up(self.steps, progress)
        # BEAM compiles in a pool of worker processes; nothing compiles after warm-up, and live
        # workers make the process hang at exit when a signal reaches its whole process group
        terminate_worker_pool()
        return time.monotonic() - started
