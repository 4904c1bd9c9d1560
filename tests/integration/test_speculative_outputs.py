"""The core property of speculative decoding, through the real openai client and server on a tiny
random model: 50 seeded requests at temperature 0, 0.7 and 1.0, with and without top_p, penalties,
a JSON schema and stop strings, answer the same text with drafts as without, alone and seven at a
time beside others; and drafts were made and confirmed on the way. So with prompt lookup alone, and
with a draft model (LLM_DRAFT_MODEL) beside it: the same tiny model, whose greedy drafts are all
confirmed where plain greedy sampling runs (which also proves its lazily filled cache right, slot
reuse and copies included), and another random one, whose drafts are mostly refused; and on a
recurrent model (qwen35), whose state must be set back wherever a draft is refused."""

import concurrent.futures

import openai
import pytest
from support import tiny_engine_server
from support.tiny_models import write_tiny_gguf
from support.tiny_qwen35 import write_tiny_qwen35

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


@pytest.fixture(scope="module", params=["prompt lookup", "same model as draft", "other model as draft", "recurrent model"])
def served(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    if request.param == "recurrent model":  # qwen35: drafted tokens in rows of state of their own
        path = write_tiny_qwen35(str(folder / "tiny.gguf"), matrix_type="Q8_0")
    else:
        path = write_tiny_gguf(str(folder / "tiny.gguf"), "llama", matrix_type="Q4_1")
    draft = {"same model as draft": path, "other model as draft": str(folder / "other.gguf")}.get(request.param)
    if request.param == "other model as draft":
        write_tiny_gguf(draft, "llama", matrix_type="Q4_0", n_layers=1, seed=5)
    with tiny_engine_server(path, slots=8, queue_limit=16, context=256, draft=draft) as (engine, server):
        # lanes at LANE_COST: whether a tiny model's drafts pay must not hang on this machine's
        # warm-up timings (a loaded machine's made the usage test's second answer draft nothing)
        engine.speculation.measured_costs = False
        if draft is not None:
            # a tiny draft costs what the tiny model does: free, it is asked whenever acceptance allows
            engine.loaded.runner.draft.step_cost = 0.0
        yield engine, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120), request.param


def answer(client, case: dict) -> tuple[str, str]:
    return reply_of(client, case)[:2]


def reply_of(client, case: dict) -> tuple[str, str, int, int]:
    """The text, the finish reason, and the drafts confirmed and refused (usage's prediction fields)."""
    reply = client.chat.completions.create(model="tiny", **case)
    details = reply.usage.completion_tokens_details
    accepted, rejected = (details.accepted_prediction_tokens, details.rejected_prediction_tokens) if details else (0, 0)
    return reply.choices[0].message.content, reply.choices[0].finish_reason, accepted or 0, rejected or 0


def plain_greedy(case: dict) -> bool:
    """Sampled as the draft model drafts: the argmax of the model's own logits."""
    return case["temperature"] == 0.0 and "frequency_penalty" not in case and "response_format" not in case


def test_fifty_requests_answer_the_same_with_drafts_alone_and_among_others(served):
    engine, client, kind = served
    engine.speculation.enabled = False
    plain = [answer(client, case) for case in cases()]
    engine.speculation.enabled = True
    engine.speculation.recent = type(engine.speculation.recent)()  # no earlier answers: the draft model drafts
    alone = [reply_of(client, case) for case in cases()]
    assert [a[:2] for a in alone] == plain
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # each beside seven others
        together = list(pool.map(lambda case: reply_of(client, case), cases()))
    assert [t[:2] for t in together] == plain
    stats = engine.stats()
    assert stats["drafted_tokens_total"] > 0 and stats["accepted_tokens_total"] > 0, stats["drafted_tokens_total"]
    if kind == "recurrent model":  # some refused: the state was set back to the last kept token's
        assert stats["accepted_tokens_total"] < stats["drafted_tokens_total"]
    if kind in ("same model as draft", "other model as draft"):
        greedy = [a[2:] for case, a in zip(cases(), alone) if plain_greedy(case)]
        accepted, rejected = map(sum, zip(*greedy))
        if kind == "same model as draft":  # refused: prompt lookup's drafts, and drafts past a stop
            assert accepted > 100 and accepted >= 0.9 * (accepted + rejected), (accepted, rejected)
        else:
            assert accepted < rejected, (accepted, rejected)


def test_usage_reports_the_confirmed_and_refused_drafts(served):
    """A request asked again drafts from its earlier answer; usage counts the drafts in OpenAI's
    predicted-output fields, and the text is the same."""
    engine, client, _ = served
    engine.speculation.enabled = True
    case = {"messages": [{"role": "user", "content": "Say something twice."}], "max_tokens": 24, "temperature": 0.0}
    first = client.chat.completions.create(model="tiny", **case)
    again = client.chat.completions.create(model="tiny", **case)
    assert again.choices[0].message.content == first.choices[0].message.content
    details = again.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens > 0, again.usage
    assert details.rejected_prediction_tokens >= 0
