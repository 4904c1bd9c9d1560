"""Loading the draft model (`LLM_DRAFT_MODEL`) beside the served one, by the same loader.

Contract: `load_draft(path, target_path, target_kv, target_steps, slots, max_chunk, cpu_kernels, cpu_isa)`
returns a `DraftModel` (webapp/engine/serving/draft_model.py) with the served model's slots and
context, or raises `ModelLoadError` in one line naming both files: where the served model's steps
do not verify drafts (only one call on the CPU kernels does: `Steps.speculates`), where the draft's
steps are not such one calls too (its catch-up and batched greedy steps are lanes of any slot and
position), where the draft has sliding-window layers, or where the vocabularies differ (a draft token id must mean the served model's token). A
recurrent draft (qwen35) drafts in rows of state of its own (serving/draft_model.py).
The vocabularies are compared before any of the draft's weights is read.
"""

from __future__ import annotations

import logging
import os

from webapp.engine.model.gguf import read_gguf
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.steps import OneCallSteps
from webapp.engine.model.transformer import load_model
from webapp.engine.serving.draft_model import DraftModel

log = logging.getLogger(__name__)


def load_draft(
    path: str, target_path: str, target_kv: dict, target_steps, slots: int, max_chunk: int, cpu_kernels: bool, cpu_isa: str = "auto"
) -> DraftModel:
    draft, target = os.path.basename(path), os.path.basename(target_path)
    if not target_steps.speculates:
        raise ModelLoadError(
            f"LLM_DRAFT_MODEL={draft}: drafts are verified only where a step is one call on the CPU kernels; "
            f"{target} runs {target_steps.how} (LLM_SPECULATIVE=false, or no LLM_DRAFT_MODEL, serves it)"
        )
    try:
        kv, _ = read_gguf(path)
    except FileNotFoundError:
        raise
    except Exception as e:
        raise ModelLoadError(f"LLM_DRAFT_MODEL: cannot parse {draft} as GGUF: {e}") from e
    mismatch = vocabulary_mismatch(kv.get("tokenizer.ggml.tokens") or [], target_kv.get("tokenizer.ggml.tokens") or [])
    if mismatch:
        raise ModelLoadError(
            f"LLM_DRAFT_MODEL: {draft} and {target} have different vocabularies ({mismatch}); a draft needs the served model's tokenizer"
        )
    model, _ = load_model(
        path, slots=slots, context=target_steps.model.context, max_chunk=max_chunk, cpu_kernels=cpu_kernels, cpu_isa=cpu_isa
    )
    if not OneCallSteps.fits(model):
        raise ModelLoadError(
            f"LLM_DRAFT_MODEL: {draft} has matrices the CPU kernels do not read, so its steps cannot be one call each as {target}'s are"
        )
    if model.ring_rows:  # the draft's cache reuse (serving/draft_model.py) knows no rings
        raise ModelLoadError(f"LLM_DRAFT_MODEL: {draft} has sliding-window layers, which a draft model cannot have yet")
    log.info("draft model %s: %d layers, dim %d, beside %s", draft, model.config.n_layers, model.config.dim, target)
    return DraftModel(OneCallSteps(model), slots, draft.removesuffix(".gguf"))


def vocabulary_mismatch(draft: list, target: list) -> str:
    """How two token lists differ, in words; "" when they are the same."""
    if len(draft) != len(target):
        return f"{len(draft)} and {len(target)} tokens"
    differ = next((i for i, (a, b) in enumerate(zip(draft, target)) if a != b), None)
    return "" if differ is None else f"token {differ} is {draft[differ]!r} in one and {target[differ]!r} in the other"
