"""The OpenAI wire format, requests: validation into frozen parameters.

Nothing here touches Flask, HTTP or the engine; every function is pure, so all of it is testable
without a server. What the model's text means (stop strings, reasoning, tool calls) is
`webapp.openai.output_text`'s.

- `parse_chat_request` / `parse_completion_request` turn a decoded JSON body into frozen
  `ChatParams` / `CompletionParams`, or raise `ApiError` (status, message, param, code, type)
  naming the offending parameter. Fields that are null count as absent; unknown fields are
  rejected unless they cannot change the output (`user`, `metadata`, `store`). Sizes are bounded:
  at most `max_messages` messages (default `MAX_MESSAGES`), `MAX_TOOLS` tools, `MAX_STOP_STRINGS`
  stop strings of at most `MAX_STOP_LENGTH` characters each; `parse_json_body` refuses bodies
  nested deeper than `MAX_JSON_DEPTH` or holding text that is not valid Unicode (lone surrogates).
- The response shapes are `webapp.openai.response_bodies`'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from webapp.openai.chat_messages import parse_messages
from webapp.openai.errors import ApiError

MAX_JSON_DEPTH = 64
_TOO_DEEP = f"The request body is nested more than {MAX_JSON_DEPTH} levels deep."


def parse_json_body(raw: bytes) -> dict:
    """Decode a request body that must be a JSON object (whatever the Content-Type says)."""
    try:
        body = json.loads(raw, parse_float=_json_number)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from e
    except RecursionError as e:  # the C decoder gives up at the interpreter's recursion limit
        raise ApiError(400, _TOO_DEEP, code="invalid_json") from e
    if not isinstance(body, dict):
        raise ApiError(400, f"The request body must be a JSON object, not {_json_type(body)}.")
    _check_json_value(body)
    return body


def _json_number(text: str) -> int | float:
    """A JSON number with a decimal point or an exponent: an int where it is whole (5.0, 1e3), as
    JSON Schema counts integers, so that every field taking a whole number takes it in either form."""
    value = float(text)
    return int(value) if value.is_integer() else value


def _check_json_value(body: dict) -> None:
    """Refuse what would only fail later, deep inside the tokenizer or the chat template: text
    with lone UTF-16 surrogates ("\\ud800" is valid JSON but not Unicode) and absurd nesting."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
            continue
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, _TOO_DEEP, code="invalid_json")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key)
                if isinstance(item, (str, list, dict)):
                    stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value if isinstance(item, (str, list, dict)))


def _check_text(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(
                400,
                "The request body contains a lone UTF-16 surrogate, which is not valid Unicode.",
                code="invalid_json",
            ) from e


# --- request validation -------------------------------------------------------------------------

MAX_MESSAGES = 1000  # the default; the app passes its MAX_MESSAGES setting
MAX_TOOLS = 128  # OpenAI's own limit
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256  # characters; the matcher holds back up to this much text per request

# Accepted but without effect: they describe the caller, not the completion.
_INERT_FIELDS = frozenset({"user", "metadata", "store"})
_COMMON_FIELDS = _INERT_FIELDS | frozenset(
    "model max_tokens temperature top_p top_k seed stop stream stream_options n "
    "frequency_penalty presence_penalty logprobs ignore_eos min_p repetition_penalty logit_bias lora".split()
)
# validated by webapp/openai/sampling_options.py (sampling, logprobs) and webapp/openai/structured.py (grammars)
_CHAT_FIELDS = _COMMON_FIELDS | frozenset(
    "messages max_completion_tokens tools tool_choice response_format top_logprobs parallel_tool_calls grammar "
    "chat_template_kwargs reasoning_effort reasoning_budget".split()
)
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo"}


@dataclass(frozen=True, kw_only=True)
class GenerationParams:
    """What both endpoints accept; `max_tokens` None means "fill the context"."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    n: int = 1  # choices: the API checks it against the engine's slot count


@dataclass(frozen=True, kw_only=True)
class ChatParams(GenerationParams):
    # Normalised for the chat template: content is always a string, tool-call arguments are
    # objects when they parse as JSON (chat templates expect a mapping there).
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None = None
    tool_choice: str = "auto"  # "auto" | "none" | "required" | "function" (then `forced_tool`)
    forced_tool: str | None = None

    @property
    def active_tools(self) -> list[dict] | None:
        """The tools to offer the model: none at all when `tool_choice` is "none"."""
        return list(self.tools) if self.tools and self.tool_choice != "none" else None


@dataclass(frozen=True, kw_only=True)
class CompletionParams(GenerationParams):
    prompt: str | tuple[int, ...]


def parse_chat_request(body: dict, max_messages: int = MAX_MESSAGES) -> ChatParams:
    """Validate a /v1/chat/completions body."""
    body = _present(body)
    _reject_unknown(body, _CHAT_FIELDS)
    max_tokens = opt_int(body, "max_tokens", minimum=1)
    # The newer name wins; OpenAI deprecates max_tokens for chat.
    max_tokens = opt_int(body, "max_completion_tokens", minimum=1) or max_tokens
    tools = _parse_tools(body.get("tools"))
    tool_choice, forced_tool = _parse_tool_choice(body.get("tool_choice", "auto"), tools)
    return ChatParams(
        **_generation_fields(body),
        max_tokens=max_tokens,
        messages=parse_messages(body.get("messages"), max_messages),
        tools=tools,
        tool_choice=tool_choice,
        forced_tool=forced_tool,
    )


def _parse_tool_choice(choice: Any, tools: tuple[dict, ...] | None) -> tuple[str, str | None]:
    """("auto" | "none" | "required" | "function", the named function or None)."""
    if choice in ("auto", "none"):
        return choice, None
    names = [t["function"]["name"] for t in tools or ()]
    if choice == "required":
        if not names:
            raise ApiError(400, "tool_choice \"required\" needs at least one tool in 'tools'.", "tool_choice")
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise ApiError(
            400,
            'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}.',
            "tool_choice",
        )
    if fn.get("name") not in names:
        raise ApiError(400, f"tool_choice names {fn.get('name')!r}, which is not in 'tools'.", "tool_choice")
    return "function", fn["name"]


def parse_completion_request(body: dict) -> CompletionParams:
    """Validate a /v1/completions body."""
    body = _present(body)
    _reject_unknown(body, _COMPLETION_FIELDS)
    # max_tokens 0 with echo scores the prompt without generating (evaluation harnesses do this)
    echo = opt_bool(body, "echo", False)
    return CompletionParams(
        **_generation_fields(body),
        max_tokens=opt_int(body, "max_tokens", minimum=0 if echo else 1),
        prompt=_parse_prompt(body.get("prompt")),
    )


def _present(body: dict) -> dict:
    return {k: v for k, v in body.items() if v is not None}


def _reject_unknown(body: dict, known: frozenset[str]) -> None:
    for key in body:
        if key not in known:
            raise ApiError(400, f"Unrecognized request argument supplied: {key}", key)


def _generation_fields(body: dict) -> dict:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, not {_json_type(model)}.", "model")
    stream = opt_bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object.", "stream_options")
    include_usage = opt_bool(options, "include_usage", False, "stream_options.include_usage")
    top_p = opt_number(body, "top_p", 0.0, 1.0, low_open=True)
    temperature = opt_number(body, "temperature", 0.0, 2.0)
    return dict(
        model=model,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        top_k=opt_int(body, "top_k", minimum=0) or 0,
        seed=opt_int(body, "seed", minimum=-(2**63), maximum=2**64 - 1),
        stop=_parse_stop(body.get("stop")),
        stream=stream,
        include_usage=stream and include_usage,
        ignore_eos=opt_bool(body, "ignore_eos", False),
        n=opt_int(body, "n", minimum=1) or 1,
    )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def opt_int(body: dict, key: str, minimum: int | None = None, maximum: int | None = None):
    value = body.get(key)
    if value is None:
        return None
    # bool is a subclass of int in Python but not an integer in JSON.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{key}' must be an integer, not {_json_type(value)}.", key)
    if minimum is not None and value < minimum:
        raise ApiError(400, f"'{key}' must be at least {minimum}, got {value}.", key)
    if maximum is not None and value > maximum:
        raise ApiError(400, f"'{key}' must be at most {maximum}, got {value}.", key)
    return value


def opt_number(body: dict, key: str, low: float, high: float, low_open: bool = False):
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{key}' must be a number, not {_json_type(value)}.", key)
    if not (low < value <= high if low_open else low <= value <= high):
        bound = f"greater than {low}" if low_open else f"at least {low}"
        raise ApiError(400, f"'{key}' must be {bound} and at most {high}, got {value}.", key)
    return value


def opt_bool(body: dict, key: str, default: bool, param: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{param or key}' must be a boolean, not {_json_type(value)}.", param or key)
    return value


def _parse_stop(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return ()
    if not isinstance(stops, list):
        raise ApiError(400, "'stop' must be a string or an array of strings.", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' accepts at most {MAX_STOP_STRINGS} strings.", "stop")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ApiError(400, "Every stop sequence must be a non-empty string.", "stop")
        if len(s) > MAX_STOP_LENGTH:
            raise ApiError(400, f"A stop sequence may be at most {MAX_STOP_LENGTH} characters long.", "stop")
    return tuple(stops)


def _parse_prompt(prompt: Any) -> str | tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return tuple(prompt)
    raise ApiError(
        400,
        "'prompt' must be a string, an array of one string, or a non-empty array of token ids.",
        "prompt",
    )


def _parse_tools(tools: Any) -> tuple[dict, ...] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be an array.", "tools")
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"'tools' may hold at most {MAX_TOOLS} tools.", "tools", "array_above_max_length")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ApiError(400, f'\'{where}\' must be {{"type": "function", "function": {{...}}}}.', where)
        name, description, parameters = fn.get("name"), fn.get("description"), fn.get("parameters")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"'{where}.function.name' must be a non-empty string.", where)
        if description is not None and not isinstance(description, str):
            raise ApiError(400, f"'{where}.function.description' must be a string.", where)
        if parameters is not None and not isinstance(parameters, dict):
            raise ApiError(400, f"'{where}.function.parameters' must be a JSON schema object.", where)
        function = {"name": name}
        if description is not None:
            function["description"] = description
        if parameters is not None:
            function["parameters"] = parameters
        out.append({"type": "function", "function": function})
    return tuple(out) or None
