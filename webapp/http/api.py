"""The OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions, /v1/completions and /health.

Routing and streaming glue only: `openai_format` validates bodies and shapes every response, and
the engine (`app.extensions["engine"]`) turns prompt token ids into generated token ids. A request
goes: validate -> prompt text -> token ids -> context check -> `engine.submit` -> read
`Request.outputs` -> incremental decode -> stop strings -> (chat) reasoning and tool-call parsing
-> one JSON object, or server-sent events ending in `data: [DONE]`.

Every refusal before a stream starts is an HTTP error (`ApiError`, `QueueFull`, `EngineNotReady`;
the handlers live in `webapp/__init__.py`). Once a stream has started, an engine failure becomes a
last `data: {"error": ...}` event followed by `data: [DONE]`. Whenever this side stops reading a
request before the engine has finished it (a stop string matched, the client went away, the
stream was never started) the request is aborted, so its slot is freed.

Authentication (`webapp.http.auth`) and admission during shutdown (`webapp.ops.lifecycle`) happen
before these views run. Every request being read is registered with the lifecycle, so a drain
that runs out of time can cancel it; the engine then finishes it with reason "shutdown", which
reaches the client as a 503 `server_shutting_down` error (an error event when streaming).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial

from flask import Blueprint, Response, current_app, jsonify, request

from webapp.engine.decoding.constraints import GrammarError
from webapp.engine.serving.errors import RETRY_AFTER_S, PromptTooLong, completion_room
from webapp.engine.serving.request import FinishReason, Request, SamplingParams
from webapp.openai import requests as fmt
from webapp.openai import responses, structured
from webapp.openai.choices import Answer, ChoiceOutputs, ChoiceReader, ClientGone, interleave
from webapp.openai.errors import ApiError, error_body
from webapp.openai.output_text import OutputParser, Piece, opens_reasoning
from webapp.openai.sampling_options import (
    CompletionEcho,
    SamplingOptions,
    chat_logprobs,
    check_token_ids,
    parse_sampling_options,
)

bp = Blueprint("api", __name__)
log = logging.getLogger(__name__)

# Not an HTTP status the client will ever see: it has gone. Logs show why the request ended.
_CLIENT_CLOSED = 499


@bp.get("/health")
def health():
    """The engine's health dict: 200 when it serves requests; 503 with `Retry-After` while loading,
    failed, stalled (a step has run longer than STALL_SECONDS) or draining for shutdown. A draining
    replica answers before asking the engine anything, so a proxy's check takes it out at once."""
    if _lifecycle().draining:
        return jsonify(status="draining"), 503, {"Retry-After": str(RETRY_AFTER_S)}
    state = _engine().health()
    if state.get("status") != "ok":
        return jsonify(state), 503, {"Retry-After": str(RETRY_AFTER_S)}
    return jsonify(state)


@bp.get("/v1/models")
def models():
    """The one model this server runs, as an OpenAI model list."""
    return jsonify(responses.models_list(_engine().model_name, int(time.time())))


@bp.post("/v1/chat/completions")
def chat_completions():
    """An OpenAI chat completion; server-sent `chat.completion.chunk`s when `stream` is true."""
    engine = _engine()
    body = _json_body()
    params = fmt.parse_chat_request(body, current_app.config["MAX_MESSAGES"])
    options = parse_sampling_options(body, chat=True)
    tools = params.active_tools
    grammar = structured.output_grammar(body, tools, params.tool_choice, params.forced_tool)
    prompt = _render_chat(engine.chat_template, list(params.messages), tools)
    ids = _encode(engine.tokenizer, prompt)
    answer = _submit(engine, ids, params, responses.new_id("chatcmpl"), "messages", options, grammar)
    parsers = [OutputParser(tools, in_reasoning=opens_reasoning(prompt)) for _ in answer.readers]
    model = params.model or engine.model_name
    parallel = structured.parallel_tool_calls(body)
    if params.stream:
        return _event_stream(answer, _chat_events(answer, parsers, parallel, params.include_usage, model))
    choices = []
    try:
        for index, (reader, parser) in enumerate(zip(answer.readers, parsers)):
            pieces = [piece for pieces in _parse(reader, parser, parallel) for piece in pieces]
            entries = reader.request.logprobs[: reader.completion_tokens]
            logprobs = chat_logprobs(engine.tokenizer, entries) if options.logprobs else None
            message = responses.assistant_message(pieces)
            choices.append(responses.chat_choice(index, message, _finish_reason(reader, parser), logprobs))
    except ClientGone:
        return Response(status=_CLIENT_CLOSED)
    finally:
        answer.close()
    return jsonify(responses.chat_completion(answer.id, answer.created, model, choices, answer.usage()))


def _render_chat(template, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt text; tools a template would silently drop go into the system prompt instead."""
    try:
        without = template.render(messages, tools=None, add_generation_prompt=True) if tools else None
        prompt = template.render(messages, tools=tools, add_generation_prompt=True)
        if prompt == without:
            messages = structured.with_tools_in_system_prompt(messages, tools)
            prompt = template.render(messages, tools=None, add_generation_prompt=True)
    except ValueError as e:  # the template's TemplateError: these messages do not fit the model
        raise ApiError(400, f"The chat template rejected the messages: {e}", "messages") from e
    return prompt


@bp.post("/v1/completions")
def completions():
    """An OpenAI (legacy) text completion of a raw prompt; SSE chunks when `stream` is true."""
    engine = _engine()
    body = _json_body()
    params = fmt.parse_completion_request(body)
    options = parse_sampling_options(body, chat=False)
    if isinstance(params.prompt, str):
        ids = _encode(engine.tokenizer, params.prompt)
    else:
        ids = _check_token_ids(engine.tokenizer, params.prompt)
    answer = _submit(engine, ids, params, responses.new_id("cmpl"), "prompt", options)
    model = params.model or engine.model_name
    echoes = [CompletionEcho(engine.tokenizer, r.request, params.prompt, options) for r in answer.readers]
    if params.stream:
        return _event_stream(answer, _completion_events(answer, echoes, params.include_usage, model))
    choices = []
    try:
        for index, (reader, echo) in enumerate(zip(answer.readers, echoes)):
            text = "".join(reader.texts())
            logprobs = echo.logprobs(reader.completion_tokens)
            choices.append(responses.completion_choice(index, echo.text + text, reader.finish_reason, logprobs))
    except ClientGone:
        return Response(status=_CLIENT_CLOSED)
    finally:
        answer.close()
    return jsonify(responses.completion(answer.id, answer.created, model, choices, answer.usage()))


def _engine():
    return current_app.extensions["engine"]


def _lifecycle():
    return current_app.extensions["lifecycle"]


def _disconnected() -> Callable[[], bool] | None:
    return request.environ.get("waitress.client_disconnected")


def _json_body() -> dict:
    # Over MAX_CONTENT_LENGTH, get_data raises the 413 itself.
    return fmt.parse_json_body(request.get_data(cache=False))


def _encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, special=True)
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    if not ids:
        raise ApiError(400, "The prompt is empty.", "prompt")
    return ids


def _check_token_ids(tokenizer, ids: tuple[int, ...]) -> list[int]:
    vocab_size = getattr(tokenizer, "vocab_size", None)
    if vocab_size is not None and max(ids) >= vocab_size:
        raise ApiError(400, f"Token id {max(ids)} is outside the vocabulary (size {vocab_size}).", "prompt")
    return list(ids)


def _submit(
    engine,
    prompt_ids: list[int],
    params: fmt.GenerationParams,
    answer_id: str,
    param: str,
    options: SamplingOptions,
    grammar: str | None = None,
) -> Answer:
    """Build one engine request per choice and queue them; QueueFull / EngineNotReady go to the
    app handlers, after the choices already queued are aborted."""
    if params.n > engine.n_slots:
        raise ApiError(400, f"n is {params.n}; this server runs at most {engine.n_slots} sequences at once.", "n")
    try:
        room = completion_room(len(prompt_ids), engine.max_context, current_app.config.get("MAX_PROMPT_TOKENS"))
    except PromptTooLong as e:
        raise ApiError(400, str(e), param, "context_length_exceeded") from e
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    check_token_ids(options, engine.tokenizer.vocab_size)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop_token_ids=frozenset() if params.ignore_eos else frozenset(engine.tokenizer.stop_ids),
        **options.engine_fields(),
    )
    if grammar is not None and params.ignore_eos:
        raise ApiError(400, "ignore_eos cannot be combined with constrained output.", "ignore_eos")
    outputs = ChoiceOutputs(params.n) if params.n > 1 else None
    requests = []
    for index in range(params.n):
        constraint = None
        if grammar is not None:
            try:
                constraint = engine.grammars.matcher(grammar)  # one each: a matcher follows its own output
            except GrammarError as e:
                raise ApiError(400, f"The output constraint does not compile: {e}") from e
        if outputs is None:
            requests.append(Request(prompt_ids, sampling, id=answer_id, constraint=constraint))
        else:
            # the same seed in every choice would give n copies of one answer
            seeded = replace(sampling, seed=None if sampling.seed is None else sampling.seed + index)
            requests.append(Request(prompt_ids, seeded, f"{answer_id}-{index}", outputs.outbox(index), constraint=constraint))
    answer = Answer(answer_id, engine, outputs, params.stop, _disconnected(), _lifecycle())
    try:
        for req in requests:
            engine.submit(req)
            answer.submitted(req)
    except Exception:
        answer.close()
        raise
    return answer


def _finish_reason(reader: ChoiceReader, parser: OutputParser) -> str:
    if parser.tool_calls and reader.finish_reason == FinishReason.STOP:
        return "tool_calls"
    return reader.finish_reason


def _event_stream(answer: Answer, events: Iterator[str]) -> Response:
    def stream():
        try:
            yield from events
        except ClientGone:
            pass
        except Exception:
            # The status line is long gone; the client can only learn of a bug from the stream.
            log.exception("streaming %s failed", answer.id)
            yield responses.sse(error_body("Internal server error.", "server_error", None, "internal_error"))
            yield responses.SSE_DONE
        finally:
            # Under Waitress a closed connection surfaces here as GeneratorExit: free the slots.
            answer.close()

    response = Response(stream(), mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # reverse proxies must not buffer the stream
    # A generator that is closed before it ever started runs no `finally`; this still aborts.
    response.call_on_close(answer.close)
    return response


def _ending(answer: Answer, choices: Iterator[str], usage_chunk: Callable[[dict], dict] | None) -> Iterator[str]:
    """The choices' events, then the usage chunk when asked, then `[DONE]`; an engine failure
    becomes an error event instead."""
    try:
        yield from choices
    except ApiError as e:
        yield responses.sse(e.body())
        yield responses.SSE_DONE
        return
    if usage_chunk is not None:
        yield responses.sse(usage_chunk(answer.usage()))
    yield responses.SSE_DONE


def _chat_events(answer: Answer, parsers: list[OutputParser], parallel: bool, include_usage: bool, model: str) -> Iterator[str]:
    streams = [
        _chat_choice_events(answer, index, reader, parser, parallel, model)
        for index, (reader, parser) in enumerate(zip(answer.readers, parsers))
    ]
    usage = partial(responses.chat_usage_chunk, answer.id, answer.created, model) if include_usage else None
    return _ending(answer, interleave(streams, answer.outputs), usage)


def _chat_choice_events(
    answer: Answer, index: int, reader: ChoiceReader, parser: OutputParser, parallel: bool, model: str
) -> Iterator[str]:
    req = reader.request
    sent = 0  # output tokens whose logprobs went out already

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        nonlocal sent
        body = responses.chat_chunk(answer.id, answer.created, model, delta, finish_reason, index)
        if req.params.logprobs and delta.keys() != {"role", "content"}:
            entries, sent = req.logprobs[sent : reader.completion_tokens], reader.completion_tokens
            if entries:
                body["choices"][0]["logprobs"] = chat_logprobs(reader.engine.tokenizer, entries)
        return responses.sse(body)

    # Sent before any token so the client sees the stream open even during a long prefill.
    yield chunk({"role": "assistant", "content": ""})
    tool_index = 0
    for pieces in _parse(reader, parser, parallel):
        for piece in pieces:
            yield chunk(responses.chat_delta(piece, tool_index))
            tool_index += piece.kind == "tool_call"
    yield chunk({}, _finish_reason(reader, parser))


def _parse(reader: ChoiceReader, parser: OutputParser, parallel: bool) -> Iterator[list[Piece]]:
    """The parser's pieces as text arrives; without `parallel`, tool calls after the first are dropped."""
    calls = 0

    def keep(piece: Piece) -> bool:
        nonlocal calls
        calls += piece.kind == "tool_call"
        return parallel or piece.kind != "tool_call" or calls == 1

    for text in reader.texts():
        yield [p for p in parser.feed(text) if keep(p)]
    yield [p for p in parser.finish() if keep(p)]


def _completion_events(answer: Answer, echoes: list[CompletionEcho], include_usage: bool, model: str) -> Iterator[str]:
    streams = [
        _completion_choice_events(answer, index, reader, echo, model) for index, (reader, echo) in enumerate(zip(answer.readers, echoes))
    ]
    usage = partial(responses.completion_usage_chunk, answer.id, answer.created, model) if include_usage else None
    return _ending(answer, interleave(streams, answer.outputs), usage)


def _completion_choice_events(answer: Answer, index: int, reader: ChoiceReader, echo: CompletionEcho, model: str) -> Iterator[str]:
    offset = 0  # where the next chunk's text starts in the whole choice's text

    def chunk(text: str, finish_reason: str | None = None, scored: bool = True, upto=None) -> str:
        nonlocal offset
        body = responses.completion_chunk(answer.id, answer.created, model, text, finish_reason, index)
        if scored:
            tokens = reader.completion_tokens if upto is None else upto
            body["choices"][0]["logprobs"] = echo.logprobs(tokens, offset)
        offset += len(text)
        return responses.sse(body)

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
