"""The HTTP API against a real engine over a scripted runner: the real `openai` client talks to a real Waitress
server, and raw HTTP checks the wire format (error shapes, SSE framing, disconnects)."""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from support import HELLO, assert_error_shape, chat, drain_outputs, get, post, raw_request, running_server, wait_until
from support.fakes import BOS, EOS, HERMES, TOOLS, XML, Reply, start_scripted_engine

from webapp import create_app
from webapp.engine.serving.request import FinishReason


def streamed(client, **kw):
    """(chunks, content, reasoning) of a streamed chat completion."""
    chunks = list(chat(client, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return chunks, content, reasoning


def open_hello_stream(server) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed chat request for HELLO over a bare connection, so a test can read it event by event."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": HELLO, "stream": True}), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


def prompt_ids(engine, messages=HELLO, tools=None):
    return [BOS, *engine.tokenizer.encode(engine.chat_template.render(messages, tools))]


def reply_len(text: str) -> int:
    return len(text.encode())  # the bytes: EOS ends the reply and is never output, so never counted


# --- happy paths ---------------------------------------------------------------------------------


def test_models_lists_the_engine_model(openai_client):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]


def test_chat_completion(openai_client, fake_engine, fake_runner):
    fake_runner.replies.append(Reply.text("Hi there!"))
    r = chat(
        openai_client,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 20, "user": "ignored"},
    )
    req = fake_runner.requests[-1]
    assert r.object == "chat.completion" and r.id == req.id and r.model == "test-model"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "Hi there!"
    assert r.choices[0].finish_reason == "stop"
    expected_prompt = prompt_ids(fake_engine)
    assert req.prompt_ids == expected_prompt
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert r.usage.completion_tokens == reply_len("Hi there!")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # nothing ran before it
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.5, 0.9, 20, 7)
    assert p.stop_token_ids == frozenset({EOS})
    assert p.max_tokens == fake_engine.max_context - len(expected_prompt)  # the default fills the context
    assert req.cancel_reason is None  # a request the engine finished is not aborted


def test_chat_stream(openai_client, fake_engine, fake_runner):
    text = "Grüße, 世界! 🎉"  # multi-byte characters arrive split over byte tokens
    fake_runner.replies.append(Reply.text(text))
    chunks, content, _ = streamed(openai_client)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert content == text
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert {c.id for c in chunks} == {fake_runner.requests[-1].id}
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)
    assert fake_runner.requests[-1].cancel_reason is None


def test_stream_include_usage(openai_client, fake_engine, fake_runner):
    chat(openai_client)  # the same prompt before: its slot keeps the prompt for reuse
    fake_runner.replies.append(Reply.text("four"))
    chunks, content, _ = streamed(openai_client, stream_options={"include_usage": True})
    assert content == "four"
    assert chunks[-2].choices[0].finish_reason == "stop"
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == reply_len("four")
    assert last.usage.prompt_tokens == len(prompt_ids(fake_engine))
    # all of it but the last token, whose logits start the reply
    assert last.usage.prompt_tokens_details.cached_tokens == fake_runner.requests[-1].cached_tokens == last.usage.prompt_tokens - 1


def test_first_chunk_is_sent_before_any_token(fake_server, fake_runner):
    fake_runner.replies.append(Reply.text("late"))
    fake_runner.gate.clear()  # the model thread holds in the request's first step
    conn, resp = open_hello_stream(fake_server)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    first = json.loads(resp.readline().decode().removeprefix("data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert wait_until(lambda: fake_runner.requests)
    assert fake_runner.requests[-1].output_ids == []  # the model has not produced anything yet
    fake_runner.gate.set()
    events = sse_events(resp.read().decode().lstrip("\n"))
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == "late"
    conn.close()


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens_is_never_emitted(openai_client, fake_engine, stream, fake_runner):
    fake_runner.replies.append(Reply.text("The answer is 42. STOP! and then more", delay=0.001))
    if stream:
        chunks, content, _ = streamed(openai_client, stop=["never", "STOP!"])
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = chat(openai_client, stop=["never", "STOP!"])
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert content == "The answer is 42. "
    assert finish == "stop"
    request = fake_runner.requests[-1]
    assert request.cancel_reason == FinishReason.CANCELLED  # the engine need not generate past a stop
    assert drain_outputs(request)[1] == FinishReason.CANCELLED


def test_stop_string_prefix_that_never_completes_is_released(openai_client, fake_engine, fake_runner):
    fake_runner.replies.append(Reply.text("a STO b ST"))
    _, content, _ = streamed(openai_client, stop="STOP")
    assert content == "a STO b ST"
    assert fake_runner.requests[-1].cancel_reason is None


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_finishes_with_length(openai_client, fake_runner, stream):
    fake_runner.replies.append(Reply.text("abcdefgh"))
    if stream:
        chunks, content, _ = streamed(openai_client, max_tokens=3)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = chat(openai_client, max_tokens=3)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert r.usage.completion_tokens == 3
    assert (content, finish) == ("abc", "length")
    assert fake_runner.requests[-1].params.max_tokens == 3


def test_max_tokens_is_capped_to_the_room_the_context_leaves(openai_client, fake_engine, fake_runner):
    chat(openai_client, max_tokens=100_000)
    assert fake_runner.requests[-1].params.max_tokens == fake_engine.max_context - len(prompt_ids(fake_engine))


def test_max_completion_tokens_wins_over_max_tokens(openai_client, fake_runner):
    chat(openai_client, max_tokens=5, max_completion_tokens=9)
    assert fake_runner.requests[-1].params.max_tokens == 9


def test_ignore_eos_drops_the_stop_token_ids(openai_client, fake_runner):
    chat(openai_client)
    assert fake_runner.requests[-1].params.stop_token_ids == frozenset({EOS})
    chat(openai_client, max_tokens=40, extra_body={"ignore_eos": True})  # past the reply's end: EOS is output
    assert fake_runner.requests[-1].params.stop_token_ids == frozenset()


def test_null_fields_count_as_absent(fake_server):
    status, _, body = post(fake_server, "/v1/chat/completions", {"messages": HELLO, "logit_bias": None, "temperature": None})
    assert status == 200 and body["choices"][0]["message"]["content"]


# --- tool calls and reasoning --------------------------------------------------------------------


def streamed_tool_calls(chunks) -> list[dict]:
    calls: dict[int, dict] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True])
def test_hermes_tool_call(openai_client, fake_engine, stream, fake_runner):
    fake_runner.replies.append(Reply.text(HERMES))
    if stream:
        chunks, content, _ = streamed(openai_client, tools=TOOLS)
        calls, finish = streamed_tool_calls(chunks), chunks[-1].choices[0].finish_reason
        assert content == ""
    else:
        r = chat(openai_client, tools=TOOLS)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        assert message.content is None
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    assert fake_engine.chat_template.calls[-1]["tools"] == TOOLS


@pytest.mark.parametrize("stream", [False, True])
def test_xml_tool_calls_follow_the_parameter_schema(openai_client, fake_runner, stream):
    fake_runner.replies.append(Reply.text(XML))
    if stream:
        chunks, content, _ = streamed(openai_client, tools=TOOLS)
        calls, finish = streamed_tool_calls(chunks), chunks[-1].choices[0].finish_reason
    else:
        r = chat(openai_client, tools=TOOLS)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        content = message.content
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert content.strip() == "Let me check."
    assert finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather", "get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "San Francisco", "days": 2}
    assert json.loads(calls[1]["arguments"]) == {"city": "2024"}  # a string by the schema
    assert len({c["id"] for c in calls}) == 2


def test_tool_choice_none_offers_no_tools_and_parses_none(openai_client, fake_engine, fake_runner):
    fake_runner.replies.append(Reply.text(HERMES))
    r = chat(openai_client, tools=TOOLS, tool_choice="none")
    assert fake_engine.chat_template.calls[-1]["tools"] is None
    assert r.choices[0].message.content == HERMES and r.choices[0].finish_reason == "stop"


def test_malformed_tool_call_is_returned_as_content(openai_client, fake_runner):
    fake_runner.replies.append(Reply.text("<tool_call>{not json}</tool_call>"))
    r = chat(openai_client, tools=TOOLS)
    assert r.choices[0].message.content == "<tool_call>{not json}</tool_call>"
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


def test_assistant_tool_calls_in_history_reach_the_template(openai_client, fake_engine):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat(openai_client, messages=messages, tools=TOOLS)
    sent = fake_engine.chat_template.calls[-1]["messages"]
    assert sent[1]["content"] == ""
    assert sent[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content(openai_client, fake_runner, stream):
    fake_runner.replies.append(Reply.text("<think>\nThe user greets me.\n</think>\n\nHello!"))
    if stream:
        _, content, reasoning = streamed(openai_client)
        assert "<" not in content
    else:
        message = chat(openai_client).choices[0].message
        content, reasoning = message.content, message.reasoning_content
    assert content == "Hello!"
    assert reasoning.strip() == "The user greets me."


def test_reasoning_when_the_template_opens_the_think_block(openai_client, fake_engine, fake_runner):
    fake_engine.chat_template.think = True
    fake_runner.replies.append(Reply.text("Hmm, a greeting.</think>\n\nHi!"))
    _, content, reasoning = streamed(openai_client)
    assert (content, reasoning) == ("Hi!", "Hmm, a greeting.")


# --- completions ---------------------------------------------------------------------------------


def test_completion(openai_client, fake_runner):
    fake_runner.replies.append(Reply.text(" a time there was"))
    r = openai_client.completions.create(model="m", prompt="Once upon", max_tokens=5)
    assert r.object == "text_completion"
    assert (r.choices[0].text, r.choices[0].finish_reason) == (" a ti", "length")
    assert fake_runner.requests[-1].prompt_ids == [BOS, *b"Once upon"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (10, 5)


def test_completion_stream(openai_client, fake_runner):
    fake_runner.replies.append(Reply.text(" there. END"))
    chunks = list(
        openai_client.completions.create(
            model="m",
            prompt="Hi",
            stream=True,
            stop=["END"],
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " there. "
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 3


@pytest.mark.parametrize(
    ("prompt", "ids"),
    [([5, 6, 7], [5, 6, 7]), (["Hi"], [BOS, *b"Hi"]), ("<s>Hi", [BOS, *b"Hi"])],
    ids=["token-ids", "one-string-list", "bos-not-doubled"],
)
def test_completion_prompt_forms(openai_client, fake_runner, prompt, ids):
    openai_client.completions.create(model="m", prompt=prompt, max_tokens=1)
    assert fake_runner.requests[-1].prompt_ids == ids


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hi", "echo": "yes"}, "echo"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [999]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "Hi", "best_of": 2}, "best_of"),
        ({"prompt": "Hi", "logprobs": 6}, "logprobs"),
    ],
)
def test_completion_errors(openai_client, fake_server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.post("/completions", body={"model": "m", **body}, cast_to=object)
    assert e.value.param == param
    status, _, payload = post(fake_server, "/v1/completions", {"model": "m", **body})
    assert status == 400
    assert_error_shape(payload)


# --- errors --------------------------------------------------------------------------------------

BAD_CHAT_BODIES = [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content",
    ),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_p": False}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"seed": "x"}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"n": 5}, "n"),  # more than the fake engine's 4 slots
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": "x"}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"model": 5}, "model"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logit_bias": {"a": 5}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"999": 1}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT_BODIES, ids=[str(b) for b, _ in BAD_CHAT_BODIES])
def test_invalid_chat_requests_are_400(openai_client, fake_server, fake_runner, body, param):
    body = {"model": "m", "messages": HELLO, **body}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.post("/chat/completions", body=body, cast_to=object)
    assert e.value.param == param
    status, _, payload = post(fake_server, "/v1/chat/completions", body)
    assert status == 400
    assert_error_shape(payload)
    assert payload["error"]["param"] == param
    assert fake_runner.requests == []


@pytest.mark.parametrize(
    ("data", "code"),
    [(b"{not json", "invalid_json"), (b"[1, 2]", None), (b"", "invalid_json"), (b'"x"', None)],
)
def test_body_must_be_a_json_object(fake_server, data, code):
    status, _, body = post(fake_server, "/v1/chat/completions", data)
    assert status == 400
    assert_error_shape(body)
    assert body["error"]["code"] == code


def test_prompt_longer_than_the_context(openai_client, fake_engine, fake_runner):
    messages = [{"role": "user", "content": "x" * (fake_engine.max_context + 100)}]
    n_prompt = len(prompt_ids(fake_engine, messages))
    with pytest.raises(openai.BadRequestError) as e:
        chat(openai_client, messages=messages)
    assert e.value.code == "context_length_exceeded"
    assert str(n_prompt) in e.value.message and str(fake_engine.max_context) in e.value.message
    assert fake_runner.requests == []


def test_prompt_that_fills_the_context_exactly_is_refused(openai_client, fake_engine):
    empty = len(prompt_ids(fake_engine, [{"role": "user", "content": ""}]))
    messages = [{"role": "user", "content": "x" * (fake_engine.max_context - empty)}]  # a byte a token
    assert len(prompt_ids(fake_engine, messages)) == fake_engine.max_context
    with pytest.raises(openai.BadRequestError) as e:
        chat(openai_client, messages=messages)
    assert e.value.code == "context_length_exceeded"


def test_template_error_is_400(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(openai_client, messages=[{"role": "user", "content": "!template-error"}])
    assert "roles must alternate" in e.value.message


def test_unknown_route_is_404(openai_client, fake_server):
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("some-model")
    status, _, body = get(fake_server, "/v1/nothing-here")
    assert status == 404
    assert_error_shape(body)


def test_wrong_method_is_405(fake_server):
    status, headers, body = get(fake_server, "/v1/chat/completions")
    assert status == 405 and "POST" in headers["Allow"]
    assert_error_shape(body)
    status, _, body = post(fake_server, "/v1/models", {"x": 1})
    assert status == 405
    assert_error_shape(body)


def test_engine_failure_non_stream_is_500(openai_client, fake_runner):
    fake_runner.replies.append(Reply([ord("a"), RuntimeError("device lost")]))
    with pytest.raises(openai.InternalServerError) as e:
        chat(openai_client)
    assert e.value.code == "engine_error"


def test_engine_failure_mid_stream_is_an_error_event(openai_client, fake_server, fake_runner):
    fake_runner.replies.append(Reply([ord("a"), RuntimeError("device lost")]))
    with pytest.raises(openai.APIError) as e:
        list(chat(openai_client, stream=True))
    assert e.value.code == "engine_error"
    fake_runner.replies.append(Reply([ord("a"), RuntimeError("device lost")]))
    conn, resp = open_hello_stream(fake_server)
    events = sse_events(resp.read().decode())
    conn.close()
    assert events[-1] == "[DONE]"
    assert_error_shape(json.loads(events[-2]), "server_error")
    assert json.loads(events[1])["choices"][0]["delta"] == {"content": "a"}


@pytest.mark.parametrize("fake_engine", [{"queue_limit": 0}], indirect=True)  # no request may wait
def test_queue_full_is_429_with_retry_after(openai_client, fake_server, fake_runner):
    with pytest.raises(openai.RateLimitError) as e:
        chat(openai_client)
    assert e.value.code == "queue_full"
    retry_after = e.value.response.headers["Retry-After"]
    assert int(retry_after) >= 1  # the engine's estimate of the queue's drain, at least a second
    status, headers, body = post(fake_server, "/v1/completions", {"prompt": "Hi"})
    assert status == 429 and headers["Retry-After"] == retry_after
    assert_error_shape(body, "rate_limit_exceeded")
    assert fake_runner.requests == []


def test_loading_engine_is_503_and_health_follows_it():
    held = threading.Event()
    engine = start_scripted_engine(held=held)
    with running_server(create_app({"TESTING": True}, engine=engine)) as srv:
        status, _, body = post(srv, "/v1/chat/completions", {"messages": HELLO})
        assert status == 503 and body["error"]["code"] == "engine_not_ready"
        status, _, body = get(srv, "/health")
        assert (status, body["status"]) == (503, "loading")
        held.set()
        assert engine.settled.wait(10)
        status, _, body = get(srv, "/health")
        assert (status, body["status"]) == (200, "ok")
        status, _, body = post(srv, "/v1/chat/completions", {"messages": HELLO})
        assert status == 200 and body["choices"][0]["message"]["content"]
    engine.stop(5)


def test_engine_cancelling_a_request_is_503(openai_client, fake_engine, fake_runner):
    fake_runner.gate.clear()  # hold the request in its first step, then cancel it from elsewhere
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(chat, openai_client)
        assert wait_until(lambda: fake_runner.requests)
        fake_engine.abort(fake_runner.requests[-1])
        fake_runner.gate.set()
        with pytest.raises(openai.InternalServerError) as e:
            reply.result(10)
    assert e.value.status_code == 503


# --- disconnects ---------------------------------------------------------------------------------


def test_client_disconnecting_mid_stream_aborts_its_request(fake_server, fake_engine, fake_runner):
    fake_runner.replies.append(Reply([ord("x")], delay=0.01, forever=True))
    sock = raw_request(fake_server, "/v1/chat/completions", {"messages": HELLO, "stream": True})
    received = b""
    while b"data: " not in received:
        received += sock.recv(4096)
    sock.close()
    assert wait_until(lambda: fake_runner.requests)  # the role chunk can come before the request's first step
    request = fake_runner.requests[-1]
    assert drain_outputs(request)[1] == FinishReason.CANCELLED
    assert request.cancel_reason == FinishReason.CANCELLED  # aborted by the handler, not ended by the engine


def test_client_disconnecting_while_waiting_aborts_its_request(fake_server, fake_runner):
    fake_runner.replies.append(Reply.text("never sent"))
    fake_runner.gate.clear()  # the model thread holds in the request's first step
    sock = raw_request(fake_server, "/v1/chat/completions", {"messages": HELLO})
    assert wait_until(lambda: fake_runner.requests)
    request = fake_runner.requests[-1]
    sock.close()
    assert wait_until(lambda: request.cancel_reason == FinishReason.CANCELLED)
    fake_runner.gate.set()
    assert drain_outputs(request)[1] == FinishReason.CANCELLED
