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

from webapp.http.families import PUBLIC, Family

bp = Family("openapi", __name__, guard=PUBLIC, drained=False)

STRING, INTEGER, NUMBER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
NULLABLE_STRING = {"type": ["string", "null"]}


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(required: tuple[str, ...] = (), **properties) -> dict:
    """An object with these properties (others allowed: clients send fields this server ignores)."""
    return {"type": "object", "required": list(required), "properties": properties}


def array(items: dict, **limits) -> dict:
    return {"type": "array", "items": items, **limits}


USAGE = obj(("prompt_tokens", "total_tokens"), prompt_tokens=INTEGER, completion_tokens=INTEGER, total_tokens=INTEGER)
STOP = {"oneOf": [{"type": "string", "minLength": 1}, array({"type": "string", "minLength": 1}, maxItems=4)]}
SAMPLING = {
    "model": STRING,
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 8},
    "stop": {"oneOf": [STOP, {"type": "null"}]},
    "seed": {"type": ["integer", "null"]},
    "stream": {"type": ["boolean", "null"]},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "logprobs": {"type": ["boolean", "null"]},
    # llama-server's: the LoRA adapter by its /lora-adapters id or name, and its scale (0: not used)
    "lora": {
        "type": "array",
        "maxItems": 64,
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0},
                "name": STRING,
                "scale": {"type": "number", "minimum": -100, "maximum": 100},
            },
        },
    },
}
CONTENT_PART = {
    "oneOf": [
        obj(("type", "text"), type={"const": "text"}, text=STRING),
        # a data: URL only: this server fetches no URL
        obj(("type", "image_url"), type={"const": "image_url"}, image_url=obj(("url",), url={"type": "string", "pattern": "^data:image/"})),
    ]
}
MESSAGE = obj(
    ("role", "content"),
    role={"enum": ["system", "developer", "user", "assistant"]},
    content={"oneOf": [STRING, array(CONTENT_PART, minItems=1)]},
    name=STRING,
)


def completion(kind: str, choice: dict) -> dict:
    """A chat or text completion: the envelope both share around their choices."""
    return obj(
        ("id", "object", "created", "model", "choices"),
        id=STRING,
        object={"const": kind},
        created=INTEGER,
        model=STRING,
        choices=array(choice),
        usage=ref("Usage"),
    )


def closed(schema: dict) -> dict:
    """`schema`, no property besides its own: the body's parser refuses the others by name."""
    return schema | {"additionalProperties": False}


SCHEMAS = {
    "Error": obj(("error",), error=obj(("message", "type"), message=STRING, type=STRING, param=NULLABLE_STRING, code=NULLABLE_STRING)),
    "Usage": USAGE,
    # a LoRA adapter is listed as a model with its base model as `parent` (vLLM's listing)
    "Model": obj(("id", "object"), id=STRING, object={"const": "model"}, created=INTEGER, owned_by=STRING, root=STRING, parent=STRING),
    "ModelList": obj(("object", "data"), object={"const": "list"}, data=array(ref("Model"))),
    "ChatCompletionRequest": closed(
        obj(("messages",), messages=array(MESSAGE, minItems=1), max_completion_tokens=SAMPLING["max_tokens"], **SAMPLING)
    ),
    "ChatCompletion": completion(
        "chat.completion",
        obj(
            ("index", "message", "finish_reason"),
            index=INTEGER,
            message=obj(("role",), role={"const": "assistant"}, content=NULLABLE_STRING),
            finish_reason=STRING,
        ),
    ),
    "CompletionRequest": closed(
        obj(("prompt",), prompt={"oneOf": [STRING, array(STRING, minItems=1), array(INTEGER, minItems=1)]}, echo=BOOLEAN, **SAMPLING)
    ),
    "Completion": completion("text_completion", obj(("index", "text", "finish_reason"), index=INTEGER, text=STRING, finish_reason=STRING)),
    "EmbeddingRequest": obj(
        ("input",),
        input={"oneOf": [STRING, array(STRING, minItems=1), array(INTEGER, minItems=1), array(array(INTEGER, minItems=1), minItems=1)]},
        model=STRING,
        encoding_format={"enum": ["float", "base64"]},
        dimensions={"type": "integer", "minimum": 1},
    ),
    "EmbeddingList": obj(
        ("object", "data", "model", "usage"),
        object={"const": "list"},
        data=array(
            obj(
                ("object", "index", "embedding"),
                object={"const": "embedding"},
                index=INTEGER,
                embedding={"oneOf": [array(NUMBER), STRING]},
            )
        ),
        model=STRING,
        usage=ref("Usage"),
    ),
    "LoraAdapters": array(
        obj(("id", "name", "path", "scale"), id=INTEGER, name=STRING, path=STRING, scale=NUMBER, rank=INTEGER, alpha=NUMBER, bytes=INTEGER)
    ),
    "RerankRequest": obj(
        ("query", "documents"),
        model=STRING,
        query=STRING,
        documents=array({"oneOf": [STRING, obj(("text",), text=STRING)]}, minItems=1, maxItems=1000),
        top_n={"type": "integer", "minimum": 1},
        return_documents=BOOLEAN,
    ),
    "RerankResult": obj(
        ("id", "model", "results", "usage"),
        id=STRING,
        model=STRING,
        results=array(obj(("index", "relevance_score"), index=INTEGER, relevance_score=NUMBER, document=obj(("text",), text=STRING))),
        usage=ref("Usage"),
    ),
    "ScoreRequest": obj(
        ("text_1", "text_2"),
        model=STRING,
        text_1={"oneOf": [STRING, array(STRING, minItems=1, maxItems=1000)]},
        text_2={"oneOf": [STRING, array(STRING, minItems=1, maxItems=1000)]},
    ),
    "ScoreResult": obj(
        ("id", "object", "model", "data", "usage"),
        id=STRING,
        object={"const": "list"},
        model=STRING,
        data=array(obj(("index", "object", "score"), index=INTEGER, object={"const": "score"}, score=NUMBER)),
        usage=ref("Usage"),
    ),
    "TokenizeRequest": obj(
        (),
        model=STRING,
        content=STRING,
        prompt=STRING,
        messages=array(MESSAGE, minItems=1),
        add_special=BOOLEAN,
        add_generation_prompt=BOOLEAN,
        with_pieces=BOOLEAN,
    ),
    "TokenizeResult": obj(("tokens",), tokens=array({"oneOf": [INTEGER, obj(("id",), id=INTEGER)]}), count=INTEGER),
    "DetokenizeRequest": obj(("tokens",), model=STRING, tokens=array(INTEGER)),
    "DetokenizeResult": obj(("content",), content=STRING),
    "Health": obj(("status",), status=STRING, model=STRING, error=STRING),
}


# Anthropic's Messages API and Ollama's, each with its own error shape
ANTHROPIC_MESSAGE = obj(("role", "content"), role={"enum": ["user", "assistant"]}, content={"oneOf": [STRING, array(obj(("type", "text"), type={"const": "text"}, text=STRING), minItems=1)]})  # fmt: skip
OLLAMA_OPTIONS = obj(
    (),
    temperature={"type": "number", "minimum": 0, "maximum": 2},
    top_p={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    num_predict={"type": "integer", "minimum": 1},
    num_ctx={"type": "integer", "minimum": 1},
    seed=INTEGER,
    stop=array({"type": "string", "minLength": 1}, maxItems=4),
)
OLLAMA_DONE = obj(("model", "created_at", "done"), model=STRING, created_at=STRING, done={"const": True}, done_reason=STRING)
SCHEMAS |= {
    "AnthropicError": obj(("type", "error"), type={"const": "error"}, error=obj(("type", "message"), type=STRING, message=STRING)),
    "MessagesRequest": obj(
        ("model", "max_tokens", "messages"),
        model=STRING,
        max_tokens={"type": "integer", "minimum": 1},
        messages=array(ANTHROPIC_MESSAGE, minItems=1),
        system={"oneOf": [STRING, array(obj(("type", "text"), type={"const": "text"}, text=STRING))]},
        temperature={"type": "number", "minimum": 0, "maximum": 1},
        top_p={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        stop_sequences=array({"type": "string", "minLength": 1}, maxItems=4),
        stream=BOOLEAN,
    ),
    "Message": obj(
        ("id", "type", "role", "model", "content", "stop_reason", "usage"),
        id=STRING,
        type={"const": "message"},
        role={"const": "assistant"},
        model=STRING,
        content=array(obj(("type",), type=STRING)),
        stop_reason=NULLABLE_STRING,
        usage=obj(("input_tokens", "output_tokens"), input_tokens=INTEGER, output_tokens=INTEGER),
    ),
    "CountTokensRequest": obj(("model", "messages"), model=STRING, messages=array(ANTHROPIC_MESSAGE, minItems=1), system=STRING),
    "TokenCount": obj(("input_tokens",), input_tokens=INTEGER),
    "OllamaError": obj(("error",), error=STRING),
    "OllamaChatRequest": obj(
        ("model", "messages"),
        model=STRING,
        messages=array(obj(("role", "content"), role={"enum": ["system", "user", "assistant"]}, content=STRING), minItems=1),
        stream=BOOLEAN,
        options=OLLAMA_OPTIONS,
    ),
    "OllamaChat": OLLAMA_DONE
    | {"properties": OLLAMA_DONE["properties"] | {"message": obj(("role", "content"), role=STRING, content=STRING)}},
    "OllamaGenerateRequest": obj(("model", "prompt"), model=STRING, prompt=STRING, system=STRING, stream=BOOLEAN, options=OLLAMA_OPTIONS),
    "OllamaGenerate": OLLAMA_DONE | {"properties": OLLAMA_DONE["properties"] | {"response": STRING}},
    "OllamaEmbedRequest": obj(("model", "input"), model=STRING, input={"oneOf": [STRING, array(STRING, minItems=1)]}),
    "OllamaEmbed": obj(("model", "embeddings"), model=STRING, embeddings=array(array(NUMBER))),
    "OllamaModels": obj(("models",), models=array(obj(("name", "model"), name=STRING, model=STRING, size=INTEGER))),
    "OllamaShowRequest": obj(("model",), model=STRING),
    "OllamaShow": obj((), template=STRING, details=obj(()), model_info=obj(())),
    "OllamaVersion": obj(("version",), version=STRING),
}


# OpenAI's Responses API: items in (messages, a model's function calls and their outputs), items out
RESPONSE_TEXT = {"oneOf": [STRING, array(obj(("type", "text"), type={"enum": ["input_text", "output_text"]}, text=STRING), minItems=1)]}
RESPONSE_ITEM = {
    "oneOf": [
        obj(
            ("role", "content"),
            type={"const": "message"},
            role={"enum": ["user", "assistant", "system", "developer"]},
            content=RESPONSE_TEXT,
        ),
        obj(("type", "call_id", "name", "arguments"), type={"const": "function_call"}, call_id=STRING, name=STRING, arguments=STRING),
        obj(("type", "call_id", "output"), type={"const": "function_call_output"}, call_id=STRING, output=STRING),
    ]
}
FUNCTION_TOOL = obj(("type", "name"), type={"const": "function"}, name=STRING, description=STRING, parameters=obj(()))
SCHEMAS |= {
    "ResponseRequest": closed(
        obj(
            ("input",),
            model=STRING,
            input={"oneOf": [STRING, array(RESPONSE_ITEM, minItems=1)]},
            instructions=STRING,
            max_output_tokens={"type": ["integer", "null"], "minimum": 1},
            temperature=SAMPLING["temperature"],
            top_p=SAMPLING["top_p"],
            stream=SAMPLING["stream"],
            store=BOOLEAN,
            previous_response_id={"type": ["string", "null"]},
            tools=array(FUNCTION_TOOL),
            tool_choice={"oneOf": [{"enum": ["auto", "none", "required"]}, obj(("type", "name"), type={"const": "function"}, name=STRING)]},
            parallel_tool_calls=BOOLEAN,
            text=obj(
                (),
                format={
                    "oneOf": [
                        obj(("type",), type={"enum": ["text", "json_object"]}),
                        obj(("type", "name", "schema"), type={"const": "json_schema"}, name=STRING, schema=obj(()), strict=BOOLEAN),
                    ]
                },
            ),
            reasoning=obj((), effort={"enum": ["minimal", "low", "medium", "high"]}),
            metadata=obj(()),
            user=STRING,
        )
    ),
    "Response": obj(
        ("id", "object", "status", "model", "output"),
        id=STRING,
        object={"const": "response"},
        created_at=INTEGER,
        status={"enum": ["completed", "incomplete", "failed", "in_progress"]},
        model=STRING,
        output=array(obj(("type",), type=STRING)),
        usage={
            "oneOf": [
                obj(("input_tokens", "output_tokens", "total_tokens"), input_tokens=INTEGER, output_tokens=INTEGER, total_tokens=INTEGER),
                {"type": "null"},
            ]
        },
    ),
    "ResponseDeleted": obj(("id", "object", "deleted"), id=STRING, object={"const": "response"}, deleted={"const": True}),
}


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
        "schemas": SCHEMAS,
        "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "LLM_API_KEY, where it is set"}},
    },
    "security": [{"apiKey": []}, {}],
}


@bp.get("/openapi.json")
def openapi():
    return jsonify(DOCUMENT)
