"""`POST /v1/embeddings`: each input's embedding, from the served model's final hidden states.

Each input becomes one engine request that prefills its prompt (no cache reuse: every position is
computed) and is pooled as the model's file asks (`Engine.pooling`: mean, last or first; the file's
end-of-text appended first where it asks, as embedding models such as Qwen3-Embedding do), through
`pooled`, which reranking (webapp/http/rerank.py) shares.
"""

from __future__ import annotations

from collections.abc import Callable

from flask import Response

from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.serving.errors import PromptTooLong, completion_room
from webapp.engine.serving.request import Request
from webapp.http import generation as gen
from webapp.http.families import Family
from webapp.openai.choices import ChoiceReader
from webapp.openai.embeddings import EmbeddingParams, embedding_list, parse_embedding_request, unit_vector
from webapp.openai.errors import ApiError

bp = Family("embeddings", __name__)  # the API key, drained, OpenAI's errors


@bp.post("/v1/embeddings")
def embeddings():
    body = gen.json_body()
    engine = gen.engine(body)
    params = parse_embedding_request(body)
    model = params.model or engine.model_name
    return embedded(engine, params, lambda vectors, tokens: embedding_list(vectors, params.encoding_format, model, tokens))


def embedded(engine, params: EmbeddingParams, answer: Callable[[list, int], dict]) -> Response:
    """The inputs' unit vectors in order, and the prompt tokens they took, shaped by `answer` into
    the response's JSON (Ollama's /api/embed shapes them its own way)."""
    prompts = [_prompt(engine, item, i) for i, item in enumerate(params.inputs)]
    return pooled(engine, prompts, engine.pooling, lambda request: unit_vector(request.embedding, params.dimensions), answer)


def pooled(
    engine, prompts: list[list[int]], pooling: str, value: Callable[[Request], object], answer: Callable[[list, int], dict]
) -> Response:
    """Each prompt run as its own engine request pooled `pooling`, at most as many at once as the
    engine has slots (so one large batch never fills the queue other users wait in); `value` of
    each finished request, in the prompts' order, and the prompt tokens they took, shaped by
    `answer` into the response's JSON. A client that goes away ends its requests."""
    window = max(1, engine.n_slots)
    running: list[tuple[int, ChoiceReader]] = []

    def read() -> dict:
        values = [None] * len(prompts)
        for index, ids in enumerate(prompts):
            running.append((index, _submit(engine, ids, pooling)))
            if len(running) >= window or index == len(prompts) - 1:
                for i, reader in running:
                    values[i] = value(_finished(reader))
                running.clear()
        return answer(values, sum(map(len, prompts)))

    def close() -> None:
        for _, reader in running:
            reader.close()

    return gen.whole(close, read)


def _prompt(engine, item, index: int) -> list[int]:
    """An input's token ids: a text tokenized as plain text (BOS first where the model wants it),
    given ids checked against the vocabulary; the file's suffix after either."""
    tokenizer = engine.tokenizer
    if isinstance(item, str):
        ids = gen.with_bos(tokenizer, tokenizer.encode(item, special=False))
    else:
        if any(not 0 <= i < tokenizer.vocab_size for i in item):
            raise ApiError(400, f"'input[{index}]': token ids are from 0 to {tokenizer.vocab_size - 1}.", "input")
        ids = list(item)
    ids += engine.embedding_suffix
    if not ids:  # a text of characters the vocabulary lacks (SmolLM2's has no byte 0x13, say), no BOS
        raise ApiError(400, f"'input[{index}]' holds no token of this model's vocabulary.", "input")
    try:
        completion_room(len(ids), engine.max_context)
    except PromptTooLong as e:
        raise ApiError(400, f"'input[{index}]': {e}", "input", "context_length_exceeded") from e
    return ids


def _submit(engine, ids: list[int], pooling: str) -> ChoiceReader:
    request = Request(ids, SamplingParams(max_tokens=0), pooling=pooling)
    reader = ChoiceReader(engine, request, (), gen.disconnected(), gen.lifecycle())
    try:
        engine.submit(request)
    except Exception:
        reader.close()
        raise
    return reader


def _finished(reader: ChoiceReader) -> Request:
    """Wait for the request's end (an engine failure or shutdown raises its ApiError)."""
    try:
        for _ in reader.texts():  # a pooled request generates no text: this returns at its end
            pass
    finally:
        reader.close()
    return reader.request
