"""A chat body parsed once into a typed `ChatRequest`: parameters, sampling options, the output's
grammar and the parallel-calls flag together, every refusal raised before anything is submitted."""

from __future__ import annotations

import pytest
from support import HELLO

from webapp.openai.chat_request import parse_chat
from webapp.openai.errors import ApiError

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


def test_a_plain_chat_is_free_output_with_parallel_calls():
    chat = parse_chat({"messages": HELLO, "temperature": 0, "stream": True}, 10)
    assert chat.params.messages and chat.params.stream and chat.params.temperature == 0
    assert chat.grammar is None and chat.parallel


def test_a_forced_call_carries_its_grammar_and_the_parallel_flag():
    chat = parse_chat({"messages": HELLO, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}, 10)
    assert chat.grammar is not None and not chat.parallel
    assert chat.params.tool_choice == "required"


@pytest.mark.parametrize(
    "extra, param",
    [({"parallel_tool_calls": "no"}, "parallel_tool_calls"), ({"top_k": -2}, "top_k"), ({"grammar": 5}, "grammar")],
)
def test_each_part_refuses_naming_its_field(extra, param):
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": HELLO, **extra}, 10)
    assert e.value.status == 400 and e.value.param == param


def test_a_whole_number_is_an_integer_however_it_is_written():
    """As JSON Schema counts integers (and /openapi.json says `integer`): 5.0 and 1e1 are whole."""
    from webapp.openai.request_bodies import parse_chat_request, parse_json_body

    body = parse_json_body(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5.0, "n": 1e0, "temperature": 0.5}')
    assert body["max_tokens"] == 5 and isinstance(body["max_tokens"], int) and body["temperature"] == 0.5
    params = parse_chat_request(body, 16)
    assert params.max_tokens == 5 and params.n == 1
    with pytest.raises(ApiError, match="must be an integer"):
        parse_chat_request(parse_json_body(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5.5}'), 16)
