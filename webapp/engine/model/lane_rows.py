"""A decode step's lanes in a cache of slots, each lane's slot and position given as device tensors:
a step's kernels are then the same whatever its width, and one captured graph serves any mix of
slots and positions without binding a variable per lane.

Contract: a cache is (kinds, slots + 1, heads, positions, row) (attention.py states what each axis
holds). `write_lane_rows(cache, rows, slots, positions)` writes rows (kinds, W, heads, row) at each
lane's slot and position, one kernel, and returns the cache after the write; `lane_rows(cache, kind,
slots, length, group)` is (W, heads, group, length, row), each lane's slot's first `length`
positions, an indexed read that tinygrad folds into whatever kernel consumes it (no copy of the rows). Lanes padding a step
share the scratch slot: their writes land there, whatever they hold.
"""

from __future__ import annotations

from tinygrad import Tensor, UOp, dtypes
from tinygrad.uop.ops import KernelInfo


def _write_kernel(kinds: int, slots: int, heads: int, positions: int, row: int, width: int):
    def write(cache: UOp, rows: UOp, lane_slots: UOp, lane_positions: UOp) -> UOp:
        target, source = cache.flatten(), rows.flatten()
        kind, lane, head, value = (UOp.range(n, axis) for axis, n in enumerate((kinds, width, heads, row)))
        slot, position = lane_slots[lane].cast(dtypes.weakint), lane_positions[lane].cast(dtypes.weakint)
        at = (((kind * slots + slot) * heads + head) * positions + position) * row + value
        read = source[((kind * width + lane) * heads + head) * row + value]
        return target[at].store(read).end(kind, lane, head, value).sink(arg=KernelInfo(name=f"lane_rows_{width}"))

    return write


def write_lane_rows(cache: Tensor, rows: Tensor, slots: Tensor, positions: Tensor) -> Tensor:
    """cache (kinds, slots + 1, heads, positions, row) after rows (kinds, W, heads, row) are written at
    (slots[w], positions[w]) for each lane w; slots and positions (W,) int32."""
    kinds, slot_count, heads, position_count, row = cache.shape
    width = rows.shape[1]
    assert rows.shape == (kinds, width, heads, row) and rows.dtype == cache.dtype, (rows.shape, cache.shape)
    write = _write_kernel(kinds, slot_count, heads, position_count, row, width)
    return cache.custom_kernel(rows.contiguous(), slots, positions, fxn=write)[0]


def lane_rows(cache: Tensor, kind: int, slots: Tensor, length: UOp | int, group: int = 1) -> Tensor:
    """(W, heads, group, length, row): the first `length` positions of each lane's slot in cache[kind],
    each head's rows repeated for the `group` query heads that read them. Repeated before the lanes
    are picked: picked rows broadcast afterwards are copied out by tinygrad first, once a layer."""
    kinds, slot_count, heads, positions, row = cache.shape
    repeated = cache[kind].unsqueeze(2).expand(slot_count, heads, group, positions, row)
    return repeated[slots][:, :, :, 0:length, :]
