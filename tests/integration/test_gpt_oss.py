"""gpt-oss's layers (attention sinks, every other layer a sliding window, q/k/v and output biases, a
mixture of experts with biased router and experts and the clamped SwiGLU) against the float64
reference on every way of running a step, past the window and the local layers' rings, and end to
end through the openai client."""

import numpy as np
import openai
import pytest
from support import tiny_engine_server
from support.tiny_models import (
    Reference,
    assert_a_lane_does_not_depend_on_the_others,
    assert_chunked_prefill_matches,
    assert_tinygrad_path_matches,
    load_steps,
    logits_without_windows,
    off_by,
    write_tiny_gguf,
)

from webapp.engine.kernels.abi import AttendFlag, LayerForm
from webapp.engine.model.steps import KernelJitSteps, OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

WINDOW = 5
RNG = np.random.default_rng(5)
PROMPT = [int(t) for t in RNG.integers(2, 4000, 20)]
LONG = [int(t) for t in RNG.integers(2, 4000, 300)]  # past a local layer's 256-position ring


@pytest.fixture(autouse=True)
def _tinygrad_here():
    use_tinygrad_from_this_thread()


def _file(tmp_path, matrix_type="F32", name="gpt-oss.gguf", **kwargs) -> str:
    # float32 matrices: the kernels' products are then exact enough that no router near-tie flips an expert
    return write_tiny_gguf(
        str(tmp_path / name), "gpt-oss", n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, experts=(8, 2, 64),
        sliding_window=WINDOW, context=4096, matrix_type=matrix_type, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = _file(tmp_path_factory.mktemp("gpt-oss"))
    return path, Reference(path)


def test_in_one_call_the_model_matches_the_reference_and_sinks_and_window_matter(gpt_oss):
    path, ref = gpt_oss
    steps = load_steps(path, slots=2, context=1024)
    assert isinstance(steps, OneCallSteps)
    blocks = steps.model.blocks
    assert [b.window for b in blocks] == [WINDOW, 0, WINDOW, 0]
    assert all(b.attend_flags & AttendFlag.SINKS for b in blocks)
    assert all(b.layer_tensors.form == LayerForm.BIASES | LayerForm.SWIGLU_CLAMPED for b in blocks)
    got = steps.score(PROMPT, slot=0, start=0)
    assert off_by(got, ref.logits(PROMPT)) < 1e-4
    without_sinks = Reference(path)
    for i in range(4):
        del without_sinks.w[f"blk.{i}.attn_sinks.weight"]
    assert off_by(got, without_sinks.logits(PROMPT)) > 0.1
    assert off_by(got, logits_without_windows(path, PROMPT)) > 0.1  # every layer global: another model


def test_a_long_prompt_in_chunks_wraps_the_rings_and_still_matches(gpt_oss):
    path, ref = gpt_oss
    assert_chunked_prefill_matches(load_steps(path, slots=2, context=1024), ref.logits(LONG), LONG, 32, 1e-4)


def test_tinygrad_runs_sinks_biases_and_the_clamped_experts(gpt_oss):
    path, ref = gpt_oss
    assert_tinygrad_path_matches(path, ref.logits(PROMPT + [42]), PROMPT, 42)


def test_five_kernels_around_a_product_without_one_match_the_reference(tmp_path):
    """The attention's output matrix without a kernel: its bias added by tinygrad, the experts on tinygrad."""
    path = _file(tmp_path, float_matrices=("attn_output.weight",))
    steps = load_steps(path, slots=2, context=512)
    assert isinstance(steps, KernelJitSteps)
    assert off_by(steps.prefill(PROMPT, slot=0, start=0), Reference(path).logits(PROMPT)[-1]) < 0.02


def test_experts_in_mxfp4_as_the_downloads_store_them_match_the_reference(tmp_path):
    """llama-quantize's MXFP4_MOE mix (the experts in MXFP4, every other matrix in Q8_0), in one call:
    position by position, as 8-bit activations can flip a router's near-tie (another expert: a far
    other output) at a position or two of twenty."""
    path = _file(tmp_path, "MXFP4_MOE")
    steps = load_steps(path, slots=2, context=512)
    assert isinstance(steps, OneCallSteps)
    got, want = steps.score(PROMPT, slot=0, start=0), Reference(path).logits(PROMPT)
    off = np.abs(got - want).max(-1) / np.abs(want).max()
    assert np.mean(off < 0.1) >= 0.9, off  # 4-bit experts: ~0.05 off where the choice holds


@pytest.mark.parametrize("matrix_type", ["Q8_0", "MXFP4_MOE"])
def test_a_lane_is_the_same_alone_and_among_others_in_blocks(tmp_path, matrix_type):
    """Bit for bit: a sequence decoded alone and among three others (other experts, other positions)."""
    assert_a_lane_does_not_depend_on_the_others(load_steps(_file(tmp_path, matrix_type), slots=4, context=512), PROMPT, 4)


def test_the_server_answers_the_openai_client(tmp_path):
    with tiny_engine_server(_file(tmp_path, "Q8_0"), slots=2, queue_limit=2) as (engine, srv):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="oss", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
        again = client.chat.completions.create(model="oss", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
        assert again.choices[0].message.content == reply.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        client.close()
