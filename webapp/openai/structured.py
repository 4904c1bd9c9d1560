"""Structured output for the chat API: `response_format`, forced tool calls, raw grammars, and
tools the chat template would drop.

Pure functions (no Flask, no engine state); every refusal is an `ApiError` 400 naming the field.
- `output_grammar(body, tools, tool_choice, forced, parallel)` returns the llguidance grammar a request's output
  must follow, or None when it is free: `response_format` json_object (any JSON object) or
  json_schema (the schema, read by `strict_schema` when `strict` is true), a forced tool call
  (`tool_choice` "required" or a named function, honouring `parallel_tool_calls`, its arguments
  always read by `strict_schema`), or the `grammar` extension field (GBNF or Lark, as llama-server
  and vLLM accept). A schema keyword the library cannot enforce is a 400 naming it, never ignored.
- `strict_schema(schema)`: an object that lists its properties takes no others unless it says
  so (`additionalProperties`), the strict reading of OpenAI's structured outputs and xgrammar's
  default; JSON Schema's own default would let a model invent properties a tool never named.
- `parallel_tool_calls(body)`: false means at most one call, enforced by the grammar when the
  call is forced and by dropping later calls from the parsed output when it is free.
- Forced calls use the hermes format that `OutputParser` reads back:
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call.
- `with_tools_in_system_prompt(messages, tools)` is for chat templates that ignore `tools` (the
  default SmolLM2 one does): the tool definitions and that call format go into the system
  prompt, and earlier assistant tool calls are written back into their message as those blocks.
"""

from __future__ import annotations

import json

from webapp.engine.decoding.constraints import JSON_STYLE, gbnf_grammar, grammar_problem, json_schema_grammar, lark_grammar
from webapp.openai.errors import ApiError

TOOL_CALL_FORMAT = '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'


def output_grammar(body: dict, tools: tuple[dict, ...] | None, tool_choice: str | None, forced: str | None, parallel: bool) -> str | None:
    """The grammar for a chat request's output (see the module docstring); `forced` is a named
    function from `tool_choice`, `tool_choice` is "auto", "none" or "required", `parallel` is
    `parallel_tool_calls(body)`."""
    kinds = [k for k in ("response_format", "grammar") if _given(body, k)]
    wants_call = tool_choice == "required" or forced is not None
    if wants_call:
        kinds.append("tool_choice")
    if len(kinds) > 1:
        raise ApiError(400, f"Only one of {', '.join(kinds)} can constrain the output.", kinds[-1])
    if wants_call:
        chosen = [t for t in tools or () if forced is None or t["function"]["name"] == forced]
        return tool_call_grammar(chosen, parallel=parallel)
    if _given(body, "response_format"):
        return _response_format_grammar(body["response_format"])
    if _given(body, "grammar"):
        return _raw_grammar(body["grammar"])
    return None


def _given(body: dict, key: str) -> bool:
    value = body.get(key)
    return value is not None and not (key == "response_format" and isinstance(value, dict) and value.get("type") == "text")


def parallel_tool_calls(body: dict) -> bool:
    """`parallel_tool_calls` (default true); false: at most one call, whatever the tool choice."""
    value = body.get("parallel_tool_calls")
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
    return value


def _response_format_grammar(fmt) -> str:
    param = "response_format"
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise ApiError(400, "'response_format.type' must be one of 'text', 'json_object' or 'json_schema'.", param)
    if fmt["type"] == "json_object":
        return _schema_grammar({"type": "object"}, param)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ApiError(400, "'response_format.json_schema' must be an object with a 'name' and a 'schema'.", param)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ApiError(400, "'response_format.json_schema.strict' must be a boolean.", param)
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object.", param)
    if spec.get("strict"):
        schema = strict_schema(schema)
    return _schema_grammar(schema, param, "response_format.json_schema.schema")


# Keywords whose values are schemas: maps of them, lists of them, or one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONES = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames")
# Beside these an object's properties may come from elsewhere, so closing it could refuse them.
_OPEN_ENDED = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas", "unevaluatedProperties")


def strict_schema(schema, close: bool = True):
    """`schema` with `"additionalProperties": false` on every object schema that lists
    `properties`, says nothing of others and is not composed with other schemas; an allOf's members
    stay open (each would refuse the others' properties). Non-schemas come back as they are."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: strict_schema(sub) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            value = [strict_schema(sub, close=False) for sub in value]
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [strict_schema(sub) for sub in value]
        elif key in _SCHEMA_ONES:
            value = strict_schema(value)
        out[key] = value
    if close and isinstance(out.get("properties"), dict) and "additionalProperties" not in out and not any(k in out for k in _OPEN_ENDED):
        out["additionalProperties"] = False
    return out


def _schema_grammar(schema: dict, param: str, where: str | None = None) -> str:
    try:
        grammar = json_schema_grammar(schema)
    except ValueError as e:
        raise ApiError(400, f"'{where or param}' is not a valid JSON schema: {e}", param) from e
    _check(grammar, param, where or param)
    return grammar


def _check(grammar: str, param: str, where: str) -> None:
    problem = grammar_problem(grammar)
    if problem:
        raise ApiError(400, f"'{where}' cannot be enforced by this server: {problem}", param)


def tool_call_grammar(tools: list[dict], parallel: bool) -> str:
    """Output that is one tool call (or, when `parallel`, one or more) to one of `tools`."""
    options = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        parameters = strict_schema(fn.get("parameters") or {"type": "object"})
        # each tool's schema on its own first, so a 400 names the tool whose schema is the problem
        _check(json_schema_grammar(parameters), "tools", f"tools[{i}].function.parameters")
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    body = json.dumps({"anyOf": options, "x-guidance": JSON_STYLE})
    repeat = ' ("\\n" call)*' if parallel else ""
    # the line break a model writes after a call's closing tag may also end the output: were it
    # always the start of the next call, most forced answers would repeat their call
    source = f'start: call{repeat} "\\n"?\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {body}\n'
    grammar = lark_grammar(source)
    _check(grammar, "tools", "tools")
    return grammar


def _raw_grammar(spec) -> str:
    """The `grammar` extension: a GBNF string, or {"type": "gbnf" | "lark", "grammar": source}."""
    if isinstance(spec, str):
        kind, source = "gbnf", spec
    elif isinstance(spec, dict) and spec.get("type") in ("gbnf", "lark") and isinstance(spec.get("grammar"), str):
        kind, source = spec["type"], spec["grammar"]
    else:
        raise ApiError(400, '\'grammar\' must be a GBNF string or {"type": "gbnf" | "lark", "grammar": "..."}.', "grammar")
    try:
        grammar = gbnf_grammar(source) if kind == "gbnf" else lark_grammar(source)
    except ValueError as e:
        raise ApiError(400, f"'grammar' does not parse: {e}", "grammar") from e
    _check(grammar, "grammar", "grammar")
    return grammar


def with_tools_in_system_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` with the tool definitions and call format in the system prompt (see the module docstring)."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    instructions = (
        "You can call the following tools. Their definitions, one per line:\n"
        f"<tools>\n{listing}\n</tools>\n"
        f"To call a tool, reply with:\n{TOOL_CALL_FORMAT}"
    )
    out = [_calls_as_text(m) for m in messages]
    if out and out[0].get("role") in ("system", "developer"):
        first = out[0]
        out[0] = {**first, "content": f"{first.get('content') or ''}\n\n{instructions}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


def _calls_as_text(message: dict) -> dict:
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not calls:
        return message
    blocks = [
        "<tool_call>\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in calls
    ]
    text = "\n".join(filter(None, [message.get("content") or "", *blocks]))
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
