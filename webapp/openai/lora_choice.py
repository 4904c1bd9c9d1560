"""A request's LoRA adapter: named by its `model` or by llama-server's `lora` field.

Contract: `parse_lora(value)` checks a body's `lora` (llama-server's shape: a list of objects, each
an adapter's `id`, its place in `/lora-adapters`, or its `name`, and a `scale`) and gives
((id or name, scale), ...); `chosen(adapters, model, requested)` gives the request's
serving/adapters.LoraUse, or None for the model as it is. A `model` naming a loaded adapter
(vLLM's way) or `base:adapter` (Ollama's tag form) chooses it at scale 1; `lora` entries choose by
id or name with their scale, a zero scale leaving the adapter out (llama-server's). One adapter a
request: two with a scale, or a `model` and a `lora` naming different ones, are a 400.
"""

from __future__ import annotations

import math

from webapp.engine.serving.adapters import MAX_SCALE, UnknownAdapter
from webapp.openai.errors import ApiError

MAX_ENTRIES = 64


def parse_lora(value) -> tuple[tuple[int | str, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_ENTRIES:
        raise ApiError(400, f"'lora' must be a list of at most {MAX_ENTRIES} objects with an 'id' (or 'name') and a 'scale'.", "lora")
    entries = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or set(entry) - {"id", "name", "scale"}:
            raise ApiError(400, f"'lora[{i}]' must be an object with an 'id' (or 'name') and a 'scale'.", "lora")
        key = entry.get("id", entry.get("name"))
        scale = entry.get("scale", 1.0)
        if not (isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool) and key >= 0)):
            raise ApiError(400, f"'lora[{i}]' names no adapter: an 'id' of 0 or more, or a 'name', is expected.", "lora")
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or abs(scale) > MAX_SCALE:
            raise ApiError(400, f"'lora[{i}].scale' must be a number from -{MAX_SCALE:g} to {MAX_SCALE:g}.", "lora")
        entries.append((key, float(scale)))
    return tuple(entries)


def chosen(adapters, model: str | None, requested: tuple[tuple[int | str, float], ...]):
    names = adapters.names if adapters is not None else []
    by_model = _named_by_model(names, model)
    picked = []
    for key, scale in requested:
        if isinstance(key, int):
            if key >= len(names):
                raise ApiError(
                    400, f"'lora' names adapter id {key}; this server has {len(names)} (GET /lora-adapters).", "lora", "lora_not_found"
                )
            key = names[key]
        if scale:
            picked.append((key, scale))
    if len(picked) > 1:
        raise ApiError(400, "'lora' chooses more than one adapter; a request runs with one.", "lora")
    if picked and by_model and picked[0][0] != by_model:
        raise ApiError(400, f"'model' chooses the adapter {by_model!r} and 'lora' chooses {picked[0][0]!r}.", "lora")
    name, scale = picked[0] if picked else (by_model, 1.0) if by_model else (None, 0.0)
    if name is None:
        return None
    if adapters is None:
        raise ApiError(
            400, f"'lora' names the adapter {name!r}; this server has no LoRA adapters (LLM_LORA_DIR).", "lora", "lora_not_found"
        )
    try:
        return adapters.choose(name, scale)
    except UnknownAdapter as e:
        raise ApiError(400, f"{e}.", "lora", "lora_not_found") from e


def _named_by_model(names: list[str], model: str | None) -> str | None:
    if not model or not names:
        return None
    if model in names:
        return model
    _, _, tag = model.rpartition(":")
    return tag if tag in names else None
