"""The OpenAI family's routes in the OpenAPI document (webapp/http/openapi.py): chat and text
completions, the Responses API, embeddings, reranking and scoring, tokenizing, the models' and LoRA
adapters' lists and /health; each request body's schema says what its parser takes."""

from __future__ import annotations

from webapp.openai.embeddings import MAX_INPUTS
from webapp.openai.json_schema import BOOLEAN, INTEGER, NONEMPTY, NULLABLE_STRING, NUMBER, STRING, array, closed, obj, ref
from webapp.openai.lora_choice import MAX_ENTRIES
from webapp.openai.rerank import MAX_DOCUMENTS

TOKEN_IDS = array(ref("TokenId"), minItems=1)

USAGE = obj(("prompt_tokens", "total_tokens"), prompt_tokens=INTEGER, completion_tokens=INTEGER, total_tokens=INTEGER)
STOP = {"oneOf": [{"type": "string", "minLength": 1}, array({"type": "string", "minLength": 1}, maxItems=4)]}
SAMPLING = {
    "model": STRING,
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 8},
    "stop": {"oneOf": [STOP, {"type": "null"}]},
    "seed": {"type": ["integer", "null"], "minimum": -(2**63), "maximum": 2**64 - 1},
    "stream": {"type": ["boolean", "null"]},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "logprobs": {"type": ["boolean", "null"]},
    # llama-server's: the LoRA adapter by its /lora-adapters id or name, and its scale (0: not used)
    "lora": ref("Lora"),
}
TEXT_PART = obj(("type", "text"), type={"const": "text"}, text=STRING)
# a data: URL only: this server fetches no URL
IMAGE_PART = obj(
    ("type", "image_url"), type={"const": "image_url"}, image_url=obj(("url",), url={"type": "string", "pattern": "^data:image/"})
)
MESSAGE = obj(
    ("role", "content"),
    role={"enum": ["system", "developer", "user", "assistant"]},
    content={"oneOf": [STRING, array(ref("ContentPart"), minItems=1)]},
    name=STRING,
)
LORA_SCALE = {"type": "number", "minimum": -100, "maximum": 100}


def lora_entries(ids: dict, names: dict, most: int = MAX_ENTRIES) -> dict:
    """The `lora` field: entries naming an adapter by its id or by its name, each with a scale."""
    by_id, by_name = closed(obj(("id",), id=ids, scale=LORA_SCALE)), closed(obj(("name",), name=names, scale=LORA_SCALE))
    return array({"oneOf": [by_id, by_name]}, maxItems=most)


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


SCHEMAS = {
    "Error": obj(("error",), error=obj(("message", "type"), message=STRING, type=STRING, param=NULLABLE_STRING, code=NULLABLE_STRING)),
    "Usage": USAGE,
    # a LoRA adapter is listed as a model with its base model as `parent` (vLLM's listing)
    "Model": obj(("id", "object"), id=STRING, object={"const": "model"}, created=INTEGER, owned_by=STRING, root=STRING, parent=STRING),
    "ModelList": obj(("object", "data"), object={"const": "list"}, data=array(ref("Model"))),
    # what openapi.py's `served_schemas` narrows to the model being served: its vocabulary, whether it
    # takes images, its adapters
    "TokenId": {"type": "integer", "minimum": 0},
    "ContentPart": {"oneOf": [TEXT_PART, IMAGE_PART]},
    "Lora": lora_entries({"type": "integer", "minimum": 0}, NONEMPTY),
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
        obj(("prompt",), prompt={"oneOf": [NONEMPTY, array(NONEMPTY, minItems=1, maxItems=1), TOKEN_IDS]}, echo=BOOLEAN, **SAMPLING)
    ),
    "Completion": completion("text_completion", obj(("index", "text", "finish_reason"), index=INTEGER, text=STRING, finish_reason=STRING)),
    "EmbeddingRequest": obj(
        ("input",),
        input={
            "oneOf": [
                NONEMPTY,
                array(NONEMPTY, minItems=1, maxItems=MAX_INPUTS),
                TOKEN_IDS,
                array(TOKEN_IDS, minItems=1, maxItems=MAX_INPUTS),
            ]
        },
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
        query=NONEMPTY,
        documents=array({"oneOf": [NONEMPTY, obj(("text",), text=NONEMPTY)]}, minItems=1, maxItems=MAX_DOCUMENTS),
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
        text_1={"oneOf": [NONEMPTY, array(NONEMPTY, minItems=1, maxItems=MAX_DOCUMENTS)]},
        text_2={"oneOf": [NONEMPTY, array(NONEMPTY, minItems=1, maxItems=MAX_DOCUMENTS)]},
    ),
    "ScoreResult": obj(
        ("id", "object", "model", "data", "usage"),
        id=STRING,
        object={"const": "list"},
        model=STRING,
        data=array(obj(("index", "object", "score"), index=INTEGER, object={"const": "score"}, score=NUMBER)),
        usage=ref("Usage"),
    ),
    "TokenizeRequest": {"anyOf": [{"required": [field]} for field in ("content", "prompt", "messages")]}
    | obj(
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
    "DetokenizeRequest": obj(("tokens",), model=STRING, tokens=array(ref("TokenId"))),
    "DetokenizeResult": obj(("content",), content=STRING),
    "Health": obj(("status",), status=STRING, model=STRING, error=STRING),
}

# OpenAI's Responses API: items in (messages, a model's function calls and their outputs), items out
RESPONSE_TEXT_PART = obj(("type", "text"), type={"enum": ["input_text", "output_text"]}, text=STRING)
RESPONSE_IMAGE_PART = obj(("type", "image_url"), type={"const": "input_image"}, image_url={"type": "string", "pattern": "^data:image/"})
RESPONSE_TEXT = {"oneOf": [STRING, array(ref("ResponseContentPart"), minItems=1)]}
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
FUNCTION_TOOL = obj(("type", "name"), type={"const": "function"}, name=NONEMPTY, description=STRING, parameters=obj(()))
SCHEMAS |= {
    "ResponseContentPart": {"oneOf": [RESPONSE_TEXT_PART, RESPONSE_IMAGE_PART]},
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
