"""The Harmony output parser (gpt-oss): channels to reasoning and content, messages to functions to
tool calls, whole and split at every point a stream could split them; and which parser a chat gets."""

import json
import random

import pytest

from webapp.openai.harmony import HarmonyParser, output_parser, uses_harmony
from webapp.openai.output_text import OutputParser

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in ("get_weather", "get_time")]

REASONING_THEN_ANSWER = (
    "<|channel|>analysis<|message|>The user asks 2+2. Simple.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4."
)
TOOL_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "C"}'
)
TWO_CALLS = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
    # the recipient in the role part, as gpt-oss's chat template writes past calls
    '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}'
)


def merged(pieces) -> list[tuple[str, object]]:
    """Pieces with consecutive text of one kind joined (how a client assembles deltas); calls by name and arguments."""
    out: list[tuple[str, object]] = []
    for kind, value in pieces:
        if kind == "tool_call":
            out.append((kind, (value["function"]["name"], json.loads(value["function"]["arguments"]))))
        elif out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def parse(text: str, chunks: list[int] | None = None, tools=TOOLS) -> tuple[list, HarmonyParser]:
    parser, pieces, at = HarmonyParser(tools), [], 0
    for size in chunks or [len(text)]:
        pieces += parser.feed(text[at : at + size])
        at += size
    pieces += parser.feed(text[at:]) + parser.finish()
    return merged(pieces), parser


def test_analysis_is_reasoning_and_final_is_content():
    pieces, parser = parse(REASONING_THEN_ANSWER)
    assert pieces == [("reasoning", "The user asks 2+2. Simple."), ("content", "2 + 2 = 4.")]
    assert parser.tool_calls == []


def test_a_message_to_a_function_is_a_tool_call_with_its_json_arguments():
    pieces, parser = parse(TOOL_CALL)
    assert pieces == [("reasoning", "Need the weather."), ("tool_call", ("get_weather", {"city": "Paris", "unit": "C"}))]
    call = parser.tool_calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")


def test_two_calls_with_the_recipient_after_the_channel_or_in_the_role():
    pieces, parser = parse(TWO_CALLS)
    assert pieces == [("tool_call", ("get_weather", {"city": "Oslo"})), ("tool_call", ("get_time", {"zone": "CET"}))]
    assert len({c["id"] for c in parser.tool_calls}) == 2


def test_a_return_or_call_token_in_the_text_ends_the_message_like_the_end_of_output():
    assert parse(REASONING_THEN_ANSWER + "<|return|>")[0] == parse(REASONING_THEN_ANSWER)[0]
    assert parse(TOOL_CALL + "<|call|>")[0] == parse(TOOL_CALL)[0]


def test_text_without_channels_is_content_as_it_comes():
    parser = HarmonyParser(TOOLS)
    assert parser.feed("Hello") == [("content", "Hello")]  # not held back: no header opens like that
    assert parser.feed(" there <|end|>") == [("content", " there <|end|>")]
    assert parser.finish() == []


@pytest.mark.parametrize("text", [REASONING_THEN_ANSWER, TOOL_CALL, TWO_CALLS, "Plain text, no channels."])
def test_split_anywhere_the_pieces_are_the_same(text):
    whole = parse(text)[0]
    for cut in range(1, len(text)):
        assert parse(text, [cut])[0] == whole, cut
    assert parse(text, [1] * len(text))[0] == whole
    rng = random.Random(len(text))
    for _ in range(20):
        assert parse(text, [rng.randint(1, 9) for _ in range(len(text))])[0] == whole


def test_no_part_of_a_special_token_reaches_the_content_while_it_is_undecided():
    parser = HarmonyParser(TOOLS)
    pieces = parser.feed("<|channel|>final<|message|>4<|")
    assert pieces == [("content", "4")]
    assert parser.feed("return|>") == [] and parser.finish() == []


def test_without_tools_or_with_arguments_that_are_not_json_the_body_is_content():
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    assert parse(call, tools=None)[0] == [("content", '{"city": "Oslo"}')]
    assert parse(call.replace('{"city": "Oslo"}', "city=Oslo"))[0] == [("content", "city=Oslo")]


def test_a_hermes_call_that_a_forced_tool_choices_grammar_writes_is_still_a_call():
    """tool_choice "required" constrains any model's output to structured.py's hermes blocks: without a
    Harmony header, the text is read as OutputParser reads it."""
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    pieces, parser = parse(text, [3] * len(text))
    assert pieces == [("tool_call", ("get_time", {"zone": "UTC"}))] and len(parser.tool_calls) == 1


def test_a_commentary_preamble_without_a_recipient_is_content():
    text = "<|channel|>commentary<|message|>Checking the weather now.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
    assert parse(text)[0] == [("content", "Checking the weather now.Sunny.")]


def test_a_template_that_writes_channels_gets_the_harmony_parser():
    assert (
        uses_harmony("{{- '<|start|>assistant<|channel|>final<|message|>' }}")
        and not uses_harmony("<|im_start|>")
        and not uses_harmony(None)
    )
    assert isinstance(output_parser("x<|channel|>y", "<|start|>assistant", TOOLS), HarmonyParser)
    chatml = output_parser("<|im_start|>", "<|im_start|>assistant\n<think>\n", TOOLS)
    assert isinstance(chatml, OutputParser) and chatml.feed("why</think>so") == [("reasoning", "why"), ("content", "so")]


def test_arguments_the_token_limit_cut_off_are_dropped_not_shown():
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Os'
    cut = HarmonyParser(TOOLS)
    assert cut.feed(call) + cut.finish(cut=True) == [] and cut.tool_calls == []
    ended = HarmonyParser(TOOLS)  # arguments that ended by themselves unparsed are what the model wrote
    assert [p.kind for p in ended.feed(call) + ended.finish()] == ["content"]
