"""Files whose matrices are IQ4_XS, Q3_K or Q2_K (the bulk of IQ4_XS, Q3_K_M and Q2_K downloads),
written by tests/support/low_bit_quants.py: they load with every layer matrix and the head on the
block kernels, their logits follow the float64 reference of the file's blocks, and a real server
answers the openai client with each."""

import numpy as np
import openai
import pytest
from support import get, tiny_engine_server
from support.tiny_models import Reference, load_steps, write_tiny_gguf
from tinygrad import Device

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model
from webapp.engine.model.weights import BlockLinear

PROMPT = [1, 504, 3458, 282, 4649, 314, 253]
SHAPE = dict(n_layers=2, dim=256, hidden=512, n_heads=4, n_kv_heads=2)  # widths in whole 256-value blocks


@pytest.fixture(scope="module", params=["IQ4_XS", "Q3_K", "Q2_K"])
def low_bit_file(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("low") / f"tiny.{request.param}.gguf")
    return write_tiny_gguf(path, "qwen3", matrix_type=request.param, **SHAPE)


def test_the_file_runs_on_block_kernels_and_follows_the_reference(low_bit_file):
    use_tinygrad_from_this_thread()
    steps = load_steps(low_bit_file, slots=2, context=64)
    if Device.DEFAULT == "CPU":
        assert isinstance(steps.model.head.linear, BlockLinear) and all(isinstance(b.qkv, BlockLinear) for b in steps.model.blocks)
    expected = Reference(low_bit_file).logits(PROMPT + [42])
    got = np.stack([steps.prefill(PROMPT, slot=0, start=0), steps.decode([42], [0], [len(PROMPT)])[0]])
    for row, reference in zip(got, expected[len(PROMPT) - 1 :], strict=True):
        scale = np.abs(reference).max()
        assert np.abs(row - reference).max() < 0.03 * scale
        # the reference's top token, or one tied with it within the int8 activations' rounding (the
        # Q2_K file's two best differ by 3e-4 of the scale)
        assert reference[np.argmax(row)] > reference.max() - 1e-3 * scale


def test_without_the_kernels_a_file_they_alone_read_is_refused_by_name(low_bit_file):
    """tinygrad's float16 path dequantizes IQ4_XS but not Q2_K or Q3_K: off the kernels, those files stop
    at load with the tensor and its type named, not deep inside tinygrad."""
    if "IQ4_XS" in low_bit_file:
        pytest.skip("tinygrad reads IQ4_XS")
    with pytest.raises(ModelLoadError, match=r"tensor 'output.weight' is stored as Q[23]_K, which only the CPU kernels read"):
        load_model(low_bit_file, slots=1, context=32, cpu_kernels=False)


def test_a_server_answers_the_openai_client_with_it(low_bit_file):
    with tiny_engine_server(low_bit_file, slots=2, queue_limit=2) as (engine, srv):
        assert get(srv, "/health")[0] == 200
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="low", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
        client.close()
