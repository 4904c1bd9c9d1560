"""Anthropic's Messages API in the OpenAPI document: its bodies, answers and error shape."""

from __future__ import annotations

from webapp.openai.json_schema import BOOLEAN, INTEGER, NULLABLE_STRING, STRING, array, closed, obj, ref

TEXT_BLOCK = obj(("type", "text"), type={"const": "text"}, text=STRING)
# base64 only: this server fetches no URL
IMAGE_BLOCK = obj(
    ("type", "source"),
    type={"const": "image"},
    source=obj(("type", "media_type", "data"), type={"const": "base64"}, media_type={"type": "string", "pattern": "^image/"}, data=STRING),
)
ANTHROPIC_MESSAGE = obj(("role", "content"), role={"enum": ["user", "assistant"]}, content={"oneOf": [STRING, array(ref("AnthropicContentBlock"), minItems=1)]})  # fmt: skip
SCHEMAS = {
    # narrowed to text where the model served takes no images (webapp/http/openapi.py)
    "AnthropicContentBlock": {"oneOf": [TEXT_BLOCK, IMAGE_BLOCK]},
    "AnthropicError": obj(("type", "error"), type={"const": "error"}, error=obj(("type", "message"), type=STRING, message=STRING)),
    "MessagesRequest": closed(
        obj(
            ("model", "max_tokens", "messages"),
            model=STRING,
            max_tokens={"type": "integer", "minimum": 1},
            messages=array(ANTHROPIC_MESSAGE, minItems=1),
            system={"oneOf": [STRING, array(obj(("type", "text"), type={"const": "text"}, text=STRING))]},
            temperature={"type": "number", "minimum": 0, "maximum": 1},
            top_p={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            stop_sequences=array({"type": "string", "minLength": 1}, maxItems=4),
            stream=BOOLEAN,
        )
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
    "CountTokensRequest": closed(obj(("model", "messages"), model=STRING, messages=array(ANTHROPIC_MESSAGE, minItems=1), system=STRING)),
    "TokenCount": obj(("input_tokens",), input_tokens=INTEGER),
}
