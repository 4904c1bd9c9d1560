"""Files whose matrices are Q5_0, Q5_1 or IQ4_NL (the `Q5_0` and `Q5_1` downloads, and the IQ4_NL of
IQ4_XS files' odd-width tensors): each loads with its matrices in their blocks on the CPU kernels, its
logits follow the float64 reference of the same file, and a real server answers the openai client."""

import logging

import numpy as np
import openai
import pytest
from support import get, tiny_engine_server
from support.tiny_models import Reference, load_steps, write_tiny_gguf

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model

PROMPT = [1, 504, 3458, 282, 4649, 314, 253]
TYPES = ["Q5_0", "Q5_1", "IQ4_NL"]


@pytest.fixture(scope="module", params=TYPES)
def model_file(request, tmp_path_factory) -> tuple[str, str]:
    path = str(tmp_path_factory.mktemp("q5") / f"tiny.{request.param}.gguf")
    return request.param, write_tiny_gguf(path, "qwen3", n_layers=2, dim=128, hidden=256, head_dim=32, matrix_type=request.param)


def test_the_file_loads_in_its_blocks_and_follows_the_reference(model_file, caplog):
    type_name, path = model_file
    use_tinygrad_from_this_thread()
    with caplog.at_level(logging.INFO, logger="webapp.engine.model.transformer"):
        steps = load_steps(path, slots=2, context=64)
    assert f"{type_name} blocks (rows interleaved)" in caplog.text and "float16" not in caplog.text.split("weights:")[-1]
    expected = Reference(path).logits(PROMPT + [42])
    got = np.stack([steps.prefill(PROMPT, slot=0, start=0), steps.decode([42], [0], [len(PROMPT)])[0]])
    for row, reference in zip(got, expected[len(PROMPT) - 1 :], strict=True):
        assert np.abs(row - reference).max() < 0.03 * np.abs(reference).max()
        assert np.argmax(row) == np.argmax(reference)


def test_a_server_answers_the_openai_client_with_it(model_file):
    type_name, path = model_file
    with tiny_engine_server(path, slots=2, queue_limit=2) as (engine, srv):
        assert get(srv, "/health")[0] == 200
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=type_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
        client.close()


def test_iq4_nl_without_the_kernels_is_refused_by_name(tmp_path):
    """tinygrad has no IQ4_NL dequantization: with the kernels off, such a file stops at its first
    IQ4_NL matrix, named, instead of failing inside tinygrad."""
    path = write_tiny_gguf(str(tmp_path / "tiny.IQ4_NL.gguf"), n_layers=1, matrix_type="IQ4_NL")
    use_tinygrad_from_this_thread()
    with pytest.raises(ModelLoadError, match="is stored as IQ4_NL, which only the CPU kernels read"):
        load_model(path, slots=1, context=32, cpu_kernels=False)
