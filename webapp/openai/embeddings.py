"""OpenAI's `POST /v1/embeddings` as pure functions: the body checked into `EmbeddingParams`, and
the answer's shape.

- `input`: a string, an array of strings, an array of token ids, or an array of such arrays (at
  most MAX_INPUTS); an empty string or array is refused, as OpenAI refuses it.
- `encoding_format`: "float" (arrays of numbers) or "base64" (each vector's float32 bytes, little
  endian: what the openai package asks for by default, and decodes itself).
- `dimensions`: keep the first n values and scale them to unit length again (Matryoshka-trained
  embedding models, such as Qwen3-Embedding, are made to be cut so).
- Vectors have unit length (L2), as OpenAI's and llama-server's do, so a dot product is a cosine.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from webapp.openai.errors import ApiError
from webapp.openai.request_bodies import opt_int

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs
ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingParams:
    inputs: tuple[str | tuple[int, ...], ...]  # texts, or token ids given as such
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None


def parse_embedding_request(body: dict) -> EmbeddingParams:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string.", "model")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise ApiError(400, f"'encoding_format' is one of {', '.join(ENCODINGS)}.", "encoding_format")
    dimensions = opt_int(body, "dimensions", minimum=1)
    if "user" in body and not isinstance(body["user"], str):
        raise ApiError(400, "'user' must be a string.", "user")
    return EmbeddingParams(_inputs(body.get("input")), model, encoding, dimensions)


def _inputs(value) -> tuple:
    """The inputs as texts or tuples of ids; OpenAI's four shapes, each refused in its own words."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and _is_ids(value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'input' must be a string, an array of strings, or token ids; it is missing or empty.", "input")
    if len(value) > MAX_INPUTS:
        raise ApiError(400, f"'input' holds {len(value)} items; at most {MAX_INPUTS} are taken at once.", "input")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, str) and item:
            out.append(item)
        elif isinstance(item, list) and item and _is_ids(item):
            out.append(tuple(item))
        else:
            raise ApiError(400, f"'input[{i}]' must be a non-empty string or a non-empty array of token ids.", "input")
    return tuple(out)


def _is_ids(items: list) -> bool:
    return all(isinstance(i, int) and not isinstance(i, bool) for i in items)


def unit_vector(values: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` values (all without it), scaled to length 1 (float32)."""
    if dimensions is not None:
        if dimensions > len(values):
            raise ApiError(400, f"'dimensions' is {dimensions}; this model's embeddings have {len(values)}.", "dimensions")
        values = values[:dimensions]
    values = np.asarray(values, dtype=np.float64)
    norm = np.linalg.norm(values)
    return (values / norm if norm > 0 else values).astype(np.float32)


def embedding_list(vectors: list[np.ndarray], encoding: str, model: str, prompt_tokens: int) -> dict:
    """OpenAI's answer: one `embedding` object per input, in order, and the tokens they took."""
    data = []
    for index, vector in enumerate(vectors):
        encoded = base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64" else vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
