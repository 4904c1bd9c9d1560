"""Reranking as pure functions: the bodies of `POST /v1/rerank` (Jina's and Cohere's shape, which
llama-server and vLLM answer too; TEI's with `texts`) and vLLM's `POST /v1/score`, checked into
`RankParams`, and each answer's shape.

- rerank: `query` (a non-empty string) and `documents` (strings, or objects with a `text` string,
  as Cohere's v1 and Jina's clients send them), or `texts` (TEI). `top_n` keeps the best n;
  `return_documents` (default true, as Jina and vLLM answer) puts each document's text in its
  result; TEI's `return_text` does so in TEI's shape. Results come best first.
- score: `text_1` and `text_2`, each a string or an array of strings: one against one, one against
  each of many, or many against as many, pair by pair (vLLM's three forms). Scores come in the
  pairs' order.
- At most MAX_DOCUMENTS pairs a request; every text non-empty.
"""

from __future__ import annotations

from dataclasses import dataclass

from webapp.openai.errors import ApiError
from webapp.openai.request_bodies import opt_int

MAX_DOCUMENTS = 1000  # Cohere's limit on one request's documents


@dataclass(frozen=True)
class RankParams:
    pairs: tuple[tuple[str, str], ...]  # (query, document) in the request's order
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    tei: bool = False  # TEI's body (`texts`): TEI's answer, a bare list


def parse_rerank_request(body: dict) -> RankParams:
    model = _model(body)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise ApiError(400, "'query' must be a non-empty string.", "query")
    tei = "texts" in body and "documents" not in body
    field = "texts" if tei else "documents"
    documents = body.get(field)
    if not isinstance(documents, list) or not documents:
        raise ApiError(400, f"'{field}' must be a non-empty array of strings.", field)
    _bounded(len(documents), field)
    texts = [_document(item, f"{field}[{i}]") for i, item in enumerate(documents)]
    top_n = opt_int(body, "top_n", minimum=1)
    flag = "return_text" if tei else "return_documents"
    returned = body.get(flag, not tei)
    if not isinstance(returned, bool):
        raise ApiError(400, f"'{flag}' must be a boolean.", flag)
    return RankParams(tuple((query, text) for text in texts), model, top_n, returned, tei)


def parse_score_request(body: dict) -> RankParams:
    model = _model(body)
    firsts, seconds = _texts(body, "text_1"), _texts(body, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise ApiError(400, f"'text_1' holds {len(firsts)} texts and 'text_2' {len(seconds)}: one, or as many as 'text_2'.", "text_1")
    return RankParams(tuple(zip(firsts, seconds, strict=True)), model)


def rerank_answer(params: RankParams, scores: list[float], model: str, prompt_tokens: int, request_id: str) -> dict | list:
    """Jina's and Cohere's answer (TEI's bare list for a TEI body): best first, `top_n` of them."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: params.top_n]
    documents = [document for _, document in params.pairs]
    if params.tei:
        return [{"index": i, "score": scores[i], **({"text": documents[i]} if params.return_documents else {})} for i in order]
    results = [
        {"index": i, "relevance_score": scores[i], **({"document": {"text": documents[i]}} if params.return_documents else {})}
        for i in order
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"id": request_id, "object": "list", "model": model, "results": results, "usage": usage}


def score_answer(scores: list[float], model: str, prompt_tokens: int, request_id: str, created: int) -> dict:
    """vLLM's answer: one `score` object per pair, in order."""
    data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}
    return {"id": request_id, "object": "list", "created": created, "model": model, "data": data, "usage": usage}


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string.", "model")
    return model


def _bounded(count: int, field: str) -> None:
    if count > MAX_DOCUMENTS:
        raise ApiError(400, f"'{field}' holds {count} items; at most {MAX_DOCUMENTS} are ranked at once.", field)


def _document(item, where: str) -> str:
    text = item.get("text") if isinstance(item, dict) else item
    if not isinstance(text, str) or not text:
        raise ApiError(400, f"'{where}' must be a non-empty string (or an object with a non-empty 'text').", where.split("[")[0])
    return text


def _texts(body: dict, field: str) -> list[str]:
    value = body.get(field)
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ApiError(400, f"'{field}' must be a non-empty string or a non-empty array of strings.", field)
    _bounded(len(items), field)
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise ApiError(400, f"'{field}[{i}]' must be a non-empty string.", field)
    return items
