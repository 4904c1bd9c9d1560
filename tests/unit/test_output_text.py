"""The output-text state machines on their own: stop strings, reasoning and tool calls, each fed
every possible split of its text, and the tool-call formats read one by one."""

from __future__ import annotations

import json

import pytest
from support.fakes import HERMES, TOOLS, XML

from webapp.openai.output_text import OutputParser, Piece, StopMatcher, opens_reasoning, parse_tool_call


def _merged(pieces):
    out = []
    for kind, value in pieces:
        if out and kind != "tool_call" and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return [(k, json.loads(v["function"]["arguments"]) if k == "tool_call" else v) for k, v in out]


@pytest.mark.parametrize(
    "text",
    [
        "<think>\nplan\n</think>\n\nDone. " + HERMES,
        XML,
        "plain <b>text</b> with a <tool_call stray tag",
        "<think>never closed",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>\\" b"}}\n</tool_call> after',
    ],
)
def test_output_parser_gives_the_same_pieces_for_every_split(text):
    whole = OutputParser(TOOLS)
    expected = _merged(whole.feed(text) + whole.finish())
    for cut in range(1, len(text)):
        parser = OutputParser(TOOLS)
        pieces = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        assert _merged(pieces) == expected, cut


def test_stop_matcher_never_emits_any_part_of_a_stop_string():
    text = "abc STOP def"
    for cut in range(len(text) + 1):
        matcher = StopMatcher(["STOP", "xyz"])
        first, hit1 = matcher.feed(text[:cut])
        second, hit2 = (first, hit1) if hit1 else matcher.feed(text[cut:])
        emitted = first + ("" if hit1 else second)
        assert (emitted, hit1 or hit2) == ("abc ", True), cut


def test_stop_matcher_gives_back_a_held_tail_when_the_stream_ends():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("the ST") == ("the ", False)
    assert matcher.flush() == "ST"
    assert StopMatcher([]).feed("anything") == ("anything", False)


def test_reasoning_only_before_content_and_from_a_prompt_that_opened_it():
    parser = OutputParser()
    assert parser.feed("<think> plan </think>\n\nanswer") == [Piece("reasoning", "plan "), Piece("content", "answer")]
    late = OutputParser()
    pieces = late.feed("answer ") + late.feed("<think>x</think>") + late.finish()
    assert "".join(p.value for p in pieces) == "answer <think>x</think>" and {p.kind for p in pieces} == {"content"}
    assert opens_reasoning("<|assistant|><think>\n") and not opens_reasoning("<|assistant|>")
    opened = OutputParser(in_reasoning=True)
    assert opened.feed("plan</think>answer") == [Piece("reasoning", "plan"), Piece("content", "answer")]


def test_tool_tags_are_content_when_no_tools_were_offered():
    parser = OutputParser(None)
    assert parser.feed(HERMES) + parser.finish() == [Piece("content", HERMES)]
    assert parser.tool_calls == []


def test_parse_tool_call_reads_hermes_json_and_typed_xml():
    hermes = parse_tool_call('{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}', {})
    assert hermes["type"] == "function" and hermes["id"].startswith("call_")
    assert (hermes["function"]["name"], json.loads(hermes["function"]["arguments"])) == ("get_weather", {"city": "Oslo"})
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    xml = parse_tool_call(
        "<function=get_weather>\n<parameter=city>\n2024\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>", schemas
    )
    assert json.loads(xml["function"]["arguments"]) == {"city": "2024", "days": 2}  # typed by the schema


@pytest.mark.parametrize("body", ["", "not a call", "{broken json", '{"arguments": {}}', '{"name": "f", "arguments": [1]}'])
def test_parse_tool_call_refuses_what_is_not_a_call(body):
    assert parse_tool_call(body, {}) is None


def test_a_closing_tag_inside_a_json_string_is_part_of_the_value():
    parser = OutputParser(TOOLS)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x</tool_call>y\\"z"}}\n</tool_call>\nDone.'
    pieces = parser.feed(text) + parser.finish()
    assert [p.kind for p in pieces] == ["tool_call", "content"] and pieces[1].value == "Done."
    assert json.loads(pieces[0].value["function"]["arguments"]) == {"city": 'x</tool_call>y"z'}


@pytest.mark.parametrize("end", [len("<tool"), len(HERMES) // 2, len(HERMES) - 4])
def test_output_the_token_limit_cut_off_is_never_markup(end):
    cut = OutputParser(TOOLS)
    pieces = cut.feed("Sure. " + HERMES[:end]) + cut.finish(cut=True)
    assert "".join(p.value for p in pieces if p.kind == "content") == "Sure. "
    # a call whose JSON is whole, cut inside its closing tag, is still the call
    assert [p.kind for p in pieces if p.kind == "tool_call"] == (["tool_call"] if end == len(HERMES) - 4 else [])
    ended = OutputParser(TOOLS)  # an output that ended by itself mid-call keeps what it wrote
    assert "<tool" in "".join(p.value for p in ended.feed(HERMES[: len(HERMES) // 2]) + ended.finish() if p.kind == "content")
