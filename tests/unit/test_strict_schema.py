"""`strict_schema`: the strict reading of a tool's argument schema, checked with an independent
validator (jsonschema) on documents with and without properties the schema never named."""

import jsonschema
import pytest

from webapp.openai.structured import strict_schema

NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "stops": {"type": "array", "items": {"$ref": "#/$defs/stop"}},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "string"}]},
        "free": {"type": "object"},
        "tags": {"type": "object", "properties": {"x": {"type": "string"}}, "additionalProperties": {"type": "string"}},
    },
    "$defs": {"stop": {"type": "object", "properties": {"name": {"type": "string"}}}},
}


def valid(schema, document) -> bool:
    try:
        jsonschema.validate(document, schema)
    except jsonschema.ValidationError:
        return False
    return True


@pytest.mark.parametrize(
    "document, strictly",
    [
        ({"city": "Oslo", "where": {"lat": 1.5}, "stops": [{"name": "a"}], "either": {"a": 1}}, True),
        ({"city": "Oslo", "api_key": "x"}, False),  # at the top
        ({"where": {"lat": 1.5, "lon": 2.0}}, False),  # in a nested object
        ({"stops": [{"name": "a", "extra": 1}]}, False),  # in a definition reached by $ref
        ({"either": {"a": 1, "b": 2}}, False),  # in an anyOf branch
        ({"free": {"anything": [1, 2]}}, True),  # an object that lists no properties stays free
        ({"tags": {"x": "1", "y": "2"}}, True),  # others allowed where the schema says so
        ({"tags": {"y": 2}}, False),  # ... and only as it says
    ],
)
def test_only_named_properties_unless_the_schema_allows_others(document, strictly):
    assert valid(NESTED, document) or not strictly  # the plain reading takes every valid document
    assert valid(strict_schema(NESTED), document) == strictly


def test_an_allof_stays_open_so_its_members_can_share_an_object():
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}
    assert valid(strict_schema(schema), {"a": 1, "b": 2})
    composed = {"type": "object", "properties": {"a": {"type": "integer"}}, "$ref": "#/$defs/more", "$defs": {"more": {}}}
    assert "additionalProperties" not in strict_schema(composed)


def test_the_given_schema_is_left_as_it_was():
    before = repr(NESTED)
    strict_schema(NESTED)
    assert repr(NESTED) == before
    assert strict_schema(True) is True and strict_schema({"type": "object"}) == {"type": "object"}
