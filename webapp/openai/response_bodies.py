"""OpenAI's response bodies for chat and completions (not the Responses API: `responses_format`):
plain dicts in the shapes the `openai` client parses.

Pure functions, like `webapp.openai.request_bodies` (the requests): `chat_chunk`, `chat_completion`,
`completion_chunk`, ... build response bodies, `sse` frames one as a server-sent event, and
`chat_delta` / `assistant_message` shape `webapp.openai.output_text.Piece`s as OpenAI deltas and messages.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from webapp.openai.output_text import Piece

# Characters that Python's str.splitlines (and some other line readers) end a line at although JSON
# leaves them raw; escaped so that one event's data can never read as two lines.
_LINE_BREAKERS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict | str, event: str | None = None) -> str:
    """One server-sent event, named when `event` is given; a str payload is sent verbatim (used for `[DONE]`)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKERS)
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, drafted: int = 0, accepted: int = 0) -> dict:
    """OpenAI's usage; speculation's drafted tokens in its predicted outputs' fields (accepted ones
    confirmed by sampling, rejected ones not), where any were drafted."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if drafted:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": drafted - accepted}
    return out


def models_list(model_name: str, created: int, adapters: list[dict] = ()) -> dict:
    """The model, and each LoRA adapter a request may name as its `model`, as vLLM lists them (`parent`)."""
    model = {"id": model_name, "object": "model", "created": created, "owned_by": "local"}
    loras = [
        {"id": a["name"], "object": "model", "created": created, "owned_by": "local", "root": a["path"], "parent": model_name}
        for a in adapters
    ]
    return {"object": "list", "data": [model, *loras]}


def model_set_list(entries: list[dict]) -> dict:
    """A model set's listing as an OpenAI model list; `size` (bytes), `loaded` and `status` ride along."""
    data = [
        {"id": e["id"], "object": "model", "created": e["created"], "owned_by": "local"}
        | {"size": e["size"], "loaded": e["loaded"], "status": e["status"]}
        for e in entries
    ]
    return {"object": "list", "data": data}


def _envelope(object: str, id: str, created: int, model: str, choices: list, **extra) -> dict:
    return {
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }


def chat_chunk(id: str, created: int, model: str, delta: dict, finish_reason=None, index: int = 0) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return _envelope("chat.completion.chunk", id, created, model, [choice])


def chat_usage_chunk(id: str, created: int, model: str, usage: dict) -> dict:
    """The last chunk of a stream with `include_usage`: no choices, only usage."""
    return _envelope("chat.completion.chunk", id, created, model, [], usage=usage)


def chat_delta(piece: Piece, tool_index: int = 0) -> dict:
    """The `delta` of a streamed chunk carrying one parser piece."""
    if piece.kind == "tool_call":
        return {"tool_calls": [{"index": tool_index, **piece.value}]}
    return {"reasoning_content" if piece.kind == "reasoning" else "content": piece.value}


def assistant_message(pieces: list[Piece]) -> dict:
    """The complete assistant message for a non-streamed reply, from all parser pieces."""
    content = "".join(p.value for p in pieces if p.kind == "content")
    reasoning = "".join(p.value for p in pieces if p.kind == "reasoning").strip()
    tool_calls = [p.value for p in pieces if p.kind == "tool_call"]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content or (None if tool_calls else ""),
    }
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_choice(index: int, message: dict, finish_reason: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(id, created, model, choices: list[dict], usage: dict) -> dict:
    return _envelope("chat.completion", id, created, model, choices, usage=usage)


def completion_choice(index: int, text: str, finish_reason=None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(id: str, created: int, model: str, text: str, finish_reason=None, index: int = 0) -> dict:
    return _envelope("text_completion", id, created, model, [completion_choice(index, text, finish_reason)])


def completion_usage_chunk(id: str, created: int, model: str, usage: dict) -> dict:
    return _envelope("text_completion", id, created, model, [], usage=usage)


def completion(id, created, model, choices: list[dict], usage: dict) -> dict:
    return _envelope("text_completion", id, created, model, choices, usage=usage)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
