"""What a whole step (tq_forward) reads beside its tokens, checked before C reads it without bounds.

`lane_values(slots, positions, state_rows, last_keys, rope_positions)` lays out the `lanes` int32
rows that tq.h describes: each lane's slot and position, then (where given) its row of recurrent
state, the last key it attends (ATTEND_KEYS_AHEAD) and the three positions its M-RoPE sections turn
by (ATTEND_ROPE_POSITIONS). `checked_inputs(ids, inputs, dim)` returns the rows negative ids
name as C-contiguous float32, or raises ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def lane_values(
    slots: Sequence[int],
    positions: Sequence[int],
    state_rows: Sequence[int] | None = None,
    last_keys: Sequence[int] | None = None,
    rope_positions: np.ndarray | None = None,
) -> np.ndarray:
    """The lanes' rows; ValueError where a last key is before its lane's position or past every
    position its slot's lanes write in this step (C would read a key nothing wrote). `rope_positions`
    (3, B): the rows ATTEND_ROPE_POSITIONS reads after a third and a fourth row."""
    rows = [slots, positions]
    if state_rows is not None or last_keys is not None or rope_positions is not None:
        rows.append(state_rows if state_rows is not None else [0] * len(slots))
    if last_keys is not None:
        written: dict[int, int] = {}
        for slot, position in zip(slots, positions, strict=True):
            written[slot] = max(written.get(slot, position), position)
        if any(not p <= k <= written[s] for s, p, k in zip(slots, positions, last_keys, strict=True)):
            raise ValueError("a lane's last key lies before its position or past what its slot's lanes write")
        rows.append(last_keys)
    if rope_positions is not None:
        turned = np.asarray(rope_positions)
        if turned.shape != (3, len(slots)) or not np.issubdtype(turned.dtype, np.integer) or (turned < 0).any():
            raise ValueError(f"RoPE positions must be (3, {len(slots)}) integers of 0 or more, not {turned.dtype} {turned.shape}")
        if last_keys is None:
            rows.append(positions)  # the fourth row, unread without keys ahead
        rows += list(turned)
    return np.ascontiguousarray(np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]), dtype=np.int32)


def checked_inputs(ids: np.ndarray, inputs: np.ndarray | None, dim: int) -> np.ndarray | None:
    """`inputs` as C-contiguous float32 rows that every negative id names, or ValueError: the C side
    copies row -1 - id without a bound."""
    if inputs is None:
        if (ids < 0).any():
            raise ValueError("a negative token id names a row of inputs, and none were given")
        return None
    given = np.ascontiguousarray(inputs, dtype=np.float32)
    if given.ndim != 2 or given.shape[1] != dim or (ids < -len(given)).any():
        raise ValueError(f"inputs of shape {given.shape} for negative ids down to {ids.min()} (rows of {dim})")
    return given
