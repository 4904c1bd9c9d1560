"""Ollama's API: `POST /api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings` and `/api/show`,
`GET /api/tags`, `/api/ps` and `/api/version`, for the clients that speak only Ollama's (the
`ollama` Python and JS libraries, Open WebUI, Continue, editor and notes plugins).

A body is translated into an OpenAI one (`webapp.ollama.requests`) and takes that path itself: the
same validation, chat template, tool grammar, engine request and output parser
(`webapp.http.generation`); the answer goes out in Ollama's shape (`webapp.ollama.replies`):
newline-delimited JSON objects while streaming, which is Ollama's default, and errors as
`{"error": ...}` for every route under /api (the family declares it). Guarded by the API key and
drained at shutdown like the other APIs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from flask import current_app, jsonify

from webapp.engine.serving.model_set import ModelSet
from webapp.engine.serving.settings import engine_settings
from webapp.http import generation as gen
from webapp.http.embeddings import embedded
from webapp.http.families import Family
from webapp.ollama import replies, requests
from webapp.openai import response_bodies
from webapp.openai.completion_request import parse_completion
from webapp.openai.embeddings import parse_embedding_request
from webapp.openai.errors import ApiError
from webapp.openai.output_text import Piece

bp = Family("ollama", __name__, errors=lambda e: replies.error(e.message), owns=("/api",))
NDJSON = "application/x-ndjson"
# The version of Ollama's API these routes follow; clients ask for it to tell which fields they may send.
API_VERSION = "0.12.0"


@bp.post("/api/chat")
def chat():
    body = gen.json_body()
    translated = requests.chat_body(body)
    engine = _engine(body)
    model = body.get("model") or engine.model_name
    if not translated["messages"]:  # Ollama's way to load a model: nothing to answer
        return jsonify(_loaded(model))
    return _chat_answer(engine, translated, model, replies.chat_line, lambda pieces: {"message": replies.message(pieces)})


@bp.post("/api/generate")
def generate():
    body = gen.json_body()
    kind, translated = requests.generate_body(body)
    engine = _engine(body)
    model = body.get("model") or engine.model_name
    if not body.get("prompt"):
        return jsonify(_loaded(model))
    if kind == "chat":
        return _chat_answer(engine, translated, model, replies.generate_line, _generated)
    completion = parse_completion(translated)
    ids = gen.encode(engine.tokenizer, translated["prompt"])
    answer = gen.submit(engine, ids, completion.params, response_bodies.new_id("gen"), "prompt", completion.options)
    reader = answer.readers[0]
    pieces = (Piece("content", text) for text in reader.texts())
    return _answer(answer, model, ([piece] for piece in pieces), replies.generate_line, _generated, translated["stream"])


@bp.post("/api/embed")
def embed():
    body = gen.json_body()
    params = parse_embedding_request(requests.embed_body(body))
    engine = _engine(body)
    model = body.get("model") or engine.model_name

    def answer(vectors: list, tokens: int) -> dict:
        return {"model": model, "embeddings": [v.tolist() for v in vectors], "load_duration": 0, "prompt_eval_count": tokens}

    return embedded(engine, params, answer)


@bp.post("/api/embeddings")
def embeddings():
    """The older single-prompt form: {"model", "prompt"} -> {"embedding"}."""
    body = gen.json_body()
    params = parse_embedding_request(requests.embeddings_body(body))
    return embedded(_engine(body), params, lambda vectors, _: {"embedding": vectors[0].tolist()})


@bp.get("/api/tags")
def tags():
    return jsonify({"models": _models(loaded_only=False)})


@bp.get("/api/ps")
def running():
    return jsonify({"models": _models(loaded_only=True)})


@bp.post("/api/show")
def show():
    body = gen.json_body()
    if "name" in body and "model" not in body:  # the older field name
        body = {**body, "model": body["name"]}
    engine = _engine(body)
    name = requests.model_name(body) or engine.model_name
    source = engine.chat_template.source or ""
    capabilities = ["completion"] + ["tools"] * ("tools" in source) + ["thinking"] * ("think" in source)
    capabilities += ["vision"] * (engine.vision is not None)  # a projector: images in messages
    entry = next((m for m in _models(loaded_only=False) if m["name"] == f"{name}:latest"), replies.model_entry(name, None, None))
    return jsonify(
        {
            "modelfile": "",
            "parameters": "",
            "template": source,
            "details": entry["details"],
            "model_info": {"general.name": name, "context_length": engine.max_context},
            "capabilities": capabilities,
            "modified_at": entry["modified_at"],
        }
    )


@bp.get("/api/version")
def version():
    return jsonify({"version": API_VERSION})


def _engine(body: dict):
    return gen.engine({"model": requests.model_name(body)}, requests.keep_alive_seconds(body))


def _loaded(model: str) -> dict:
    return {"model": model, "created_at": replies.now(), "response": "", "done": True, "done_reason": "load"}


def _generated(pieces: list[Piece]) -> dict:
    out = {"response": "".join(p.value for p in pieces if p.kind == "content")}
    thinking = "".join(p.value for p in pieces if p.kind == "reasoning")
    return out | ({"thinking": thinking} if thinking else {})


def _chat_answer(engine, translated: dict, model: str, line_of: Callable, whole_of: Callable):
    run = gen.start_chat(engine, gen.parse_chat(translated), response_bodies.new_id("chat"), "messages")
    parsed = gen.parse(run.answer.readers[0], run.parsers[0], run.chat.parallel)
    return _answer(run.answer, model, parsed, line_of, whole_of, run.chat.params.stream)


def _answer(answer, model: str, parsed: Iterator[list[Piece]], line_of: Callable, whole_of: Callable, stream: bool):
    """The answer streamed as `line_of` objects then the last one, or whole: `whole_of(pieces)`'s
    fields in the last object."""
    reader = answer.readers[0]

    def last(**fields) -> dict:
        return replies.done(model, reader.finish_reason, reader.request, reader.completion_tokens, **fields)

    if stream:
        return gen.event_stream(answer, _lines(parsed, model, line_of, last, whole_of([])), _failed, mimetype=NDJSON)
    return gen.whole(answer.close, lambda: last(**whole_of([p for pieces in parsed for p in pieces])))


def _lines(parsed: Iterator[list[Piece]], model: str, line_of: Callable, last: Callable, empty: dict) -> Iterator[str]:
    try:
        for pieces in parsed:
            for piece in pieces:
                if piece.kind == "tool_call" or piece.value:
                    yield replies.line(line_of(model, piece))
    except ApiError as e:  # the engine failed or is shutting down: the stream's last line says so
        yield replies.line(replies.error(e.message))
        return
    yield replies.line(last(**empty))  # the whole answer's fields, empty: the stream carried them


def _failed() -> str:
    return replies.line(replies.error("Internal server error."))


def _models(loaded_only: bool) -> list[dict]:
    served = gen.served()
    if isinstance(served, ModelSet):
        listing = [e for e in served.listing() if e["loaded"] or not loaded_only]
        return [replies.model_entry(e["id"], e["size"], e["created"]) for e in listing]
    if loaded_only and served.state != "ok":
        return []
    size = modified = None
    try:
        stat = os.stat(engine_settings(current_app.config).path)
        size, modified = stat.st_size, stat.st_mtime
    except (OSError, TypeError, ValueError):
        pass
    return [replies.model_entry(served.model_name, size, modified)]
