"""OpenAI's Responses API (`/v1/responses`: Codex CLI, the Agents SDK), as pure functions: a body
translated into the chat body the chat side validates, and the response, its output items and its
stream's events built from parsed output pieces.

Requests (`chat_body(body, history)`):
- `instructions` become the system message; `input` is a string or items: messages (roles user,
  assistant, system, developer; `input_text` / `output_text` parts, `input_image` parts with a data:
  URL as chat's image parts), `function_call` (an assistant
  tool call) and `function_call_output` (a tool message); earlier `reasoning` items are dropped.
  `history` is the items of the `previous_response_id` chain, put before `input`.
- `tools`: function tools become chat tools; tools of other types (`web_search`, `namespace`,
  `local_shell`, `custom`, ...) are skipped, since Codex sends them with every request and the model
  can only call functions; `tool_choice` auto / none / required / a named function.
- `text.format` json_schema / json_object become `response_format`; `max_output_tokens` is
  `max_tokens`; `reasoning.effort` is chat's `reasoning_effort`. Fields that change nothing here
  (`store`, `include`, `reasoning`'s others,
  `prompt_cache_key`, `client_metadata`, `metadata`, `truncation`, `service_tier`, `user`,
  `safety_identifier`) are accepted; any other is a 400 naming it.

Responses: `Output` turns pieces into output items (`reasoning`, `message` with `output_text`,
`function_call`) and, streaming, into the events that add, extend and finish them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from webapp.engine.serving.request import FinishReason
from webapp.openai.errors import ApiError
from webapp.openai.output_text import Piece

_INERT = frozenset(
    {
        "store",
        "include",
        "reasoning",
        "prompt_cache_key",
        "client_metadata",
        "metadata",
        "truncation",
        "service_tier",
        "user",
        "safety_identifier",
    }
)
_FIELDS = _INERT | frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "previous_response_id",
    }
)
_ROLES = ("user", "assistant", "system", "developer")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def input_items(body: dict) -> list[dict]:
    """The request's `input` as items (a string is one user message)."""
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'input' must be a string or a non-empty array of items.", "input")
    return raw


def chat_body(body: dict, history: list[dict]) -> dict:
    """A /v1/responses body (after `history`, the earlier turns' items) as a chat body."""
    unknown = sorted(k for k in body if k not in _FIELDS)
    if unknown:
        raise ApiError(400, f"Unsupported parameter: '{unknown[0]}'.", unknown[0])
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string.", "instructions")
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate([*history, *input_items(body)]):
        _add_item(messages, item, f"input[{i - len(history)}]" if i >= len(history) else "previous_response_id")
    out: dict[str, Any] = {"messages": messages, "stream": bool(body.get("stream", False))}
    for ours, theirs in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"), ("max_tokens", "max_output_tokens")):
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        raise ApiError(400, "'tools' must be an array.", "tools")
    functions = (_tool(tool, f"tools[{i}]") for i, tool in enumerate(body.get("tools") or []))
    tools = [t for t in functions if t is not None]
    if tools:
        out["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        out["tool_choice"] = _tool_choice(choice) if tools or choice in ("auto", "none") else "none"
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:
        out["response_format"] = _response_format(fmt)
    effort = body["reasoning"].get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort is not None:  # chat's reasoning_effort: the template's thinking switches (reasoning_controls.py)
        out["reasoning_effort"] = effort
    return out


def _text(content: Any, where: str) -> str | list[dict]:
    """A message's content as chat's: its text, or where it holds images chat's parts in their order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}.content' must be a string or an array of parts.", f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            if not isinstance(part.get("image_url"), str) or not part["image_url"].startswith(("data:", "http://", "https://")):
                why = "an input_image needs its image_url: a data: URL, or an http(s) URL the server may fetch (it keeps no files)"
                raise ApiError(400, f"'{where}.content[{j}]': {why}.", f"{where}.content")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ApiError(400, f"'{where}.content[{j}]' of type {kind!r} is not supported; text and images are.", f"{where}.content")
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def _add_item(messages: list[dict], item: Any, where: str) -> None:
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "message":
        if item.get("role") not in _ROLES:
            raise ApiError(400, f"'{where}.role' must be one of {', '.join(_ROLES)}.", f"{where}.role")
        messages.append({"role": item["role"], "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise ApiError(400, f"'{where}': a function_call needs call_id, name and arguments strings.", where)
        call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
            last.setdefault("tool_calls", []).append(call)  # parallel calls of one turn
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(item.get("call_id"), str):
            raise ApiError(400, f"'{where}': a function_call_output needs a call_id.", where)
        messages.append(
            {"role": "tool", "tool_call_id": item["call_id"], "content": output if isinstance(output, str) else _text(output, where)}
        )
    elif kind != "reasoning":
        raise ApiError(
            400, f"'{where}' has type {kind!r}; message, function_call, function_call_output and reasoning items are supported.", where
        )


def _tool(tool: Any, where: str) -> dict | None:
    if not isinstance(tool, dict):
        raise ApiError(400, f"'{where}' must be an object.", where)
    if tool.get("type") != "function":
        return None  # web_search, namespace, local_shell, custom...: not something this model can call
    if not isinstance(tool.get("name"), str):
        raise ApiError(400, f"'{where}.name' must be a string.", where)
    function = {"name": tool["name"]}
    for key in ("description", "parameters"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}.', "tool_choice")


def _response_format(fmt: Any) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise ApiError(400, "text.format.type must be text, json_object or json_schema.", "text.format")


# --- responses -----------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},  # not told apart from the answer's tokens
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(id: str, model: str, body: dict, output: list[dict], status: str, usage: dict | None, incomplete: str | None = None) -> dict:
    return {
        "id": id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "usage": usage,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "error": None,
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "tools": [t for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "store": body.get("store", True),
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": body.get("metadata") or {},
    }


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """The response's status and incomplete reason for how the request ended."""
    return ("incomplete", "max_output_tokens") if finish_reason == FinishReason.LENGTH else ("completed", None)


class Output:
    """The output items of one answer, built piece by piece; `add` returns the stream's events
    (dicts without `sequence_number`, which the view numbers)."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: str | None = None  # the type of the last item while it can still grow

    def add(self, piece: Piece) -> list[dict]:
        events = []
        if piece.kind == "tool_call":
            events += self.close()
            function = piece.value["function"]
            item = {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": piece.value.get("id") or new_id("call"),
                "name": function["name"],
                "arguments": "",
                "status": "in_progress",
            }
            self.items.append(item)
            index = len(self.items) - 1
            events.append({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
            item["arguments"] = function["arguments"]
            events.append(
                {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index, "delta": item["arguments"]}
            )
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "arguments": item["arguments"],
                }
            )
            item["status"] = "completed"
            events.append({"type": "response.output_item.done", "output_index": index, "item": dict(item)})
            return events
        if not piece.value:
            return events
        kind = "message" if piece.kind == "content" else "reasoning"
        if self._open != kind:
            events += self.close()
            events += self._open_item(kind)
        item, index = self.items[-1], len(self.items) - 1
        part = item["content"][0]
        part["text"] += piece.value
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        events.append({"type": delta, "item_id": item["id"], "output_index": index, "content_index": 0, "delta": piece.value})
        return events

    def _open_item(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open = kind
        index = len(self.items) - 1
        events = [{"type": "response.output_item.added", "output_index": index, "item": json.loads(json.dumps(item))}]
        item["content"].append(part)
        if kind == "message":
            events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": dict(part),
                }
            )
        return events

    def close(self) -> list[dict]:
        """The events that finish the item still open, if one is."""
        if self._open is None:
            return []
        kind, self._open = self._open, None
        item, index = self.items[-1], len(self.items) - 1
        part = item["content"][0]
        if kind == "message":
            item["status"] = "completed"
            events = [
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": part["text"],
                },
                {
                    "type": "response.content_part.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": dict(part),
                },
            ]
        else:
            events = [
                {
                    "type": "response.reasoning_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": part["text"],
                }
            ]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": json.loads(json.dumps(item))}]
