"""LoRA adapters through the real `openai` client and plain HTTP, against a real Waitress server and
engine (paged KV cache) on a tiny model with adapters from a folder (LLM_LORA_DIR): a request names
its adapter by `model` (vLLM's way, or Ollama's `base:adapter`) or by llama-server's `lora` field,
and its prompt's logprobs are the float64 merged model's; the prefix cache never serves one adapter's
K/V to another request; adapters are listed by /v1/models and /lora-adapters, loaded and unloaded
at run time, and bad bodies are 400s in OpenAI's shape."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from support import assert_error_shape, tiny_engine_server
from support.tiny_lora import merged_reference, write_lora_gguf
from support.tiny_models import Reference, write_tiny_gguf

PROMPT = "The quick brown fox jumps over"
TOLERANCE = 0.05  # nats: the 8-bit weights' and activations' rounding


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_api")
    model = write_tiny_gguf(str(folder / "tiny.gguf"), matrix_type="Q8_0", context=512)
    loras = folder / "loras"
    loras.mkdir()
    write_lora_gguf(str(loras / "bold.gguf"), model, rank=16, seed=3, size=0.3)
    write_lora_gguf(str(folder / "later.gguf"), model, rank=8, seed=4, size=0.3, targets=("attn_q", "attn_v", "ffn_down"))
    return model, str(loras), str(folder / "later.gguf")


@pytest.fixture(scope="module")
def served(files):
    model, loras, _ = files
    with tiny_engine_server(model, slots=4, queue_limit=16, context=256, lora_dir=loras, paging=(4, ("positions", 1024))) as (
        engine,
        server,
    ):
        yield engine, server


@pytest.fixture
def client(served):
    _, server = served
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def reference_logprobs(reference: Reference, ids: list[int]) -> np.ndarray:
    """The reference's log-probability of each prompt token after those before it."""
    logits = reference.logits(ids)[:-1]
    top = logits.max(-1, keepdims=True)
    logsoftmax = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return logsoftmax[np.arange(len(ids) - 1), ids[1:]]


def served_logprobs(client, **kwargs) -> np.ndarray:
    """The server's logprob of each prompt token after the first (an echoed completion's)."""
    answer = client.completions.create(prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=0, **kwargs)
    return np.array(answer.choices[0].logprobs.token_logprobs[1:-1])


def prompt_ids(engine) -> list[int]:
    ids = engine.tokenizer.encode(PROMPT, special=True)
    bos = engine.tokenizer.bos_id
    return [bos, *ids] if engine.tokenizer.add_bos and bos is not None and ids[:1] != [bos] else ids


def test_an_adapter_named_three_ways_scores_as_the_merged_model(files, served, client):
    model, loras, _ = files
    engine, _ = served
    want = reference_logprobs(merged_reference(model, f"{loras}/bold.gguf"), prompt_ids(engine))
    base = reference_logprobs(Reference(model), prompt_ids(engine))
    assert np.abs(want - base).max() > 10 * TOLERANCE  # the adapter matters
    for kwargs in ({"model": "bold"}, {"model": "tiny:bold"}, {"model": "tiny", "extra_body": {"lora": [{"id": 0, "scale": 1.0}]}}):
        np.testing.assert_allclose(served_logprobs(client, **kwargs), want, atol=TOLERANCE, err_msg=str(kwargs))
    np.testing.assert_allclose(served_logprobs(client, model="tiny"), base, atol=TOLERANCE)
    half = reference_logprobs(merged_reference(model, f"{loras}/bold.gguf", 0.5), prompt_ids(engine))
    np.testing.assert_allclose(
        served_logprobs(client, model="tiny", extra_body={"lora": [{"name": "bold", "scale": 0.5}]}), half, atol=TOLERANCE
    )


def test_the_prefix_cache_keeps_each_adapters_kv_apart(served, client):
    engine, _ = served
    long_prompt = PROMPT + " the lazy dog." * 8  # several 16-position blocks
    first = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=1, temperature=0)
    with_adapter = client.completions.create(model="bold", prompt=long_prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model="bold", prompt=long_prompt, max_tokens=1, temperature=0)
    cached = lambda answer: answer.usage.prompt_tokens_details.cached_tokens  # noqa: E731
    assert cached(with_adapter) == 0  # the base model's blocks are not the adapter's
    assert cached(again) > 0 and again.choices[0].text == with_adapter.choices[0].text
    assert first.choices[0].text != with_adapter.choices[0].text or cached(first) == 0


def test_adapters_are_listed(files, served):
    _, server = served
    _, loras, _ = files
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [(m["id"], m.get("parent")) for m in models["data"]] == [("tiny", None), ("bold", "tiny")]
    listed = httpx.get(f"{server.url}/lora-adapters").json()
    assert [(a["id"], a["name"], a["rank"], a["scale"]) for a in listed] == [(0, "bold", 16, 0.0)]
    assert listed[0]["path"] == f"{loras}/bold.gguf"
    dashboard = httpx.get(f"{server.url}/admin/stats.json").json()
    assert [(a["name"], a["rank"], a["retired"]) for a in dashboard["adapters"]] == [("bold", 16, False)]


def test_an_adapter_loaded_and_unloaded_at_run_time(files, served, client):
    model, _, later = files
    engine, server = served
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "later", "lora_path": later})
    assert loaded.status_code == 200 and "later" in loaded.text
    want = reference_logprobs(merged_reference(model, later), prompt_ids(engine))
    np.testing.assert_allclose(served_logprobs(client, model="later"), want, atol=TOLERANCE)
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "later", "lora_path": later})
    assert again.status_code == 400 and "loaded already" in again.json()["error"]["message"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "later"}).status_code == 200
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"lora": [{"name": "later", "scale": 1}]})
    assert refused.value.code == "lora_not_found"
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "later"})
    assert gone.status_code == 404
    assert_error_shape(gone.json(), code="lora_not_found")


@pytest.mark.parametrize(
    "body, words",
    [
        ({"lora": {"id": 0}}, "must be a list"),
        ({"lora": [{"id": 3, "scale": 1}]}, "adapter id 3"),
        ({"lora": [{"id": 0, "scale": "big"}]}, "scale"),
        ({"lora": [{"id": 0, "scale": 1}, {"name": "bold", "scale": 2}]}, "more than one"),
        ({"lora": [{"name": "nope", "scale": 1}]}, "no LoRA adapter named 'nope'"),
        ({"lora_path": "/nonexistent.gguf", "lora_name": "x", "load": True}, "is not a file"),
    ],
)
def test_bad_lora_bodies_are_400s(served, body, words):
    _, server = served
    body = dict(body)
    if body.pop("load", False):
        response = post(server, "/v1/load_lora_adapter", body)
    else:
        response = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1} | body)
    answer = response.json()
    assert response.status_code == 400 and words in answer["error"]["message"], answer
    assert_error_shape(answer)
