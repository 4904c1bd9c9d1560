"""The API's structured-output, tool-choice, sampling and logprobs parameters, through the real
openai client against a real engine over a scripted runner: what is accepted, what reaches the
engine (a constraint shows as a script the grammar bends), the response shapes, and a 400 naming the parameter for anything that cannot be honoured."""

import json

import openai
import pytest
from support import chat
from support.fakes import EOS, Reply, ScriptedRunner

from webapp.engine.text.chat_template import ChatTemplate

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def bad_request(fn, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        fn()
    assert e.value.body["param"] == param, e.value.body
    return e.value.body["message"]


def content(reply) -> str:
    return reply.choices[0].message.content


def test_json_object_and_json_schema_reach_the_engine_as_a_constraint(openai_client, fake_runner):
    fake_runner.replies.append(Reply.text('Sure: {"a": 1}'))  # not JSON: the grammar picks other tokens
    assert isinstance(json.loads(content(chat(openai_client, response_format={"type": "json_object"}))), dict)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    fake_runner.replies.append(Reply.text('{"b": 1}'))  # the wrong key: the schema's is the only one allowed
    assert json.loads(content(chat(openai_client, response_format=fmt))) == {"a": 1}
    fake_runner.replies.append(Reply.text('{"b": 1}'))
    assert content(chat(openai_client, response_format={"type": "text"})) == '{"b": 1}'


def test_a_schema_keyword_that_cannot_be_enforced_is_a_400_naming_it(openai_client):
    schema = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema}}
    message = bad_request(lambda: chat(openai_client, response_format=fmt), "response_format")
    assert '"if"' in message and '"then"' in message


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos"),
        ({"extra_body": {"grammar": "root ::= ("}}, "grammar"),
        ({"extra_body": {"grammar": {"type": "regex", "grammar": "a+"}}}, "grammar"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_constraints_that_cannot_be_honoured_are_400(openai_client, kw, param):
    bad_request(lambda: chat(openai_client, **kw), param)


def test_forced_tool_call_is_constrained_and_parsed_back(openai_client, fake_runner):
    # a misspelt argument: the grammar allows only the tool's own
    fake_runner.replies.append(Reply.text('<tool_call>\n{"name": "get_weather", "arguments": {"citx": "Oslo"}}\n</tool_call>'))
    reply = chat(
        openai_client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert reply.choices[0].finish_reason == "tool_calls"
    fake_runner.replies.append(Reply.text("No call."))
    assert content(chat(openai_client, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=True)) == "No call."


def test_raw_gbnf_and_lark_grammars_are_accepted(openai_client, fake_runner):
    fake_runner.replies.append(Reply.text("no way"))
    assert content(chat(openai_client, extra_body={"grammar": 'root ::= "yes" | "no"'})) == "no"
    # the scripted "b" is refused where the grammar allows only the end: the answer ends after "aa"
    # (with `"a"+` the end and a third "a" would tie, and the draw would pick either)
    fake_runner.replies.append(Reply.text("aab"))
    assert content(chat(openai_client, extra_body={"grammar": {"type": "lark", "grammar": 'start: "a" "a"'}})) == "aa"


def test_tools_go_into_the_system_prompt_when_the_template_ignores_them(openai_client, fake_engine, fake_runner):
    fake_engine.loaded.chat_template = ChatTemplate(None, "<s>", "</s>")  # plain ChatML: never renders `tools`
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    chat(openai_client, messages=history, tools=[WEATHER])
    prompt = fake_engine.tokenizer.decode(fake_runner.requests[-1].prompt_ids)
    assert prompt.count("<|im_start|>system") == 1 and "Be brief." in prompt
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt and "To call a tool" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    chat(openai_client, messages=history, tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in fake_engine.tokenizer.decode(fake_runner.requests[-1].prompt_ids)


def test_sampling_options_reach_the_engine(openai_client, fake_runner):
    chat(
        openai_client,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"65": 3, "66": -100},
        extra_body={"min_p": 0.1, "repetition_penalty": 1.2},
    )
    p = fake_runner.requests[-1].params
    assert (p.presence_penalty, p.frequency_penalty, p.min_p, p.repetition_penalty) == (0.5, -0.25, 0.1, 1.2)
    assert p.logit_bias == ((65, 3.0), (66, -100.0))


def test_chat_logprobs_non_streamed_and_streamed(openai_client, fake_runner):
    fake_runner.replies.append(Reply.text("Hey"))
    reply = chat(openai_client, logprobs=True, top_logprobs=1)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == ["H", "e", "y"]
    assert all(
        c.logprob == pytest.approx(ScriptedRunner.picked_logprob(), abs=1e-6)
        and c.bytes == list(c.token.encode())
        and len(c.top_logprobs) == 1
        for c in content
    )
    fake_runner.replies.append(Reply.text("Hey"))
    chunks = list(chat(openai_client, logprobs=True, stream=True))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == ["H", "e", "y"]
    assert chat(openai_client).choices[0].logprobs is None


def test_completion_echo_scores_the_prompt_with_max_tokens_zero(openai_client, fake_runner):
    out = openai_client.completions.create(model="m", prompt="abc", max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == "abc" and choice.finish_reason == "length" and out.usage.completion_tokens == 0
    # the fake tokenizer adds BOS; its first token has no logprob
    assert choice.logprobs.tokens == ["<s>", "a", "b", "c"]
    # each prompt token as likely as the runner's rows make it
    assert choice.logprobs.token_logprobs == [None, *[pytest.approx(ScriptedRunner.picked_logprob(), abs=1e-6)] * 3]
    assert choice.logprobs.text_offset == [0, 3, 4, 5]
    assert fake_runner.requests[-1].params.prompt_logprobs == 1


def test_completion_logprobs_and_echo_streamed(openai_client, fake_runner):
    fake_runner.replies.append(Reply([ord("x"), ord("y"), EOS]))
    chunks = list(openai_client.completions.create(model="m", prompt="ab", max_tokens=5, echo=True, logprobs=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "abxy"
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == ["<s>", "a", "b", "x", "y"]
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model="m", prompt="ab", max_tokens=0)


def test_parallel_tool_calls_false_keeps_only_the_first_free_call(openai_client, fake_runner):
    two = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>\n' * 2
    for stream in (False, True):
        for parallel, expected in ((False, 1), (True, 2)):
            fake_runner.replies.append(Reply.text(two))
            reply = chat(openai_client, tools=[WEATHER], parallel_tool_calls=parallel, stream=stream)
            if stream:
                calls = {d.index for c in reply if c.choices for d in c.choices[0].delta.tool_calls or []}
            else:
                calls = reply.choices[0].message.tool_calls
            assert len(calls) == expected
    with pytest.raises(openai.BadRequestError):
        chat(openai_client, tools=[WEATHER], extra_body={"parallel_tool_calls": "no"})


def test_a_forced_call_takes_no_property_its_tool_never_named(openai_client, fake_runner):
    # JSON Schema lets an object take any property it does not list; a forced call reads the tool's
    # schema strictly, so the invented one is refused token by token and the object ends instead
    invented = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "api_key": "x"}}\n</tool_call>'
    fake_runner.replies.append(Reply.text(invented))
    reply = chat(openai_client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_by_max_tokens_is_dropped_not_shown_as_markup(openai_client, fake_runner, stream):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for max_tokens in (5, 30, len(call) - 3):  # inside the opening tag, the arguments, the closing tag
        fake_runner.replies.append(Reply.text(call))
        reply = chat(openai_client, tools=[WEATHER], tool_choice="required", max_tokens=max_tokens, stream=stream)
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        else:
            text, calls = content(reply) or "", reply.choices[0].message.tool_calls or []
            finish = reply.choices[0].finish_reason
        assert "<" not in text and finish == "length", (max_tokens, text)
        # a call whose JSON was whole when the limit fell inside its closing tag is still a call
        assert len(calls) == (max_tokens == len(call) - 3), max_tokens


def test_a_forced_call_may_end_with_the_line_break_after_its_closing_tag(openai_client, fake_runner):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    fake_runner.replies.append(Reply.text(call))  # then the end of output, which the grammar must allow
    reply = chat(openai_client, tools=[WEATHER], tool_choice="required", max_tokens=200)
    assert len(reply.choices[0].message.tool_calls) == 1 and reply.choices[0].finish_reason == "tool_calls"
