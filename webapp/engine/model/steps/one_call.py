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
from webapp.engine.model.recurrent_config import draft_state_rows
from webapp.engine.model.steps.base import Chunk, Steps, prompt_lanes

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

    def _state_rows(self, chunk_slots: list[int], lane_chunks: list[Chunk]) -> list[int] | None:
        """Each token's row of recurrent state in a verification: prompt chunks' tokens (their slots:
        `chunk_slots`) and a drafted lane's first token in their slots' rows, each drafted token in
        a draft row of its own; None for a model without recurrent layers."""
        if self.spare_rows is None:
            return None
        assert sum(len(lane) - 1 for lane, _, _ in lane_chunks) <= len(self.spare_rows), "drafted_limit"
        self._lane_rows.clear()
        free, rows = iter(self.spare_rows), list(chunk_slots)
        for lane, slot, _ in lane_chunks:
            self._lane_rows[slot] = [slot, *(next(free) for _ in lane[1:])]
            rows += self._lane_rows[slot]
        return rows

    def _step(
        self, tokens: list[int], lanes: list[int], picks: list[int], state_rows: list[int] | None = None, resume: bool = False
    ) -> np.ndarray:
        return self.kernels.step(self.whole_model, tokens, lanes, picks, state_rows=state_rows, resume_rows=resume)

    def prefill(self, tokens: list[int], slot: int, start: int) -> np.ndarray:
        n = len(tokens)
        assert n > 0 and start + n <= self.model.context
        return self._step(tokens, prompt_lanes(slot, start, n), [n - 1])[0]

    def decode(self, tokens: list[int], slots: list[int], positions: list[int]) -> np.ndarray:
        assert tokens
        return self._step(tokens, slots + positions, list(range(len(tokens))))

    def decode_in_rows(self, tokens: list[int], slots: list[int], positions: list[int], rows: list[int], resume: bool) -> np.ndarray:
        """`decode` with lane i's recurrent state in row rows[i] (of `spare_rows`), its slot's row left
        as it is: taken from the slot's row, or with `resume` going on from what the row holds (a
        draft model's tokens, each fed after the one before, that the slot must not take in)."""
        assert tokens and len(rows) == len(tokens) == len(set(rows)) and set(rows) <= set(self.spare_rows)
        return self._step(tokens, slots + positions, list(range(len(tokens))), rows, resume)

    def score(self, tokens: list[int], slot: int, start: int) -> np.ndarray:
        """One call: every token's logits, as generating them would give."""
        n = len(tokens)
        assert tokens and start + n <= self.model.context
        return self._step(tokens, prompt_lanes(slot, start, n), list(range(n)))

    def hidden(self, tokens: list[int], slot: int, start: int) -> np.ndarray:
        """One call: every token's final norm output (len(tokens), dim)."""
        n = len(tokens)
        assert tokens and start + n <= self.model.context
        return self.kernels.step(self.whole_model, tokens, prompt_lanes(slot, start, n), list(range(n)), hidden=True)

    def verify(self, lanes: list[list[int]], slots: list[int], positions: list[int]) -> list[np.ndarray]:
        """One call: lane i's tokens at positions[i].. of slots[i], every token's logits (len(lane), vocab)
        each; a token's keys are written before any lane attends, as in a prompt chunk."""
        chunks = list(zip(lanes, slots, positions, strict=True))
        assert lanes and all(lanes) and len(set(slots)) == len(slots)
        assert all(start + len(lane) <= self.model.context for lane, _, start in chunks)
        tokens, lane_slots, lane_positions = _chunk_lanes(chunks)
        logits = self._step(tokens, lane_slots + lane_positions, list(range(len(tokens))), self._state_rows([], chunks))
        return np.split(logits, np.cumsum([len(lane) for lane in lanes])[:-1])

    def prefill_and_decode(
        self, chunks: list[Chunk], decoding: list[int], slots: list[int], positions: list[int]
    ) -> tuple[list[np.ndarray], np.ndarray]:
        """Prompt chunks (tokens, slot, start), each as `prefill` runs it, and `decode(decoding, slots,
        positions)` as one call: each chunk's last token's logits (vocab,), and the decode lanes'
        (len(decoding), vocab). A lane's numbers are those of a call of its own: every lane's keys are
        written before any lane attends, and lanes never mix. Each chunk's slot is its own."""
        chunk_slots = [slot for _, slot, _ in chunks]
        assert chunks and all(t for t, _, _ in chunks) and len(set(chunk_slots + slots)) == len(chunk_slots + slots)
        tokens, lane_slots, lane_positions = _chunk_lanes(chunks)
        picks = [end - 1 for end in itertools.accumulate(len(chunk) for chunk, _, _ in chunks)]  # each chunk's last token
        picks += range(len(tokens), len(tokens) + len(decoding))
        logits = self._step(tokens + decoding, lane_slots + slots + lane_positions + positions, picks)
        return list(logits[: len(chunks)]), logits[len(chunks) :]

    def prefill_and_verify(
        self, chunks: list[Chunk], lanes: list[list[int]], slots: list[int], positions: list[int]
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """`prefill_and_decode` with drafted tokens: lane i's tokens at positions[i].. of slots[i], as
        `verify` runs them, beside the prompt chunks in one call; each chunk's last token's logits, and
        every lane token's (len(lane), vocab) per lane."""
        assert chunks and lanes and len(set([slot for _, slot, _ in chunks] + slots)) == len(chunks) + len(slots)
        lane_chunks = list(zip(lanes, slots, positions, strict=True))
        tokens, lane_slots, lane_positions = _chunk_lanes(chunks + lane_chunks)
        lasts = [end - 1 for end in itertools.accumulate(len(chunk) for chunk, _, _ in chunks)]
        state_rows = self._state_rows(lane_slots[: lasts[-1] + 1], lane_chunks)
        logits = self._step(tokens, lane_slots + lane_positions, lasts + list(range(lasts[-1] + 1, len(tokens))), state_rows)
        return list(logits[: len(chunks)]), np.split(logits[len(chunks) :], np.cumsum([len(lane) for lane in lanes])[:-1])

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


def _median_seconds(run, times: int = TIMED_VERIFICATIONS) -> float:
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _chunk_lanes(chunks: list[Chunk]) -> tuple[list[int], list[int], list[int]]:
    """Chunks (tokens, slot, start) as the kernels' lanes: every chunk's tokens in turn, each token's
    slot, each token's position."""
    tokens, slots, positions = [], [], []
    for chunk, slot, start in chunks:
        tokens += chunk
        slots += [slot] * len(chunk)
        positions += range(start, start + len(chunk))
    return tokens, slots, positions
