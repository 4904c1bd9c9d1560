"""gpt-oss's Harmony output, decided as it streams: reasoning, content and tool calls.

A Harmony model writes messages, each a header and a body:
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`
(the prompt already wrote the first `<|start|>assistant`). The channel routes a body: `analysis` to
reasoning, `final` to content, and a message addressed to a function (`to=functions.NAME`, in the
header's role part or after its channel, with `<|constrain|>json` maybe before `<|message|>`) becomes an
OpenAI tool call, its body the JSON arguments; `commentary` without a recipient (a preamble the user
may see) is content. `<|call|>` and `<|return|>` end generation as stop tokens, so they seldom reach
the text: the end of the output closes the message it is in.

Contract: `HarmonyParser(tools)` has `OutputParser`'s interface (`feed(text)` and `finish()` return
`Piece`s, `tool_calls` lists the calls made) and holds back any text that could still be the start of
a special token, so deltas split anywhere give the same pieces. Output that does not open with a
Harmony header is read as `OutputParser` reads other models' (content as it comes, or the hermes
`<tool_call>` blocks a grammar forces when `tool_choice` requires a call, structured.py). A Harmony
call is only made when `tools` were offered and its body is a JSON object; otherwise its body is
content. `output_parser(template_source, prompt, tools)` is the
one place that picks this parser or `OutputParser` for a chat: Harmony when the model's chat template
writes `<|channel|>` (`uses_harmony`). `template_messages(template_source, messages)` hands such a
template the reasoning a client sent back with a tool call, where gpt-oss's template reads it.
Standard library only.
"""

from __future__ import annotations

import json
import re

from webapp.openai.output_text import OutputParser, Piece, StreamedText, opens_reasoning, partial_tail, tool_call

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
# what ends a message's body; a <|start|> without an <|end|> before it also opens the next message
BODY_ENDS = (END, CALL, RETURN, START)
# what a header can open with: the first one (after the prompt's `<|start|>assistant`) a channel or a
# recipient, every later one `<|start|>`
HEADER_OPENINGS = (START, CHANNEL, " to=", "to=")
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


def uses_harmony(template_source: str | None) -> bool:
    """Whether a chat template speaks Harmony (gpt-oss's): it writes channels."""
    return CHANNEL in (template_source or "")


def output_parser(template_source: str | None, prompt: str, tools: list[dict] | None) -> OutputParser | HarmonyParser:
    """The parser for one choice of a chat whose prompt the template rendered."""
    if uses_harmony(template_source):
        return HarmonyParser(tools)
    return OutputParser(tools, in_reasoning=opens_reasoning(prompt))


def template_messages(template_source: str | None, messages: list[dict]) -> list[dict]:
    """The messages as a Harmony template wants them: an assistant tool call's `reasoning_content` as
    its `thinking`, which gpt-oss's template writes back as the analysis before the call (it refuses a
    tool call with both content and thinking, so only a call without content gets it)."""
    if not uses_harmony(template_source):
        return messages
    return [
        {**m, "thinking": m["reasoning_content"]}
        if m.get("role") == "assistant" and m.get("tool_calls") and m.get("reasoning_content") and not m.get("content")
        else m
        for m in messages
    ]


class HarmonyParser(StreamedText):
    """Splits streamed Harmony text into content, reasoning and tool calls (see the module docstring)."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self._calls = tools is not None  # a message to a function is a tool call only when tools were offered
        self._mode = "header"  # "header" | "body" | "plain" (no Harmony: OutputParser's reading)
        self._plain = OutputParser(tools)
        self._buf = ""
        self._kind = "content"  # the body's: "content", "reasoning" or "tool" (its text kept whole)
        self._function = ""
        self._call_body = ""
        self.tool_calls: list[dict] = []

    def finish(self, cut: bool = False) -> list[Piece]:
        out: list[Piece] = []
        buf, self._buf = self._buf, ""
        if self._mode == "body":
            self._body_text(out, buf)
            self._close_body(out, cut)
        elif self._mode == "plain" or buf.strip():  # a header cut off: what there is of it is text
            self._read_plain(out, buf, final=True, cut=cut)
        return out

    def _read_plain(self, out: list[Piece], text: str, final: bool = False, cut: bool = False) -> None:
        pieces = self._plain.feed(text) + (self._plain.finish(cut) if final else [])
        self.tool_calls += [p.value for p in pieces if p.kind == "tool_call"]
        out += pieces

    def _step(self, out: list[Piece]) -> bool:
        """Consume what can be decided in the buffer; True when a header or a body ended."""
        buf = self._buf
        if self._mode == "plain":
            self._buf = ""
            self._read_plain(out, buf)
            return False
        if self._mode == "header":
            return self._header(buf)
        found = [(i, tag) for tag in BODY_ENDS if (i := buf.find(tag)) >= 0]
        if not found:
            keep = partial_tail(buf, BODY_ENDS)
            self._buf = buf[len(buf) - keep :]
            self._body_text(out, buf[: len(buf) - keep])
            return False
        at, tag = min(found)
        self._body_text(out, buf[:at])
        self._close_body(out)
        self._buf = buf[at:] if tag == START else buf[at + len(tag) :]
        self._mode = "header"
        return True

    def _header(self, buf: str) -> bool:
        opening = buf.lstrip("\n")
        if not any(opening.startswith(o) or o.startswith(opening) for o in HEADER_OPENINGS):
            self._mode = "plain"  # not Harmony (or no longer): OutputParser reads the rest
            return True
        at = buf.find(MESSAGE)
        if at < 0:
            return False
        self._open_body(buf[:at])
        self._buf, self._mode = buf[at + len(MESSAGE) :], "body"
        return True

    def _open_body(self, header: str) -> None:
        """The kind of the body a header opens: its recipient's, else its channel's."""
        recipient = _RECIPIENT.search(header)
        words = header.split(CHANNEL, 1)[1].replace("<|", " <|").split() if CHANNEL in header else []
        channel = words[0] if words else ""
        if recipient and self._calls:
            self._kind, self._function, self._call_body = "tool", recipient.group(1), ""
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"

    def _body_text(self, out: list[Piece], text: str) -> None:
        if self._kind == "tool":
            self._call_body += text
        else:
            self._emit(out, self._kind, text)

    def _close_body(self, out: list[Piece], cut: bool = False) -> None:
        """Ends a body; a call's arguments that do not parse are text, unless the token limit cut them off."""
        if self._kind != "tool":
            return
        self._kind = "content"
        call = _tool_call(self._function, self._call_body)
        if call is None:
            if not cut:
                self._emit(out, "content", self._call_body)
            return
        self.tool_calls.append(call)
        out.append(Piece("tool_call", call))

    @staticmethod
    def _emit(out: list[Piece], kind: str, text: str) -> None:
        if text:
            out.append(Piece(kind, text))


def _tool_call(name: str, body: str) -> dict | None:
    """An OpenAI tool call to `name` with the JSON object `body` as its arguments, or None."""
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    return tool_call(name, arguments) if isinstance(arguments, dict) else None
