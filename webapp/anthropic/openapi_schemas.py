"""Anthropic's Messages API in the OpenAPI document: its bodies, answers and error shape."""

from __future__ import annotations

from webapp.openai.json_schema import BOOLEAN, INTEGER, NULLABLE_STRING, STRING, array, obj

ANTHROPIC_MESSAGE = obj(("role", "content"), role={"enum": ["user", "assistant"]}, content={"oneOf": [STRING, array(obj(("type", "text"), type={"const": "text"}, text=STRING), minItems=1)]})  # fmt: skip
SCHEMAS = {
    "AnthropicError": obj(("type", "error"), type={"const": "error"}, error=obj(("type", "message"), type=STRING, message=STRING)),
    "MessagesRequest": obj(
        ("model", "max_tokens", "messages"),
        model=STRING,
        max_tokens={"type": "integer", "minimum": 1},
        messages=array(ANTHROPIC_MESSAGE, minItems=1),
        system={"oneOf": [STRING, array(obj(("type", "text"), type={"const": "text"}, text=STRING))]},
        temperature={"type": "number", "minimum": 0, "maximum": 1},
        top_p={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        stop_sequences=array({"type": "string", "minLength": 1}, maxItems=4),
        stream=BOOLEAN,
    ),
    "Message": obj(
        ("id", "type", "role", "model", "content", "stop_reason", "usage"),
        id=STRING,
        type={"const": "message"},
        role={"const": "assistant"},
        model=STRING,
        content=array(obj(("type",), type=STRING)),
        stop_reason=NULLABLE_STRING,
        usage=obj(("input_tokens", "output_tokens"), input_tokens=INTEGER, output_tokens=INTEGER),
    ),
    "CountTokensRequest": obj(("model", "messages"), model=STRING, messages=array(ANTHROPIC_MESSAGE, minItems=1), system=STRING),
    "TokenCount": obj(("input_tokens",), input_tokens=INTEGER),
}
