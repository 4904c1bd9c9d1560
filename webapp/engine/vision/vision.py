"""Images in a prompt, as the web layer and the model thread see them.

Contract: `Vision(projector, vocab)` is made at load beside a model whose steps take embedding rows
(`Steps.takes_inputs`) and kept as `LoadedModel.vision`. A handler thread calls `prepare(data)`: the
image decoded under images.py's limits (`ImageError` otherwise) and preprocessed as the projector's
family does it, into its pieces (`PreparedImage`s: most families one, SmolVLM its tiles and an
overview), each knowing its digest and how many prompt positions it takes. In a prompt a piece is
its `before` text + that many positions + its `after` text (the family's own text around its
rows), each position holding `placeholder(piece)`: a token id past the vocabulary, one per content,
so that the prefix cache tells images apart by their pixels and a second request with the same
image shares its blocks. The model thread encodes a waiting request's images a slice
at a time (`encode_slice`, one a pass of its loop, until `encoded`), so a long encode never holds
other requests' steps up for more than a slice; the rows are kept by digest (the most recently
used, up to `ENCODED_BYTES`), and a follow-up turn about the same picture encodes nothing. `inputs(images, start, count)`
gives a prompt chunk the rows its image positions take instead of a token's embedding (encoded at
once where they are no longer kept: a preempted request's, say).
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np

from webapp.engine.vision.images import decode_image
from webapp.engine.vision.siglip import SLICE_FLOPS

ALONE_SLICES = 16  # an encode slice's work while no request runs: a request arriving meanwhile waits about this many slices
ENCODED_BYTES = 256 * 2**20  # encoded pieces' rows kept by digest: a hundred Gemma 3 images, ~1,500 SmolVLM tiles
_ID_SPACE = 2**31 - 1  # int32 token ids: placeholders lie between the vocabulary and this


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """One encoder input: a whole image, or one of its tiles or its overview."""

    pixels: np.ndarray  # the family's preprocessed input, float32
    digest: bytes  # sha256 of those pixels: equal images, equal digests, whatever their encoding
    tokens: int  # prompt positions its rows take
    before: str = ""  # the family's text before its rows, and after them
    after: str = ""
    both_ways: bool = False  # its positions attend each other both ways: one prompt chunk holds them all
    grid: tuple[int, int] | None = None  # its rows' (rows, cols), which M-RoPE turns them by; None: as text


@dataclass(frozen=True)
class ImageSpan:
    """An image's rows in a prompt: positions start .. start + image.tokens - 1."""

    start: int
    image: PreparedImage


class Vision:
    def __init__(self, projector, vocab: int):
        self.projector, self.vocab = projector, vocab
        self._encoded: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self._kept_bytes = 0
        self._encoding: tuple[bytes, Generator[None, None, np.ndarray]] | None = None  # the image being encoded, by slices
        self._lock = threading.Lock()  # the counters: read by the dashboard's thread
        self.encodes, self.encode_seconds, self.reused = 0, 0.0, 0

    def prepare(self, data: bytes) -> tuple[PreparedImage, ...]:
        """The image's pieces in prompt order."""
        pieces = []
        for before, pixels, after in self.projector.pieces(decode_image(data)):
            pixels = np.ascontiguousarray(pixels, dtype=np.float32)
            digest = hashlib.sha256(repr(pixels.shape).encode() + pixels.tobytes()).digest()
            tokens, grid = self.projector.tokens(pixels), self.projector.grid(pixels)
            pieces.append(PreparedImage(pixels, digest, tokens, before, after, self.projector.both_ways, grid))
        return tuple(pieces)

    def placeholder(self, image: PreparedImage) -> int:
        return self.vocab + int.from_bytes(image.digest[:8], "little") % (_ID_SPACE - self.vocab)

    def encoded(self, images: tuple[ImageSpan, ...]) -> bool:
        return all(span.image.digest in self._encoded for span in images)

    def encode_slice(self, images: tuple[ImageSpan, ...], alone: bool = False) -> None:
        """One slice of encoding the first of `images` not encoded yet (Projector.encode_slices); a
        larger one (ALONE_SLICES of them: a few BLAS calls of many rows go faster than many of few)
        where the model thread has no step to run beside it, `alone`."""
        image = next((span.image for span in images if span.image.digest not in self._encoded), None)
        if image is None:
            return
        self.projector.encoder.slice_flops = SLICE_FLOPS * (ALONE_SLICES if alone else 1)
        if self._encoding is None or self._encoding[0] != image.digest:  # a new one, or the last one's request went
            self._encoding = (image.digest, self.projector.encode_slices(image.pixels))
        started = time.perf_counter()
        try:
            next(self._encoding[1])
        except StopIteration as done:
            self._encoding = None
            self._keep(image.digest, done.value)
        finally:
            with self._lock:
                self.encode_seconds += time.perf_counter() - started

    def inputs(self, images: tuple[ImageSpan, ...], start: int, count: int) -> tuple[tuple[int, np.ndarray], ...]:
        """The image rows among prompt positions start .. start + count - 1, as (offset from start,
        rows) pairs."""
        found = []
        for span in images:
            first, last = max(span.start, start), min(span.start + span.image.tokens, start + count)
            if first < last:
                rows = self.rows(span.image, counted=first == span.start)
                found.append((first - start, rows[first - span.start : last - span.start]))
        return tuple(found)

    def rope_positions(self, images: tuple[ImageSpan, ...], start: int, count: int) -> np.ndarray | None:
        """(3, count) positions M-RoPE turns sequence positions start .. start + count - 1 by: an
        image's rows by its time (its first row's), and its time plus their row and column in its
        grid; every other token by its position less what the images before it saved (an image
        counts as its grid's longer side, as Qwen2-VL's positions and llama.cpp's mtmd count it).
        None where no image with a grid lies before the range's end: each token's own position."""
        gridded = sorted((s for s in images if s.image.grid is not None and s.start < start + count), key=lambda s: s.start)
        if not gridded:
            return None
        at = np.arange(start, start + count, dtype=np.int64)
        out = np.tile(at, (3, 1))
        saved = 0  # by the images before this one
        for span in gridded:
            (rows, cols), end = span.image.grid, span.start + span.image.tokens
            inside = (at >= span.start) & (at < end)
            offset, first = at[inside] - span.start, span.start - saved
            out[0, inside], out[1, inside], out[2, inside] = first, first + offset // cols, first + offset % cols
            saved += span.image.tokens - max(rows, cols)
            out[:, at >= end] -= span.image.tokens - max(rows, cols)
        return out

    def rows(self, image: PreparedImage, counted: bool = True) -> np.ndarray:
        """The image's projected rows (tokens, dim), encoded once while kept; `counted`: a kept
        image's reuse counts (not so for the later chunks of one prompt's image)."""
        rows = self._encoded.get(image.digest)
        if rows is not None:
            self._encoded.move_to_end(image.digest)
            with self._lock:
                self.reused += counted
            return rows
        started = time.perf_counter()
        rows = self._keep(image.digest, self.projector.encode(image.pixels))
        with self._lock:
            self.encode_seconds += time.perf_counter() - started
        return rows

    def _keep(self, digest: bytes, encoded: np.ndarray) -> np.ndarray:
        """An encode's rows, kept by digest (the least recently used let go past ENCODED_BYTES) and counted."""
        rows = self._encoded[digest] = np.ascontiguousarray(encoded, dtype=np.float32)
        with self._lock:
            self.encodes += 1
        self._kept_bytes += rows.nbytes
        while self._kept_bytes > ENCODED_BYTES and len(self._encoded) > 1:
            self._kept_bytes -= self._encoded.popitem(last=False)[1].nbytes
        return rows

    def stats(self) -> dict:
        with self._lock:
            return {
                "family": self.projector.family,
                "encodes": self.encodes,
                "encode_seconds": round(self.encode_seconds, 3),
                "reused": self.reused,
            }
