"""The KV cache's element types (`LLM_KV_TYPE`): float16 rows, or 8-bit rows in GGUF's Q8_0 blocks.

Contract: `kv_type_named(name)` is the `KvRows` for "f16" or "q8_0" (ValueError naming the setting
otherwise). A cache is (2, slots, kv_heads, positions, `row_width(head_dim)`) of `dtype`, a row
being one position's key or value for one kv head; `row_bytes(head_dim)` is its size, what memory
planning counts. On tinygrad's path `store(x)` turns float keys or values (..., head_dim) into rows
and `load(rows)` reads them back as float32 (..., head_dim); the CPU kernels write and read the same
rows themselves (c/attention.c, c/attention_q8.c), told which by `abi` (tq_attention.kv_type: the
blocks hand it to the kernels beside the cache). `ring_positions(window,
step_writes)` sizes a sliding-window layer's ring, `cache_positions` says whether a layer has one.

Q8_0 rows: head_dim / 32 blocks of a float16 scale d and 32 int8 q (value d * q; d = max |x| / 127,
q = x / d rounded to nearest even), 34 bytes per 32 values against float16's 64: the same cache
memory holds 1.88x the positions. Its cost in fidelity and speed is measured in bench/kv_fidelity.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinygrad import Tensor, dtypes

from webapp.engine.kernels.abi import KEY_CHUNK, Q8_BLOCK, Q8_BLOCK_BYTES, KvType


class KvRows:
    name: str
    abi: KvType
    dtype = dtypes.float16

    def row_width(self, head_dim: int) -> int:
        return head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * self.dtype.itemsize

    def check(self, head_dim: int) -> str | None:
        """Why a model with this head size cannot use these rows, or None."""
        return None

    def store(self, x: Tensor) -> Tensor:
        """Keys or values (..., head_dim) -> rows (..., row_width) of `dtype`."""
        return x.cast(self.dtype)

    def load(self, rows: Tensor) -> Tensor:
        """Rows (..., row_width) -> float32 (..., head_dim)."""
        return rows.float()


class F16Rows(KvRows):
    name, abi = "f16", KvType.F16


class Q8Rows(KvRows):
    name, abi = "q8_0", KvType.Q8_0
    dtype = dtypes.uint8

    def row_width(self, head_dim: int) -> int:
        return head_dim // Q8_BLOCK * Q8_BLOCK_BYTES

    def check(self, head_dim: int) -> str | None:
        if head_dim % Q8_BLOCK:
            return f"LLM_KV_TYPE=q8_0 stores heads in blocks of {Q8_BLOCK} values; this model's heads have {head_dim}"
        return None

    def store(self, x: Tensor) -> Tensor:
        *lead, head_dim = x.shape
        blocks = x.float().reshape(*lead, head_dim // Q8_BLOCK, Q8_BLOCK)  # (..., nb, 32)
        d = blocks.abs().max(-1, keepdim=True) / 127  # (..., nb, 1)
        q = (blocks * (d > 0).where(d.reciprocal(), 0)).round().cast(dtypes.int8).bitcast(dtypes.uint8)
        return d.cast(dtypes.float16).bitcast(dtypes.uint8).cat(q, dim=-1).reshape(*lead, self.row_width(head_dim))

    def load(self, rows: Tensor) -> Tensor:
        # only the row axis splits: the positions' (symbolic) axis stays as it is
        *lead, width = rows.shape
        blocks = rows.reshape(*lead, width // Q8_BLOCK_BYTES, Q8_BLOCK_BYTES)  # (..., nb, 34)
        d = blocks[..., :2].bitcast(dtypes.float16).float()  # (..., nb, 1)
        q = blocks[..., 2:].bitcast(dtypes.int8).float()  # (..., nb, 32)
        return (q * d).reshape(*lead, width // Q8_BLOCK_BYTES * Q8_BLOCK)


KV_TYPES = {rows.name: rows for rows in (F16Rows(), Q8Rows())}


def kv_type_named(name: str) -> KvRows:
    rows = KV_TYPES.get(str(name).lower())
    if rows is None:
        raise ValueError(f"LLM_KV_TYPE={name!r}: one of {', '.join(KV_TYPES)} is expected")
    return rows


# Positions a ring keeps besides a window and a step's writes: how far before the furthest a slot's
# sequence went a later prompt may part from it and still reuse the slot (kv_cache.RingRows).
RING_KEEP = 128
# A step writes at least this many positions to a slot: a verification's drafted lanes (drafts.DRAFT_MAX + 1).
STEP_WRITES_AT_LEAST = 16


def ring_positions(window: int, step_writes: int) -> int:
    """A sliding-window layer's cache positions on the CPU kernels: its window, a step's writes to a
    slot and RING_KEEP, in whole chunks of attention's keys (a chunk's rows never wrap)."""
    return -(-(window + max(step_writes, STEP_WRITES_AT_LEAST) + RING_KEEP) // KEY_CHUNK) * KEY_CHUNK


def cache_positions(window: int, context: int, step_writes: int | None) -> int:
    """A layer's cache positions a slot: the context, or a sliding-window layer's ring where the CPU
    kernels keep one (`step_writes` given) and it is fewer. The blocks and the memory plan both ask here."""
    if not window or step_writes is None:
        return context
    return min(context, ring_positions(window, step_writes))


# A paged cache's positions a block: vLLM's default. Sixteen users of one long system prompt hold it
# once and keep fewer than 16 positions of their own each before their first token; the attention
# kernel walks a chunk's keys block by block in the same order, so its numbers do not depend on it.
BLOCK_POSITIONS = 16


@dataclass(frozen=True)
class KvPool:
    """A paged KV cache (on the CPU kernels, for models whose layers all attend the whole context):
    one pool of `blocks` blocks of `block_positions` positions a layer, shared by `rows` sequences of
    up to `positions` each through a block table (serving/paged_slots.py)."""

    blocks: int
    rows: int
    positions: int
    block_positions: int = BLOCK_POSITIONS

    @property
    def table_width(self) -> int:
        return -(-self.positions // self.block_positions)

    @property
    def pool_positions(self) -> int:
        return self.blocks * self.block_positions
