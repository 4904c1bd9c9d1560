"""Anthropic's Messages API through the real `anthropic` client, against a real Waitress server over
the scripted fake fake_engine: messages.create and messages.stream, thinking and tool_use blocks, a
tool_result turn, stop reasons, count_tokens, Claude Code's request shape, auth by x-api-key, and
errors in Anthropic's own shape."""

import json

import anthropic
import pytest
from support import drain_outputs, post, running_server
from support.fakes import EOS, Reply

from webapp import create_app
from webapp.anthropic.messages import chat_body
from webapp.engine.serving.request import FinishReason

HELLO = [{"role": "user", "content": "hello"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def claude(fake_server):
    client = anthropic.Anthropic(base_url=fake_server.url, api_key="test-key", max_retries=0, timeout=10)
    yield client
    client.close()


def test_a_message_comes_back_as_a_text_block_with_usage(claude, fake_runner):
    fake_runner.replies.append(Reply.text("Hi there."))
    message = claude.messages.create(model="tiny", max_tokens=50, system="Be brief.", messages=HELLO)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert [(b.type, b.text) for b in message.content] == [("text", "Hi there.")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens == len("Hi there.") and message.usage.input_tokens > 0
    sent = fake_runner.requests[-1]
    assert sent.params.max_tokens == 50 and EOS in sent.params.stop_token_ids


def test_stop_reasons_max_tokens_and_stop_sequence(claude, fake_runner):
    fake_runner.replies.append(Reply.text("one two three four"))
    assert claude.messages.create(model="m", max_tokens=4, messages=HELLO).stop_reason == "max_tokens"
    fake_runner.replies.append(Reply.text("alpha END beta"))
    message = claude.messages.create(model="m", max_tokens=50, messages=HELLO, stop_sequences=["END"])
    assert (message.stop_reason, message.stop_sequence, message.content[0].text) == ("stop_sequence", "END", "alpha ")


def test_the_stream_has_anthropics_event_sequence_and_builds_the_same_message(claude, fake_runner):
    fake_runner.replies.append(Reply.text("<think>Let me see.</think>Paris is sunny."))
    with claude.messages.stream(model="m", max_tokens=100, messages=HELLO, thinking={"type": "enabled", "budget_tokens": 50}) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Let me see." and message.content[1].text == "Paris is sunny."
    assert message.stop_reason == "end_turn" and message.usage.output_tokens > 0


def test_a_forced_tool_call_then_its_tool_result_turn(claude, fake_engine, fake_runner):
    fake_runner.replies.append(Reply.text(CALL.replace("city", "citx")))  # forced tool use goes through the grammar
    message = claude.messages.create(
        model="m",
        max_tokens=100,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    (call,) = message.content
    assert (call.type, call.name, call.input, message.stop_reason) == ("tool_use", "get_weather", {"city": "Paris"}, "tool_use")
    fake_runner.replies.append(Reply.text("It is sunny in Paris."))
    answer = claude.messages.create(
        model="m",
        max_tokens=100,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 24 C"}]},
        ],
    )
    assert answer.content[0].text == "It is sunny in Paris."
    rendered = fake_engine.chat_template.calls[-1]["messages"]
    assert [m["role"] for m in rendered] == ["user", "assistant", "tool"]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and rendered[2]["content"] == "sunny, 24 C"


def test_a_streamed_tool_call_arrives_as_input_json(claude, fake_runner):
    fake_runner.replies.append(Reply.text("Checking. " + CALL))
    with claude.messages.stream(model="m", max_tokens=100, messages=HELLO, tools=[WEATHER]) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        message = stream.get_final_message()
    assert "input_json_delta" in deltas and [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[1].input == {"city": "Paris"} and message.stop_reason == "tool_use"


def test_count_tokens_counts_the_rendered_prompt(claude, fake_engine):
    counted = claude.messages.count_tokens(model="m", system="Be brief.", messages=HELLO)
    prompt = fake_engine.chat_template.render([{"role": "system", "content": "Be brief."}, *HELLO])
    assert counted.input_tokens == len(fake_engine.tokenizer.encode(prompt)) + 1  # and the BOS


def test_claude_codes_billing_header_block_is_dropped_and_its_extra_fields_accepted():
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=sdk-cli; cch=ab12;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": "u"},
        "context_management": {"edits": []},
        "output_config": {"effort": "high"},
    }
    chat = chat_body(body)
    assert chat["messages"][0] == {"role": "system", "content": "You are Claude Code."}
    assert chat["tools"][0]["function"]["name"] == "get_weather" and chat["stream"] is True


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "m", "messages": HELLO}, "max_tokens"),
        ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
        ({"model": "m", "max_tokens": 5, "messages": HELLO, "temperature": 1.5}, "temperature"),
        ({"model": "m", "max_tokens": 5, "messages": HELLO, "frequency": 1}, "frequency"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"model": "m", "max_tokens": 5, "messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "web"}]}, "web_search"),
    ],
)
def test_bad_bodies_get_anthropics_error_shape(fake_server, claude, body, field):
    status, _, error = post(fake_server, "/v1/messages", body)
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # the client's own error class, from the shape
        claude.post("/v1/messages", body=body, cast_to=object)


def test_the_api_key_may_come_as_x_api_key(fake_engine):
    app = create_app({"TESTING": True, "API_KEY": "secret"}, engine=fake_engine)
    with running_server(app) as srv:
        good = anthropic.Anthropic(base_url=srv.url, api_key="secret", max_retries=0, timeout=10)
        assert good.messages.create(model="m", max_tokens=20, messages=HELLO).content
        bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0, timeout=10)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="m", max_tokens=20, messages=HELLO)
        assert e.value.body["error"]["type"] == "authentication_error"
        status, _, body = post(srv, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": HELLO}, {"Authorization": "Bearer secret"})
        assert status == 200 and body["type"] == "message"


def test_a_stream_cut_midway_frees_the_request(fake_server, fake_runner):
    import socket

    fake_runner.replies.append(Reply.text("x" * 500, delay=0.01))
    sock = socket.create_connection((fake_server.host, fake_server.port), timeout=10)
    payload = json.dumps({"model": "m", "max_tokens": 600, "stream": True, "messages": HELLO}).encode()
    sock.sendall(
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    received = b""
    while b"content_block_delta" not in received:  # the stream is under way
        received += sock.recv(4096)
    sock.close()
    assert drain_outputs(fake_runner.requests[-1])[1] == FinishReason.CANCELLED


def test_a_tool_call_cut_off_by_max_tokens_leaves_no_markup(claude, fake_runner):
    fake_runner.replies.append(Reply.text(CALL))
    message = claude.messages.create(
        model="m", max_tokens=30, messages=HELLO, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert message.stop_reason == "max_tokens" and message.content == []
