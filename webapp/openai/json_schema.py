"""JSON Schema building blocks the API's OpenAPI document (webapp/http/openapi.py) is written with."""

from __future__ import annotations

STRING, INTEGER, NUMBER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
NULLABLE_STRING = {"type": ["string", "null"]}
NONEMPTY = {"type": "string", "minLength": 1}


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(required: tuple[str, ...] = (), **properties) -> dict:
    """An object with these properties (others allowed: clients send fields this server ignores)."""
    return {"type": "object", "required": list(required), "properties": properties}


def array(items: dict, **limits) -> dict:
    return {"type": "array", "items": items, **limits}


def closed(schema: dict) -> dict:
    """`schema`, no property besides its own: the body's parser refuses the others by name."""
    return schema | {"additionalProperties": False}
