"""Ollama's API, answers: the objects its routes return and the newline-delimited JSON its streams
are made of.

Contract: a stream is `line(obj)` after `line(obj)`; a generation's pieces go out as `chat_line` /
`generate_line` objects with `done` false, and its last object is `done(...)` with `done_reason`
("stop", or "length" where `num_predict` or the context ended it) and Ollama's counts and
durations (nanoseconds, from the engine's request: queued to first token is the prompt's, first
token to last the answer's). An error is `{"error": message}`, in a stream as its last line.
`model_entry` is a model as `/api/tags`, `/api/ps` and `/api/show` describe it.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

from webapp.openai.output_text import Piece, arguments_object


def line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def error(message: str) -> dict:
    return {"error": message}


def tool_call(call: dict) -> dict:
    """An OpenAI tool call (arguments a JSON string) as Ollama's (arguments an object)."""
    return {"function": {"name": call["function"]["name"], "arguments": arguments_object(call)}}


def message(pieces: list[Piece]) -> dict:
    """The assistant's message from parsed pieces: content, thinking, tool calls."""
    out = {"role": "assistant", "content": "".join(p.value for p in pieces if p.kind == "content")}
    thinking = "".join(p.value for p in pieces if p.kind == "reasoning")
    if thinking:
        out["thinking"] = thinking
    calls = [tool_call(p.value) for p in pieces if p.kind == "tool_call"]
    if calls:
        out["tool_calls"] = calls
    return out


def chat_line(model: str, piece: Piece) -> dict:
    return {"model": model, "created_at": now(), "message": message([piece]), "done": False}


def generate_line(model: str, piece: Piece) -> dict:
    field = "thinking" if piece.kind == "reasoning" else "response"
    return {"model": model, "created_at": now(), "response": "", field: piece.value, "done": False}


def done(model: str, finish_reason: str | None, request, completion_tokens: int, **fields) -> dict:
    """The last object of an answer: `fields` (the whole message or response where not streamed), the
    reason it ended, and the engine request's counts and durations."""
    finished = request.finished_at or time.monotonic()
    first = request.first_token_at or finished
    admitted = request.admitted_at or request.submitted_at

    def ns(seconds: float) -> int:
        return max(0, int(seconds * 1e9))

    return {
        "model": model,
        "created_at": now(),
        **fields,
        "done": True,
        "done_reason": "length" if finish_reason == "length" else "stop",
        "total_duration": ns(finished - request.submitted_at),
        "load_duration": 0,
        "prompt_eval_count": request.prompt_len,
        "prompt_eval_duration": ns(first - admitted),
        "eval_count": completion_tokens,
        "eval_duration": ns(finished - first),
    }


def model_entry(name: str, size: int | None, modified: float | None, template: str | None = None) -> dict:
    """A model's name (with Ollama's `:latest` tag, which clients expect), size and date; its details
    are what this server knows of every model: a GGUF file."""
    stamp = datetime.fromtimestamp(modified or time.time(), UTC).isoformat().replace("+00:00", "Z")
    entry = {"name": f"{name}:latest", "model": f"{name}:latest", "modified_at": stamp, "size": size or 0}
    entry["details"] = {"format": "gguf", "family": "", "families": None, "parameter_size": "", "quantization_level": ""}
    if template is not None:
        entry["template"] = template
    return entry
