"""`POST /v1/rerank` (also `/rerank`, `/v1/reranking`, `/reranking`: llama-server's paths; `/v2/rerank`:
Cohere's v2 client's) and vLLM's `POST /v1/score` (`/score`): relevance scores from a reranker model.

Each (query, document) pair becomes one prompt, built as llama-server builds it: the file's rerank
prompt (`tokenizer.chat_template.rerank`) with the two texts put in, tokenized whole with special
tokens read, or without one, BOS, the query, the file's end-of-text where it asks for it, the
document, the end-of-text again. Each prompt runs as one engine request pooled "rank": the model's
last final-norm output through the file's head (serving/ranker.py), through `pooled`, which the
embeddings share. A model whose file is not a reranker is refused with a 400 that says so.
"""

from __future__ import annotations

import re
import time

from webapp.engine.serving.errors import PromptTooLong, completion_room
from webapp.http import generation as gen
from webapp.http.embeddings import pooled
from webapp.http.families import Family
from webapp.openai.errors import ApiError
from webapp.openai.rerank import RankParams, parse_rerank_request, parse_score_request, rerank_answer, score_answer
from webapp.openai.response_bodies import new_id

bp = Family("rerank", __name__)  # the API key, drained, OpenAI's errors

PLACEHOLDER = re.compile(r"\{query\}|\{document\}")


@bp.post("/v1/rerank")
@bp.post("/rerank")
@bp.post("/v1/reranking")
@bp.post("/reranking")
@bp.post("/v2/rerank")
def rerank():
    return _answered(
        parse_rerank_request, lambda params, scores, model, tokens: rerank_answer(params, scores, model, tokens, new_id("rerank"))
    )


@bp.post("/v1/score")
@bp.post("/score")
def score():
    return _answered(
        parse_score_request, lambda _, scores, model, tokens: score_answer(scores, model, tokens, new_id("score"), int(time.time()))
    )


def _answered(parse, answer):
    """The body parsed by `parse` into RankParams, its pairs scored, the answer shaped by `answer`."""
    body = gen.json_body()
    engine = gen.engine(body)
    params = parse(body)
    model = params.model or engine.model_name
    return _scored(engine, params, lambda scores, tokens: answer(params, scores, model, tokens))


def _scored(engine, params: RankParams, answer):
    ranker = engine.ranker
    if ranker is None:
        raise ApiError(
            400,
            f"The model {engine.model_name!r} is not a reranker: its file's pooling type is not rank. "
            "Reranking needs a reranker's GGUF (a Qwen3-Reranker, say).",
            "model",
            "model_not_reranker",
        )
    prompts = [_prompt(engine, ranker.prompt, query, document, i) for i, (query, document) in enumerate(params.pairs)]
    return pooled(engine, prompts, "rank", lambda request: float(request.embedding), answer)


def _prompt(engine, template: str | None, query: str, document: str, index: int) -> list[int]:
    tokenizer = engine.tokenizer
    if template is not None:
        # one pass, so that a query holding "{document}" stays as it was written
        text = PLACEHOLDER.sub(lambda m: query if m.group() == "{query}" else document, template)
        ids = tokenizer.encode(text, special=True)
    else:
        end = list(engine.embedding_suffix)
        ids = gen.with_bos(tokenizer, tokenizer.encode(query, special=False)) + end + tokenizer.encode(document, special=False) + end
    try:
        completion_room(len(ids), engine.max_context)
    except PromptTooLong as e:
        raise ApiError(400, f"document {index}: {e}", "documents", "context_length_exceeded") from e
    return ids
