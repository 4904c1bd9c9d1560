"""Qwen2-MoE's layers (qwen2moe): q/k/v biases, routed experts weighted by their probabilities as they
are, and a shared expert every token runs, scaled by sigmoid(its gate . n), against the float64
reference on every way of running a step, and end to end through the openai client."""

import numpy as np
import openai
import pytest
from support import tiny_engine_server
from support.tiny_models import (
    Reference,
    assert_a_lane_does_not_depend_on_the_others,
    assert_chunked_prefill_matches,
    assert_matches_where_the_router_decides,
    assert_tinygrad_path_matches,
    load_steps,
    off_by,
    write_tiny_gguf,
)

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.routed import RoutedFeedForward
from webapp.engine.model.steps import KernelJitSteps, OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model

RNG = np.random.default_rng(11)
PROMPT = [int(t) for t in RNG.integers(2, 4000, 16)]
LONG = [int(t) for t in RNG.integers(2, 4000, 70)]
SHARED = 96  # the shared expert's width: another than the routed experts' (64)


@pytest.fixture(autouse=True)
def _tinygrad_here():
    use_tinygrad_from_this_thread()


def _file(tmp_path, matrix_type="F32", name="qwen2moe.gguf", **kwargs) -> str:
    # float32 matrices: the kernels' products are then exact enough that no router near-tie flips an expert
    sizes = {"dim": 256, "hidden": 256, "experts": (8, 2, 256)} if matrix_type == "Q4_K_M" else {"hidden": SHARED, "experts": (8, 2, 64)}
    return write_tiny_gguf(str(tmp_path / name), "qwen2moe", n_layers=2, matrix_type=matrix_type, seed=3, **sizes, **kwargs)


@pytest.fixture(scope="module")
def qwen2moe(tmp_path_factory):
    path = _file(tmp_path_factory.mktemp("qwen2moe"))
    return path, Reference(path)


def test_in_one_call_the_model_matches_the_reference_and_the_shared_expert_matters(qwen2moe):
    path, ref = qwen2moe
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, OneCallSteps)
    blocks = steps.model.blocks
    assert all(isinstance(b.ffn, RoutedFeedForward) and b.ffn.shared is not None and b.ffn.expert_blocks is not None for b in blocks)
    assert all(b.layer_tensors.experts.shared_ffn_dim == SHARED and b.layer_tensors.experts.flags == 0 for b in blocks)
    got = steps.score(PROMPT, slot=0, start=0)
    assert off_by(got, ref.logits(PROMPT)) < 1e-4
    without_shared, ungated = Reference(path), Reference(path)
    for i in range(2):
        del without_shared.w[f"blk.{i}.ffn_gate_shexp.weight"]
        ungated.w[f"blk.{i}.ffn_gate_inp_shexp.weight"] *= 0  # sigmoid(0): every token's shared expert halved
    assert off_by(got, without_shared.logits(PROMPT)) > 0.1
    assert off_by(got, ungated.logits(PROMPT)) > 0.05


def test_a_long_prompt_in_chunks_matches(qwen2moe):
    path, ref = qwen2moe
    assert_chunked_prefill_matches(load_steps(path, slots=2, context=256), ref.logits(LONG), LONG, 16, 1e-4)


def test_tinygrad_runs_the_shared_expert_beside_the_masked_experts(qwen2moe):
    path, ref = qwen2moe
    assert_tinygrad_path_matches(path, ref.logits(PROMPT + [42]), PROMPT, 42)


def test_five_kernels_around_a_product_without_one_match_the_reference(tmp_path):
    """The attention's output matrix without a kernel: the experts and the shared expert on tinygrad."""
    path = _file(tmp_path, float_matrices=("attn_output.weight",))
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, KernelJitSteps)
    assert off_by(steps.prefill(PROMPT, slot=0, start=0), Reference(path).logits(PROMPT)[-1]) < 0.02


@pytest.mark.parametrize("matrix_type, tolerance", [("Q8_0", 0.05), ("Q4_K_M", 0.1)])
def test_quantized_files_match_the_reference_where_the_routers_choice_holds(tmp_path, matrix_type, tolerance):
    path = _file(tmp_path, matrix_type)
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, OneCallSteps)
    assert_matches_where_the_router_decides(steps.score(PROMPT, slot=0, start=0), Reference(path), PROMPT, tolerance)


@pytest.mark.parametrize("matrix_type", ["Q8_0", "Q4_K_M"])
def test_a_lane_is_the_same_alone_and_among_others_and_prefill_equals_decode(tmp_path, matrix_type):
    assert_a_lane_does_not_depend_on_the_others(load_steps(_file(tmp_path, matrix_type), slots=4, context=256), PROMPT, 4)


def test_a_file_without_its_shared_expert_is_refused(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "no-shexp.gguf"), "qwen3moe", n_layers=2, experts=(8, 2, 64))
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(data.replace(b"qwen3moe", b"qwen2moe")))  # a qwen3moe file renamed: no shared expert
    with pytest.raises(ModelLoadError, match="lacks tensors: blk.0.ffn_gate_inp_shexp.weight"):
        load_model(path, slots=1, context=32)


def test_the_server_answers_the_openai_client(tmp_path):
    with tiny_engine_server(_file(tmp_path, "Q8_0"), slots=2, queue_limit=2) as (engine, srv):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="qwen2moe", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
        again = client.chat.completions.create(model="qwen2moe", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
        assert again.choices[0].message.content == reply.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        client.close()
