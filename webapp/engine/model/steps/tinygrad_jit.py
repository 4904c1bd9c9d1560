"""Steps as captured jits of tinygrad's own kernels (`Transformer.forward_prefill` / `forward_decode`):
every device but the CPU, and the CPU without its kernels.

A prefill piece's slot and start and a decode step's key length enter as bound symbolic variables, a
decode step's lanes' slots and positions as device tensors (lane_rows.py), never as shapes, so
sequences joining and leaving never recompile and a decode step's kernels do not grow with its
width; a prefill piece is padded to a fixed size, which compiles to faster kernels than a symbolic
length (bench/RESULTS.md, figures moved out of code comments).

A step with LoRA adapters (some lane's `lora`) runs jits of its own, captured the first time each
shape is asked for (or at warm-up, for adapters loaded by then) with each lane's adapter and scale
as two more device tensors (model/device_lora.py); a step without one runs the plain jits, which
read no adapter.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
from tinygrad import Tensor, UOp, dtypes

from webapp.engine.model.device_lora import DeviceLoraTable
from webapp.engine.model.lanes import Lane, Want
from webapp.engine.model.steps.base import capturing_jit
from webapp.engine.model.steps.jitted import JittedSteps, one_lane

ROWS_PIECE = 32  # a chunk with an image's rows runs as one piece, padded to a power of two from this


class TinygradJitSteps(JittedSteps):
    how = "jitted, on tinygrad"
    takes_inputs = True  # a prompt chunk with rows runs whole (`_prefill_rows`)
    turns_by_sections = True  # an M-RoPE model's jits take each token's three positions (`_turned`)
    picks = True  # a jit of its own a shape ends in the argmax: one id a lane read back, not a row

    def __init__(self, model, prefill_chunk: int):
        super().__init__(model, prefill_chunk)
        self.v_slot = UOp.variable("slot", 0, model.slots)
        self.v_start = UOp.variable("start", 0, model.context - 1)
        self.v_length = UOp.variable("length", 1, model.context)
        self.lora_table = DeviceLoraTable(model)

    def _jit(self, jits: dict, key, forward, lora: list | None, width: int, pick: bool = False) -> tuple:
        """The jit of `forward` for `key` (of its argmax over the vocabulary, `pick`), and the inputs
        that go before its own: none without adapters; with them, the jit that adds each lane's
        (`width` lanes) and their adapters and scales."""
        if pick:
            forward, key = _picking(forward), ("pick", key)
        if lora is None:
            jit = jits.get(key)
            if jit is None:
                jit = jits[key] = capturing_jit(forward)
            return jit, ()
        table, b = self.lora_table, self.buffers
        key = ("lora", table.generation, key)
        jit = jits.get(key)
        if jit is None:
            for stale in [k for k in jits if isinstance(k, tuple) and k[0] == "lora" and k[1] != table.generation]:
                del jits[stale]  # captured over stacks the table no longer uses

            def adapted(adapters: Tensor, scales: Tensor, *args):
                with table.lanes(adapters, scales):
                    return forward(*args)

            jit = jits[key] = capturing_jit(adapted)
        lanes = list(lora) + [None] * (width - len(lora))
        adapters = b.fill("lora adapters", [0 if lane is None else lane[0] for lane in lanes], dtypes.int32)
        scales = b.fill("lora scales", [0.0 if lane is None else lane[1] for lane in lanes], dtypes.float32)
        return jit, (adapters, scales)

    def run(self, lanes: list[Lane]) -> list[np.ndarray]:
        if len(lanes) == 1 and lanes[0].inputs:
            return [self._prefill_rows(lanes[0])]
        return super().run(lanes)

    def _prefill_rows(self, lane: Lane) -> np.ndarray:
        """A prompt chunk holding rows in place of embeddings (an image's) as one jitted piece, so an
        image attended both ways sees all of itself: padded to a power of two (a multiple of
        ROWS_PIECE near the context's end, where the cache's spare positions end), a jit a size."""
        if lane.want not in (Want.LAST, Want.TOKEN) or lane.decoding:
            raise NotImplementedError("rows in place of embeddings run in a prompt chunk wanting its last logits or pick")
        n, start, b = len(lane.tokens), lane.start, self.buffers
        spare = self.model.key_positions.shape[0] - start  # positions the cache holds from `start`
        piece = max(ROWS_PIECE, 1 << (n - 1).bit_length())
        piece = piece if piece <= spare else -(-n // ROWS_PIECE) * ROWS_PIECE
        tokens, last_keys = list(lane.tokens) + [0] * (piece - n), list(range(start, start + piece))
        width = self.model.config.dim * (1 + self.model.config.deepstack_layers)  # an image row, its deepstack parts after it
        inputs, given = np.zeros((1, piece, width), np.float32), np.zeros((1, piece, 1), np.float32)
        for offset, rows in lane.inputs:
            end = offset + len(rows)
            inputs[0, offset:end], given[0, offset:end], tokens[offset:end] = rows, 1.0, [0] * len(rows)
            if lane.inputs_both_ways:
                last_keys[offset:end] = [start + end - 1] * len(rows)
        forward, pick = self.model.forward_prefill_rows, lane.want is Want.TOKEN
        jit, adapted = self._jit(self._prefill_jits, ("rows", piece), forward, one_lane(lane.lora), 1, pick)
        args = [
            *adapted,
            b.fill("rows tokens", [tokens], dtypes.int32),
            b.fill("rows last", [[float(i == n - 1) for i in range(piece)]], dtypes.float32),
        ]
        args += [b.fill("rows inputs", inputs, dtypes.float32), b.fill("rows given", given, dtypes.float32)]
        args += [b.fill("rows last keys", last_keys, dtypes.int32)]
        out = b.read(jit(*args, self.v_slot.bind(lane.slot), self.v_start.bind(start), *self._turned(start, piece, lane.rope_positions)), 1)
        return out if pick else out[0]  # a pick (1,), or the row

    def _turned(self, start: int, piece: int, turned: np.ndarray | None) -> tuple:
        """An M-RoPE model's jits' last input: (piece, 3) positions, `turned` (3, n) for the first n
        tokens where given, each padding token's own position thrice; nothing for other models."""
        if self.model.section_rows is None:
            return ()
        rows = np.repeat(np.arange(start, start + piece, dtype=np.int32)[:, None], 3, axis=1)
        if turned is not None:
            rows[: turned.shape[1]] = np.asarray(turned, dtype=np.int32).T
        return (self.buffers.fill(f"turned {piece}", rows, dtypes.int32),)

    def _prefill_piece(
        self, tokens: list[int], slot: int, start: int, piece: int, lora=None, pick: bool = False, turned: np.ndarray | None = None
    ) -> np.ndarray:
        n, b = len(tokens), self.buffers
        assert 0 < n <= piece
        jit, adapted = self._jit(self._prefill_jits, piece, self.model.forward_prefill, one_lane(lora), 1, pick)
        last = b.fill("prefill last", [[float(i == n - 1) for i in range(piece)]], dtypes.float32)
        padded = b.fill("prefill tokens", [tokens + [0] * (piece - n)], dtypes.int32)
        out = b.read(jit(*adapted, padded, last, self.v_slot.bind(slot), self.v_start.bind(start), *self._turned(start, piece, turned)), 1)
        return out if pick else out[0]  # a pick (1,), or the row

    def _hidden_piece(self, tokens: list[int], slot: int, start: int, piece: int, lora=None) -> np.ndarray:
        n = len(tokens)
        padded = Tensor(np.array([tokens + [0] * (piece - n)], dtype=np.int32))
        lanes = (Tensor([lora[0]], dtype=dtypes.int32), Tensor([lora[1]], dtype=dtypes.float32)) if lora else None
        with self.lora_table.lanes(*lanes) if lanes else nullcontext():
            return self.model.hidden_prefill(padded, self.v_slot.bind(slot), self.v_start.bind(start)).numpy()[:n]

    def _decode_width(
        self, tokens: list[int], slots: list[int], positions: list[int], width: int, lora=None, pick: bool = False, turned=None
    ) -> np.ndarray:
        n, b = len(tokens), self.buffers
        assert 0 < n <= width
        pad = width - n
        tokens, slots, positions = tokens + [0] * pad, slots + [self.model.slots] * pad, positions + [0] * pad
        jit, adapted = self._jit(self._decode_jits, width, self.model.forward_decode, lora, width, pick)
        assert all(0 <= s <= self.model.slots for s in slots) and all(0 <= p < self.model.context for p in positions)
        tokens_in = b.fill("decode tokens", tokens, dtypes.int32)
        positions_in = b.fill("decode positions", positions, dtypes.int32)
        slots_in = b.fill("decode slots", slots, dtypes.int32)
        lanes = [[p] * 3 if at is None else list(at[:, 0]) for p, at in zip(positions, (turned or []) + [None] * width)]  # M-RoPE's, a lane
        rope = (b.fill("decode turned", lanes, dtypes.int32),) if self.model.section_rows is not None else ()
        return b.read(jit(*adapted, tokens_in, positions_in, slots_in, self.v_length.bind(max(positions) + 1), *rope), n)

    def warm_variants(self) -> list[tuple[tuple[int, float] | None, bool]]:
        """The steps that pick too, and, with adapters loaded with the model, theirs: compiled now, not on a first request."""
        adapted = [((0, 0.0), False), ((0, 0.0), True)] if self.lora_table.loaded else []
        return [(None, False), (None, True), *adapted]


def _picking(forward):
    """`forward`, its logits (lanes, vocab) turned into each lane's argmax, int32 (lanes,)."""

    def picked(*args):
        return forward(*args).argmax(-1).cast(dtypes.int32).realize()

    return picked
