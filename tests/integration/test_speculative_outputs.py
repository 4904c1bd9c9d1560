"""The core property of speculative decoding, through the real openai client and server on a tiny
random model: 50 seeded requests at temperature 0, 0.7 and 1.0, with and without top_p, penalties,
a JSON schema and stop strings, answer the same text with drafts as without, alone and seven at a
time beside others; and drafts were made and confirmed on the way."""

import concurrent.futures

import openai
import pytest
from support import tiny_engine_server
from support.tiny_models import write_tiny_gguf

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}


def cases() -> list[dict]:
    out = []
    for i in range(50):
        case = {"seed": i, "temperature": (0.0, 0.7, 1.0)[i % 3], "max_tokens": 24}
        if i % 2:
            case["top_p"] = 0.9
        if i % 5 == 1:
            case |= {"frequency_penalty": 0.5, "presence_penalty": 0.3}
        if i % 7 == 3:
            case["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
        if i % 4 == 2:
            case["stop"] = ["ab", "\n"]
        words = " ".join(["one two three four"] * (1 + i % 4))
        case["messages"] = [{"role": "user", "content": f"Say it again: {words} {i}"}]
        out.append(case)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("spec") / "tiny.gguf"), "llama", matrix_type="Q4_1")
    with tiny_engine_server(path, slots=8, queue_limit=16, context=256) as (engine, server):
        yield engine, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def answer(client, case: dict) -> tuple[str, str]:
    reply = client.chat.completions.create(model="tiny", **case)
    return reply.choices[0].message.content, reply.choices[0].finish_reason


def test_fifty_requests_answer_the_same_with_drafts_alone_and_among_others(served):
    engine, client = served
    engine.speculation.enabled = False
    plain = [answer(client, case) for case in cases()]
    engine.speculation.enabled = True
    alone = [answer(client, case) for case in cases()]
    assert alone == plain
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # each beside seven others
        together = list(pool.map(lambda case: answer(client, case), cases()))
    assert together == plain
    stats = engine.stats()
    assert stats["drafted_tokens_total"] > 0 and stats["accepted_tokens_total"] > 0, stats["drafted_tokens_total"]


def test_usage_reports_the_confirmed_and_refused_drafts(served):
    """A request asked again drafts from its earlier answer; usage counts the drafts in OpenAI's
    predicted-output fields, and the text is the same."""
    engine, client = served
    engine.speculation.enabled = True
    case = {"messages": [{"role": "user", "content": "Say something twice."}], "max_tokens": 24, "temperature": 0.0}
    first = client.chat.completions.create(model="tiny", **case)
    again = client.chat.completions.create(model="tiny", **case)
    assert again.choices[0].message.content == first.choices[0].message.content
    details = again.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens > 0, again.usage
    assert details.rejected_prediction_tokens >= 0
