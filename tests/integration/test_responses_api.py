"""OpenAI's Responses API through the real `openai` client, against a real Waitress server over the
scripted fake fake_engine: responses.create and responses.stream, reasoning, function calls and their
outputs, text.format json_schema through responses.parse, previous_response_id chaining, stored
responses, Codex's request shape, and errors."""

import json

import openai
import pytest
from pydantic import BaseModel
from support import post
from support.fakes import Reply

from webapp.openai.responses_format import chat_body

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_string_input_gives_one_message_item(openai_client, fake_engine, fake_runner):
    fake_runner.replies.append(Reply.text("Hi there."))
    response = openai_client.responses.create(model="tiny", input="hello", instructions="Be brief.")
    assert response.object == "response" and response.status == "completed" and response.model == "tiny"
    assert response.output_text == "Hi there." and response.output[0].type == "message"
    assert response.usage.output_tokens == len("Hi there.") and response.usage.input_tokens > 0
    rendered = fake_engine.chat_template.calls[-1]["messages"]
    assert rendered == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]


def test_running_out_of_tokens_is_an_incomplete_response(openai_client, fake_runner):
    fake_runner.replies.append(Reply.text("one two three"))
    response = openai_client.responses.create(model="m", input="hello", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert fake_runner.requests[-1].params.max_tokens == 3


def test_the_stream_has_the_responses_events_and_ends_completed(openai_client, fake_runner):
    fake_runner.replies.append(Reply.text("<think>Hmm.</think>Paris."))
    with openai_client.responses.stream(model="m", input="Capital of France?") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.reasoning_text.delta" in kinds
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "Paris."


def test_a_function_call_then_its_output_chained_by_previous_response_id(openai_client, fake_engine, fake_runner):
    fake_runner.replies.append(Reply.text(CALL.replace("city", "citx")))  # required tool use goes through the grammar
    first = openai_client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER], tool_choice="required")
    (call,) = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    fake_runner.replies.append(Reply.text("Sunny in Paris."))
    second = openai_client.responses.create(
        model="m",
        previous_response_id=first.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert second.output_text == "Sunny in Paris." and second.previous_response_id == first.id
    rendered = fake_engine.chat_template.calls[-1]["messages"]
    assert [m["role"] for m in rendered] == ["user", "assistant", "tool"]
    assert rendered[1]["tool_calls"][0]["id"] == call.call_id and rendered[2]["content"] == "sunny"
    assert openai_client.responses.retrieve(second.id).output_text == "Sunny in Paris."


def test_text_format_json_schema_is_parsed_by_the_client(openai_client, fake_runner):
    class City(BaseModel):
        name: str
        population: int

    fake_runner.replies.append(Reply.text('{"nime": "Paris", "population": 2100000}'))  # the schema constrains the output
    parsed = openai_client.responses.parse(model="m", input="A city?", text_format=City)
    assert parsed.output_parsed == City(name="Paris", population=2100000)


def test_store_false_is_not_kept_and_unknown_ids_are_errors(openai_client, fake_runner, fake_server):
    fake_runner.replies.append(Reply.text("x"))
    response = openai_client.responses.create(model="m", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        openai_client.responses.create(model="m", input="hi", previous_response_id="resp_missing")


def test_codexs_request_shape_is_accepted_with_its_non_function_tools_skipped():
    body = {
        "model": "gpt-5-codex",
        "instructions": "You are Codex.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>...</permissions>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "reasoning", "summary": [], "encrypted_content": None},
        ],
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "parameters": {"type": "object", "properties": {"command": {"type": "array"}}},
                "strict": False,
            },
            {"type": "web_search"},
            {"type": "namespace", "name": "mcp", "tools": []},
            {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "abc",
        "client_metadata": {"x": "y"},
    }
    chat = chat_body(body, [])
    assert [m["role"] for m in chat["messages"]] == ["system", "developer", "user"]
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell"] and chat["parallel_tool_calls"] is False


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": "hi", "frequency": 1}, "frequency"),
        (
            {"model": "m", "input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input_image",
        ),
        ({"model": "m", "input": [{"type": "computer_call"}]}, "computer_call"),
        ({"model": "m", "input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ],
)
def test_bad_bodies_are_400s_in_openais_shape(fake_server, body, field):
    status, _, error = post(fake_server, "/v1/responses", body)
    assert status == 400 and error["error"]["type"] == "invalid_request_error" and field in error["error"]["message"]


def test_the_agents_sdk_runs_an_agent_with_a_tool_in_its_default_responses_mode(fake_server, fake_engine, fake_runner):
    """The OpenAI Agents SDK as its users run it: an Agent with a function tool; the model calls the
    tool, the SDK runs it and sends its output back, and the final answer ends the run."""
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # its traces would go to OpenAI's servers
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    fake_runner.replies.extend([Reply.text(CALL), Reply.text("It is sunny in Paris.")])
    client = openai.AsyncOpenAI(base_url=f"{fake_server.url}/v1", api_key="local", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=OpenAIResponsesModel("any", client))
    result = Runner.run_sync(agent, "Weather in Paris?", run_config=RunConfig(tracing_disabled=True))
    assert seen == ["Paris"] and result.final_output == "It is sunny in Paris."
    rendered = fake_engine.chat_template.calls[-1]["messages"]
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool"] and rendered[-1]["content"] == "sunny"
