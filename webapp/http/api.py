"""The OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions and /v1/completions.

Routing and streaming glue only: `webapp.openai` validates bodies and shapes every response, and
the engine (`app.extensions["engine"]`) turns prompt token ids into generated token ids. A request
goes: validate -> prompt text -> token ids -> context check -> `engine.submit` -> read
`Request.outputs` -> incremental decode -> stop strings -> (chat) reasoning and tool-call parsing
-> one JSON object, or server-sent events ending in `data: [DONE]`.

Every refusal before a stream starts is an HTTP error (`ApiError`, `QueueFull`, `EngineNotReady`;
the handlers live in `webapp/__init__.py`). Once a stream has started, an engine failure becomes a
last `data: {"error": ...}` event followed by `data: [DONE]`. Whenever this side stops reading a
request before the engine has finished it (a stop string matched, the client went away, the
stream was never started) the request is aborted, so its slot is freed.

The family owns /v1: its routes, and any unknown route under it, need the API key, are drained on
shutdown and err in OpenAI's shape (`webapp.http.families`); both checks happen before these views
run. Every request being read is registered with the lifecycle, so a drain
that runs out of time can cancel it; the engine then finishes it with reason "shutdown", which
reaches the client as a 503 `server_shutting_down` error (an error event when streaming).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from functools import partial

from flask import jsonify

from webapp.engine.serving import adapters
from webapp.engine.serving.model_set import ModelSet
from webapp.engine.serving.request import FinishReason
from webapp.http import generation as gen
from webapp.http.families import Family
from webapp.openai import response_bodies
from webapp.openai.choices import Answer, ChoiceReader, interleave
from webapp.openai.completion_request import parse_completion
from webapp.openai.errors import ApiError
from webapp.openai.output_text import OutputParser
from webapp.openai.sampling_options import CompletionEcho, chat_logprobs

bp = Family("api", __name__, owns=("/v1",))
log = logging.getLogger(__name__)


@bp.get("/v1/models")
def models():
    """The model this server runs and its LoRA adapters, or with LLM_MODELS_DIR every model it offers, as an OpenAI model list."""
    served = gen.served()
    if isinstance(served, ModelSet):
        return jsonify(response_bodies.model_set_list(served.listing()))
    return jsonify(response_bodies.models_list(served.model_name, int(time.time()), adapters.listing_of(served)))


@bp.post("/v1/chat/completions")
def chat_completions():
    """An OpenAI chat completion; server-sent `chat.completion.chunk`s when `stream` is true."""
    body = gen.json_body()
    engine = gen.engine(body)
    run = gen.start_chat(engine, gen.parse_chat(body), response_bodies.new_id("chatcmpl"), "messages")
    params, options, parallel = run.chat.params, run.chat.options, run.chat.parallel
    answer, parsers, model = run.answer, run.parsers, run.model
    if params.stream:
        return gen.event_stream(answer, _chat_events(answer, parsers, parallel, params.include_usage, model))

    def read() -> dict:
        choices = []
        for index, (reader, parser) in enumerate(zip(answer.readers, parsers)):
            pieces = [piece for pieces in gen.parse(reader, parser, parallel) for piece in pieces]
            entries = reader.request.logprobs[: reader.completion_tokens]
            logprobs = chat_logprobs(engine.tokenizer, entries) if options.logprobs else None
            message = response_bodies.assistant_message(pieces)
            choices.append(response_bodies.chat_choice(index, message, _finish_reason(reader, parser), logprobs))
        return response_bodies.chat_completion(answer.id, answer.created, model, choices, answer.usage())

    return gen.whole(answer.close, read)


@bp.post("/v1/completions")
def completions():
    """An OpenAI (legacy) text completion of a raw prompt; SSE chunks when `stream` is true."""
    body = gen.json_body()
    engine = gen.engine(body)
    completion = parse_completion(body)
    params, options = completion.params, completion.options
    if isinstance(params.prompt, str):
        ids = gen.encode(engine.tokenizer, params.prompt)
    else:
        ids = gen.prompt_token_ids(engine.tokenizer, params.prompt)
    answer = gen.submit(engine, ids, params, response_bodies.new_id("cmpl"), "prompt", options)
    model = params.model or engine.model_name
    echoes = [CompletionEcho(engine.tokenizer, r.request, params.prompt, options) for r in answer.readers]
    if params.stream:
        return gen.event_stream(answer, _completion_events(answer, echoes, params.include_usage, model))

    def read() -> dict:
        choices = []
        for index, (reader, echo) in enumerate(zip(answer.readers, echoes)):
            text = "".join(reader.texts())
            logprobs = echo.logprobs(reader.completion_tokens)
            choices.append(response_bodies.completion_choice(index, echo.text + text, reader.finish_reason, logprobs))
        return response_bodies.completion(answer.id, answer.created, model, choices, answer.usage())

    return gen.whole(answer.close, read)


def _finish_reason(reader: ChoiceReader, parser: OutputParser) -> str:
    if parser.tool_calls and reader.finish_reason == FinishReason.STOP:
        return "tool_calls"
    return reader.finish_reason


def _ending(answer: Answer, choices: Iterator[str], usage_chunk: Callable[[dict], dict] | None) -> Iterator[str]:
    """The choices' events, then the usage chunk when asked, then `[DONE]`; an engine failure
    becomes an error event instead."""
    try:
        yield from choices
    except ApiError as e:
        yield response_bodies.sse(e.body())
        yield response_bodies.SSE_DONE
        return
    if usage_chunk is not None:
        yield response_bodies.sse(usage_chunk(answer.usage()))
    yield response_bodies.SSE_DONE


def _chat_events(answer: Answer, parsers: list[OutputParser], parallel: bool, include_usage: bool, model: str) -> Iterator[str]:
    streams = [
        _chat_choice_events(answer, index, reader, parser, parallel, model)
        for index, (reader, parser) in enumerate(zip(answer.readers, parsers))
    ]
    usage = partial(response_bodies.chat_usage_chunk, answer.id, answer.created, model) if include_usage else None
    return _ending(answer, interleave(streams, answer.outputs), usage)


def _chat_choice_events(
    answer: Answer, index: int, reader: ChoiceReader, parser: OutputParser, parallel: bool, model: str
) -> Iterator[str]:
    req = reader.request
    sent = 0  # output tokens whose logprobs went out already

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        nonlocal sent
        body = response_bodies.chat_chunk(answer.id, answer.created, model, delta, finish_reason, index)
        if req.params.logprobs and delta.keys() != {"role", "content"}:
            entries, sent = req.logprobs[sent : reader.completion_tokens], reader.completion_tokens
            if entries:
                body["choices"][0]["logprobs"] = chat_logprobs(reader.engine.tokenizer, entries)
        return response_bodies.sse(body)

    # Sent before any token so the client sees the stream open even during a long prefill.
    yield chunk({"role": "assistant", "content": ""})
    tool_index = 0
    for pieces in gen.parse(reader, parser, parallel):
        for piece in pieces:
            yield chunk(response_bodies.chat_delta(piece, tool_index))
            tool_index += piece.kind == "tool_call"
    yield chunk({}, _finish_reason(reader, parser))


def _completion_events(answer: Answer, echoes: list[CompletionEcho], include_usage: bool, model: str) -> Iterator[str]:
    streams = [
        _completion_choice_events(answer, index, reader, echo, model) for index, (reader, echo) in enumerate(zip(answer.readers, echoes))
    ]
    usage = partial(response_bodies.completion_usage_chunk, answer.id, answer.created, model) if include_usage else None
    return _ending(answer, interleave(streams, answer.outputs), usage)


def _completion_choice_events(answer: Answer, index: int, reader: ChoiceReader, echo: CompletionEcho, model: str) -> Iterator[str]:
    offset = 0  # where the next chunk's text starts in the whole choice's text

    def chunk(text: str, finish_reason: str | None = None, scored: bool = True, upto=None) -> str:
        nonlocal offset
        body = response_bodies.completion_chunk(answer.id, answer.created, model, text, finish_reason, index)
        if scored:
            tokens = reader.completion_tokens if upto is None else upto
            body["choices"][0]["logprobs"] = echo.logprobs(tokens, offset)
        offset += len(text)
        return response_bodies.sse(body)

    yield chunk("", scored=False)
    echoed = False
    for text in reader.texts():
        if not echoed:  # the prompt is scored once its first output arrives
            echoed = True
            if echo.text:
                yield chunk(echo.text, upto=0)
        yield chunk(text)
    if not echoed and echo.text:
        yield chunk(echo.text)
    yield chunk("", reader.finish_reason)
