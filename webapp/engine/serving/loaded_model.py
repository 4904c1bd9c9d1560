"""What loading a model yields, as the engine sees it: a runner that runs the model, the file's
tokenizer and chat template, its name, context and device. Defined on the engine's side so that
the engine needs no import of the loader (which builds engines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from webapp.engine.model.runner import Runner
    from webapp.engine.serving.kv_cache import RingRows


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
    # the KV cache's rows (LLM_KV_TYPE) and what one token takes in it, every layer's key and value
    kv_type: str = "f16"
    kv_bytes_per_token: int = 0
    embedding_suffix: tuple[int, ...] = ()
    # a mixture of experts': how many lanes each expert has taken since load, (layers, experts), where
    # the kernels count them (Transformer.routed_tokens)
    routed_tokens: Callable[[], np.ndarray | None] | None = None
    # a sliding-window model's rings: which cached prefixes a slot still serves (Transformer.ring_rows)
    ring_rows: RingRows | None = None
