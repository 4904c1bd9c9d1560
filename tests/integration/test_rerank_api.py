"""Reranking through Cohere's real client (v1 and v2), llama-server's and TEI's bodies and vLLM's
`/v1/score`, against a real Waitress server and engine on a tiny reranker file (Qwen3-Reranker's
layout, as llama.cpp's converter writes it): each score is the float64 reference's probability of
"yes" over "no" after the file's rerank prompt, results come best first, and bad input, or a model
that is no reranker, is a 400 in OpenAI's shape."""

import cohere
import numpy as np
import pytest
from support import assert_error_shape, post, tiny_engine_server
from support.tiny_models import RERANK_PROMPT, Reference, write_tiny_gguf

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris, on the Seine.", "2 + 2 = 4"]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("rank") / "reranker.gguf"), "qwen3", rank_labels=("yes", "no"), context=512)


@pytest.fixture(scope="module")
def served(model_file):
    with tiny_engine_server(model_file, slots=2, queue_limit=16, context=256) as (engine, server):
        yield engine, server


def reference_scores(model_file: str, engine, query: str, documents: list[str]) -> list[float]:
    """The float64 forward pass's softmax over the "yes" and "no" tokens' logits after each prompt."""
    reference, tokens = Reference(model_file), engine.tokenizer
    yes, no = (tokens.encode(word, special=False)[0] for word in ("yes", "no"))
    scores = []
    for document in documents:
        ids = tokens.encode(RERANK_PROMPT.replace("{query}", query).replace("{document}", document), special=True)
        logits = reference.logits(ids)[-1][[yes, no]]
        scores.append(float(np.exp(logits[0]) / np.exp(logits).sum()))
    return scores


def test_cohere_v2_rerank_scores_follow_the_float64_reference_best_first(model_file, served):
    engine, server = served
    client = cohere.ClientV2(api_key="unused", base_url=server.url, timeout=120)
    answer = client.rerank(model="tiny", query=QUERY, documents=DOCUMENTS)
    want = reference_scores(model_file, engine, QUERY, DOCUMENTS)
    assert sorted(r.index for r in answer.results) == [0, 1, 2, 3]
    assert [r.relevance_score for r in answer.results] == sorted((r.relevance_score for r in answer.results), reverse=True)
    for result in answer.results:
        assert abs(result.relevance_score - want[result.index]) < 2e-3, (result, want)
        assert result.document == {"text": DOCUMENTS[result.index]}  # v2 types it a dict
    assert len({round(w, 6) for w in want}) == 4  # four different scores: the order is the model's


def test_cohere_v1_top_n_and_a_batch_larger_than_the_slots_alone_equal(served):
    _, server = served
    client = cohere.Client(api_key="unused", base_url=server.url, timeout=120)
    many = [f"{text} ({i})" for i, text in enumerate(DOCUMENTS * 3)]  # 12, more than the 2 slots
    answer = client.rerank(model="tiny", query=QUERY, documents=many, top_n=3, return_documents=False)
    assert len(answer.results) == 3 and all(r.document is None for r in answer.results)
    everything = client.rerank(model="tiny", query=QUERY, documents=many).results
    for best in answer.results:
        alone = client.rerank(model="tiny", query=QUERY, documents=[many[best.index]]).results[0]
        assert alone.relevance_score == best.relevance_score == next(r.relevance_score for r in everything if r.index == best.index)


def test_llama_server_and_tei_bodies_and_vllm_score_agree(served):
    _, server = served
    status, _, jina = post(server, "/v1/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS]})
    assert status == 200 and jina["object"] == "list" and jina["usage"]["prompt_tokens"] > 0
    by_index = {r["index"]: r["relevance_score"] for r in jina["results"]}
    status, _, tei = post(server, "/rerank", {"query": QUERY, "texts": DOCUMENTS, "return_text": True})
    assert status == 200 and {r["index"]: r["score"] for r in tei} == by_index and tei[0]["text"] == DOCUMENTS[tei[0]["index"]]
    status, _, scored = post(server, "/v1/score", {"model": "tiny", "text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200 and [d["score"] for d in scored["data"]] == [by_index[i] for i in range(4)]
    assert scored["data"][0]["object"] == "score" and scored["usage"] == jina["usage"] | {"completion_tokens": 0}
    status, _, pairs = post(server, "/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]})
    assert status == 200 and [d["score"] for d in pairs["data"]] == [by_index[0], by_index[1]]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/rerank", {"documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q"}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a", 3]}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": [{"title": "no text"}]}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"] * 1001}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["x" * 5000]}, "documents"),  # past the 256-position context
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": [""]}, "text_2"),
        ("/v1/score", {"text_1": 3, "text_2": "b"}, "text_1"),
    ],
)
def test_bad_bodies_are_400s_that_name_the_field(served, path, body, param):
    _, server = served
    status, _, answer = post(server, path, body)
    assert status == 400, answer
    assert_error_shape(answer)
    assert answer["error"]["param"] == param


def test_a_model_that_is_no_reranker_says_so(tmp_path):
    plain = write_tiny_gguf(str(tmp_path / "chat.gguf"), "qwen3", context=256)
    with tiny_engine_server(plain, slots=1, queue_limit=4) as (_, server):
        status, _, answer = post(server, "/v1/rerank", {"query": "q", "documents": ["a"]})
    assert status == 400 and answer["error"]["code"] == "model_not_reranker" and "not a reranker" in answer["error"]["message"]
