"""`GET /openapi.json`: an OpenAPI 3.1 document of the API, for clients, gateways and schema fuzzers.

It covers, so far, the OpenAI family's routes (`/v1/models`, `/v1/chat/completions`,
`/v1/completions`, `/v1/embeddings`, the Responses API's `/v1/responses`), reranking (`/v1/rerank`,
`/v1/score`), the LoRA adapters' list (`/lora-adapters`), Anthropic's `/v1/messages` and its token
count, Ollama's `/api/*`, `/tokenize`, `/detokenize` and `/health`. A request body's schema says
what the server takes (the parsers are the authority: a body they refuse gets a 400 in its family's
error shape: `Error`, `AnthropicError` or `OllamaError` here); a response's says the fields every
answer has. tests/integration/test_openapi.py fuzzes each route from this document with
Schemathesis and validates the real responses against it. Public, as vLLM's is: it says nothing
the routes do not.
"""

from __future__ import annotations

from flask import jsonify

from webapp.anthropic import openapi_schemas as anthropic_schemas
from webapp.anthropic.openapi_schemas import IMAGE_BLOCK, TEXT_BLOCK
from webapp.engine.serving.model_set import ModelSet
from webapp.http import generation as gen
from webapp.http.families import PUBLIC, Family
from webapp.ollama import openapi_schemas as ollama_schemas
from webapp.openai import openapi_schemas as openai_schemas
from webapp.openai.json_schema import NONEMPTY, STRING, array, ref
from webapp.openai.openapi_schemas import IMAGE_PART, RESPONSE_IMAGE_PART, RESPONSE_TEXT_PART, TEXT_PART, lora_entries

bp = Family("openapi", __name__, guard=PUBLIC, drained=False)


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


ERRORS = {str(status): {"description": why, **_json(ref("Error"))} for status, why in ((400, "the body is refused"), (401, "the API key is wrong"), (404, "no such model, or no such stored response"), (413, "the body is too large"), (429, "the queue is full"), (503, "loading, draining or failed"))}  # fmt: skip


def errors_of(schema: str) -> dict:
    return {status: answer | _json(ref(schema)) for status, answer in ERRORS.items()}


def post(summary: str, request: str, answer: str, streams: str | None = None, errors: str = "Error") -> dict:
    ok = _json(ref(answer))
    if streams:  # `stream: true` answers so: server-sent events, or Ollama's lines of JSON
        ok["content"][streams] = {"schema": STRING}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, **_json(ref(request))},
            "responses": {"200": {"description": "the answer", **ok}, **errors_of(errors)},
        }
    }


def get_(summary: str, answer: str, errors: str = "Error") -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "the answer", **_json(ref(answer))}, **errors_of(errors)}}}


PATHS = {
    "/v1/models": get_("The models served", "ModelList"),
    "/v1/chat/completions": post("A chat completion", "ChatCompletionRequest", "ChatCompletion", streams="text/event-stream"),
    "/v1/completions": post("A text completion", "CompletionRequest", "Completion", streams="text/event-stream"),
    "/v1/responses": post("A model response (OpenAI's Responses API)", "ResponseRequest", "Response", streams="text/event-stream"),
    "/v1/responses/{response_id}": {
        "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": STRING}],
        **get_("A stored response", "Response"),
        "delete": {
            "summary": "Forget a stored response",
            "responses": {"200": {"description": "forgotten", **_json(ref("ResponseDeleted"))}, **errors_of("Error")},
        },
    },
    "/v1/messages": post("Anthropic's Messages API", "MessagesRequest", "Message", streams="text/event-stream", errors="AnthropicError"),
    "/v1/messages/count_tokens": post("A prompt's tokens, Anthropic's way", "CountTokensRequest", "TokenCount", errors="AnthropicError"),
    "/api/chat": post("Ollama's chat", "OllamaChatRequest", "OllamaChat", streams="application/x-ndjson", errors="OllamaError"),
    "/api/generate": post(
        "Ollama's completion", "OllamaGenerateRequest", "OllamaGenerate", streams="application/x-ndjson", errors="OllamaError"
    ),
    "/api/embed": post("Ollama's embeddings", "OllamaEmbedRequest", "OllamaEmbed", errors="OllamaError"),
    "/api/show": post("A model's template and details, Ollama's way", "OllamaShowRequest", "OllamaShow", errors="OllamaError"),
    "/api/tags": get_("The models, Ollama's way", "OllamaModels", errors="OllamaError"),
    "/api/ps": get_("The loaded models, Ollama's way", "OllamaModels", errors="OllamaError"),
    "/api/version": get_("Ollama's API version", "OllamaVersion", errors="OllamaError"),
    "/v1/embeddings": post("Embeddings of texts or token ids", "EmbeddingRequest", "EmbeddingList"),
    "/v1/rerank": post("Documents ranked against a query (a reranker model)", "RerankRequest", "RerankResult"),
    "/lora-adapters": get_("The LoRA adapters loaded, with the ids a request's lora names them by", "LoraAdapters"),
    "/v1/score": post("Scores of text pairs (a reranker model)", "ScoreRequest", "ScoreResult"),
    "/tokenize": post("Token ids of a text or chat messages", "TokenizeRequest", "TokenizeResult"),
    "/detokenize": post("The text of token ids", "DetokenizeRequest", "DetokenizeResult"),
    "/health": {
        "get": {
            "summary": "Whether the server serves requests",
            "responses": {
                "200": {"description": "serving", **_json(ref("Health"))},
                "503": {"description": "loading, stalled, failed or draining", **_json(ref("Health"))},
            },
        }
    },
}

DOCUMENT = {
    "openapi": "3.1.0",
    "info": {"title": "tinyserve", "version": "1", "description": "An OpenAI-compatible LLM server on tinygrad."},
    "paths": PATHS,
    "components": {
        "schemas": openai_schemas.SCHEMAS | anthropic_schemas.SCHEMAS | ollama_schemas.SCHEMAS,
        "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "LLM_API_KEY, where it is set"}},
    },
    "security": [{"apiKey": []}, {}],
}


def served_schemas(served) -> dict:
    """The components that depend on what is served, narrowed to the one model loaded (a model set's
    or a loading engine's stay as wide as any model's): token ids within its vocabulary, image parts
    only where it has a projector, `lora` entries naming only its adapters, one at most."""
    loaded = None if isinstance(served, ModelSet) else served.loaded
    if loaded is None:
        return {}
    adapters = loaded.adapters.names if loaded.adapters is not None else []
    requests = openai_schemas.SCHEMAS
    return {
        # n within the engine's slots, dimensions within the model's width
        "ChatCompletionRequest": _narrowed(requests["ChatCompletionRequest"], n=served.n_slots),
        "CompletionRequest": _narrowed(requests["CompletionRequest"], n=served.n_slots),
        "EmbeddingRequest": _narrowed(requests["EmbeddingRequest"], dimensions=loaded.width),
        "TokenId": {"type": "integer", "minimum": 0, "maximum": loaded.tokenizer.vocab_size - 1},
        "ContentPart": {"oneOf": [TEXT_PART, IMAGE_PART]} if loaded.vision is not None else TEXT_PART,
        "ResponseContentPart": {"oneOf": [RESPONSE_TEXT_PART, RESPONSE_IMAGE_PART]} if loaded.vision is not None else RESPONSE_TEXT_PART,
        "AnthropicContentBlock": {"oneOf": [TEXT_BLOCK, IMAGE_BLOCK]} if loaded.vision is not None else TEXT_BLOCK,
        "Lora": lora_entries({"enum": list(range(len(adapters)))}, {"enum": adapters}, most=1) if adapters else array(NONEMPTY, maxItems=0),
    }


def _narrowed(schema: dict, **maxima: int) -> dict:
    """`schema` with each named property's maximum lowered to at most the one given."""
    properties = schema["properties"] | {
        name: schema["properties"][name] | {"maximum": min(most, schema["properties"][name].get("maximum", most))}
        for name, most in maxima.items()
    }
    return schema | {"properties": properties}


@bp.get("/openapi.json")
def openapi():
    components = DOCUMENT["components"]
    return jsonify(DOCUMENT | {"components": components | {"schemas": components["schemas"] | served_schemas(gen.served())}})
