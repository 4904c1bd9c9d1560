"""A file shaped like the most common download, Qwen3-1.7B in Q4_K_M, at its real widths (dim 2,048,
16 heads, 8 KV heads of 128, FFN 6,144, QK-norm, the tied embedding in Q6_K, attn_v and ffn_down in Q6_K
where llama-quantize puts them), two layers deep: it loaded into a segmentation fault before (the
Q6_K embedding and the stacked Q4_K q/k/v were copied with eight times their size). Now it loads,
its logits follow the float64 reference, and a real server answers the openai client with it."""

import numpy as np
import openai
import pytest
from support import get, tiny_engine_server
from support.tiny_models import Reference, load_steps, write_tiny_gguf

from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

QWEN3_1_7B = dict(dim=2048, hidden=6144, n_heads=16, n_kv_heads=8, head_dim=128)
PROMPT = [1, 504, 3458, 282, 4649, 314, 253]


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("k") / "qwen3-1.7b-shaped.Q4_K_M.gguf")
    return write_tiny_gguf(path, "qwen3", n_layers=2, matrix_type="Q4_K_M", tied=True, context=4096, **QWEN3_1_7B)


def test_the_real_shape_loads_and_follows_the_reference(q4_k_m_file):
    use_tinygrad_from_this_thread()
    steps = load_steps(q4_k_m_file, slots=2, context=128)
    expected = Reference(q4_k_m_file).logits(PROMPT + [42])
    got = np.stack([steps.prefill(PROMPT, slot=0, start=0), steps.decode([42], [0], [len(PROMPT)])[0]])
    want = expected[len(PROMPT) - 1 :]
    for row, reference in zip(got, want, strict=True):
        assert np.abs(row - reference).max() < 0.03 * np.abs(reference).max()
        assert np.argmax(row) == np.argmax(reference)


def test_a_server_answers_the_openai_client_with_it(q4_k_m_file):
    with tiny_engine_server(q4_k_m_file, slots=2, queue_limit=2) as (engine, srv):
        assert get(srv, "/health")[0] == 200
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="q4km", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
        completion = client.completions.create(model="q4km", prompt=PROMPT, max_tokens=3, temperature=0)
        assert completion.usage.prompt_tokens == len(PROMPT) and completion.usage.completion_tokens == 3
        client.close()
