"""What the model's output text means, decided as it streams: stop strings, reasoning, tool calls.

Small state machines fed strings, with no Flask, HTTP or engine in sight; `webapp.http.api` feeds them
the incrementally decoded text of one request.

- `StopMatcher` finds stop strings in streamed text and holds back any tail that could still grow
  into one, so a stop string is never emitted, even when it is split across tokens.
- `OutputParser` routes `<think>...</think>` to reasoning and turns `<tool_call>...</tool_call>`
  blocks (hermes JSON or `<function=...>` XML, read by `parse_tool_call`) into OpenAI tool calls,
  holding back text that could be the start of a tag so that no part of one ever leaks out as
  content; a call the token limit cut off is dropped. It yields `Piece`s, which
  `webapp.openai.response_bodies` shapes as deltas and messages.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, NamedTuple


def partial_tail(text: str, needles: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `needles`."""
    longest = max((len(n) for n in needles), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(n.startswith(tail) for n in needles):
            return k
    return 0


class StopMatcher:
    """Cuts streamed text at the first stop string.

    `feed(text)` returns `(safe_text, matched)`: the text that can no longer be part of a stop
    string, and whether a stop string was found (then `safe_text` is everything before it and the
    caller must stop). `flush()` returns the held-back tail once the stream ends without a match.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None  # the stop string found, once one is

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        buf = self._held + text
        hits = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            self._held = ""
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return buf[:at], True
        keep = partial_tail(buf, self._stops)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class Piece(NamedTuple):
    """One unit of parsed output: kind "content" | "reasoning" (str) or "tool_call" (dict)."""

    kind: str
    value: Any


def arguments_object(call: dict) -> dict:
    """A tool_call piece's arguments (a JSON string) as an object, for the APIs that send them so;
    a model's malformed arguments become none, rather than a broken answer."""
    text = call["function"]["arguments"]
    try:
        arguments = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def opens_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt already opened a think block, so the output starts inside it."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


class StreamedText:
    """What the output parsers share: streamed text is buffered, and `_step(out)` (the parser's own)
    turns as much of it as it can into pieces, True while it could go on."""

    _buf: str

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[Piece]) -> bool:
        raise NotImplementedError


class OutputParser(StreamedText):
    """Splits streamed model text into content, reasoning and tool calls.

    `feed(text)` and, at the end, `finish()` return lists of `Piece`s. Text that could be the start
    of a tag is held back until it is decided, and a tool call is only emitted once its closing tag
    (or the end of the output) arrives, so no part of a tag ever reaches the content. A `<think>`
    is only honoured before any content; `<tool_call>` only when `tools` were offered. A block that
    does not parse as a tool call is passed through as content, tags included.
    """

    def __init__(self, tools: list[dict] | None = None, in_reasoning: bool = False) -> None:
        self._schemas = None if tools is None else {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        self._mode = "reasoning" if in_reasoning else "content"
        self._buf = ""
        self._content_started = False
        self._reasoning_started = False
        # Leading whitespace of the reply, and after </think> or a tool call, is layout.
        self._strip_content = True
        self.tool_calls: list[dict] = []

    def finish(self, cut: bool = False) -> list[Piece]:
        """The pieces still held back once the output ended; `cut` when the token limit ended it,
        so that a tool call or tag it cut off is dropped rather than shown as raw markup."""
        out: list[Piece] = []
        buf, self._buf = self._buf, ""
        if self._mode == "reasoning":
            self._emit(out, "reasoning", buf)
        elif self._mode == "tool":
            # the output may end inside the closing tag
            self._close_tool_call(out, buf[: len(buf) - partial_tail(buf, (TOOL_CLOSE,))], closed=False, cut=cut)
        else:
            if cut and self._schemas is not None:
                buf = buf[: len(buf) - partial_tail(buf, (TOOL_OPEN,))]
            self._emit(out, "content", buf)
        return out

    def _open_tags(self) -> tuple[str, ...]:
        tags = () if self._content_started else (THINK_OPEN,)
        return tags + ((TOOL_OPEN,) if self._schemas is not None else ())

    def _step(self, out: list[Piece]) -> bool:
        """Consume what can be decided in the buffer; True when a tag switched the mode."""
        buf = self._buf
        if self._mode == "tool":
            end = _closing_tag(buf)
            if end < 0:
                return False
            self._buf = buf[end + len(TOOL_CLOSE) :]
            self._close_tool_call(out, buf[:end], closed=True)
            self._mode = "content"
            return True
        tags = (THINK_CLOSE,) if self._mode == "reasoning" else self._open_tags()
        found = [(i, tag) for tag in tags if (i := buf.find(tag)) >= 0]
        if not found:
            keep = partial_tail(buf, tags)
            self._buf = buf[len(buf) - keep :]
            self._emit(out, self._mode, buf[: len(buf) - keep])
            return False
        start, tag = min(found)
        self._emit(out, self._mode, buf[:start])
        self._buf = buf[start + len(tag) :]
        if tag == THINK_CLOSE:
            self._mode, self._strip_content = "content", True
        else:
            self._mode = "reasoning" if tag == THINK_OPEN else "tool"
        return True

    def _emit(self, out: list[Piece], kind: str, text: str) -> None:
        if kind == "reasoning":
            if not self._reasoning_started:
                text = text.lstrip()
            self._reasoning_started = self._reasoning_started or bool(text)
        else:
            if self._strip_content:
                text = text.lstrip()
                self._strip_content = not text
            # Whitespace alone does not count as content: a <think> may still follow it.
            self._content_started = self._content_started or bool(text.strip())
        if text:
            out.append(Piece(kind, text))

    def _close_tool_call(self, out: list[Piece], body: str, closed: bool, cut: bool = False) -> None:
        call = parse_tool_call(body, self._schemas or {})
        if call is None:
            if not cut:
                self._emit(out, "content", TOOL_OPEN + body + (TOOL_CLOSE if closed else ""))
            return
        self.tool_calls.append(call)
        self._strip_content = True
        out.append(Piece("tool_call", call))


def _closing_tag(body: str) -> int:
    """Where the `</tool_call>` that ends this call's text is, or -1: in hermes JSON, one inside a
    string value (a model may write anything there) is part of the value."""
    at = body.find(TOOL_CLOSE)
    while at >= 0 and body.lstrip().startswith("{") and _inside_json_string(body[:at]):
        at = body.find(TOOL_CLOSE, at + 1)
    return at


def _inside_json_string(text: str) -> bool:
    """Whether JSON text that starts outside a string ends inside one."""
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = inside
        elif ch == '"':
            inside = not inside
    return inside


_FUNCTION_RE = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER_RE = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def parse_tool_call(body: str, schemas: dict[str, dict]) -> dict | None:
    """An OpenAI tool call from the inside of a `<tool_call>` block, or None if it does not parse.

    Accepts hermes JSON (`{"name": ..., "arguments": {...}}`) and the XML form
    (`<function=name><parameter=p>value</parameter></function>`); XML values are strings unless
    the tool's JSON schema gives the parameter another type.
    """
    text = body.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        name, arguments = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
    elif match := _FUNCTION_RE.match(text):
        name, inner = match.group(1), match.group(2)
        properties = (schemas.get(name) or {}).get("properties") or {}
        arguments = {}
        for p in _PARAMETER_RE.finditer(inner):
            arguments[p.group(1)] = _xml_value(p.group(2), properties.get(p.group(1)))
    else:
        return None
    return tool_call(name, arguments)


def tool_call(name: str, arguments: dict) -> dict:
    """An OpenAI tool call (a fresh id) to function `name` with these arguments."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _xml_value(raw: str, schema: Any) -> Any:
    # The format puts each value on its own lines; those newlines are layout, not value.
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
