"""`POST /v1/embeddings`: each input's embedding, from the served model's final hidden states.

Each input becomes one engine request that prefills its prompt (no cache reuse: every position is
computed) and is pooled as the model's file asks (`Engine.pooling`: mean, last or first; the file's
end-of-text appended first where it asks, as embedding models such as Qwen3-Embedding do). At most
as many inputs run at once as the engine has slots, so one large batch never fills the queue that
other users wait in; a client that goes away ends its requests.
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
    window = max(1, engine.n_slots)
    running: list[tuple[int, ChoiceReader]] = []

    def read() -> dict:
        vectors = [None] * len(prompts)
        for index, ids in enumerate(prompts):
            running.append((index, _submit(engine, ids)))
            if len(running) >= window or index == len(prompts) - 1:
                for i, reader in running:
                    vectors[i] = _read(reader, params.dimensions)
                running.clear()
        return answer(vectors, sum(map(len, prompts)))

    def close() -> None:
        for _, reader in running:
            reader.close()

    return gen.whole(close, read)


def _prompt(engine, item, index: int) -> list[int]:
    """An input's token ids: a text tokenized as plain text (BOS first where the model wants it),
    given ids checked against the vocabulary; the file's suffix after either."""
    tokenizer = engine.tokenizer
    if isinstance(item, str):
        ids = tokenizer.encode(item, special=False)
        if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
            ids = [tokenizer.bos_id, *ids]
    else:
        if any(not 0 <= i < tokenizer.vocab_size for i in item):
            raise ApiError(400, f"'input[{index}]': token ids are from 0 to {tokenizer.vocab_size - 1}.", "input")
        ids = list(item)
    ids += engine.embedding_suffix
    try:
        completion_room(len(ids), engine.max_context)
    except PromptTooLong as e:
        raise ApiError(400, f"'input[{index}]': {e}", "input", "context_length_exceeded") from e
    return ids


def _submit(engine, ids: list[int]) -> ChoiceReader:
    request = Request(ids, SamplingParams(max_tokens=0), pooling=engine.pooling)
    reader = ChoiceReader(engine, request, (), gen.disconnected(), gen.lifecycle())
    try:
        engine.submit(request)
    except Exception:
        reader.close()
        raise
    return reader


def _read(reader: ChoiceReader, dimensions: int | None):
    """Wait for the request's end (an engine failure or shutdown raises its ApiError); its unit vector."""
    try:
        for _ in reader.texts():  # an embedding generates no text: this returns at its end
            pass
    finally:
        reader.close()
    return unit_vector(reader.request.embedding, dimensions)
