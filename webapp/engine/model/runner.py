"""Turns scheduler work into model calls and model logits into sampled token ids.

`Runner` is the contract the engine programs against (`LoadedModel.runner`); `ModelRunner` fulfils
it with the tinygrad model, the tests' `FakeRunner` without one. Decode batches are
padded up to a few fixed widths so each width compiles once (at warm-up) and is replayed after.
Sampling happens elsewhere (webapp/engine/decoding/sampling.py), on the NumPy logits rows returned here.
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

    def decode(self, batch: list[Request], positions: list[int]) -> np.ndarray:
        """Feed each request's last output token at its position; logits (len(batch), vocab)."""

    # True when `prefill_and_decode` runs as one model step; the engine calls it only then
    mixes: bool

    def prefill_and_decode(
        self, chunks: list[tuple[Request, list[int], int]], batch: list[Request], positions: list[int]
    ) -> tuple[list[np.ndarray], np.ndarray]:
        """`prefill(request, tokens, start)` for each chunk and `decode(batch, positions)` in one model
        step: each chunk's logits (vocab,), and the batch's (len(batch), vocab)."""

    def copy_prefix(self, request: Request, source_slot: int, length: int) -> None:
        """Copy the K/V of positions 0..length-1 from `source_slot` into `request`'s slot."""

    def warm_up(self, progress: Callable[[str], None]) -> float:
        """Compile everything the steps will run, reporting through `progress`; the seconds it took."""


# Prompt tokens per compiled prefill call: the bulk of a chunk in 32-token pieces, its remainder in
# 8-token ones, so a short prompt does not pay for 32. On the CPU kernels (default model, this 2-core
# VM, 512 tokens) 8-token pieces ran 172 tok/s and 32-token ones 209; each size is ~2 s of warm-up.
PREFILL_PIECES = (32, 8)


def prefill_pieces(prefill_chunk: int) -> list[int]:
    """The piece sizes a chunk of at most `prefill_chunk` tokens runs as, largest first."""
    return sorted({min(p, prefill_chunk) for p in PREFILL_PIECES}, reverse=True)


def buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from `smallest` up to (and ending at) `largest`."""
    sizes, n = [], smallest
    while n < largest:
        sizes.append(n)
        n *= 2
    return sizes + [largest]


class ModelRunner:
    def __init__(self, model, prefill_chunk: int, beam: int = 0):
        self.model = model
        self.beam = beam  # tinygrad BEAM search width for compiling kernels at warm-up (0: default kernels)
        self.pieces = prefill_pieces(prefill_chunk)
        self.piece = self.pieces[0]  # the largest: the model's cache has room for its padding
        # every power of two: a width-4 step took 38 ms against 57 for a padded width 8 (default
        # model), and on the CPU kernels a width costs ~1.5 s of warm-up
        self.widths = buckets(1, model.slots)

    @property
    def mixes(self) -> bool:
        return self.model.mixes_steps

    def prefill(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        """Run one chunk of `request`'s prompt, piece by piece; logits (vocab,) of its last token."""
        if self.model.whole_model is not None:  # no compiled shapes: the chunk as one call reads the weights once
            return self.model.prefill(tokens, request.slot, start, len(tokens))[0]
        done = 0
        while done < len(tokens):
            rest = len(tokens) - done
            piece = next((p for p in self.pieces if p <= rest), self.pieces[-1])  # the last one padded
            logits = self.model.prefill(tokens[done : done + piece], request.slot, start + done, piece)
            done += min(piece, rest)
        return logits[0]

    def prompt_logits(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        """Like `prefill`, but logits (len(tokens), vocab) for every token, for prompt scoring."""
        return self.model.score(tokens, request.slot, start)

    def decode(self, batch: list[Request], positions: list[int]) -> np.ndarray:
        """Feed each request's last output token at its position; logits (len(batch), vocab)."""
        width = next(w for w in self.widths if w >= len(batch))
        tokens = [r.output_ids[-1] for r in batch]
        logits = self.model.decode(tokens, [r.slot for r in batch], positions, width)
        return logits[: len(batch)]

    def prefill_and_decode(
        self, chunks: list[tuple[Request, list[int], int]], batch: list[Request], positions: list[int]
    ) -> tuple[list[np.ndarray], np.ndarray]:
        """Prompt chunks and a decode step as one model step (only where `mixes`): each chunk's last
        token's logits (vocab,) and the batch's (len(batch), vocab)."""
        decoding, slots = [r.output_ids[-1] for r in batch], [r.slot for r in batch]
        return self.model.prefill_and_decode([(t, r.slot, s) for r, t, s in chunks], decoding, slots, positions)

    def copy_prefix(self, request: Request, source_slot: int, length: int) -> None:
        self.model.copy_prefix(source_slot, request.slot, length)

    def warm_up(self, progress=log.info) -> float:
        """Compile every kernel the server will run, on the scratch slot, before any user arrives."""
        from tinygrad.engine.worker import terminate_worker_pool
        from tinygrad.helpers import Context

        with Context(BEAM=self.beam):
            seconds = self._compile_all(progress)
        # BEAM compiles in a pool of worker processes; nothing compiles after warm-up, and live
        # workers make the process hang at exit when a signal reaches its whole process group
        terminate_worker_pool()
        return seconds

    def _compile_all(self, progress) -> float:
        started = time.monotonic()
        progress(f"warm-up: compiling prefill pieces {self.pieces} and decode widths {self.widths} (BEAM={self.beam})")
        scratch = self.model.slots
        # the model's jits capture on the first call; the second call checks the replay
        for piece in self.pieces:
            for _ in range(2):
                self.model.prefill([0] * piece, scratch, 0, piece)
        progress(f"warm-up: prefill ready ({time.monotonic() - started:.1f} s)")
        for width in self.widths:
            for _ in range(2):
                self.model.decode([0], [scratch], [0], width)
            progress(f"warm-up: decode width {width} ready ({time.monotonic() - started:.1f} s)")
        for _ in range(2):
            self.model.copy_prefix(0, scratch, 1)
        return time.monotonic() - started
