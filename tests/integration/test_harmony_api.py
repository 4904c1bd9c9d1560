"""Harmony (gpt-oss) output through the real `openai` client and a real Waitress server: the scripted
fake engine speaks bytes, so every special token reaches the parser split across tokens; a chat
template that writes `<|channel|>` makes the server read the reply as Harmony."""

from __future__ import annotations

import json

import pytest
from support import chat
from support.fakes import TOOLS, Reply

ANSWER = "<|channel|>analysis<|message|>A greeting; reply in kind.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!"
CALLS = (
    "<|channel|>analysis<|message|>Two lookups.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>'
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'
)


@pytest.fixture(autouse=True)
def harmony_template(fake_engine):
    fake_engine.chat_template.source = "{{- '<|start|>assistant<|channel|>final<|message|>' }}"


def _streamed(client, **kw) -> tuple[str, str, list[dict], str]:
    chunks = [c for c in chat(client, stream=True, **kw) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return content, reasoning, [calls[i] for i in sorted(calls)], chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_analysis_is_reasoning_content_and_final_the_content(openai_client, fake_runner, stream):
    fake_runner.replies.append(Reply.text(ANSWER))
    if stream:
        content, reasoning, calls, finish = _streamed(openai_client)
    else:
        choice = chat(openai_client).choices[0]
        content, reasoning, calls, finish = (
            choice.message.content,
            choice.message.reasoning_content,
            choice.message.tool_calls,
            choice.finish_reason,
        )
    assert (content, reasoning, finish) == ("Hello there!", "A greeting; reply in kind.", "stop") and not calls


@pytest.mark.parametrize("stream", [False, True])
def test_messages_to_functions_are_tool_calls(openai_client, fake_runner, stream):
    fake_runner.replies.append(Reply.text(CALLS))
    if stream:
        content, reasoning, calls, finish = _streamed(openai_client, tools=TOOLS)
    else:
        choice = chat(openai_client, tools=TOOLS).choices[0]
        content, reasoning, finish = choice.message.content, choice.message.reasoning_content, choice.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert not content and reasoning == "Two lookups." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_weather", {"city": "Oslo"}),
    ]


def test_a_forced_call_comes_back_as_a_tool_call(openai_client, fake_runner):
    fake_runner.replies.append(Reply.text('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'))
    choice = chat(openai_client, tools=TOOLS, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Rome"}


def test_a_tool_calls_reasoning_sent_back_reaches_the_template_as_thinking(openai_client, fake_engine):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat(openai_client, messages=messages, tools=TOOLS)
    sent = fake_engine.chat_template.calls[-1]["messages"]
    assert sent[1]["thinking"] == "Look it up." and "thinking" not in sent[0]
