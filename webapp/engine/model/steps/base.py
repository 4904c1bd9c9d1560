"""What every way of running a step offers, and the two things they share: the prefix copy between
slots and a jit that captures on its first call.

Contract (`Steps`): `run(lanes)` runs one step of ragged lanes (lanes.py: each a sequence's tokens in
its slot from a position, and what it wants back) and returns each lane's output in order: the last
token's logits (vocab,), every token's (len(tokens), vocab), or every token's final norm output
(len(tokens), dim); each equal to what running the lane alone gives, and a prompt position's logits
equal to what generating it gives. What lanes one step may hold is the strategy's capabilities:
`mixes`, prompt chunks beside decode lanes (else a step is one prompt chunk, or decode lanes of one
token each); `speculates`, verifications (a decoding lane with drafted tokens: only where it is set;
no more drafted tokens a step than `drafted_limit` where one is set), after which `kept(slot, n)`
says how many of the slot's lanes were kept (a recurrent state then goes on from the nth, not from
the last); `pages`, the cache is a paged pool whose blocks `block_rows` and `write_block_rows` move
(the prefix store's contract); `spare_rows`, rows of recurrent state for drafted tokens (None: no
recurrent layers); `picks`, a lane may want TOKEN (lanes.py: the argmax picked where the logits
are, so a device's step reads back token ids, not rows; elsewhere the runner asks for LAST and
picks on the host). `prefill`, `decode`, `score`, `hidden`, `verify`, `prefill_and_decode` and
`prefill_and_verify` are `run` by shape, for the draft model, tests and benches. `takes_inputs`: a
prompt lane's `inputs` (rows fed in place of token embeddings: an image's) are honoured; elsewhere
such a lane is refused. `lora_table`: where set (kernels/lora_table.py, model/device_lora.py), a
lane's `lora` adapter adds its low-rank products to the lane's; elsewhere a lane with one is
refused. `copy_prefix(source, target, length)` copies K/V rows between slots; `warm_up(progress)` compiles what the steps will run
(and, where `speculates`, times `verify_seconds`, what drafted lanes cost: decoding/drafts.py). `how`
says in words how a step runs, for the start-up log; `tunable` is whether tinygrad's BEAM search
(`make tune`) can change any kernel a step runs. All outputs are float32 NumPy arrays.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tinygrad import Device, TinyJit, UOp

from webapp.engine.model.lanes import Lane, Want, decode_lanes

Chunk = tuple[list[int], int, int]  # prompt tokens, slot, start position


class Steps:
    how: str = ""
    tunable: bool = True
    mixes: bool = False  # a step may hold prompt chunks beside decode lanes
    speculates: bool = False  # `verify` runs drafted tokens as lanes whose logits equal a lone decode's
    drafted_limit: int | None = None  # the drafted tokens a verification may hold (None: the lanes bound them)
    verify_seconds: list[float] | None = None  # `verify` of 1, 2, .. lanes of one sequence, timed at warm-up
    spare_rows: range | None = None  # rows of recurrent state for drafted tokens (None: no recurrent layers)
    pages: bool = False  # the KV cache is a paged pool's blocks, read through block tables, and `block_rows` moves them
    takes_inputs: bool = False  # a lane's `inputs` rows replace its tokens' embeddings (images)
    turns_by_sections: bool = False  # a lane's `rope_positions` turn its tokens (M-RoPE models' images)
    picks: bool = False  # a lane may want TOKEN: its last logits' argmax, picked in the step
    lora_table = None  # the adapters a lane's `lora` names (a LoraTable or DeviceLoraTable), where lanes take them

    def __init__(self, model):
        self.model = model
        self._prefix_copy = PrefixCopy(model)

    def run(self, lanes: list[Lane]) -> list[np.ndarray]:
        raise NotImplementedError

    # `run` by shape: one lane or one kind of step at a time
    def prefill(self, tokens: list[int], slot: int, start: int) -> np.ndarray:
        """A prompt chunk into `slot` from `start`: its last token's logits (vocab,)."""
        return self.run([Lane(slot, start, tokens)])[0]

    def score(self, tokens: list[int], slot: int, start: int) -> np.ndarray:
        """A prompt chunk's every token's logits (len(tokens), vocab), as generating them would give."""
        return self.run([Lane(slot, start, tokens, Want.ALL)])[0]

    def hidden(self, tokens: list[int], slot: int, start: int) -> np.ndarray:
        """A prompt chunk's every token's final norm output (len(tokens), dim)."""
        return self.run([Lane(slot, start, tokens, Want.HIDDEN)])[0]

    def decode(self, tokens: list[int], slots: list[int], positions: list[int]) -> np.ndarray:
        """Each lane's one token at its position: (len(tokens), vocab)."""
        return np.stack(self.run(decode_lanes(tokens, slots, positions)))

    def verify(self, lanes: list[list[int]], slots: list[int], positions: list[int]) -> list[np.ndarray]:
        """Lane i's tokens (a decoding sequence's, then its drafts) at positions[i].. of slots[i]:
        every token's logits, (len(lane), vocab) a lane."""
        return self.run([Lane(s, p, lane, Want.ALL, decoding=True) for lane, s, p in zip(lanes, slots, positions, strict=True)])

    def prefill_and_decode(
        self, chunks: list[Chunk], decoding: list[int], slots: list[int], positions: list[int]
    ) -> tuple[list[np.ndarray], np.ndarray]:
        """Prompt chunks (tokens, slot, start) and a decode step as one step: each chunk's last
        token's logits, and the decode lanes' (len(decoding), vocab)."""
        out = self.run([Lane(slot, start, tokens) for tokens, slot, start in chunks] + decode_lanes(decoding, slots, positions))
        rows = out[len(chunks) :]
        return out[: len(chunks)], np.stack(rows) if rows else np.zeros((0, self.model.config.vocab_size), np.float32)

    def prefill_and_verify(
        self, chunks: list[Chunk], lanes: list[list[int]], slots: list[int], positions: list[int]
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """`prefill_and_decode` with `verify`'s lanes instead of one-token ones."""
        verifying = [Lane(s, p, lane, Want.ALL, decoding=True) for lane, s, p in zip(lanes, slots, positions, strict=True)]
        out = self.run([Lane(slot, start, tokens) for tokens, slot, start in chunks] + verifying)
        return out[: len(chunks)], out[len(chunks) :]

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Copy the K/V of positions 0..length-1 from slot `source` to slot `target`, every layer."""
        self._prefix_copy(source, target, length)

    def kept(self, slot: int, lanes: int) -> None:
        """The first `lanes` of `slot`'s lanes in the last verification were kept: the cache holds what
        they wrote, and what later lanes wrote is written again before it is read."""

    def copy_state(self, source: int, target: int) -> None:
        """Copy every recurrent layer's state from row `source` to row `target` of its cache (a slot's
        row, or a snapshot's after the slots' and the scratch one: gated_delta.GatedDeltaNet)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no recurrent state")

    def warm_up(self, progress: Callable[[str], None]) -> None:
        raise NotImplementedError

    # where `pages`: a paged pool's blocks as arrays, every layer's (serving/prefix_store.py saves and restores them)
    def block_row_shapes(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """Each layer's rows of one block: (k|v, kv heads, positions, row) and their dtype."""
        raise NotImplementedError(f"{type(self).__name__} keeps no paged pool")

    def block_rows(self, blocks: list[int]) -> list[np.ndarray]:
        """A copy of the given blocks' rows, a (len(blocks), *shape) array a layer."""
        raise NotImplementedError(f"{type(self).__name__} keeps no paged pool")

    def write_block_rows(self, blocks: list[int], rows: list[np.ndarray]) -> None:
        """Write `rows` (as `block_rows` gives them) into the given blocks."""
        raise NotImplementedError(f"{type(self).__name__} keeps no paged pool")


class PrefixCopy:
    """Slot-to-slot K/V copies as one captured tinygrad step, whichever way the model's steps run."""

    def __init__(self, model):
        self.model = model
        self.v_source = UOp.variable("source", 0, model.slots)
        self.v_target = UOp.variable("slot", 0, model.slots)
        self.v_length = UOp.variable("length", 1, model.context)
        self._jit: TinyJit | None = None
        # the CPU kernels' steps read the caches outside tinygrad's queue: they must see the copy done
        self.synchronize = False

    def __call__(self, source: int, target: int, length: int) -> None:
        assert source != target and 0 < length <= self.model.context
        if self._jit is None:
            self._jit = capturing_jit(self.model.copy_prefix_rows)
        self._jit(self.v_source.bind(source), self.v_target.bind(target), self.v_length.bind(length))
        if self.synchronize:
            Device[Device.DEFAULT].synchronize()


def capturing_jit(fn) -> TinyJit:
    """A TinyJit that captures on its first call. By default it first runs once eagerly, which
    schedules and compiles the whole step only for the capture to do it again: skipping that run
    takes that scheduling and compiling off warm-up (bench/RESULTS.md, figures moved out of code
    comments)."""
    jit = TinyJit(fn)
    jit.cnt = 1
    return jit


def prompt_lanes(slot: int, start: int, n: int) -> list[int]:
    """The kernels' lanes for n prompt tokens of `slot` from position `start`: their slots, then their positions."""
    return [slot] * n + list(range(start, start + n))
