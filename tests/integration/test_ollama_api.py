"""Ollama's API through the real `ollama` client against a real Waitress server: chat and generate,
whole and streamed as newline-delimited JSON, thinking, tool calls both ways, options and `format`
reaching the engine, a raw prompt, the model listings, and errors in Ollama's `{"error": ...}`
shape; over the scripted fake engine, and once over a real tiny model (chat and embeddings)."""

import json
import threading

import numpy as np
import ollama
import pytest
import requests
from support import tiny_engine_server
from support.fakes import EOS, TOOLS, Reply
from support.tiny_models import write_tiny_gguf

from webapp.engine.serving.request import FinishReason

HELLO = [{"role": "user", "content": "hello"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def client(fake_server):
    return ollama.Client(host=fake_server.url, timeout=10)


def test_a_chat_comes_back_whole_with_ollamas_counts(client, fake_runner):
    fake_runner.replies.append(Reply.text("Hi there."))
    options = {"temperature": 0.5, "top_k": 7, "seed": 3, "num_predict": 40, "stop": ["END"], "num_ctx": 4096}
    response = client.chat(model="tiny:latest", messages=HELLO, stream=False, options=options)
    assert response.model == "tiny:latest" and response.done and response.done_reason == "stop"
    assert response.message.role == "assistant" and response.message.content == "Hi there."
    assert response.eval_count == len("Hi there.") and response.prompt_eval_count > 0
    assert response.total_duration >= response.eval_duration >= 0
    sent = fake_runner.requests[-1].params
    assert (sent.temperature, sent.top_k, sent.seed, sent.max_tokens) == (0.5, 7, 3, 40) and EOS in sent.stop_token_ids


def test_a_streamed_chat_is_ndjson_ending_in_a_done_object_and_thinking_comes_apart(client, fake_runner):
    fake_runner.replies.append(Reply.text("<think>Hmm.</think>Paris is sunny."))
    chunks = list(client.chat(model="tiny", messages=HELLO, think=True, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done and chunks[-1].done_reason == "stop"
    assert "".join(c.message.content for c in chunks) == "Paris is sunny."
    assert "".join(c.message.thinking or "" for c in chunks) == "Hmm."
    assert chunks[-1].eval_count == len("<think>Hmm.</think>Paris is sunny.")


def test_num_predict_ends_the_answer_with_done_reason_length(client, fake_runner):
    fake_runner.replies.append(Reply.text("one two three four"))
    response = client.chat(model="tiny", messages=HELLO, stream=False, options={"num_predict": 4})
    assert response.done_reason == "length" and response.message.content == "one "
    assert fake_runner.requests[-1].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_comes_back_with_arguments_as_an_object_and_its_result_goes_in(client, fake_runner, fake_engine, stream):
    fake_runner.replies.append(Reply.text(CALL))
    if stream:
        calls = [
            call for chunk in client.chat(model="tiny", messages=HELLO, tools=TOOLS, stream=True) for call in chunk.message.tool_calls or []
        ]
    else:
        calls = client.chat(model="tiny", messages=HELLO, tools=TOOLS, stream=False).message.tool_calls
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert fake_engine.chat_template.calls[-1]["tools"] == TOOLS
    fake_runner.replies.append(Reply.text("It is sunny in Paris."))
    turn = [
        *HELLO,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    assert client.chat(model="tiny", messages=turn, tools=TOOLS, stream=False).message.content == "It is sunny in Paris."
    sent = fake_engine.chat_template.calls[-1]["messages"]
    assert sent[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert sent[2]["role"] == "tool" and sent[2]["content"] == "sunny"


def test_format_constrains_the_output_to_json(client, fake_runner):
    fake_runner.replies.append(Reply.text('Sure: {"a": 1}'))  # not JSON: the grammar picks other tokens
    assert isinstance(json.loads(client.chat(model="tiny", messages=HELLO, format="json", stream=False).message.content), dict)
    fake_runner.replies.append(Reply.text('{"b": 1}'))  # the wrong key: the schema's is the only one allowed
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert json.loads(client.chat(model="tiny", messages=HELLO, format=schema, stream=False).message.content) == {"a": 1}


def test_generate_through_the_template_and_raw(client, fake_runner, fake_engine):
    fake_runner.replies.append(Reply.text("Bonjour."))
    response = client.generate(model="tiny", prompt="Say hello", system="Be French.", stream=False)
    assert response.response == "Bonjour." and response.done and response.done_reason == "stop"
    assert fake_engine.chat_template.calls[-1]["messages"] == [
        {"role": "system", "content": "Be French."},
        {"role": "user", "content": "Say hello"},
    ]
    fake_runner.replies.append(Reply.text(" world"))
    pieces = list(client.generate(model="tiny", prompt="hello", raw=True, stream=True))
    assert "".join(p.response for p in pieces) == " world" and pieces[-1].done
    assert fake_runner.requests[-1].prompt_ids[-5:] == list(b"hello")  # the prompt as it is: no template


def test_an_empty_prompt_loads_the_model_and_answers_nothing(client, fake_runner):
    response = client.generate(model="tiny", prompt="", stream=False)
    assert response.done and response.done_reason == "load" and response.response == ""
    assert not fake_runner.requests


def test_the_model_listings(client, fake_engine):
    listed = client.list().models
    assert [m.model for m in listed] == [f"{fake_engine.model_name}:latest"] and listed[0].details.format == "gguf"
    assert [m.model for m in client.ps().models] == [f"{fake_engine.model_name}:latest"]
    shown = client.show("tiny")
    assert shown.template == (fake_engine.chat_template.source or "") and "completion" in shown.capabilities
    assert requests.get(f"{client._client.base_url}/api/version", timeout=5).json()["version"]


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda c: c.chat(model="tiny", messages=HELLO, options={"warp_drive": 1}), "options.warp_drive"),
        (lambda c: c.chat(model="tiny", messages=[{"role": "user", "content": "what is this?", "images": [b"\x89PNG"]}]), "images"),
        (lambda c: c.chat(model="tiny", messages=HELLO, options={"num_predict": 0}), "num_predict"),
        (lambda c: c.generate(model="tiny", prompt="x", suffix="y"), "suffix"),
        (lambda c: c.generate(model="tiny", prompt="x", raw=True, format="json"), "format"),
    ],
)
def test_bad_input_is_a_400_in_ollamas_shape(client, call, words):
    with pytest.raises(ollama.ResponseError) as e:
        call(client)
    assert e.value.status_code == 400 and words in e.value.error


def test_an_unknown_route_under_api_answers_in_ollamas_shape(fake_server):
    response = requests.post(f"{fake_server.url}/api/pull", json={"model": "llama3"}, timeout=5)
    assert response.status_code == 404 and set(response.json()) == {"error"}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("ollama") / "tiny.gguf"), "qwen3", matrix_type="Q8_0", context=512)
    with tiny_engine_server(path, slots=2, queue_limit=8, context=256) as (engine, server):
        yield engine, ollama.Client(host=server.url, timeout=120)


def test_a_real_model_chats_and_embeds(real):
    engine, client = real
    chunks = list(client.chat(model=engine.model_name, messages=HELLO, options={"num_predict": 5, "temperature": 0}, stream=True))
    assert chunks[-1].done and chunks[-1].eval_count == 5
    whole = client.chat(model=engine.model_name, messages=HELLO, stream=False, options={"num_predict": 5, "temperature": 0})
    assert whole.message.content == "".join(c.message.content for c in chunks)  # greedy: the same tokens
    vectors = client.embed(model=engine.model_name, input=["the cat", "a dog"]).embeddings
    assert len(vectors) == 2 and all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    single = client.embeddings(model=engine.model_name, prompt="the cat").embedding
    np.testing.assert_allclose(single, vectors[0], atol=1e-6)


def test_keep_alive_0_puts_the_model_to_sleep_and_the_next_request_wakes_it(tmp_path):
    from support import running_server
    from support.fakes import FakeModelEngines

    from webapp import create_app
    from webapp.engine.serving.model_set import ModelSet

    (tmp_path / "sleepy.gguf").write_bytes(b"x" * 100)
    models = ModelSet(None, FakeModelEngines(), first=str(tmp_path / "sleepy.gguf"), idle_s=3600).start()
    app = create_app({"TESTING": True}, engine=models)
    try:
        with running_server(app) as server:
            client = ollama.Client(host=server.url, timeout=10)
            assert client.chat(model="sleepy", messages=HELLO, stream=False, keep_alive="5m").done
            assert [m.model for m in client.ps().models] == ["sleepy:latest"]
            assert client.chat(model="sleepy", messages=HELLO, stream=False, keep_alive=0).done
            for _ in range(100):  # released when the response closes
                if not client.ps().models:
                    break
                threading.Event().wait(0.02)
            assert client.ps().models == [] and [m.model for m in client.list().models] == ["sleepy:latest"]
            listed = requests.get(f"{server.url}/v1/models", timeout=5).json()["data"]
            assert [(m["id"], m["status"]) for m in listed] == [("sleepy", "unloaded")]
            assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
            assert client.chat(model="sleepy", messages=HELLO, stream=False).done  # woken
            assert [m.model for m in client.ps().models] == ["sleepy:latest"]
            with pytest.raises(ollama.ResponseError) as e:
                client.chat(model="sleepy", messages=HELLO, stream=False, keep_alive="soon")
            assert e.value.status_code == 400 and "keep_alive" in e.value.error
    finally:
        models.stop(5)
