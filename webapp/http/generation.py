"""What every generating view shares, whatever API it speaks: reading the body, the prompt's token
ids (with images in it: `image_prompt`), one engine request per choice, reading the answer back as
parsed pieces, and the event stream that frees the slots when the client goes away.

Flask glue around `webapp.openai.choices`; each API's views (`api.py` for OpenAI's,
`anthropic_api.py` for Anthropic's) shape what these return into their own wire format.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from flask import Response, after_this_request, current_app, jsonify, request

from webapp.engine.decoding.constraints import GrammarError
from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.serving.errors import RETRY_AFTER_S, PromptTooLong, completion_room
from webapp.engine.serving.model_set import ModelNotFound, ModelsBusy, ModelSet
from webapp.engine.serving.request import Request
from webapp.engine.vision.images import ImageError
from webapp.engine.vision.vision import ImageSpan
from webapp.openai import chat_request, lora_choice, request_bodies, response_bodies, structured
from webapp.openai.chat_request import ChatRequest
from webapp.openai.choices import Answer, ChoiceOutputs, ChoiceReader, ClientGone
from webapp.openai.errors import ApiError, error_body
from webapp.openai.harmony import HarmonyParser, output_parser, template_messages
from webapp.openai.images import IMAGE_MARKER
from webapp.openai.output_text import THINK_CLOSE, THINK_OPEN, OutputParser, Piece, opens_reasoning
from webapp.openai.sampling_options import SamplingOptions, check_token_ids

log = logging.getLogger(__name__)

# Not an HTTP status the client will ever see: it has gone. Logs show why the request ended.
CLIENT_CLOSED = 499


@dataclass(frozen=True)
class ChatRun:
    """A chat request submitted to the engine, and what a view reads its answer with."""

    chat: ChatRequest
    answer: Answer
    parsers: list[OutputParser | HarmonyParser]  # one per choice (harmony.output_parser's choice)
    model: str


def parse_chat(body: dict) -> ChatRequest:
    """A chat body (whichever API it came in, translated), validated once under this app's limits."""
    return chat_request.parse_chat(body, current_app.config["MAX_MESSAGES"], current_app.extensions.get("image_fetcher"))


def start_chat(engine, chat: ChatRequest, answer_id: str, param: str) -> ChatRun:
    """Render and tokenize a chat request's prompt and submit it (the grammar of its response
    format or forced tool included)."""
    params, tools, extra = chat.params, chat.params.active_tools, chat.template_kwargs
    prompt = render_chat(engine.chat_template, list(params.messages), tools, extra=extra)
    prompt_ids, images = image_prompt(engine, prompt, chat.images) if chat.images else (encode(engine.tokenizer, prompt), ())
    ends = message_ends(engine, list(params.messages), tools, prompt, prompt_ids, extra) if engine.keeps_states else ()
    first = output_parser(engine.chat_template.source, prompt, tools)
    reasoning = reasoning_fields(engine, prompt, chat.reasoning_budget, first)
    answer = submit(engine, prompt_ids, params, answer_id, param, chat.options, chat.grammar, ends, reasoning, images)
    # one parser a choice, made once submit has checked how many choices the engine takes
    parsers = [first] + [output_parser(engine.chat_template.source, prompt, tools) for _ in answer.readers[1:]]
    return ChatRun(chat, answer, parsers, params.model or engine.model_name)


def reasoning_fields(engine, prompt: str, budget: int | None, parser: OutputParser | HarmonyParser) -> dict:
    """SamplingParams' thinking budget for this prompt: the request's, else LLM_REASONING_BUDGET;
    none where the output parser reads Harmony's channels, whose end of thinking is no one marker."""
    budget = current_app.config.get("REASONING_BUDGET") if budget is None else budget
    if budget is None or isinstance(parser, HarmonyParser):
        return {}
    markers = tuple(tuple(engine.tokenizer.encode(marker, special=True)) for marker in (THINK_OPEN, THINK_CLOSE))
    return {"reasoning_budget": int(budget), "reasoning_markers": markers, "reasoning_open": opens_reasoning(prompt)}


def render_chat(template, messages: list[dict], tools: list[dict] | None, generation: bool = True, extra: dict | None = None) -> str:
    """The prompt text (with the generation prompt unless not `generation`; `extra`, the request's
    template variables); tools a template would silently drop go into the system prompt instead."""
    messages, extra = template_messages(template.source, messages), extra or {}
    try:
        without = template.render(messages, tools=None, add_generation_prompt=generation, **extra) if tools else None
        prompt = template.render(messages, tools=tools, add_generation_prompt=generation, **extra)
        if prompt == without:
            messages = structured.with_tools_in_system_prompt(messages, tools)
            prompt = template.render(messages, tools=None, add_generation_prompt=generation, **extra)
    except ValueError as e:  # the template's TemplateError: these messages do not fit the model
        raise ApiError(400, f"The chat template rejected the messages: {e}", "messages") from e
    return prompt


def message_ends(
    engine, messages: list[dict], tools: list[dict] | None, prompt: str, prompt_ids: list[int], extra: dict | None = None
) -> tuple[int, ...]:
    """Where in `prompt_ids` the system prompt ends, the last user message starts and the generation
    prompt starts: a recurrent model snapshots its state there (Request.message_ends), for another
    user's chat with the same system prompt, an edited last message, and this chat's next turn. A
    boundary the template does not render as a prefix of the prompt, or that its tokens do not keep,
    is left out."""
    leading = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=0)
    ends = []
    for count in {leading, last_user, len(messages)} - {0}:
        try:
            text = render_chat(engine.chat_template, messages[:count], tools, generation=False, extra=extra)
        except ApiError:
            continue
        if not text or not prompt.startswith(text):
            continue
        # the shorter side is encoded again: the system prompt, or the last message's end
        if len(text) <= len(prompt) - len(text):
            head = encode(engine.tokenizer, text)
            end = len(head) if prompt_ids[: len(head)] == head else 0
        else:
            rest = engine.tokenizer.encode(prompt[len(text) :], special=True)
            end = len(prompt_ids) - len(rest) if prompt_ids[len(prompt_ids) - len(rest) :] == rest else 0
        if 0 < end < len(prompt_ids):
            ends.append(end)
    return tuple(sorted(set(ends)))


def served():
    """What serves requests: the one `Engine`, or with LLM_MODELS_DIR the `ModelSet` (health, stats, listing)."""
    return current_app.extensions["engine"]


def engine(body: dict | None = None, keep_alive: float | None = None):
    """The engine for a request body's `model`: the one place a request picks its model. With one
    model, it (whatever the name); with a model set, that model's, loaded first if need be, held
    until the response is closed (so it is never unloaded under the request), then left to sleep
    after `keep_alive` seconds idle where given (Ollama's; else LLM_IDLE_UNLOAD_SECONDS). An unknown name is a
    404 `model_not_found`; a model that cannot be loaded while every other one is busy, a 503."""
    models = served()
    if not isinstance(models, ModelSet):
        return models
    name = body.get("model") if isinstance(body, dict) else None
    try:
        lease = models.lease(name if isinstance(name, str) else None, keep_alive)  # a non-string: the body's parser refuses it
    except ModelNotFound as e:
        raise ApiError(404, str(e), "model", "model_not_found") from e
    except ModelsBusy as e:
        raise ApiError(503, str(e), "model", "model_busy", headers={"Retry-After": str(RETRY_AFTER_S)}) from e

    @after_this_request
    def release_at_close(response: Response) -> Response:
        response.call_on_close(lease.release)
        return response

    return lease.engine


def lifecycle():
    return current_app.extensions["lifecycle"]


def disconnected() -> Callable[[], bool] | None:
    return request.environ.get("waitress.client_disconnected")


def json_body() -> dict:
    # Over MAX_CONTENT_LENGTH, get_data raises the 413 itself.
    return request_bodies.parse_json_body(request.get_data(cache=False))


def encode(tokenizer, text: str) -> list[int]:
    ids = with_bos(tokenizer, tokenizer.encode(text, special=True))
    if not ids:
        raise ApiError(400, "The prompt is empty.", "prompt")
    return ids


def with_bos(tokenizer, ids: list[int]) -> list[int]:
    """A prompt's ids with the BOS first, where the model wants one and they lack it."""
    if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        return [tokenizer.bos_id, *ids]
    return ids


def image_prompt(engine, prompt: str, images: tuple[bytes, ...]) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """A rendered chat prompt with images in it: `prompt` split at its image markers
    (webapp/openai/images.py), each image prepared for the served model's projector (`engine.vision`)
    and standing as its pieces (a family's tiles and overview, or the whole image), each its family's
    text around a run of placeholder ids; the token ids, and the `ImageSpan`s the engine feeds the
    pieces' rows at. A model without a projector, a marker the chat template dropped or an image that
    does not decode is an `ApiError` 400."""
    vision, tokenizer = engine.vision, engine.tokenizer
    if vision is None:
        why = "it was loaded without a projector file (LLM_MMPROJ, or NAME.mmproj.gguf beside it)"
        raise ApiError(400, f"The model {engine.model_name} takes no images: {why}.", "messages", "images_not_supported")
    texts = prompt.split(IMAGE_MARKER)
    if len(texts) != len(images) + 1:
        kept = f"The chat template kept {len(texts) - 1} of the {len(images)} images; send them in user messages."
        raise ApiError(400, kept, "messages")
    ids, spans = with_bos(tokenizer, tokenizer.encode(texts[0], special=True)), []
    for number, (data, text) in enumerate(zip(images, texts[1:], strict=True), 1):
        try:
            pieces = vision.prepare(data)
        except ImageError as e:
            raise ApiError(400, f"Image {number} of the request: {e}.", "messages", "invalid_image") from e
        for piece in pieces:
            ids += tokenizer.encode(piece.before, special=True)
            spans.append(ImageSpan(len(ids), piece))
            ids += [vision.placeholder(piece)] * piece.tokens
            ids += tokenizer.encode(piece.after, special=True)
        ids += tokenizer.encode(text, special=True)
    return ids, tuple(spans)


def prompt_token_ids(tokenizer, ids: tuple[int, ...]) -> list[int]:
    vocab_size = getattr(tokenizer, "vocab_size", None)
    if vocab_size is not None and max(ids) >= vocab_size:
        raise ApiError(400, f"Token id {max(ids)} is outside the vocabulary (size {vocab_size}).", "prompt")
    return list(ids)


def submit(
    engine,
    prompt_ids: list[int],
    params: request_bodies.GenerationParams,
    answer_id: str,
    param: str,
    options: SamplingOptions,
    grammar: str | None = None,
    message_ends: tuple[int, ...] = (),
    reasoning: dict | None = None,
    images: tuple = (),
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
    lora = lora_choice.chosen(engine.adapters, params.model, options.lora)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop_token_ids=frozenset() if params.ignore_eos else frozenset(engine.tokenizer.stop_ids),
        **options.engine_fields(),
        **(reasoning or {}),
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
            requests.append(
                Request(prompt_ids, sampling, answer_id, message_ends=message_ends, images=images, lora=lora, constraint=constraint)
            )
        else:
            # the same seed in every choice would give n copies of one answer
            seeded = replace(sampling, seed=None if sampling.seed is None else sampling.seed + index)
            outbox = outputs.outbox(index)
            requests.append(Request(prompt_ids, seeded, f"{answer_id}-{index}", outbox, message_ends, images, lora, constraint=constraint))
    answer = Answer(answer_id, engine, outputs, params.stop, disconnected(), lifecycle())
    try:
        for req in requests:
            engine.submit(req)
            answer.submitted(req)
    except Exception:
        answer.close()
        raise
    return answer


def whole(close: Callable[[], None], read: Callable[[], dict]) -> Response:
    """A whole (not streamed) answer as JSON: `read()` waits for the engine and builds the body,
    then `close()` frees whatever is still held, however reading ended. A client that went away
    meanwhile gets nothing: the 499 is for the logs."""
    try:
        body = read()
    except ClientGone:
        return Response(status=CLIENT_CLOSED)
    finally:
        close()
    return jsonify(body)


def event_stream(
    answer: Answer, events: Iterator[str], error_event: Callable[[], str] | None = None, mimetype: str = "text/event-stream"
) -> Response:
    """`events` streamed as they come (server-sent events, or another line format by `mimetype`);
    a failure mid-stream ends it with `error_event()`, and the answer's requests end with it."""

    def stream():
        try:
            yield from events
        except ClientGone:
            pass
        except Exception:
            # The status line is long gone; the client can only learn of a bug from the stream.
            log.exception("streaming %s failed", answer.id)
            if error_event is not None:
                yield error_event()
            else:
                yield response_bodies.sse(error_body("Internal server error.", "server_error", None, "internal_error"))
                yield response_bodies.SSE_DONE
        finally:
            # Under Waitress a closed connection surfaces here as GeneratorExit: free the slots.
            answer.close()

    response = Response(stream(), mimetype=mimetype)
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # reverse proxies must not buffer the stream
    # A generator that is closed before it ever started runs no `finally`; this still aborts.
    response.call_on_close(answer.close)
    return response


def parse(reader: ChoiceReader, parser: OutputParser, parallel: bool) -> Iterator[list[Piece]]:
    """The parser's pieces as text arrives; without `parallel`, tool calls after the first are dropped."""
    calls = 0

    def keep(piece: Piece) -> bool:
        nonlocal calls
        calls += piece.kind == "tool_call"
        return parallel or piece.kind != "tool_call" or calls == 1

    for text in reader.texts():
        yield [p for p in parser.feed(text) if keep(p)]
    yield [p for p in parser.finish(cut=reader.finish_reason == "length") if keep(p)]
