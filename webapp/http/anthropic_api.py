"""Anthropic's Messages API: `POST /v1/messages` (Claude Code, the `anthropic` SDK) and
`POST /v1/messages/count_tokens`.

A body is translated into an OpenAI chat body (`webapp.anthropic.messages`) and then takes the chat
path itself: the same validation, chat template, tool grammar, engine request and output parser
(`webapp.http.generation`); only the answer's shape differs (`webapp.anthropic.events`). Errors,
before a stream and inside one, are in Anthropic's shape: the family declares it, for its routes and
for any unknown route under /v1/messages (`webapp.http.families`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from flask import current_app, jsonify

from webapp.anthropic import events
from webapp.anthropic.messages import chat_body, count_tokens_body
from webapp.http import generation as gen
from webapp.http.families import Family
from webapp.openai import request_bodies
from webapp.openai.choices import Answer
from webapp.openai.errors import ApiError
from webapp.openai.output_text import OutputParser
from webapp.openai.reasoning_controls import template_kwargs

PREFIX = "/v1/messages"
bp = Family("anthropic", __name__, errors=events.api_error_body, owns=(PREFIX,))
log = logging.getLogger(__name__)


@bp.post(PREFIX)
def messages():
    """An Anthropic message; its stream of events when `stream` is true."""
    body = gen.json_body()
    run = gen.start_chat(gen.engine(body), gen.parse_chat(chat_body(body)), events.new_id("msg"), "messages")
    answer, parser, parallel, model = run.answer, run.parsers[0], run.chat.parallel, run.model
    if run.chat.params.stream:
        return gen.event_stream(answer, _events(answer, parser, parallel, model), _error_event)

    def read() -> dict:
        blocks = events.Blocks()
        reader = answer.readers[0]
        for pieces in gen.parse(reader, parser, parallel):
            for piece in pieces:
                blocks.add(piece)
        stop = events.stop_reason(reader.finish_reason, reader.stop_sequence, blocks.called_tools)
        return events.message(answer.id, model, blocks.content, stop, reader.stop_sequence, _usage(answer))

    return gen.whole(answer.close, read)


@bp.post(PREFIX + "/count_tokens")
def count_tokens():
    """How many tokens the prompt of these messages (system, tools and all) takes."""
    raw = gen.json_body()
    engine = gen.engine(raw)
    body = count_tokens_body(raw)
    params = request_bodies.parse_chat_request(body, current_app.config["MAX_MESSAGES"])
    prompt = gen.render_chat(engine.chat_template, list(params.messages), params.active_tools, extra=template_kwargs(body))
    return jsonify(input_tokens=len(gen.encode(engine.tokenizer, prompt)))


def _usage(answer: Answer) -> dict:
    request = answer.readers[0].request
    return events.usage(request.prompt_len, answer.readers[0].completion_tokens, request.cached_tokens)


def _error_event() -> str:
    return events.event("error", {"error": events.error_body(500, "Internal server error.")["error"]})


def _events(answer: Answer, parser: OutputParser, parallel: bool, model: str) -> Iterator[str]:
    reader = answer.readers[0]
    request = reader.request
    # sent before any token, so the client sees the stream open even during a long prefill
    start = events.message(answer.id, model, [], None, None, events.usage(request.prompt_len, 0, 0))
    yield events.event("message_start", {"message": start})
    yield events.event("ping", {})
    blocks = events.Blocks()
    try:
        for pieces in gen.parse(reader, parser, parallel):
            for piece in pieces:
                yield from blocks.add(piece)
    except ApiError as e:  # the engine failed or the server is shutting down: the stream says so
        yield from blocks.close()
        yield events.event("error", {"error": events.error_body(e.status, e.message)["error"]})
        return
    yield from blocks.close()
    stop = events.stop_reason(reader.finish_reason, reader.stop_sequence, blocks.called_tools)
    yield events.event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": reader.stop_sequence}, "usage": _usage(answer)})
    yield events.event("message_stop", {})
