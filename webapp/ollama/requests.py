"""Ollama's API, requests: `/api/chat`, `/api/generate` and `/api/embed` bodies translated into the
OpenAI bodies the rest of the server validates, so Ollama's clients take the same path to the
engine (template, tools, grammar, stops) as OpenAI's.

Contract: `chat_body`, `generate_body`, `embed_body` and `embeddings_body` return an OpenAI chat, completion or
embeddings body, or raise `ApiError` naming the Ollama field at fault; `model_name` is the name a
client sent, less Ollama's `:latest` tag, which this server's names never carry.
- `options`: `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, `num_predict` (-1 or -2:
  until the context is full), `repeat_penalty`, `presence_penalty`, `frequency_penalty`. Options
  that only tune Ollama's own runner (`num_ctx`, `num_gpu`, `num_thread`, `mirostat`, ...) change
  nothing here and are accepted; any other is a 400 naming it.
- `format`: "json" (any JSON object) or a JSON schema, as constrained output.
- `think`: true or false sets the chat template's `enable_thinking` (Qwen3's switch), a level
  ("low", "medium", "high") OpenAI's `reasoning_effort` (openai/reasoning_controls.py); what a model
  thinks comes back in `thinking`.
- `stream` is true unless the body says false, as in Ollama; `keep_alive` (a duration, "5m", or
  seconds; 0: unload after this request; negative: keep loaded) is `keep_alive_seconds`, the idle
  time after which the model sleeps where the server unloads idle models.
- Messages: `images` (base64 strings) go before the message's text as image parts; an assistant's `tool_calls`
  (arguments as an object) become OpenAI tool calls and its `thinking` its reasoning, a `tool`
  message answers the last call of its `tool_name` (else the last call).
- `/api/generate`: the prompt (with `system`) goes through the chat template, or with `raw` as it
  is (`images` then refused: no template places them); `suffix`, a `template` of its own and a
  non-empty `context` are refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

from webapp.openai.errors import ApiError
from webapp.openai.images import data_url

# Ollama's options that tune its own runner (memory, threads, GPUs, the context it allocates, its
# other samplers): nothing here reads them
_RUNNER_OPTIONS = frozenset(
    "num_ctx num_batch num_gpu main_gpu low_vram vocab_only use_mmap use_mlock num_thread numa num_keep "
    "typical_p repeat_last_n tfs_z mirostat mirostat_tau mirostat_eta penalize_newline".split()
)
_SAMPLING_OPTIONS = {  # Ollama's name -> the OpenAI body's
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
_COMMON = frozenset({"model", "options", "format", "stream", "keep_alive", "think"})
_CHAT_FIELDS = _COMMON | {"messages", "tools"}
_GENERATE_FIELDS = _COMMON | {"prompt", "system", "raw", "suffix", "template", "images", "context"}
_EMBED_FIELDS = frozenset({"model", "input", "truncate", "options", "keep_alive", "dimensions"})
_EMBEDDINGS_FIELDS = frozenset({"model", "prompt", "options", "keep_alive"})  # the older /api/embeddings
THINK_LEVELS = ("low", "medium", "high")


def model_name(body: dict) -> str | None:
    name = body.get("model")
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model: a model name is expected.", "model")
    return name.removesuffix(":latest")


_DURATION = re.compile(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(body: dict) -> float | None:
    """`keep_alive` in seconds: a number, or a duration as Go writes one ("5m", "1h30m", "-1")."""
    value = body.get("keep_alive")
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        sign, text = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
        try:
            return sign * float(text)  # a bare number: seconds
        except ValueError:
            pass
        parts = _DURATION.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    raise ApiError(400, 'keep_alive: a duration ("5m", "1h") or a number of seconds is expected.', "keep_alive")


def streams(body: dict) -> bool:
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream: true or false is expected.", "stream")
    return stream


def chat_body(body: dict) -> dict:
    """An /api/chat body as a /v1/chat/completions body."""
    _reject_unknown(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "messages: a list of messages is expected.", "messages")
    out = _common(body)
    out["messages"] = _messages(messages)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError(400, "tools: a list of tools is expected.", "tools")
        if tools:
            out["tools"] = tools  # Ollama's tools are OpenAI's: {"type": "function", "function": {...}}
    return out


def generate_body(body: dict) -> tuple[str, dict]:
    """An /api/generate body as ("chat", a chat body) or, with `raw`, ("completion", a completion body)."""
    _reject_unknown(body, _GENERATE_FIELDS)
    for field, why in (("suffix", "fill-in-the-middle"), ("template", "a template of the request's own")):
        if body.get(field):
            raise ApiError(400, f"{field}: this server does not take {why}.", field)
    if body.get("context"):
        raise ApiError(400, "context: this server does not continue from token ids; send the conversation to /api/chat.", "context")
    prompt, system, raw = body.get("prompt", ""), body.get("system"), body.get("raw", False)
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt: a string is expected.", "prompt")
    if system is not None and not isinstance(system, str):
        raise ApiError(400, "system: a string is expected.", "system")
    if not isinstance(raw, bool):
        raise ApiError(400, "raw: true or false is expected.", "raw")
    out = _common(body)
    if raw:
        if body.get("images"):
            raise ApiError(400, "images: a raw prompt has no place for them; send them without raw.", "images")
        if system:
            raise ApiError(400, "system: a raw prompt is sent as it is, without a system prompt.", "system")
        if "response_format" in out:
            raise ApiError(400, "format: a raw prompt's output is not constrained here; use /api/chat.", "format")
        for template_only in ("chat_template_kwargs", "reasoning_effort"):  # `think`: no template renders a raw prompt
            out.pop(template_only, None)
        return "completion", out | {"prompt": prompt}
    user = {"role": "user", "content": _with_images(prompt, body.get("images"), "images")}
    return "chat", out | {"messages": ([{"role": "system", "content": system}] if system else []) + [user]}


def embed_body(body: dict) -> dict:
    """An /api/embed body as a /v1/embeddings body."""
    _reject_unknown(body, _EMBED_FIELDS)
    if not isinstance(body.get("truncate", True), bool):
        raise ApiError(400, "truncate: true or false is expected.", "truncate")
    keep_alive_seconds(body)
    _options(body.get("options"))  # checked; none of them changes an embedding
    out = {"input": body.get("input")}
    if body.get("dimensions") is not None:
        out["dimensions"] = body["dimensions"]
    return out


def embeddings_body(body: dict) -> dict:
    """An /api/embeddings body (one `prompt`) as a /v1/embeddings body."""
    _reject_unknown(body, _EMBEDDINGS_FIELDS)
    return {"input": body.get("prompt")}


def _common(body: dict) -> dict:
    """What /api/chat and /api/generate share, as OpenAI body fields."""
    out = {"stream": streams(body)}
    think = body.get("think")
    if isinstance(think, bool):  # the switch of the templates that have one (Qwen3's enable_thinking)
        out["chat_template_kwargs"] = {"enable_thinking": think}
    elif think in THINK_LEVELS:  # gpt-oss's levels, thinking on for the others
        out["reasoning_effort"] = think
    elif think is not None:
        raise ApiError(400, 'think: true, false, "low", "medium" or "high" is expected.', "think")
    keep_alive_seconds(body)  # checked here; the view hands it to the model's lease
    out |= _options(body.get("options"))
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise ApiError(400, 'format: "json" or a JSON schema is expected.', "format")
    return out


def _options(options: Any) -> dict:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ApiError(400, "options: an object is expected.", "options")
    out = {}
    for name, value in options.items():
        if name in _SAMPLING_OPTIONS:
            out[_SAMPLING_OPTIONS[name]] = value
        elif name == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value not in (-1, -2)):
                raise ApiError(400, "options.num_predict: a whole number of at least 1 (or -1, -2: no limit) is expected.", "options")
            if value > 0:
                out["max_tokens"] = value
        elif name not in _RUNNER_OPTIONS:
            raise ApiError(400, f"options.{name}: not an option this server knows.", "options")
    return out


def _with_images(text: str, images: Any, where: str) -> str | list[dict]:
    """A message's text, or with images chat's parts: the images (base64, any format), then the text."""
    if not images:
        return text
    if not isinstance(images, list) or not all(isinstance(image, str) for image in images):
        raise ApiError(400, f"{where}: a list of base64 strings is expected.", "images")
    return [data_url("", image) for image in images] + ([{"type": "text", "text": text}] if text else [])


def _messages(messages: list) -> list[dict]:
    out, calls = [], []  # calls: (id, name) of every tool call so far, for the tool messages after them
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where}: an object is expected.", "messages")
        role, content = message.get("role"), message.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content: a string is expected.", "messages")
        entry = {"role": role, "content": _with_images(content, message.get("images"), f"{where}.images")}
        if role == "assistant":
            if isinstance(message.get("thinking"), str) and message["thinking"]:
                entry["reasoning_content"] = message["thinking"]
            tool_calls = _tool_calls(message.get("tool_calls"), where, len(calls))
            if tool_calls:
                entry["tool_calls"] = tool_calls
                calls += [(call["id"], call["function"]["name"]) for call in tool_calls]
        elif role == "tool":
            name = message.get("tool_name")
            answered = [id_ for id_, called in calls if called == name] or [id_ for id_, _ in calls]
            entry["tool_call_id"] = answered[-1] if answered else "call_0"
        out.append(entry)
    return out


def _tool_calls(tool_calls: Any, where: str, first: int) -> list[dict]:
    if tool_calls is None:
        return []
    if not isinstance(tool_calls, list):
        raise ApiError(400, f"{where}.tool_calls: a list is expected.", "messages")
    out = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{where}.tool_calls[{j}]: {{'function': {{'name': ..., 'arguments': {{...}}}}}} is expected.", "messages")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, dict):
            raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments: an object is expected.", "messages")
        out.append(
            {"id": f"call_{first + j}", "type": "function", "function": {"name": function["name"], "arguments": json.dumps(arguments)}}
        )
    return out


def _reject_unknown(body: dict, known: frozenset) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: not a field this server knows.", unknown[0])
