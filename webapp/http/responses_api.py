"""OpenAI's Responses API: `POST /v1/responses` (Codex CLI, the Agents SDK), `GET` and `DELETE
/v1/responses/{id}`.

A body is translated into a chat body (`webapp.openai.responses_format`), after the items of its
`previous_response_id` chain, and takes the chat path itself (`webapp.http.generation`). A response
is kept in `app.extensions["responses"]` (a bounded `ResponseStore`, in memory) unless `store` is
false. Streaming sends the Responses events, each with its `sequence_number`, from
`response.created` to `response.completed` (or `response.failed` when the engine fails).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from flask import current_app, jsonify

from webapp.http import generation as gen
from webapp.http.families import Family
from webapp.openai import responses_format
from webapp.openai.choices import Answer
from webapp.openai.errors import ApiError
from webapp.openai.output_text import OutputParser
from webapp.openai.response_bodies import sse
from webapp.openai.response_store import ResponseStore

bp = Family("responses", __name__)  # OpenAI's: the API key, drained, OpenAI's errors
log = logging.getLogger(__name__)


bp.record_once(lambda state: state.app.extensions.setdefault("responses", ResponseStore()))


def _store() -> ResponseStore:
    return current_app.extensions["responses"]


@bp.post("/v1/responses")
def create():
    """A model response; its event stream when `stream` is true."""
    body = gen.json_body()
    history = _history(body.get("previous_response_id"))
    engine = gen.engine(body)
    chat = gen.parse_chat(responses_format.chat_body(body, history))
    run = gen.start_chat(engine, chat, responses_format.new_id("resp"), "input")
    answer, parser, parallel, model = run.answer, run.parsers[0], chat.parallel, run.model
    conversation = [*history, *responses_format.input_items(body)]
    if chat.params.stream:
        return gen.event_stream(answer, _events(answer, parser, parallel, model, body, conversation, _store()), _failed_event)

    def read() -> dict:
        output = responses_format.Output()
        for pieces in gen.parse(answer.readers[0], parser, parallel):
            for piece in pieces:
                output.add(piece)
        output.close()
        return _finish(answer, output, model, body, conversation, _store())

    return gen.whole(answer.close, read)


@bp.get("/v1/responses/<response_id>")
def retrieve(response_id: str):
    """A stored response, as it was returned."""
    stored = _store().get(response_id)
    if stored is None:
        raise ApiError(
            404, f"No response with id {response_id!r} is stored here (responses live in memory until evicted or a restart).", "response_id"
        )
    return jsonify(stored[0])


@bp.delete("/v1/responses/<response_id>")
def delete(response_id: str):
    """Forget a stored response."""
    if not _store().delete(response_id):
        raise ApiError(404, f"No response with id {response_id!r} is stored here.", "response_id")
    return jsonify(id=response_id, object="response", deleted=True)


def _history(previous: object) -> list[dict]:
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise ApiError(400, "'previous_response_id' must be a string.", "previous_response_id")
    stored = _store().get(previous)
    if stored is None:
        raise ApiError(400, f"Previous response with id {previous!r} not found (stored responses live in memory).", "previous_response_id")
    return stored[1]


def _finish(
    answer: Answer, output: responses_format.Output, model: str, body: dict, conversation: list[dict], store: ResponseStore
) -> dict:
    reader = answer.readers[0]
    request = reader.request
    usage = responses_format.usage(request.prompt_len, reader.completion_tokens, request.cached_tokens)
    status, incomplete = responses_format.status_of(reader.finish_reason)
    done = responses_format.response(answer.id, model, body, output.items, status, usage, incomplete)
    if body.get("store", True) is not False:
        store.put(answer.id, done, [*conversation, *output.items])
    return done


def _sse(event: dict) -> str:
    return sse(event, event=event["type"])


def _failed_event() -> str:
    return _sse({"type": "error", "code": "internal_error", "message": "Internal server error.", "sequence_number": 0})


def _events(
    answer: Answer, parser: OutputParser, parallel: bool, model: str, body: dict, conversation: list[dict], store: ResponseStore
) -> Iterator[str]:
    sequence = 0

    def numbered(event: dict) -> str:
        nonlocal sequence
        event["sequence_number"] = sequence
        sequence += 1
        return _sse(event)

    started = responses_format.response(answer.id, model, body, [], "in_progress", None)
    yield numbered({"type": "response.created", "response": started})
    yield numbered({"type": "response.in_progress", "response": started})
    output = responses_format.Output()
    reader = answer.readers[0]
    try:
        for pieces in gen.parse(reader, parser, parallel):
            for piece in pieces:
                for event in output.add(piece):
                    yield numbered(event)
    except ApiError as e:
        for event in output.close():
            yield numbered(event)
        failed = responses_format.response(answer.id, model, body, output.items, "failed", None)
        failed["error"] = {"code": e.code or "server_error", "message": e.message}
        yield numbered({"type": "response.failed", "response": failed})
        return
    for event in output.close():
        yield numbered(event)
    done = _finish(answer, output, model, body, conversation, store)
    yield numbered({"type": "response.incomplete" if done["status"] == "incomplete" else "response.completed", "response": done})
