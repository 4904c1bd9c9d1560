"""Turns the engine's requests into model steps and returns their outputs.

`Runner` is the contract the engine programs against (`LoadedModel.runner`); `ModelRunner` fulfils
it with the model's step strategy (`webapp.engine.model.steps`), the tests' fake runners without a
model. A step is a list of `Part`s, one a request: a prompt chunk, or a decoding request's last
output token and its drafts; the runner maps each to its request's slot (a `Lane`) and the strategy
runs them all as one step. How a step runs (one call, padded pieces and widths, compiled jits) is
the strategy's, and so is what one step may hold (its capabilities below). Sampling happens
elsewhere (webapp/engine/decoding/sampling.py), on the NumPy logits rows returned here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from webapp.engine.decoding.sampling import score_prompt
from webapp.engine.model.lanes import Lane, Want, pick_of
from webapp.engine.serving import pooling
from webapp.engine.serving.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """One request's share of a step: `tokens` fed from position `start` and what it wants back
    (lanes.Want); `decoding`: its last output token, then its drafted tokens (`drafts`)."""

    request: Request
    tokens: list[int]
    start: int
    want: Want = Want.LAST
    decoding: bool = False

    @property
    def drafts(self) -> list[int]:
        """A decoding part's drafted tokens: those after its last output token."""
        return list(self.tokens[1:]) if self.decoding else []

    def take(self, output: np.ndarray) -> np.ndarray | None:
        """A prompt chunk's output taken: an embedding pools its rows, a scored prompt records each
        next prompt token's logprob; the chunk's last logits row (None for an embedding)."""
        request = self.request
        if self.want is Want.HIDDEN:  # every position's final norm output
            pooling.add(request, output, self.start)
            return None
        if self.want is Want.ALL:  # (T, vocab)
            scored = score_prompt(output, request.prompt_ids, self.start, request.params.prompt_logprobs)
            request.prompt_logprobs = (request.prompt_logprobs or []) + scored
            return output[-1]
        return output  # the last logits row, or a TOKEN part's pick

    @classmethod
    def prompt(cls, request: Request, tokens: list[int], start: int) -> Part:
        """A prompt chunk's lane: an embedding's final norm outputs, a scored prompt's every logits
        row, else the last (its argmax alone where that is all the request samples)."""
        if request.pooling is not None:
            return cls(request, tokens, start, Want.HIDDEN)
        return cls(request, tokens, start, Want.ALL if request.scores_prompt else _last(request))

    @classmethod
    def decode(cls, request: Request, position: int, draft: list[int]) -> Part:
        """A decoding request's lane: every drafted token's logits too where it drafted."""
        return cls(request, [request.output_ids[-1], *draft], position, Want.ALL if draft else _last(request), True)


def _last(request: Request) -> Want:
    """TOKEN where the request's sampler takes nothing from a row but its argmax, else LAST."""
    return Want.TOKEN if request.sampler is not None and request.sampler.picks_greedily else Want.LAST


class Runner(Protocol):
    """What the engine's model thread calls, and nothing else calls."""

    # what one step may hold (the steps' capabilities, model/steps/base.py): prompt chunks beside
    # decode lanes, and verifications (decoding parts with drafts); a step that may not holds one
    # prompt chunk, or decoding parts without drafts
    mixes: bool
    speculates: bool
    # the most drafted tokens one verification may hold, all requests together (None: no bound but the step's lanes)
    drafted_limit: int | None
    verify_seconds: list[float] | None  # a verification of 1, 2, .. lanes of one sequence, timed at warm-up
    # the draft model (serving/draft_model.py) where LLM_DRAFT_MODEL loaded one, else None
    draft: object

    def run(self, parts: list[Part]) -> list[np.ndarray]:
        """One model step: each part's output, in order: its last token's logits (vocab,), every
        token's (len(tokens), vocab), every token's final norm output (len(tokens), dim), or (a
        part wanting TOKEN) its last logits' argmax, an int32 array (1,)."""

    def kept(self, request: Request, lanes: int) -> None:
        """The first `lanes` of `request`'s lanes in the last verification were kept: its cache goes
        on from the last of them (a recurrent state, which took in every lane, is set back to that one's)."""

    def ready(self, request: Request) -> bool:
        """Whether the request's prompt can run: every image in it encoded (the scheduler admits no other)."""

    def encode(self, waiting, alone: bool = False) -> None:
        """One slice of work on the images of the oldest waiting request that is not `ready`: called once
        a pass of the engine's loop, between steps; a larger slice where no request runs (`alone`)."""

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
    def __init__(self, steps, beam: int = 0, draft=None, vision=None):
        self.steps = steps
        self.beam = beam  # tinygrad BEAM search width for compiling kernels at warm-up (0: default kernels)
        self.draft = draft  # a DraftModel, run on this thread beside the served model
        self.vision = vision  # the projector's Vision (webapp/engine/vision/vision.py) where images are taken
        self._both_ways = vision is not None and vision.projector.both_ways  # a lane's image rows see each other
        self._turns_images = vision is not None and steps.turns_by_sections  # M-RoPE: images turn by their grid

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

    def run(self, parts: list[Part]) -> list[np.ndarray]:
        lora = [None if p.request.lora is None else p.request.lora.lane for p in parts]
        picks = self.steps.picks  # else a TOKEN part's row comes back, and is picked here
        wants = [Want.LAST if p.want is Want.TOKEN and not picks else p.want for p in parts]
        outputs = self.steps.run(
            [
                Lane(p.request.slot, p.start, p.tokens, want, p.decoding, self._inputs(p), a, self._both_ways, self._rope_positions(p))
                for p, a, want in zip(parts, lora, wants, strict=True)
            ]
        )
        return [pick_of(o) if p.want is not w else o for p, w, o in zip(parts, wants, outputs, strict=True)]

    def ready(self, request: Request) -> bool:
        return not request.images or self.vision.encoded(request.images)

    def encode(self, waiting, alone: bool = False) -> None:
        pending = next((request for request in waiting if not self.ready(request)), None)
        if pending is not None:
            self.vision.encode_slice(pending.images, alone)

    def _inputs(self, part: Part) -> tuple:
        """A prompt chunk's image rows, encoded here on the model thread where first needed."""
        if part.decoding or not part.request.images:
            return ()
        return self.vision.inputs(part.request.images, part.start, len(part.tokens))

    def _rope_positions(self, part: Part):
        """The positions an M-RoPE model turns a part of a request with images by (Vision.rope_positions)."""
        if not self._turns_images or not part.request.images:
            return None
        return self.vision.rope_positions(part.request.images, part.start, len(part.tokens))

    def kept(self, request: Request, lanes: int) -> None:
        self.steps.kept(request.slot, lanes)

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
