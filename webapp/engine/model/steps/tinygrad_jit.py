"""Steps as captured jits of tinygrad's own kernels (`Transformer.forward_prefill` / `forward_decode`):
every device but the CPU, and the CPU without its kernels.

A prefill piece's slot and start and a decode step's key length enter as bound symbolic variables, a
decode step's lanes' slots and positions as device tensors (lane_rows.py), never as shapes, so
sequences joining and leaving never recompile and a decode step's kernels do not grow with its
width; a prefill piece is padded to a fixed size, which compiles to faster kernels than a symbolic
length (bench/RESULTS.md, figures moved out of code comments).
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor, UOp, dtypes

from webapp.engine.model.lanes import Lane, Want
from webapp.engine.model.steps.base import capturing_jit
from webapp.engine.model.steps.jitted import JittedSteps

ROWS_PIECE = 32  # a chunk with an image's rows runs as one piece, padded to a power of two from this


class TinygradJitSteps(JittedSteps):
    how = "jitted, on tinygrad"
    takes_inputs = True  # a prompt chunk with rows runs whole (`_prefill_rows`)

    def __init__(self, model, prefill_chunk: int):
        super().__init__(model, prefill_chunk)
        self.v_slot = UOp.variable("slot", 0, model.slots)
        self.v_start = UOp.variable("start", 0, model.context - 1)
        self.v_length = UOp.variable("length", 1, model.context)

    def run(self, lanes: list[Lane]) -> list[np.ndarray]:
        if len(lanes) == 1 and lanes[0].inputs:
            return [self._prefill_rows(lanes[0])]
        return super().run(lanes)

    def _prefill_rows(self, lane: Lane) -> np.ndarray:
        """A prompt chunk holding rows in place of embeddings (an image's) as one jitted piece, so an
        image attended both ways sees all of itself: padded to a power of two (a multiple of
        ROWS_PIECE near the context's end, where the cache's spare positions end), a jit a size."""
        if lane.want is not Want.LAST or lane.decoding:
            raise NotImplementedError("rows in place of embeddings run in a prompt chunk wanting its last logits")
        n, start, b = len(lane.tokens), lane.start, self.buffers
        spare = self.model.key_positions.shape[0] - start  # positions the cache holds from `start`
        piece = max(ROWS_PIECE, 1 << (n - 1).bit_length())
        piece = piece if piece <= spare else -(-n // ROWS_PIECE) * ROWS_PIECE
        tokens, last_keys = list(lane.tokens) + [0] * (piece - n), list(range(start, start + piece))
        inputs, given = np.zeros((1, piece, self.model.config.dim), np.float32), np.zeros((1, piece, 1), np.float32)
        for offset, rows in lane.inputs:
            end = offset + len(rows)
            inputs[0, offset:end], given[0, offset:end], tokens[offset:end] = rows, 1.0, [0] * len(rows)
            if lane.inputs_both_ways:
                last_keys[offset:end] = [start + end - 1] * len(rows)
        jit = self._prefill_jits.get(("rows", piece))
        if jit is None:
            jit = self._prefill_jits["rows", piece] = capturing_jit(self.model.forward_prefill_rows)
        args = [
            b.fill("rows tokens", [tokens], dtypes.int32),
            b.fill("rows last", [[float(i == n - 1) for i in range(piece)]], dtypes.float32),
        ]
        args += [b.fill("rows inputs", inputs, dtypes.float32), b.fill("rows given", given, dtypes.float32)]
        args += [b.fill("rows last keys", last_keys, dtypes.int32)]
        return b.read(jit(*args, self.v_slot.bind(lane.slot), self.v_start.bind(start)), 1)[0]

    def _prefill_piece(self, tokens: list[int], slot: int, start: int, piece: int) -> np.ndarray:
        n, b = len(tokens), self.buffers
        assert 0 < n <= piece
        jit = self._prefill_jits.get(piece)
        if jit is None:
            jit = self._prefill_jits[piece] = capturing_jit(self.model.forward_prefill)
        last = b.fill("prefill last", [[float(i == n - 1) for i in range(piece)]], dtypes.float32)
        padded = b.fill("prefill tokens", [tokens + [0] * (piece - n)], dtypes.int32)
        return b.read(jit(padded, last, self.v_slot.bind(slot), self.v_start.bind(start)), 1)[0]

    def _hidden_piece(self, tokens: list[int], slot: int, start: int, piece: int) -> np.ndarray:
        n = len(tokens)
        padded = Tensor(np.array([tokens + [0] * (piece - n)], dtype=np.int32))
        return self.model.hidden_prefill(padded, self.v_slot.bind(slot), self.v_start.bind(start)).numpy()[:n]

    def _decode_width(self, tokens: list[int], slots: list[int], positions: list[int], width: int) -> np.ndarray:
        n, b = len(tokens), self.buffers
        assert 0 < n <= width
        pad = width - n
        tokens, slots, positions = tokens + [0] * pad, slots + [self.model.slots] * pad, positions + [0] * pad
        jit = self._decode_jits.get(width)
        if jit is None:
            jit = self._decode_jits[width] = capturing_jit(self.model.forward_decode)
        assert all(0 <= s <= self.model.slots for s in slots) and all(0 <= p < self.model.context for p in positions)
        tokens_in = b.fill("decode tokens", tokens, dtypes.int32)
        positions_in = b.fill("decode positions", positions, dtypes.int32)
        slots_in = b.fill("decode slots", slots, dtypes.int32)
        return b.read(jit(tokens_in, positions_in, slots_in, self.v_length.bind(max(positions) + 1)), n)
