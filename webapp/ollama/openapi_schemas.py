"""Ollama's API in the OpenAPI document: its bodies, answers and error shape."""

from __future__ import annotations

from webapp.openai.json_schema import BOOLEAN, INTEGER, NONEMPTY, NUMBER, STRING, array, closed, obj

OLLAMA_OPTIONS = closed(
    obj(
        (),
        temperature={"type": "number", "minimum": 0, "maximum": 2},
        top_p={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        num_predict={"type": "integer", "minimum": 1},
        num_ctx={"type": "integer", "minimum": 1},
        seed={"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1},
        stop=array({"type": "string", "minLength": 1}, maxItems=4),
    )
)
OLLAMA_DONE = obj(("model", "created_at", "done"), model=STRING, created_at=STRING, done={"const": True}, done_reason=STRING)
SCHEMAS = {
    "OllamaError": obj(("error",), error=STRING),
    "OllamaChatRequest": closed(
        obj(
            ("model", "messages"),
            model=NONEMPTY,
            messages=array(obj(("role", "content"), role={"enum": ["system", "user", "assistant"]}, content=STRING), minItems=1),
            stream=BOOLEAN,
            options=OLLAMA_OPTIONS,
        )
    ),
    "OllamaChat": OLLAMA_DONE
    | {"properties": OLLAMA_DONE["properties"] | {"message": obj(("role", "content"), role=STRING, content=STRING)}},
    "OllamaGenerateRequest": closed(
        obj(("model", "prompt"), model=NONEMPTY, prompt=STRING, system=STRING, stream=BOOLEAN, options=OLLAMA_OPTIONS)
    ),
    "OllamaGenerate": OLLAMA_DONE | {"properties": OLLAMA_DONE["properties"] | {"response": STRING}},
    "OllamaEmbedRequest": closed(obj(("model", "input"), model=NONEMPTY, input={"oneOf": [NONEMPTY, array(NONEMPTY, minItems=1)]})),
    "OllamaEmbed": obj(("model", "embeddings"), model=STRING, embeddings=array(array(NUMBER))),
    "OllamaModels": obj(("models",), models=array(obj(("name", "model"), name=STRING, model=STRING, size=INTEGER))),
    "OllamaShowRequest": closed(obj(("model",), model=NONEMPTY)),
    "OllamaShow": obj((), template=STRING, details=obj(()), model_info=obj(())),
    "OllamaVersion": obj(("version",), version=STRING),
}
