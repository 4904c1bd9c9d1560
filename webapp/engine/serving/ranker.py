"""A reranker file's scoring: the head that turns a (query, document) prompt's last hidden state into
a relevance score, and the prompt the file asks for.

Contract: `ranker_of(path, kv)` is None unless the file's pooling type is rank (llama.cpp's 4), as
llama.cpp's converter writes Qwen3-Reranker: then `cls.output.weight` (one row per label, "yes" then
"no": the language model head's rows for those tokens) must be there, `cls.output.bias` may be.
`Ranker.score(row)` takes the prompt's last final-norm output and returns the first label's
probability over the labels (softmax) where the file names two or more, else the single raw logit,
as llama-server's /v1/rerank answers. `Ranker.prompt` is the file's `tokenizer.chat_template.rerank`
with `{query}` and `{document}` in it, or None: then the prompt is BOS, the query, the separator
tokens the file asks for, the document (webapp/http/rerank.py builds it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from webapp.engine.model.gguf import float_values, read_gguf
from webapp.engine.model.load_error import ModelLoadError

log = logging.getLogger(__name__)

RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK
MAX_LABELS = 64  # a classifier head of more rows than this is not a reranker's


@dataclass(frozen=True)
class Ranker:
    weight: np.ndarray  # (labels, dim) float32
    bias: np.ndarray | None  # (labels,)
    labels: tuple[str, ...]
    prompt: str | None

    def score(self, row: np.ndarray) -> float:
        logits = self.weight.astype(np.float64) @ np.asarray(row, dtype=np.float64)
        if self.bias is not None:
            logits += self.bias
        if len(logits) == 1:
            return float(logits[0])
        exps = np.exp(logits - logits.max())
        return float(exps[0] / exps.sum())


def ranker_of(path: str, kv: dict, dim: int) -> Ranker | None:
    """The file's rank head, or None where its pooling type is not rank; a rank file whose head is
    missing or malformed raises ModelLoadError (it cannot do the one thing it is for)."""
    arch = kv.get("general.architecture")
    if kv.get(f"{arch}.pooling_type") != RANK_POOLING:
        return None
    _, tensors = read_gguf(path)
    try:
        weight = _values(path, tensors, "cls.output.weight")
        bias = _values(path, tensors, "cls.output.bias") if "cls.output.bias" in tensors else None
    except ValueError as e:
        raise ModelLoadError(f"a reranker file (pooling type rank): {e}") from e
    weight = weight.reshape(1, -1) if weight.ndim == 1 else weight
    if weight.ndim != 2 or weight.shape[1] != dim or not 1 <= weight.shape[0] <= MAX_LABELS:
        raise ModelLoadError(f"cls.output.weight has shape {weight.shape}; a reranker's is (labels, {dim})")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ModelLoadError(f"cls.output.bias has shape {bias.shape}, not ({weight.shape[0]},)")
    labels = kv.get(f"{arch}.classifier.output_labels") or ()
    labels = tuple(str(label) for label in labels) if isinstance(labels, list) else ()
    prompt = kv.get("tokenizer.chat_template.rerank")
    if not (isinstance(prompt, str) and "{query}" in prompt and "{document}" in prompt):
        prompt = None
    log.info("reranker: %d label(s) %s, %s prompt", weight.shape[0], list(labels), "the file's" if prompt else "a plain")
    return Ranker(weight, bias, labels, prompt)


def _values(path: str, tensors: dict, name: str) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"tensor {name} is missing")
    return float_values(path, name, tensors[name])
