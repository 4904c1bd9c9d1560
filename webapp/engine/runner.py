"""Turns scheduler work into model calls and model logits into sampled token ids.

`ModelRunner` is the only engine piece besides model.py that touches tinygrad. Decode batches are
padded up to a few fixed widths so each width compiles once (at warm-up) and is replayed after.
Sampling runs in NumPy on the logits rows, with a generator per request, so a seeded request gives
the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .request import Request, SamplingParams

log = logging.getLogger(__name__)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from a (vocab,) row: greedy at temperature 0, else temperature / top-k / top-p."""
    if params.temperature <= 0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / params.temperature
    ids = np.arange(x.shape[0])
    if 0 < params.top_k < x.shape[0]:
        ids = np.argpartition(-x, params.top_k)[: params.top_k]
        x = x[ids]
    if params.top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        x, ids = x[order], ids[order]
        probs = np.exp(x - x[0])
        probs /= probs.sum()
        # keep the smallest head whose mass reaches top_p (always at least one token)
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        x, ids = x[:keep], ids[:keep]
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    return int(ids[rng.choice(len(ids), p=probs)])


SMALLEST_CHUNK = 8


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
        # smaller buckets keep follow-up turns and prompt tails from paying for a full padded chunk
        self.chunks = buckets(min(SMALLEST_CHUNK, prefill_chunk), prefill_chunk)
        self.widths = buckets(1, model.slots)

    def prefill(self, request: Request, tokens: list[int], start: int) -> np.ndarray:
        """Run one chunk of `request`'s prompt; logits (vocab,) of its last token."""
        chunk = next(c for c in self.chunks if c >= len(tokens))
        return self.model.prefill(tokens, request.slot, start, chunk).numpy()[0]

    def decode(self, batch: list[Request], positions: list[int]) -> np.ndarray:
        """Feed each request's last output token at its position; logits (len(batch), vocab)."""
        width = next(w for w in self.widths if w >= len(batch))
        tokens = [r.output_ids[-1] for r in batch]
        logits = self.model.decode(tokens, [r.slot for r in batch], positions, width)
        return logits.numpy()[: len(batch)]

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
        progress(f"warm-up: compiling prefill chunks {self.chunks} and decode widths {self.widths} (BEAM={self.beam})")
        scratch = self.model.slots
        # the model's jits capture on the first call; the second call checks the replay
        for chunk in self.chunks:
            for _ in range(2):
                self.model.prefill([0] * chunk, scratch, 0, chunk).numpy()
            progress(f"warm-up: prefill chunk {chunk} ready ({time.monotonic() - started:.1f} s)")
        for width in self.widths:
            for _ in range(2):
                self.model.decode([0], [scratch], [0], width).numpy()
            progress(f"warm-up: decode width {width} ready ({time.monotonic() - started:.1f} s)")
        return time.monotonic() - started
