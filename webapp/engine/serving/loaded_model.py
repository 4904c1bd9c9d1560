"""What loading a model yields, as the engine sees it: a runner that runs the model, the file's
tokenizer and chat template, its name, context and device. Defined on the engine's side so that
the engine needs no import of the loader (which builds engines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from webapp.engine.serving.block_pool import BlockPool
from webapp.engine.serving.kv_cache import RingRows, SlotTable
from webapp.engine.serving.paged_slots import PagedSlots
from webapp.engine.serving.state_snapshots import RecurrentSlots

if TYPE_CHECKING:
    import numpy as np

    from webapp.engine.serving.runner import Runner


@dataclass
class LoadedModel:
    """What loading a model yields; the runner is the only part that runs the model."""

    runner: Runner
    tokenizer: object
    chat_template: object
    name: str
    context: int
    device: str
    # how /v1/embeddings pools a prompt's final norm outputs ("mean", "last" or "first"), and the
    # tokens it appends to each input first (an embedding model's end-of-text, where the file asks)
    pooling: str = "mean"
    width: int = 0  # the model's hidden width: an embedding's values
    # the KV cache's rows (LLM_KV_TYPE) and what one token takes in it, every layer's key and value
    kv_type: str = "f16"
    kv_bytes_per_token: int = 0
    state_bytes: int = 0  # a slot's recurrent states, whatever its length (model/memory.state_bytes)
    state_snapshots: int = 0  # rows of them kept for prefix reuse (recurrent_config.snapshot_rows)
    draft_states: int = 0  # rows of them for drafted tokens (recurrent_config.DRAFT_STATE_ROWS)
    embedding_suffix: tuple[int, ...] = ()
    # a reranker file's head and prompt (serving/ranker.py), else None
    ranker: object = None
    # a mixture of experts': how many lanes each expert has taken since load, (layers, experts), where
    # the kernels count them (Transformer.routed_tokens)
    routed_tokens: Callable[[], np.ndarray | None] | None = None
    # a sliding-window model's rings: which cached prefixes a slot still serves
    ring_rows: RingRows | None = None
    # a paged cache's pool (model/kv_types.KvPool) and the block table its kernels read, else None
    kv_pool: object = None
    block_table: np.ndarray | None = None
    # what `make tune`'s stamp for this configuration is filed under; None where a step runs no
    # tinygrad kernel to tune (model/tuning_stamp.py)
    tuning_key: dict | None = None
    # a projector's side of image input (webapp/engine/vision/vision.py's Vision), else None
    vision: object = None
    # the LoRA adapters requests may choose (serving/adapters.py's Adapters), else None
    adapters: object = None

    def kv_bytes(self, slots: int) -> int:
        """The KV cache when full: the pool's blocks, or `slots` slots and the scratch one at the whole context."""
        if self.kv_pool is not None:
            return self.kv_pool.pool_positions * self.kv_bytes_per_token
        return (slots + 1) * (self.context * self.kv_bytes_per_token + self.state_bytes) + (
            self.state_snapshots + self.draft_states
        ) * self.state_bytes

    def kv_table(self, slots: int) -> SlotTable | PagedSlots:
        """The scheduler's table of what the cache holds: the pool's sequences, or `slots` slots."""
        if self.state_bytes:
            return RecurrentSlots(slots, self.state_snapshots)
        if self.kv_pool is None:
            return SlotTable(slots, self.ring_rows)
        return PagedSlots(BlockPool(self.kv_pool.blocks, self.kv_pool.block_positions), self.block_table)
