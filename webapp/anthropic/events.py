"""Anthropic's Messages API, responses: the message, its content blocks, the stream's events and the
error shape, as plain dicts the `anthropic` client parses.

- `Blocks` turns parsed output pieces (`webapp.openai.output_text.Piece`: content, reasoning, tool
  calls) into content blocks, and, streaming, into the events that open, extend and close them:
  reasoning becomes `thinking` blocks, text `text` blocks, a tool call a `tool_use` block whose
  input is sent whole as one `input_json_delta`.
- `stop_reason(finish_reason, stop_sequence, called_tools)`: `end_turn`, `max_tokens`,
  `stop_sequence` or `tool_use`.
- `error_body(status, message)`: `{"type": "error", "error": {"type", "message"}}`, its type by
  status; `api_error_body(e)` is that of an `ApiError`, the Anthropic family's error shape.
"""

from __future__ import annotations

import json
import uuid

from webapp.engine.serving.request import FinishReason
from webapp.openai.errors import ApiError
from webapp.openai.output_text import Piece, arguments_object
from webapp.openai.response_bodies import sse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def api_error_body(e: ApiError) -> dict:
    return error_body(e.status, e.message)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def event(kind: str, data: dict) -> str:
    """One server-sent event as Anthropic sends them: a named event whose data repeats the type."""
    return sse({"type": kind, **data}, event=kind)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    # input_tokens counts what was not read from the cache, as Anthropic's usage does
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": completion_tokens,
    }


def message(id: str, model: str, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
    return {
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


def stop_reason(finish_reason: str | None, stop_sequence: str | None, called_tools: bool) -> str:
    if finish_reason == FinishReason.LENGTH:
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if called_tools else "end_turn"


def _tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": new_id("toolu"), "name": call["function"]["name"], "input": arguments_object(call)}


class Blocks:
    """The content blocks of one answer, built piece by piece; `add` returns the stream's events."""

    def __init__(self):
        self.content: list[dict] = []
        self._open: str | None = None  # the kind of the last block while it can still grow

    @property
    def called_tools(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.content)

    def add(self, piece: Piece) -> list[str]:
        events: list[str] = []
        kind = {"content": "text", "reasoning": "thinking", "tool_call": "tool_use"}[piece.kind]
        if kind == "tool_use":
            events += self.close()
            block = _tool_use(piece.value)
            self.content.append(block)
            index = len(self.content) - 1
            events.append(event("content_block_start", {"index": index, "content_block": {**block, "input": {}}}))
            partial = json.dumps(block["input"], ensure_ascii=False)
            events.append(event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": partial}}))
            events.append(event("content_block_stop", {"index": index}))
            return events
        if not piece.value:
            return events
        if self._open != kind:
            events += self.close()
            self.content.append({"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""})
            self._open = kind
            events.append(event("content_block_start", {"index": len(self.content) - 1, "content_block": dict(self.content[-1])}))
        self.content[-1][kind] += piece.value
        delta = {"type": "text_delta", "text": piece.value} if kind == "text" else {"type": "thinking_delta", "thinking": piece.value}
        events.append(event("content_block_delta", {"index": len(self.content) - 1, "delta": delta}))
        return events

    def close(self) -> list[str]:
        """The events that close the block still open, if one is."""
        if self._open is None:
            return []
        index, kind = len(self.content) - 1, self._open
        self._open = None
        closing = (
            [event("content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": ""}})]
            if kind == "thinking"
            else []
        )
        return closing + [event("content_block_stop", {"index": index})]
