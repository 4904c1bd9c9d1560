"""Steps as one direct call into the CPU kernels (`QuantizedCPU.step`, `tq_forward`): the embedding,
every layer and the head, for lanes of any slot and position.

Chosen when the embedding, the head and every layer's products are in blocks the kernels read
(`fits`). Nothing is compiled and nothing padded: a chunk runs as the call it is, and prompt chunks
and decode lanes share one call (`mixes`), which reads the weights once for all of them.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import numpy as np

from webapp.engine.device.buffers import host_view
from webapp.engine.kernels.block_weight import BlockWeight
from webapp.engine.kernels.lora_table import LoraTable
from webapp.engine.model.lanes import Lane, Want
from webapp.engine.model.recurrent_config import draft_state_rows
from webapp.engine.model.steps.base import Steps

# a verification of 1..9 lanes (DRAFT_MAX drafted tokens and the sequence's own), each timed 3 times
# (their median): part of warm-up, longer the larger the model (bench/RESULTS.md, figures moved
# out of code comments)
VERIFY_LANES, TIMED_VERIFICATIONS = 9, 3
WARM_UP_TOKENS = 32  # one prompt piece: the first user's step then finds every weight page mapped in


class OneCallSteps(Steps):
    how = "one call each on the CPU kernels"
    tunable = False  # no tinygrad kernel runs in a step
    mixes = True
    speculates = True  # a lane's numbers never depend on the step's other lanes
    takes_inputs = True  # tq_forward embeds a negative token as a row of its inputs
    turns_by_sections = True  # a lane's rope_positions turn it (M-RoPE: ATTEND_ROPE_POSITIONS)

    @staticmethod
    def fits(model) -> bool:
        embed, head = getattr(model.embed, "weight", None), getattr(model.head, "weight", None)
        layers = [block.layer_tensors for block in model.blocks]
        return model.kernels is not None and isinstance(embed, BlockWeight) and isinstance(head, BlockWeight) and None not in layers

    def __init__(self, model):
        super().__init__(model)
        self.kernels = model.kernels
        layers = [block.layer_tensors for block in model.blocks]
        self.whole_model = self.kernels.whole_model(
            model.embed.weight,
            model.output_norm,
            model.head.weight,
            model.inv_freq,
            layers,
            model.config.norm_eps,
            inv_freq_local=model.inv_freq_local,
            embed_scale=model.config.embed_scale,
            block_tables=model.block_table,
            block_positions=0 if model.pool is None else model.pool.block_positions,
            rope_sections=model.rope_sections,
            deepstack=model.config.deepstack_layers,
        )
        self._prefix_copy.synchronize = True
        # the recurrent layers' caches as (rows, state floats) over their memory: a state's copy is a
        # memcpy the kernels see at once (the model thread runs both, one after the other)
        self._states = [host_view(b.cache).reshape(b.cache.shape[1], -1) for b in model.blocks if b.recurrent]
        # a recurrent state takes in every token a step feeds: drafted tokens run in rows of their own,
        # and a verification's kept lanes leave the state of the last of them (`kept`)
        self.spare_rows = draft_state_rows(model.slots) if self._states else None
        self.drafted_limit = None if self.spare_rows is None else len(self.spare_rows)
        self._lane_rows: dict[int, list[int]] = {}  # slot -> its lanes' rows in the last verification
        self.lora_table = LoraTable(len(model.blocks))

    @property
    def pages(self) -> bool:
        return self.model.pool is not None

    def block_row_shapes(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        return [((c.shape[0], *c.shape[2:]), c.dtype) for c in map(host_view, self._caches())]

    def block_rows(self, blocks: list[int]) -> list[np.ndarray]:
        return [np.moveaxis(host_view(c)[:, blocks], 1, 0) for c in self._caches()]

    def write_block_rows(self, blocks: list[int], rows: list[np.ndarray]) -> None:
        for cache, values in zip(self._caches(), rows, strict=True):
            host_view(cache)[:, blocks] = np.moveaxis(values, 0, 1)

    def _caches(self):
        assert self.model.pool is not None, "a paged cache's blocks"
        return [block.cache for block in self.model.blocks]

    def copy_state(self, source: int, target: int) -> None:
        assert self._states and source != target
        for rows in self._states:
            rows[target] = rows[source]

    def kept(self, slot: int, lanes: int) -> None:
        rows = self._lane_rows.pop(slot, None)
        if rows is not None and lanes > 1:  # one lane kept: it ran in the slot's own row
            self.copy_state(rows[lanes - 1], slot)

    def _state_rows(self, lanes: list[Lane]) -> list[int] | None:
        """Each token's row of recurrent state in a step with a verification: a prompt chunk's tokens
        and a drafted lane's first token in their slots' rows, each drafted token in a draft row of
        its own; None for a model without recurrent layers."""
        if self.spare_rows is None:
            return None
        assert sum(len(lane.tokens) - 1 for lane in lanes if lane.drafted) <= len(self.spare_rows), "drafted_limit"
        self._lane_rows.clear()
        free, rows = iter(self.spare_rows), []
        for lane in lanes:
            if lane.drafted:
                self._lane_rows[lane.slot] = [lane.slot, *(next(free) for _ in lane.tokens[1:])]
                rows += self._lane_rows[lane.slot]
            else:
                rows += [lane.slot] * len(lane.tokens)
        return rows

    def _step(
        self,
        tokens: list[int],
        lanes: list[int],
        picks: list[int],
        state_rows: list[int] | None = None,
        resume: bool = False,
        inputs: np.ndarray | None = None,
        lora: int = 0,
        last_keys: list[int] | None = None,
        rope_positions: np.ndarray | None = None,
    ) -> np.ndarray:
        return self.kernels.step(
            self.whole_model,
            tokens,
            lanes,
            picks,
            state_rows=state_rows,
            resume_rows=resume,
            inputs=inputs,
            lora=lora,
            last_keys=last_keys,
            rope_positions=rope_positions,
        )

    def run(self, lanes: list[Lane]) -> list[np.ndarray]:
        """One call for every lane: their tokens one after another, each token's slot and position,
        and the outputs each lane wants picked from them. Every lane's keys are written before any
        lane attends, and lanes never mix."""
        assert lanes and all(lane.tokens for lane in lanes) and len({lane.slot for lane in lanes}) == len(lanes)
        assert all(lane.start + len(lane.tokens) <= self.model.context for lane in lanes)
        tokens, slots, positions, picks, inputs, given, adapters, scales = [], [], [], [], [], 0, [], []
        last_keys = [] if any(lane.inputs_both_ways and lane.inputs for lane in lanes) else None
        turned = [] if any(lane.rope_positions is not None for lane in lanes) else None
        for lane in lanes:
            first, n = len(tokens), len(lane.tokens)
            tokens += lane.tokens
            slots += [lane.slot] * n
            positions += range(lane.start, lane.start + n)
            if turned is not None:  # M-RoPE's three positions a token: a lane without its own turns as text
                turned.append(lane.rope_positions if lane.rope_positions is not None else np.tile(positions[first:], (3, 1)))
            if last_keys is not None:
                last_keys += positions[first:]
            for offset, rows in lane.inputs:  # fed as -1 - their row in `inputs` (tq_forward)
                tokens[first + offset : first + offset + len(rows)] = range(-1 - given, -1 - given - len(rows), -1)
                inputs.append(rows)
                given += len(rows)
                if lane.inputs_both_ways:  # every position of the run sees its last
                    last_keys[first + offset : first + offset + len(rows)] = [lane.start + offset + len(rows) - 1] * len(rows)
            picks += [first + n - 1] if lane.want is Want.LAST else range(first, first + n)
            adapter, scale = lane.lora or (-1, 0.0)
            adapters += [adapter] * n
            scales += [scale] * n
        lora = self.lora_table.address(np.array(adapters, np.int32), np.array(scales, np.float32))
        given = {"inputs": _rows(inputs), "lora": lora, "last_keys": last_keys}
        given["rope_positions"] = None if turned is None else np.concatenate(turned, axis=1)
        if any(lane.want is Want.HIDDEN for lane in lanes):  # the final norm's outputs, for a whole call only
            assert len(lanes) == 1 and lanes[0].want is Want.HIDDEN, "a hidden lane runs alone"
            return [self.kernels.step(self.whole_model, tokens, slots + positions, picks, hidden=True, **given)]
        state_rows = self._state_rows(lanes) if any(lane.drafted for lane in lanes) else None
        out = self._step(tokens, slots + positions, picks, state_rows, **given)
        ends = list(itertools.accumulate(lane.picked for lane in lanes))
        return [out[end - 1] if lane.want is Want.LAST else out[end - lane.picked : end] for lane, end in zip(lanes, ends)]

    def decode_in_rows(self, tokens: list[int], slots: list[int], positions: list[int], rows: list[int], resume: bool) -> np.ndarray:
        """`decode` with lane i's recurrent state in row rows[i] (of `spare_rows`), its slot's row left
        as it is: taken from the slot's row, or with `resume` going on from what the row holds (a
        draft model's tokens, each fed after the one before, that the slot must not take in)."""
        assert tokens and len(rows) == len(tokens) == len(set(rows)) and set(rows) <= set(self.spare_rows)
        return self._step(tokens, slots + positions, list(range(len(tokens))), rows, resume)

    def _time_verifications(self, scratch: int) -> list[float] | None:
        """A verification of 1..VERIFY_LANES lanes of one sequence on the scratch slot (after the warm-up
        prompt), what a drafted lane costs on this model and machine; None where the context has no
        room for two."""
        drafted = self.drafted_limit if self.drafted_limit is not None else VERIFY_LANES
        lanes = min(VERIFY_LANES, self.model.context - WARM_UP_TOKENS, 1 + drafted)
        if lanes < 2:
            return None
        self.verify([[0] * lanes], [scratch], [WARM_UP_TOKENS])  # the first call of this width sizes its buffers
        return [_median_seconds(lambda n=n: self.verify([[0] * n], [scratch], [WARM_UP_TOKENS])) for n in range(1, lanes + 1)]

    def warm_up(self, progress: Callable[[str], None]) -> None:
        scratch = self.model.slots
        progress("warm-up: nothing to compile (steps are one call each on the CPU kernels); one step reads every weight once")
        self.prefill([0] * WARM_UP_TOKENS, scratch, 0)
        self.decode([0], [scratch], [0])
        self.verify_seconds = self._time_verifications(scratch)
        if self.verify_seconds:
            costs = " ".join(f"{t / self.verify_seconds[0]:.2f}" for t in self.verify_seconds)
            progress(f"a verification of 1..{len(self.verify_seconds)} lanes costs {costs} one-lane steps (how long drafts pay)")
        if self.model.pool is not None:
            return  # a paged cache shares blocks: no prefix is ever copied (the scratch row writes the stray-write block)
        for _ in range(2):  # the prefix copy's jit captures on the first call; the second checks the replay
            self.copy_prefix(0, scratch, 1)


def _rows(inputs: list[np.ndarray]) -> np.ndarray | None:
    return np.concatenate(inputs) if inputs else None


def _median_seconds(run, times: int = TIMED_VERIFICATIONS) -> float:
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)
