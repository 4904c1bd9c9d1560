"""LoRA adapters at run time: vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`
(admin-guarded: they change what the server runs), and llama-server's `GET /lora-adapters`.

A request chooses an adapter by its `model` or its `lora` field (webapp/openai/lora_choice.py); these
routes change which adapters there are. Loading reads and fits the file on the model thread,
between steps; unloading waits for the adapter's running requests to end (serving/adapters.py).
Success answers as vLLM's do, in plain text; a refusal is a JSON error in OpenAI's shape.
"""

from __future__ import annotations

import os

from flask import Response, jsonify

from webapp.engine.serving import adapters
from webapp.http import generation as gen
from webapp.http.families import ADMIN_TOKEN, Family
from webapp.openai.errors import ApiError

bp = Family("lora_admin", __name__, guard=ADMIN_TOKEN)
listing_bp = Family("lora", __name__)  # the API key, drained, OpenAI's errors


@bp.post("/v1/load_lora_adapter")
def load_lora_adapter():
    body = gen.json_body()
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    if not os.path.isfile(path):
        raise ApiError(400, f"'lora_path' {path!r} is not a file on the server.", "lora_path", "lora_not_found")
    engine = gen.engine(body)
    try:
        adapters.load(engine, name, path)
    except adapters.UnknownAdapter as e:
        raise ApiError(400, f"{e}.", "lora_path", "lora_not_supported") from e
    except ValueError as e:
        raise ApiError(400, f"The adapter cannot be loaded: {e}.", "lora_path", "invalid_lora") from e
    return Response(f"Success: LoRA adapter '{name}' added successfully.", mimetype="text/plain")


@bp.post("/v1/unload_lora_adapter")
def unload_lora_adapter():
    body = gen.json_body()
    name = _text(body, "lora_name")
    try:
        adapters.unload(gen.engine(body), name)
    except adapters.UnknownAdapter as e:
        raise ApiError(404, f"{e}.", "lora_name", "lora_not_found") from e
    except adapters.AdapterBusy as e:
        raise ApiError(409, f"{e}.", "lora_name", "lora_busy") from e
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", mimetype="text/plain")


@listing_bp.get("/lora-adapters")
def lora_adapters():
    """The loaded adapters, each with the `id` a request's `lora` names it by (llama-server's shape:
    `scale` is the one a request gets without naming it, 0), its name, rank, alpha and bytes."""
    loaded = gen.engine().adapters
    listing = [] if loaded is None else loaded.listing()
    return jsonify([{"id": i, "path": a["path"], "scale": 0.0} | a for i, a in enumerate(listing)])


def _text(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value.strip() or len(value) > 4096:
        raise ApiError(400, f"'{key}' must be a non-empty string.", key)
    return value
