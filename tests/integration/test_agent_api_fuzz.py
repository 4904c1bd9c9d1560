"""Fuzzing the agents' APIs with hypothesis, as test_fuzz.py does the chat API: whatever body comes
to /v1/messages, /v1/responses or /v1/embeddings, the answer is never a 5xx; a 4xx is that API's own
error shape (Anthropic's under /v1/messages, OpenAI's elsewhere), and a 200 is a message, a
response or a list of embeddings, or a stream of that API's events."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.fakes import start_scripted_engine

from webapp import create_app

FUZZ = settings(
    deadline=None, database=None, max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)

scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=12)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6
)
texts = st.text(max_size=30) | st.sampled_from(
    ["", "<think>", "</think>", "<tool_call>", "x-anthropic-billing-header: cc=1", "!template-error"]
)
schema = st.just({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


def anything_or(valid):
    return st.one_of(valid, valid, valid, json_values)


anthropic_blocks = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
        st.fixed_dictionaries(
            {
                "type": st.just("tool_use"),
                "id": st.text(max_size=6),
                "name": st.sampled_from(["get_weather", "x"]),
                "input": anything_or(st.dictionaries(st.text(max_size=5), scalars, max_size=2)),
            }
        ),
        st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.text(max_size=6), "content": anything_or(texts)}),
        st.fixed_dictionaries({"type": st.sampled_from(["image", "thinking", "document", "bogus"])}),
        json_values,
    ),
    max_size=3,
)
anthropic_bodies = st.fixed_dictionaries(
    {
        "model": anything_or(st.just("m")),
        "max_tokens": anything_or(st.integers(-2, 50)),
        "messages": anything_or(
            st.lists(
                st.fixed_dictionaries(
                    {"role": anything_or(st.sampled_from(["user", "assistant"])), "content": anything_or(texts | anthropic_blocks)}
                ),
                max_size=3,
            )
        ),
    },
    optional={
        "system": anything_or(texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2)),
        "stream": anything_or(st.booleans()),
        "temperature": anything_or(st.floats(-1, 2)),
        "stop_sequences": anything_or(st.lists(texts, max_size=5)),
        "tools": anything_or(
            st.lists(st.fixed_dictionaries({"name": st.sampled_from(["get_weather", ""]), "input_schema": anything_or(schema)}), max_size=2)
        ),
        "tool_choice": anything_or(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["auto", "any", "tool", "none", "x"]), "name": st.sampled_from(["get_weather", "nope"])}
            )
        ),
        "thinking": anything_or(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"])})),
        "metadata": json_values,
    },
)
response_items = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.just("message"),
                "role": st.sampled_from(["user", "assistant", "developer", "x"]),
                "content": anything_or(
                    texts
                    | st.lists(
                        st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": texts}),
                        max_size=2,
                    )
                ),
            }
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call"),
                "call_id": anything_or(st.text(max_size=5)),
                "name": st.just("get_weather"),
                "arguments": anything_or(st.just('{"city": "Paris"}')),
            }
        ),
        st.fixed_dictionaries(
            {"type": st.just("function_call_output"), "call_id": anything_or(st.text(max_size=5)), "output": anything_or(texts)}
        ),
        st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "computer_call", "bogus"])}),
        json_values,
    ),
    max_size=3,
)
responses_bodies = st.fixed_dictionaries(
    {"model": anything_or(st.just("m")), "input": anything_or(texts | response_items)},
    optional={
        "instructions": anything_or(texts),
        "stream": anything_or(st.booleans()),
        "max_output_tokens": anything_or(st.integers(-2, 50)),
        "tools": anything_or(
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["function", "web_search"]), "name": st.just("get_weather"), "parameters": anything_or(schema)}
                ),
                max_size=2,
            )
        ),
        "tool_choice": anything_or(st.sampled_from(["auto", "none", "required"])),
        "text": anything_or(
            st.fixed_dictionaries(
                {
                    "format": anything_or(
                        st.fixed_dictionaries(
                            {
                                "type": st.sampled_from(["text", "json_object", "json_schema", "yaml"]),
                                "schema": schema,
                                "name": st.just("s"),
                            }
                        )
                    )
                }
            )
        ),
        "previous_response_id": anything_or(st.just("resp_missing")),
        "store": anything_or(st.booleans()),
    },
)


embedding_bodies = st.fixed_dictionaries(
    {"input": anything_or(texts | st.lists(texts, max_size=3) | st.lists(st.integers(-2, 300), max_size=4))},
    optional={
        "model": anything_or(st.just("m")),
        "encoding_format": anything_or(st.sampled_from(["float", "base64", "int8"])),
        "dimensions": anything_or(st.integers(-1, 10)),
        "user": anything_or(texts),
    },
)


@pytest.fixture(scope="module")
def client():
    engine = start_scripted_engine()
    yield create_app({"TESTING": True}, engine=engine).test_client()
    engine.stop(5)


def _check(response, path: str) -> None:
    assert response.status_code < 500, response.get_data(as_text=True)[:500]
    if response.status_code >= 400:
        body = response.get_json()
        if path == "/v1/messages":
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
        else:
            assert set(body) == {"error"} and body["error"]["message"] and body["error"]["type"]
        return
    if response.mimetype == "text/event-stream":
        events = [json.loads(line[6:]) for line in response.get_data(as_text=True).splitlines() if line.startswith("data: ")]
        last = events[-1]["type"]
        assert last in (
            ("message_stop", "error") if path == "/v1/messages" else ("response.completed", "response.incomplete", "response.failed")
        )
    else:
        assert response.get_json()["type" if path == "/v1/messages" else "object"] in ("message", "response", "list")


@FUZZ
@given(body=anthropic_bodies)
def test_messages_never_fail_with_a_5xx(client, body):
    _check(client.post("/v1/messages", json=body), "/v1/messages")


@FUZZ
@given(body=responses_bodies)
def test_responses_never_fail_with_a_5xx(client, body):
    _check(client.post("/v1/responses", json=body), "/v1/responses")


@FUZZ
@given(body=embedding_bodies)
def test_embeddings_never_fail_with_a_5xx(client, body):
    _check(client.post("/v1/embeddings", json=body), "/v1/embeddings")
