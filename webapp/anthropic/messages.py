"""Anthropic's Messages API, requests: a `/v1/messages` body translated into the chat body the
OpenAI side validates, so both APIs share one path to the engine (template, tools, grammar, stops).

Contract: `chat_body(body)` returns an OpenAI chat-completions body, or raises `ApiError` naming the
Anthropic field at fault; `parse_json_body` and everything after it are the OpenAI side's.
- `system` (a string or text blocks) becomes the system message, less Claude Code's
  `x-anthropic-billing-header:` line: it changes with every request, so keeping it would make each
  turn's prompt differ from the last one's at its first tokens and lose the whole prefix cache.
- `messages`: text blocks join as text; an assistant's `tool_use` blocks become tool calls; a user's
  `tool_result` blocks become tool messages, before that user turn's own text. `thinking` blocks
  of earlier turns are dropped (the template would not show them). A user's `image` blocks (base64
  sources) become image parts where they stand among its text; URL sources and documents are refused.
- `tools` with `input_schema` become function tools; `tool_choice` auto / any / tool / none map to
  auto / required / that function / none, and `disable_parallel_tool_use` to `parallel_tool_calls`.
- `max_tokens` is required, `temperature` is 0..1, `stop_sequences` are stop strings.
- `thinking` `enabled` / `disabled` sets the chat template's `enable_thinking` (Qwen3's switch;
  openai/reasoning_controls.py), `adaptive` leaves the template's default; an enabled one's
  `budget_tokens` is the thinking budget.
- Fields that change nothing here (`metadata`, `cache_control` on blocks, Claude Code's
  `context_management` and `output_config`, `service_tier`) are accepted and ignored; any other is a
  400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from webapp.openai import images
from webapp.openai.errors import ApiError

BILLING_HEADER = "x-anthropic-billing-header:"
_INERT = frozenset({"metadata", "context_management", "output_config", "service_tier", "container"})
_FIELDS = _INERT | frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
    }
)
_COUNT_FIELDS = _INERT | frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})


def chat_body(body: dict) -> dict:
    """A /v1/messages body as a /v1/chat/completions body."""
    _reject_unknown(body, _FIELDS)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, "max_tokens: a whole number of at least 1 is required.", "max_tokens")
    out = _conversation(body)
    out["max_tokens"] = max_tokens
    for key in ("model", "top_p", "top_k"):
        if body.get(key) is not None:
            out[key] = body[key]
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 1:
            raise ApiError(400, "temperature: a number from 0 to 1 is expected.", "temperature")
        out["temperature"] = temperature
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ApiError(400, "stop_sequences: an array of strings is expected.", "stop_sequences")
        if stops:
            out["stop"] = stops
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream: true or false is expected.", "stream")
    out["stream"] = stream
    return out


def count_tokens_body(body: dict) -> dict:
    """A /v1/messages/count_tokens body as a chat body (without anything to generate)."""
    _reject_unknown(body, _COUNT_FIELDS)
    return _conversation(body)


def _conversation(body: dict) -> dict:
    _check_thinking(body.get("thinking"))
    messages = _system(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages: a non-empty array is required.", "messages")
    for i, message in enumerate(raw):
        messages += _message(message, f"messages.{i}")
    out: dict[str, Any] = {"messages": messages}
    thinking = (body.get("thinking") or {}).get("type")
    if thinking in ("enabled", "disabled"):  # the switch of the templates that have one (Qwen3's enable_thinking)
        out["chat_template_kwargs"] = {"enable_thinking": thinking == "enabled"}
    budget = (body.get("thinking") or {}).get("budget_tokens")
    if thinking == "enabled" and budget is not None:
        out["reasoning_budget"] = budget
    tools = body.get("tools")
    if tools is not None:
        out["tools"] = _tools(tools)
    if body.get("tool_choice") is not None:
        out["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if parallel is not None:
            out["parallel_tool_calls"] = parallel
    return out


def _reject_unknown(body: dict, known: frozenset[str]) -> None:
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: Extra inputs are not permitted.", unknown[0])


def _check_thinking(thinking: Any) -> None:
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise ApiError(400, 'thinking: {"type": "enabled" | "disabled" | "adaptive", ...} is expected.', "thinking")


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        texts = [system]
    elif isinstance(system, list):
        texts = [_text_block(block, f"system.{i}") for i, block in enumerate(system)]
    else:
        raise ApiError(400, "system: a string or an array of text blocks is expected.", "system")
    texts = [t for t in texts if not t.startswith(BILLING_HEADER)]
    return [{"role": "system", "content": "\n\n".join(texts)}] if texts else []


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise ApiError(400, f"{where}: a text block is expected.", where)
    return block["text"]


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: a string or an array of content blocks is expected.", f"{where}.content")
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("document", "search_result"):
            raise ApiError(400, f"{where}.content.{i}: {kind} blocks are not supported by this model; send text.", f"{where}.content")
        if kind == "image":
            _image_part(block, f"{where}.content.{i}")
        elif kind not in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
            raise ApiError(400, f"{where}.content.{i}: unknown content block type {kind!r}.", f"{where}.content")
    return content


def _message(message: Any, where: str) -> list[dict]:
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise ApiError(400, f'{where}.role: "user" or "assistant" is expected.', f"{where}.role")
    blocks = _blocks(message.get("content"), where)
    texts = [b["text"] for b in blocks if b["type"] == "text"]
    if role == "assistant":
        if any(b["type"] == "tool_result" for b in blocks):
            raise ApiError(400, f"{where}: tool_result blocks belong in a user message.", f"{where}.content")
        calls = [_tool_call(b, f"{where}.content") for b in blocks if b["type"] == "tool_use"]
        out = {"role": "assistant", "content": "".join(texts)}
        if calls:
            out["tool_calls"] = calls
        return [out]
    if any(b["type"] == "tool_use" for b in blocks):
        raise ApiError(400, f"{where}: tool_use blocks belong in an assistant message.", f"{where}.content")
    results = [_tool_result(b, f"{where}.content") for b in blocks if b["type"] == "tool_result"]
    if any(b["type"] == "image" for b in blocks):  # OpenAI's parts, in their order
        parts = [
            _image_part(b, where) if b["type"] == "image" else {"type": "text", "text": b["text"]}
            for b in blocks
            if b["type"] in ("text", "image")
        ]
        return results + [{"role": "user", "content": parts}]
    return results + ([{"role": "user", "content": "\n\n".join(texts)}] if texts or not results else [])


def _image_part(block: dict, where: str) -> dict:
    """A base64 image block as an OpenAI image part (images.data_url); a URL source as one with that
    URL, which the server fetches only where its operator allows (images.chat_images)."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise ApiError(400, f"{where}: an image block needs a base64 or a url source.", f"{where}.source")
    if not isinstance(source.get("media_type"), str) or not isinstance(source.get("data"), str):
        raise ApiError(400, f"{where}: an image block's source needs media_type and data strings.", f"{where}.source")
    return images.data_url(source["media_type"], source["data"])


def _tool_call(block: dict, where: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
        raise ApiError(400, f"{where}: a tool_use block needs an id, a name and an input object.", where)
    arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def _tool_result(block: dict, where: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise ApiError(400, f"{where}: a tool_result block needs a tool_use_id.", where)
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n\n".join(_text_block(b, where) for b in content)
    elif not isinstance(content, str):
        raise ApiError(400, f"{where}: a tool_result's content is a string or text blocks.", where)
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise ApiError(400, "tools: an array is expected.", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"{where}: tools of type {kind!r} are not supported; custom tools with an input_schema are.", where)
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise ApiError(400, f"{where}: a tool needs a name and an input_schema object.", where)
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = (
        None if not isinstance(choice, dict) or "disable_parallel_tool_use" not in choice else not choice["disable_parallel_tool_use"]
    )
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ApiError(400, 'tool_choice: {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...} is expected.', "tool_choice")
