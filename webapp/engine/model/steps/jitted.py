"""What the two jitted ways of running a step share: prompt chunks run as fixed-size pieces and
decode batches padded to a few fixed widths, so each shape compiles once (at warm-up) and every
later step replays it.

Contract: a subclass gives `_prefill_piece(tokens, slot, start, piece, lora)` (tokens padded to
`piece`; logits (vocab,) of the last real token), `_hidden_piece(tokens, slot, start, piece, lora)`
(the same padding; every real token's final norm output (len(tokens), dim), run eagerly: embeddings
are rare next to generation, and a jit per piece would double warm-up) and `_decode_width(tokens,
slots, positions, width, lora)` (lanes padded to `width` with the scratch slot; logits (len(tokens),
vocab)). `lora` is None where no lane has an adapter, else the lane's (or each lane's) `Lane.lora`,
which only a subclass with a `lora_table` is given; `pick` (only where `picks` is set): the last
logits' argmax, an int32 array (1,) from a piece and (len(tokens),) from a width, in place of the rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from webapp.engine.device.buffers import StepBuffers
from webapp.engine.model.lanes import Lane, Want, pick_of
from webapp.engine.model.steps.base import Steps

# Prompt tokens per compiled prefill call: the bulk of a chunk in 32-token pieces, its remainder in
# 8-token ones, so a short prompt does not pay for 32. On the CPU kernels 32-token pieces run a long
# prompt faster than 8-token ones, and each size costs warm-up (bench/RESULTS.md, whole layers on the
# kernels: the tq_layer row, 87cf691).
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


class JittedSteps(Steps):
    def __init__(self, model, prefill_chunk: int):
        super().__init__(model)
        self.pieces = prefill_pieces(prefill_chunk)
        # every power of two: a width-4 step costs less than one padded to width 8, and on the CPU
        # kernels each width costs warm-up (bench/RESULTS.md: the tq_layer row, 87cf691, and
        # figures moved out of code comments)
        self.widths = buckets(1, model.slots)
        self.buffers = StepBuffers()
        self._prefill_jits: dict = {}
        self._decode_jits: dict = {}

    def _by_pieces(self, run, tokens: list[int], slot: int, start: int) -> list[np.ndarray]:
        """run(piece's tokens, slot, start, piece) over the chunk piece by piece, the last one padded."""
        assert tokens and start + len(tokens) <= self.model.context
        done, results = 0, []
        while done < len(tokens):
            rest = len(tokens) - done
            piece = next((p for p in self.pieces if p <= rest), self.pieces[-1])
            results.append(run(tokens[done : done + piece], slot, start + done, piece))
            done += min(piece, rest)
        return results

    def run(self, lanes: list[Lane]) -> list[np.ndarray]:
        """A decode step (one token a lane, padded to a width), or one prompt chunk (in pieces); a
        prompt's every logits row runs as one decode lane a token, each as generating it gives it."""
        assert self.takes_inputs or not any(lane.inputs for lane in lanes), "rows in place of embeddings: takes_inputs is not set"
        assert self.lora_table is not None or not any(lane.lora for lane in lanes), "an adapter's products: no lora_table here"
        assert self.picks or not any(lane.want is Want.TOKEN for lane in lanes), "a lane wants TOKEN: `picks` is not set"
        assert self.turns_by_sections or all(lane.rope_positions is None for lane in lanes), (
            "M-RoPE positions: turns_by_sections is not set"
        )
        if all(lane.decoding and len(lane.tokens) == 1 for lane in lanes):
            width = next(w for w in self.widths if w >= len(lanes))
            lora = [lane.lora for lane in lanes] if any(lane.lora for lane in lanes) else None
            pick = all(lane.want is Want.TOKEN for lane in lanes)  # else the rows come back, and are picked here
            rope = {"turned": [lane.rope_positions for lane in lanes]} if self.turns_by_sections else {}
            rows = self._decode_width(
                [lane.tokens[0] for lane in lanes],
                [lane.slot for lane in lanes],
                [lane.start for lane in lanes],
                width,
                lora,
                pick,
                **rope,
            )
            if pick:
                return [rows[i : i + 1] for i in range(len(lanes))]
            return [pick_of(row) if lane.want is Want.TOKEN else row for lane, row in zip(lanes, rows, strict=True)]
        if len(lanes) != 1 or lanes[0].decoding:
            raise NotImplementedError(f"{type(self).__name__} runs a decode step or one prompt chunk, neither mixed nor drafted")
        lane = lanes[0]
        tokens, slot, start, lora = list(lane.tokens), lane.slot, lane.start, lane.lora

        at = lane.rope_positions  # M-RoPE's (3, tokens), or None

        def turned(first: int, n: int):  # the lane's M-RoPE positions of its tokens first .. first + n - 1
            return None if at is None else at[:, first - start : first - start + n]

        if lane.want in (Want.LAST, Want.TOKEN):
            pick, extra = lane.want is Want.TOKEN, (lambda first, n: {"turned": turned(first, n)} if self.turns_by_sections else {})
            prefill = lambda t, s, first, piece: self._prefill_piece(t, s, first, piece, lora, pick, **extra(first, len(t)))  # noqa: E731
            return [self._by_pieces(prefill, tokens, slot, start)[-1]]
        if lane.want is Want.HIDDEN:
            return [np.concatenate(self._by_pieces(lambda *piece: self._hidden_piece(*piece, lora), tokens, slot, start))]
        assert start + len(tokens) <= self.model.context
        extra = lambda i: {"turned": [turned(start + i, 1)]} if self.turns_by_sections else {}  # noqa: E731
        return [np.stack([self._decode_width([t], [slot], [start + i], 1, one_lane(lora), **extra(i))[0] for i, t in enumerate(tokens)])]

    def _prefill_piece(self, tokens: list[int], slot: int, start: int, piece: int, lora=None, pick: bool = False) -> np.ndarray:
        raise NotImplementedError

    def _hidden_piece(self, tokens: list[int], slot: int, start: int, piece: int, lora=None) -> np.ndarray:
        raise NotImplementedError

    def _decode_width(
        self, tokens: list[int], slots: list[int], positions: list[int], width: int, lora=None, pick: bool = False
    ) -> np.ndarray:
        raise NotImplementedError

    def warm_variants(self) -> list[tuple[tuple[int, float] | None, bool]]:
        """The (lora, pick) variants of every piece and width that warm-up compiles: the plain ones here."""
        return [(None, False)]

    def warm_up(self, progress: Callable[[str], None]) -> None:
        started = time.monotonic()
        progress(f"warm-up: compiling prefill pieces {self.pieces} and decode widths {self.widths}")
        scratch = self.model.slots
        for lora, pick in self.warm_variants():
            label = ", ".join(["with a LoRA adapter"] * (lora is not None) + ["picking"] * pick)
            label = f" ({label})" if label else ""
            # the jits capture on the first call; the second call checks the replay
            for piece in self.pieces:
                for _ in range(2):
                    self._prefill_piece([0] * piece, scratch, 0, piece, lora, pick)
            progress(f"warm-up: prefill{label} ready ({time.monotonic() - started:.1f} s)")
            for width in self.widths:
                for _ in range(2):
                    self._decode_width([0], [scratch], [0], width, one_lane(lora), pick)
                progress(f"warm-up: decode width {width}{label} ready ({time.monotonic() - started:.1f} s)")
        for _ in range(2):
            self.copy_prefix(0, scratch, 1)


def one_lane(lora: tuple[int, float] | None) -> list | None:
    """`_decode_width`'s `lora` for one lane's adapter (None: none)."""
    return None if lora is None else [lora]
