"""The slow end-to-end tests: the real default model (SmolLM2-135M-Instruct) behind Waitress, asked
by the real openai client, answers a two-turn conversation correctly, returns schema-valid
structured output, makes forced tool calls, and scores prompts (echo + logprobs) consistently."""

import concurrent.futures
import json
import time

import anthropic
import jsonschema
import numpy as np
import openai
import pydantic
import pytest
from support import running_server

from webapp import create_app
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread


@pytest.fixture(scope="module")
def default_model_client():
    """The real `openai` client of the real default model (2 requests at once, 1,024 positions) behind Waitress."""
    use_tinygrad_from_this_thread()
    app = create_app({"TESTING": True, "SLOTS": 2, "MAX_BATCH": 2, "MAX_CONTEXT": 1024})
    engine = app.extensions["engine"]
    with running_server(app) as srv:
        deadline = time.monotonic() + 900
        while engine.state == "loading" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert engine.state == "ok", engine.error
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=600) as c:
            yield c
    engine.stop(5)


def test_capital_of_france_then_germany(default_model_client):
    # A 135M model's greedy answer to a terse question flips with rounding: to "What is the capital
    # of France?" llama.cpp itself answers "L'Étoile, la Marseillaise, ...". Asked for one short
    # sentence, llama.cpp answers "The capital of France is Paris.", and so does this server.
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
    first = default_model_client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=40)
    answer = first.choices[0].message.content
    assert "Paris" in answer

    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And what is the capital of Germany? Answer in one short sentence."},
    ]
    stream = default_model_client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=40, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Berlin" in text
    # the follow-up turn prefilled only its new tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


# --- structured output, forced tool calls and prompt scoring on the real model ------------------


class City(pydantic.BaseModel):
    name: str
    country: str
    population_millions: float


class Person(pydantic.BaseModel):
    name: str
    age: int
    hobbies: list[str]


PARSE_CASES = [
    (City, "Describe Paris as JSON."),
    (City, "Give me data about Tokyo."),
    (City, "What do you know about Cairo?"),
    (City, "Berlin, please, as structured data."),
    (City, "Tell me about New York City."),
    (Person, "Invent a person who likes hiking."),
    (Person, "Describe a retired teacher."),
    (Person, "Make up a profile for a young chess player."),
    (Person, "Who was Ada Lovelace?"),
    (Person, "Create a character for a story about pirates."),
]


def test_parse_returns_a_valid_instance_for_ten_prompts(default_model_client):
    for model, prompt in PARSE_CASES:
        reply = default_model_client.chat.completions.parse(
            model="default",
            messages=[{"role": "user", "content": prompt}],
            response_format=model,
            temperature=0,
            max_tokens=100,
            # greedy decoding of a 135M model repeats list items forever; a frequency penalty ends them
            frequency_penalty=1.0,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        assert isinstance(choice.message.parsed, model), (prompt, choice.message.content)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_forced_tool_call_has_arguments_that_validate(default_model_client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = default_model_client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Is it raining in Lisbon?"}],
            tools=[WEATHER],
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=80,
        )
        out = reply.choices[0]
        assert out.finish_reason == "tool_calls", out.message
        (call,) = out.message.tool_calls
        assert call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == {"city", "unit"} and isinstance(arguments["city"], str)
        assert arguments["unit"] in ("celsius", "fahrenheit")


# The arguments' schema as a client writes it, saying nothing of other properties: JSON Schema's
# default would take invented ones, which this small model at temperature 1 writes often.
LOOSE_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"],
}
TRIES = 50


def _strictly_valid(arguments: dict) -> None:
    jsonschema.validate(arguments, {**LOOSE_SCHEMA, "additionalProperties": False})


def test_forced_tool_calls_at_temperature_one_are_strict_through_both_clients(default_model_client):
    """Every forced reply is calls whose arguments validate strictly, or, where the token limit cut
    the call off, no call and no markup; bench/tool_calls.py counts how often each happens."""
    question = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": LOOSE_SCHEMA}}

    def openai_reply(seed: int) -> tuple[str, list[dict], str]:
        choice = default_model_client.chat.completions.create(
            model="default", messages=question, tools=[tool], tool_choice="required", temperature=1.0, seed=seed, max_tokens=256
        ).choices[0]
        calls = [json.loads(c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.finish_reason, calls, choice.message.content or ""

    claude = anthropic.Anthropic(base_url=str(default_model_client.base_url).removesuffix("/v1/"), api_key="unused", max_retries=0)

    def anthropic_reply(_: int) -> tuple[str, list[dict], str]:
        message = claude.messages.create(  # the SDK sends no temperature: the API's default, 1
            model="default",
            max_tokens=256,
            messages=question,
            tools=[{"name": "get_weather", "description": "The weather in a city.", "input_schema": LOOSE_SCHEMA}],
            tool_choice={"type": "tool", "name": "get_weather"},
        )
        calls = [b.input for b in message.content if b.type == "tool_use"]
        return message.stop_reason, calls, "".join(b.text for b in message.content if b.type == "text")

    for ask, called, cut in ((openai_reply, "tool_calls", "length"), (anthropic_reply, "tool_use", "max_tokens")):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(ask, range(TRIES)))
        for end, calls, text in replies:
            assert "<" not in text and end in (called, cut), (end, text)
            assert calls or end == cut, (end, text)
            for arguments in calls:
                _strictly_valid(arguments)
        assert sum(bool(calls) for _, calls, _ in replies) >= TRIES - 3, replies


def test_echo_logprobs_scoring_matches_one_request_at_a_time(default_model_client):
    prompts = ["The capital of France is Paris.", "Two plus two equals four.", "The quick brown fox jumps."]
    together = default_model_client.completions.create(model="default", prompt=prompts[0], max_tokens=0, echo=True, logprobs=2)
    scored = together.choices[0]
    assert scored.text == prompts[0]
    assert scored.logprobs.token_logprobs[0] is None and len(scored.logprobs.tokens) > 3
    assert all(lp <= 0 for lp in scored.logprobs.token_logprobs[1:])
    # the same prompt scored while other requests generate, and again alone: the same numbers
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        busy = [
            pool.submit(default_model_client.completions.create, model="default", prompt=p, max_tokens=30, temperature=0)
            for p in prompts[1:]
        ]
        again = default_model_client.completions.create(model="default", prompt=prompts[0], max_tokens=0, echo=True, logprobs=2)
        for f in busy:
            f.result()
    np.testing.assert_allclose(again.choices[0].logprobs.token_logprobs[1:], scored.logprobs.token_logprobs[1:], atol=2e-3)
    # and the first generated token's logprob is the same as scoring it as part of the prompt
    gen = default_model_client.completions.create(model="default", prompt=prompts[0][:-1], max_tokens=1, temperature=0, logprobs=0)
    full = default_model_client.completions.create(
        model="default", prompt=prompts[0][:-1] + gen.choices[0].text, max_tokens=0, echo=True, logprobs=0
    )
    np.testing.assert_allclose(full.choices[0].logprobs.token_logprobs[-1], gen.choices[0].logprobs.token_logprobs[0], atol=2e-3)


def test_two_choices_are_their_seeds_answers_streamed_or_not(default_model_client):
    ask = dict(model="default", messages=[{"role": "user", "content": "Name a fruit."}], temperature=1.0, max_tokens=12)
    both = default_model_client.chat.completions.create(n=2, seed=41, **ask)
    assert [c.index for c in both.choices] == [0, 1]
    alone = [default_model_client.chat.completions.create(seed=seed, **ask).choices[0].message.content for seed in (41, 42)]
    assert [c.message.content for c in both.choices] == alone
    streamed = {0: "", 1: ""}
    for chunk in default_model_client.chat.completions.create(n=2, seed=41, stream=True, **ask):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert list(streamed.values()) == alone
    with pytest.raises(openai.BadRequestError, match="n is 3"):
        default_model_client.chat.completions.create(n=3, **ask)  # this server has 2 slots
