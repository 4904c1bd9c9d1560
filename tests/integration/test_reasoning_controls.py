"""Turning a model's thinking off or setting its effort, on every API, through the real clients against
a real Waitress server over the scripted fake engine: `chat_template_kwargs` and `reasoning_effort`
(OpenAI chat), `reasoning.effort` (Responses), `thinking` (Anthropic) and `think` (Ollama) reach the
chat template as its variables, and a template that then closes its think block makes the answer
plain content; bad values are a 400 naming the field."""

import anthropic
import ollama
import openai
import pytest
from support.fakes import Reply

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
def thinking_template(fake_engine):
    fake_engine.chat_template.think = True  # its generation prompt opens a think block, as Qwen3's does
    return fake_engine.chat_template


def extra(template) -> dict:
    return template.calls[-1]["extra"]


def test_chat_template_kwargs_reach_the_template_and_thinking_off_gives_plain_content(openai_client, fake_runner, thinking_template):
    fake_runner.replies.append(Reply.text("Hmm.</think>Paris."))  # the prompt opened the think block
    thought = openai_client.chat.completions.create(model="m", messages=HELLO)
    assert thought.choices[0].message.content == "Paris." and thought.choices[0].message.reasoning_content == "Hmm."
    fake_runner.replies.append(Reply.text("Paris."))
    kwargs = {"enable_thinking": False, "custom_flag": [1, {"a": None}]}
    plain = openai_client.chat.completions.create(model="m", messages=HELLO, extra_body={"chat_template_kwargs": kwargs})
    assert extra(thinking_template) == kwargs
    assert plain.choices[0].message.content == "Paris." and getattr(plain.choices[0].message, "reasoning_content", None) is None
    assert fake_runner.requests[-1].prompt_ids[-len(b"<think>\n\n</think>\n\n") :] == list(b"<think>\n\n</think>\n\n")


@pytest.mark.parametrize(
    "effort, variables",
    [
        ("none", {"enable_thinking": False, "reasoning_effort": "low"}),
        ("minimal", {"enable_thinking": False, "reasoning_effort": "low"}),
        ("low", {"enable_thinking": True, "reasoning_effort": "low"}),
        ("high", {"enable_thinking": True, "reasoning_effort": "high"}),
    ],
)
def test_reasoning_effort_sets_both_families_switches(openai_client, fake_runner, thinking_template, effort, variables):
    fake_runner.replies.append(Reply.text("ok"))
    openai_client.chat.completions.create(model="m", messages=HELLO, reasoning_effort=effort)
    assert extra(thinking_template) == variables
    fake_runner.replies.append(Reply.text("ok"))  # explicit template variables win over the effort's
    openai_client.chat.completions.create(
        model="m", messages=HELLO, reasoning_effort=effort, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    assert extra(thinking_template)["enable_thinking"] is True


def test_the_responses_apis_reasoning_effort(openai_client, fake_runner, thinking_template):
    fake_runner.replies.append(Reply.text("ok"))
    openai_client.responses.create(model="m", input="hello", reasoning={"effort": "minimal"})
    assert extra(thinking_template) == {"enable_thinking": False, "reasoning_effort": "low"}


def test_anthropics_thinking_switch(fake_server, fake_runner, thinking_template):
    claude = anthropic.Anthropic(base_url=fake_server.url, api_key="k", max_retries=0, timeout=10)
    fake_runner.replies.append(Reply.text("Paris."))
    message = claude.messages.create(model="m", max_tokens=20, messages=HELLO, thinking={"type": "disabled"})
    assert extra(thinking_template) == {"enable_thinking": False} and [b.type for b in message.content] == ["text"]
    fake_runner.replies.append(Reply.text("Hmm.</think>Paris."))  # the prompt opened the think block
    claude.messages.create(model="m", max_tokens=50, messages=HELLO, thinking={"type": "enabled", "budget_tokens": 1024})
    assert extra(thinking_template) == {"enable_thinking": True}
    assert claude.messages.count_tokens(model="m", messages=HELLO, thinking={"type": "disabled"}).input_tokens > 0
    assert extra(thinking_template) == {"enable_thinking": False}


def test_ollamas_think(fake_server, fake_runner, thinking_template):
    client = ollama.Client(host=fake_server.url, timeout=10)
    fake_runner.replies.append(Reply.text("Paris."))
    response = client.chat(model="m", messages=HELLO, think=False, stream=False)
    assert extra(thinking_template) == {"enable_thinking": False} and response.message.content == "Paris." and not response.message.thinking
    fake_runner.replies.append(Reply.text("Hmm.</think>Paris."))  # the prompt opened the think block
    response = client.chat(model="m", messages=HELLO, think="high", stream=False)
    assert extra(thinking_template) == {"enable_thinking": True, "reasoning_effort": "high"} and response.message.thinking == "Hmm."


@pytest.mark.parametrize(
    "body, param",
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"big": "x" * 20000}}, "chat_template_kwargs"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(openai_client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="m", messages=HELLO, extra_body=body)
    assert e.value.body["param"] == param


def test_a_thinking_budget_forces_the_end_of_thinking_and_the_answer_follows(openai_client, fake_runner, thinking_template):
    thought = "Hmm, thinking on and on and on."
    fake_runner.replies.append(Reply.text(thought + "</think>Paris."))  # the prompt opened the think block
    reply = openai_client.chat.completions.create(model="m", messages=HELLO, extra_body={"reasoning_budget": 5})
    assert fake_runner.requests[-1].output_ids[:13] == list(b"Hmm, </think>")  # five tokens of thinking, then the marker
    assert reply.choices[0].message.reasoning_content == "Hmm,"
    assert reply.choices[0].message.content  # the answer after it
    fake_runner.replies.append(Reply.text("Hmm.</think>Paris."))
    reply = openai_client.chat.completions.create(model="m", messages=HELLO, extra_body={"reasoning_budget": 50})
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content) == ("Hmm.", "Paris.")  # in time


def test_anthropics_budget_tokens_and_the_server_default(fake_server, fake_app, fake_runner, thinking_template):
    claude = anthropic.Anthropic(base_url=fake_server.url, api_key="k", max_retries=0, timeout=10)
    fake_runner.replies.append(Reply.text("Hmm, thinking on and on.</think>Paris."))
    message = claude.messages.create(model="m", max_tokens=50, messages=HELLO, thinking={"type": "enabled", "budget_tokens": 3})
    assert message.content[0].type == "thinking" and message.content[0].thinking == "Hmm"
    fake_app.config["REASONING_BUDGET"] = 4
    fake_runner.replies.append(Reply.text("Hmm, thinking on and on.</think>Paris."))
    message = claude.messages.create(model="m", max_tokens=50, messages=HELLO)
    assert message.content[0].thinking == "Hmm,"


def test_a_negative_budget_is_a_400(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="m", messages=HELLO, extra_body={"reasoning_budget": -1})
    assert e.value.body["param"] == "reasoning_budget"


# a thinking template in the way Qwen3's behave: the generation prompt opens a think block, or with
# enable_thinking false writes it closed and empty
THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- else %}<think>\n{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from support import tiny_engine_server
    from support.tiny_models import write_tiny_gguf

    path = write_tiny_gguf(str(tmp_path_factory.mktemp("think") / "think.gguf"), "llama", context=256, chat_template=THINKING_TEMPLATE)
    with tiny_engine_server(path, slots=2, queue_limit=8, context=256) as (engine, server):
        yield engine, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_real_model_thinks_within_its_budget_then_answers(real):
    engine, client = real
    ask = dict(model="m", messages=HELLO, temperature=0, max_tokens=24, logprobs=True)
    on = client.chat.completions.create(**ask)
    off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the template wrote the block closed
    assert getattr(off.choices[0].message, "reasoning_content", None) is None  # nothing to think: plain content
    budgeted = client.chat.completions.create(**ask, extra_body={"reasoning_budget": 3})
    tokens = [t.token for t in budgeted.choices[0].logprobs.content]
    marker = [engine.tokenizer.decode([i]) for i in engine.tokenizer.encode("</think>", special=True)]
    if "</think>" not in "".join(tokens[:3]):  # unless the model closed it itself within the budget
        assert tokens[3 : 3 + len(marker)] == marker  # three tokens of thinking, then the forced marker
    assert budgeted.usage.completion_tokens == 24  # and the answer goes on after it
