"""Chat template tests: the real SmolLM2 template, the ChatML fallback, the sandbox, HF's helpers."""

import datetime

import pytest

from webapp.engine.text.chat_template import ChatTemplate, TemplateError

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def smollm2_template(smollm2_kv) -> str:
    return smollm2_kv["tokenizer.chat_template"]


def test_smollm2_template_two_turns(smollm2_template):
    template = ChatTemplate(smollm2_template, bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert template.render(CONVERSATION) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_template_keeps_given_system_prompt(smollm2_template):
    template = ChatTemplate(smollm2_template, bos_token="<|im_start|>", eos_token="<|im_end|>")
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert template.render(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


@pytest.mark.parametrize("source", [None, ""])
def test_chatml_fallback(source):
    template = ChatTemplate(source, bos_token="", eos_token="<|im_end|>")
    assert template.is_builtin
    assert template.render(CONVERSATION[:2], add_generation_prompt=False) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
    )
    assert template.render([{"role": "user", "content": "Hi"}]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    # An assistant turn that only carried tool calls has content None.
    assert template.render([{"role": "assistant", "content": None}], add_generation_prompt=False) == ("<|im_start|>assistant\n<|im_end|>\n")


def test_text_parts_are_flattened_without_touching_the_callers_messages():
    messages = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    rendered = ChatTemplate(None, "", "").render(messages, add_generation_prompt=False)
    assert rendered == "<|im_start|>user\nfirst\nsecond<|im_end|>\n"
    assert isinstance(messages[0]["content"], list)


def test_non_text_parts_are_rejected():
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    with pytest.raises(TemplateError, match="image_url"):
        ChatTemplate(None, "", "").render(messages)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ self.__init__.__globals__['__builtins__'] }}",
        "{{ messages.append({'role': 'x'}) }}",  # the immutable sandbox forbids mutating inputs
        "{{ messages[0].update({'content': 'changed'}) }}",
    ],
)
def test_hostile_templates_raise(source):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError):
        ChatTemplate(source, "", "").render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_hostile_template_does_not_execute(tmp_path):
    target = tmp_path / "pwned"
    source = "{{ cycler.__init__.__globals__.__builtins__.open('" + str(target) + "', 'w') }}"
    with pytest.raises(TemplateError, match="unsafe"):
        ChatTemplate(source, "", "").render([])
    assert not target.exists()


def test_raise_exception_surfaces_the_templates_message():
    source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    template = ChatTemplate(source, "", "")
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="^Conversation must start with user$") as info:
        template.render([{"role": "assistant", "content": "x"}])
    assert isinstance(info.value, ValueError)


def test_syntax_error_is_raised_at_construction():
    with pytest.raises(TemplateError, match="line 2"):
        ChatTemplate("fine\n{% for m in messages %}{{ m }", "", "")


@pytest.mark.parametrize("source", ["{{ missing.attribute }}", "{{ messages[0]['content'] + 1 }}", "{{ 1 // 0 }}"])
def test_render_failures_become_template_errors(source):
    with pytest.raises(TemplateError, match="chat template failed"):
        ChatTemplate(source, "", "").render([{"role": "user", "content": "x"}])


def test_tools_and_extra_variables_reach_the_template():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für <Orte>"}}]
    source = (
        "{{ bos_token }}{% if tools %}{% for t in tools %}{{ t.function.name }};{% endfor %}"
        "{{ tools | tojson }}|{{ tools[0].function | tojson(indent=2) }}{% endif %}"
        "|{{ enable_thinking }}|{{ eos_token }}"
    )
    rendered = ChatTemplate(source, "<s>", "</s>").render([], tools=tools, enable_thinking=False)
    assert rendered == (
        '<s>get_weather;[{"type": "function", '
        '"function": {"name": "get_weather", "description": "Wetter für <Orte>"}}]|'
        '{\n  "name": "get_weather",\n  "description": "Wetter für <Orte>"\n}|False|</s>'
    )
    assert ChatTemplate("{{ tools is none }}", "", "").render([]) == "True"


def test_hf_helpers_strftime_now_loopcontrols_and_generation_tag():
    year = datetime.date.today().year
    assert ChatTemplate("{{ strftime_now('%Y') }}", "", "").render([]) in {str(year), str(year + 1)}
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert ChatTemplate(source, "", "").render(CONVERSATION) == "What is 2+2?"


def test_trim_and_lstrip_blocks_like_hf():
    source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert ChatTemplate(source, "", "").render(CONVERSATION) == "What is 2+2?\nAnd 3+3?\n"
