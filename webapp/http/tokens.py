"""`POST /tokenize` and `POST /detokenize`, in both llama-server's and vLLM's shapes, so editors and
evaluation tools count tokens exactly as the model does.

- `/tokenize`: text as `content` (llama-server) or `prompt` (vLLM), or chat `messages` rendered with
  the model's template (and its generation prompt unless `add_generation_prompt` is false).
  `add_special` / `add_special_tokens` (default true) parses special-token text and puts the BOS
  first where the model wants one; `with_pieces` gives each id with its text. Images in the
  messages count as the positions they take (their placeholder ids, as the engine is sent them). The answer carries
  `tokens`, `count` and `max_model_len`.
- `/detokenize`: `tokens` back to text, as `content` and as `prompt`.

Outside /v1, as llama-server and vLLM serve them, yet a family like the API's: the API key, drained
on shutdown, OpenAI's error shape (`webapp.http.families`).
"""

from __future__ import annotations

from flask import current_app, jsonify

from webapp.http import generation as gen
from webapp.http.families import Family
from webapp.openai import images, request_bodies
from webapp.openai.errors import ApiError

bp = Family("tokens", __name__)


@bp.post("/tokenize")
def tokenize():
    """Token ids of a text or of chat messages."""
    body = gen.json_body()
    engine = gen.engine(body)
    special = _flag(body, "add_special", _flag(body, "add_special_tokens", True))
    if "messages" in body:
        params = request_bodies.parse_chat_request({"messages": body["messages"]}, current_app.config["MAX_MESSAGES"])
        text = engine.chat_template.render(list(params.messages), add_generation_prompt=_flag(body, "add_generation_prompt", True))
    else:
        text = body.get("content", body.get("prompt"))
        if not isinstance(text, str):
            raise ApiError(400, "Send the text as 'content' (or 'prompt'), or chat 'messages'.", "content")
    tokenizer = engine.tokenizer
    pictures = images.chat_images(body["messages"], current_app.extensions.get("image_fetcher")) if "messages" in body else ()
    if pictures:
        ids = gen.image_prompt(engine, text, pictures)[0]
    else:
        ids = tokenizer.encode(text, special=special)
        ids = gen.with_bos(tokenizer, ids) if special else ids
    out: dict = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_context}
    if _flag(body, "with_pieces", False):
        out["tokens"] = [{"id": i, "piece": tokenizer.decode([i]) if i < tokenizer.vocab_size else "[image]"} for i in ids]
    return jsonify(out)


@bp.post("/detokenize")
def detokenize():
    """The text of token ids."""
    body = gen.json_body()
    engine = gen.engine(body)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ApiError(400, "'tokens' must be an array of token ids.", "tokens")
    if any(not 0 <= i < engine.tokenizer.vocab_size for i in ids):
        raise ApiError(400, f"Token ids are from 0 to {engine.tokenizer.vocab_size - 1} (the vocabulary).", "tokens")
    text = engine.tokenizer.decode(ids)
    return jsonify(content=text, prompt=text)


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be true or false.", key)
    return value
