"""`POST /v1/embeddings` through the real `openai` client against a real Waitress server and engine:
the vectors are the model's own (mean or last pooling of the final norm's output, against the
float64 reference), unit length, independent of what else runs in the batch, in both encodings; the
file's pooling_type and add_eos_token are obeyed; bad input is a 400 in OpenAI's shape."""

import base64

import numpy as np
import openai
import pytest
from support import assert_error_shape, post, tiny_engine_server
from support.tiny_models import Reference, write_tiny_gguf


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("emb") / "tiny.gguf"), "qwen3", matrix_type="Q8_0", context=512)


@pytest.fixture(scope="module")
def served(model_file):
    with tiny_engine_server(model_file, slots=2, queue_limit=8, context=256) as (engine, server):
        yield engine, server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_mean_pooled_vectors_follow_the_float64_reference(model_file, served):
    engine, _, client = served
    prompts = [[1, 504, 3458, 282, 4649], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]  # the second spans chunks
    answer = client.embeddings.create(model="tiny", input=prompts, encoding_format="float")
    assert answer.usage.prompt_tokens == sum(map(len, prompts)) and [d.index for d in answer.data] == [0, 1]
    reference = Reference(model_file)
    for datum, ids in zip(answer.data, prompts, strict=True):
        got, want = np.array(datum.embedding), unit(reference.hidden(ids).mean(axis=0))
        assert got.shape == (64,) and abs(np.linalg.norm(got) - 1) < 1e-5
        assert got @ want > 0.999, got @ want  # cosine to the float64 pooling (int8 activations on the kernels)


def test_a_vector_does_not_depend_on_its_batch_and_both_encodings_agree(served):
    _, server, client = served
    texts = ["The cat sat on the mat.", "Markets fell.", "hello", "A longer sentence about cats, mats and sitting on them."] * 4
    texts = [f"{text} ({i})" for i, text in enumerate(texts)]  # 16, more than the slots
    batch = client.embeddings.create(model="tiny", input=texts)  # the openai package asks for base64 and decodes it
    for text, datum in zip(texts, batch.data, strict=True):
        alone = client.embeddings.create(model="tiny", input=text, encoding_format="float").data[0].embedding
        assert np.array_equal(np.float32(datum.embedding), np.float32(alone))
    status, _, raw = post(server, "/v1/embeddings", {"input": texts[0], "encoding_format": "base64"})
    assert status == 200 and raw["object"] == "list" and raw["data"][0]["object"] == "embedding"
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.float32(batch.data[0].embedding))


def test_dimensions_cut_and_renormalize(served):
    _, _, client = served
    full = np.array(client.embeddings.create(model="tiny", input="hello there", encoding_format="float").data[0].embedding)
    cut = np.array(client.embeddings.create(model="tiny", input="hello there", encoding_format="float", dimensions=16).data[0].embedding)
    assert cut.shape == (16,) and np.allclose(cut, unit(full[:16]), atol=1e-6)


def test_the_engine_is_free_again_and_chat_still_answers(served):
    engine, _, client = served
    client.embeddings.create(model="tiny", input=["a", "b", "c", "d", "e"])  # more inputs than slots
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert engine.stats()["running"] == 0


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", 3]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "x" * 5000}, "input"),  # past the 256-position context
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 65}, "dimensions"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "model": 3}, "model"),
        ({"input": "\u0013"}, "input"),  # a character SmolLM2's vocabulary lacks: no token at all
    ],
)
def test_bad_input_is_a_400_in_openais_shape(served, body, param):
    engine, server, _ = served
    status, _, answer = post(server, "/v1/embeddings", body)
    assert status == 400, answer
    assert_error_shape(answer)
    assert answer["error"]["param"] == param
    assert engine.stats()["running"] == 0


def test_the_files_pooling_type_and_end_of_text_are_obeyed(tmp_path):
    """An embedding model's file (Qwen3-Embedding's keys): last-token pooling over the input with its
    end-of-text appended."""
    path = write_tiny_gguf(str(tmp_path / "embedder.gguf"), "qwen3", matrix_type="Q8_0", metadata={"pooling_type": 3}, add_eos=True)
    with tiny_engine_server(path, slots=2, queue_limit=2) as (engine, server):
        assert engine.pooling == "last" and engine.embedding_suffix == (engine.tokenizer.eos_id,)
        status, _, answer = post(server, "/v1/embeddings", {"input": [[5, 6, 7]], "encoding_format": "float"})
    assert status == 200 and answer["usage"]["prompt_tokens"] == 4
    want = unit(Reference(path).hidden([5, 6, 7, engine.tokenizer.eos_id])[-1])
    assert np.array(answer["data"][0]["embedding"]) @ want > 0.999
