"""`/openapi.json` (webapp/http/openapi.py) is a valid OpenAPI 3.1 document, and every route it
describes, fuzzed from it with Schemathesis against a real Waitress server and engine on a tiny
model: never a 5xx, every body the document allows served (a 4xx only where no schema can say it:
`INHERENT`), every 4xx in its family's error shape, every 200 valid against the document, and the
engine idle and serving afterwards (no request kept a slot)."""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from support import get, post, tiny_engine_server, wait_until
from support.tiny_models import write_tiny_gguf

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))  # a route; FUZZ_EXAMPLES=1000 for a longer run


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # a reranker's file (a chat model too): every route can answer 200
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("openapi") / "tiny.gguf"), "qwen3", rank_labels=("yes", "no"), context=256)
    with tiny_engine_server(path, slots=2, queue_limit=16, context=128) as (engine, server):
        yield engine, server


@pytest.fixture(scope="module")
def schema(served):
    _, server = served
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def test_the_document_is_served_publicly_and_names_every_route_it_fuzzes(served):
    _, server = served
    status, _, document = get(server, "/openapi.json")
    assert status == 200 and document["openapi"] == "3.1.0"
    assert {path for path, _ in OPERATIONS} == set(document["paths"])


def test_the_document_narrows_to_the_model_served(served):
    """What depends on the model: token ids within its vocabulary, `n` within the slots, no image
    parts without a projector, no `lora` entries without adapters (a server with a projector offers
    image parts in every shape: tests/integration/test_images_api.py)."""
    engine, server = served
    _, _, document = get(server, "/openapi.json")
    schemas = document["components"]["schemas"]
    assert schemas["TokenId"]["maximum"] == engine.tokenizer.vocab_size - 1
    assert schemas["ChatCompletionRequest"]["properties"]["n"]["maximum"] == engine.n_slots == 2
    assert schemas["ContentPart"]["properties"]["type"] == {"const": "text"}
    assert schemas["ResponseContentPart"]["properties"]["type"]["enum"] == ["input_text", "output_text"]
    assert schemas["AnthropicContentBlock"]["properties"]["type"] == {"const": "text"}
    assert schemas["Lora"]["maxItems"] == 0


OPERATIONS = [
    ("/v1/models", "GET"),
    ("/v1/chat/completions", "POST"),
    ("/v1/completions", "POST"),
    ("/v1/responses", "POST"),
    ("/v1/responses/{response_id}", "GET"),
    ("/v1/responses/{response_id}", "DELETE"),
    ("/v1/embeddings", "POST"),
    ("/v1/rerank", "POST"),
    ("/v1/score", "POST"),
    ("/lora-adapters", "GET"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
    ("/health", "GET"),
    ("/v1/messages", "POST"),
    ("/v1/messages/count_tokens", "POST"),
    ("/api/chat", "POST"),
    ("/api/generate", "POST"),
    ("/api/embed", "POST"),
    ("/api/show", "POST"),
    ("/api/tags", "GET"),
    ("/api/ps", "GET"),
    ("/api/version", "GET"),
]


# refusals of bodies the document allows that no JSON schema could rule out: a prompt longer than
# the context or of characters the vocabulary lacks, a stored response that does not exist, score
# pairs that do not pair up, a forced tool the request's tools do not hold
INHERENT = re.compile(
    r"maximum context length|prompt is empty|holds no token of|Previous response with id|holds \d+ texts? and|which is not in 'tools'"
)
STREAMING = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/api/chat", "/api/generate"}
BY_ID = {"/v1/responses/{response_id}"}  # random ids name no stored response: 404s, each in the document's shape


@pytest.mark.parametrize("path, method", OPERATIONS)
def test_every_route_fuzzed_from_the_document_answers_without_a_server_error(served, schema, path, method):
    engine, server = served
    operation = schema[path][method]

    statuses: Counter = Counter()

    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    def fuzz(case):
        if path in STREAMING and isinstance(case.body, dict):
            case.body["stream"] = False  # a stream's events are checked in the streaming tests (Ollama streams unless told not to)
        response = case.call(base_url=server.url, timeout=60)
        statuses[response.status_code] += 1
        # a 4xx is checked against its family's error schema in the document (OpenAI's, Anthropic's, Ollama's)
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
        if response.status_code >= 400 and path not in BY_ID:
            assert INHERENT.search(response.text), f"a body the document allows was refused: {case.body!r} -> {response.text}"

    fuzz()
    assert (statuses[200] > 0 or path in BY_ID) and sum(statuses.values()) >= (EXAMPLES // 2 if method == "POST" else 1), statuses
    print(path, method, dict(statuses))
    assert wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["queue_depth"] == 0, timeout=30)
    status, _, _ = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200
