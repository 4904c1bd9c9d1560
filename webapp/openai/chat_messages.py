"""A chat body's messages, validated into the dicts chat templates render.

Contract: `parse_messages(messages, max_messages)` returns each message as {"role", "content", and
where given "tool_calls", "name", "tool_call_id", "reasoning_content"}: content a string (a list of
parts joined, an image part standing as images.IMAGE_MARKER), tool call arguments parsed from their
JSON string where it is one. Anything else is an `ApiError` 400 naming the message. Pure Python.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from webapp.openai import images
from webapp.openai.errors import ApiError

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def parse_messages(messages: Any, max_messages: int) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array.", "messages")
    if len(messages) > max_messages:
        raise ApiError(
            400,
            f"'messages' may hold at most {max_messages} messages, got {len(messages)}.",
            "messages",
            "array_above_max_length",
        )
    return tuple(_parse_message(m, f"messages[{i}]") for i, m in enumerate(messages))


def _parse_message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise ApiError(400, f"'{where}' must be an object.", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(
            400,
            f"'{where}.role' must be one of {', '.join(sorted(ROLES))}; got {role!r}.",
            f"{where}.role",
        )
    content = _parse_content(message.get("content"), f"{where}.content")
    out: dict[str, Any] = {"role": role, "content": content}
    tool_calls = message.get("tool_calls")
    if role == "assistant" and tool_calls is not None:
        out["tool_calls"] = _parse_tool_calls(tool_calls, f"{where}.tool_calls")
    if content is None:
        if not out.get("tool_calls"):
            raise ApiError(400, f"'{where}' has no content.", f"{where}.content")
        out["content"] = ""  # templates test `content is string`; null trips some of them
    for key in ("name", "tool_call_id", "reasoning_content"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _parse_content(content: Any, where: str) -> str | None:
    """A message's text; an image part stands in it as images.IMAGE_MARKER."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}' must be a string or an array of text and image parts.", where)
    texts = []
    for i, part in enumerate(content):
        if images.is_image(part):
            texts.append(images.part_text(part, f"{where}[{i}]", where))
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            if images.IMAGE_MARKER in part["text"]:
                raise ApiError(400, f"'{where}[{i}]' holds {images.IMAGE_MARKER}, which stands for an image here.", where)
            texts.append(part["text"])
        else:
            raise ApiError(400, f"'{where}[{i}]' must be a text or an image_url part.", where)
    return "\n".join(texts)


def _parse_tool_calls(tool_calls: Any, where: str) -> list[dict]:
    if not isinstance(tool_calls, list):
        raise ApiError(400, f"'{where}' must be an array.", where)
    out = []
    for i, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"'{where}[{i}]' must have a function with a name.", where)
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            # A model's malformed arguments may come back verbatim; those stay text.
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments) if arguments.strip() else {}
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out
