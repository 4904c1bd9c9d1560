"""The one slow end-to-end test: the real default model (SmolLM2-135M-Instruct) behind Waitress,
asked by the real openai client, answers a two-turn conversation correctly."""

import time

import openai
import pytest
from conftest import running_server

from webapp import create_app
from webapp.engine.model import use_tinygrad_from_this_thread


@pytest.fixture(scope="module")
def client():
    use_tinygrad_from_this_thread()
    app = create_app({"TESTING": True, "SLOTS": 2, "MAX_CONTEXT": 1024})
    engine = app.extensions["engine"]
    with running_server(app) as srv:
        deadline = time.monotonic() + 900
        while engine.state == "loading" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert engine.state == "ok", engine.error
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            yield c
    engine.stop(5)


def test_capital_of_france_then_germany(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=40)
    answer = first.choices[0].message.content
    assert "Paris" in answer

    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Germany?"}]
    stream = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=40, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Berlin" in text
    # the follow-up turn prefilled only its new tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
