"""gpt-oss's own chat template (the `tokenizer.chat_template` of gpt-oss's GGUF files, as llama.cpp
keeps it in models/templates/openai-gpt-oss-120b.jinja) through our renderer: a system message,
tools, a past tool call with its result, and the generation prompt, in Harmony's `<|start|>...<|end|>`
structure. The template is OpenAI's, not this project's, so it is not kept here: the tests read it
from a llama.cpp checkout's models/templates folder named by LLAMA_CPP_TEMPLATES, and skip without one."""

import os
import pathlib

import pytest

from webapp.engine.text.chat_template import ChatTemplate
from webapp.openai.harmony import template_messages, uses_harmony

TEMPLATE = pathlib.Path(os.environ.get("LLAMA_CPP_TEMPLATES", "/nonexistent")) / "openai-gpt-oss-120b.jinja"
pytestmark = pytest.mark.skipif(not TEMPLATE.is_file(), reason="LLAMA_CPP_TEMPLATES names no llama.cpp templates folder")
SOURCE = TEMPLATE.read_text() if TEMPLATE.is_file() else ""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "A city"}, "unit": {"type": "string", "enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]
# as webapp.openai.request_bodies normalizes a conversation: content a string, arguments an object
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should call get_weather.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
]


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(SOURCE, bos_token="<|startoftext|>", eos_token="<|return|>")


def test_a_conversation_with_tools_and_a_past_tool_call_renders_in_harmony(template):
    prompt = template.render(template_messages(SOURCE, CONVERSATION), tools=TOOLS)
    assert uses_harmony(SOURCE)
    assert prompt.startswith("<|start|>system<|message|>") and "Reasoning: medium" in prompt
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {" in prompt
    assert '// Weather now.\ntype get_weather = (_: {\n// A city\ncity: string,\nunit?: "C" | "F",\n}) => any;' in prompt
    assert "type get_time = (_: {\nzone?: string,\n}) => any;" in prompt  # a tool without a description renders too
    assert prompt.endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>I should call get_weather.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18C"<|end|>'
        "<|start|>assistant"
    )


def test_a_past_answer_is_written_to_the_final_channel_and_its_reasoning_dropped(template):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
        {"role": "user", "content": "Bye"},
    ]
    prompt = template.render(template_messages(SOURCE, messages))
    assert "<|start|>assistant<|channel|>final<|message|>Hello!<|end|><|start|>user<|message|>Bye<|end|><|start|>assistant" in prompt
    assert "A greeting." not in prompt and "<|start|>developer" not in prompt
