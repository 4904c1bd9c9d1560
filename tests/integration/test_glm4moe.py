"""GLM-4.5's layers (glm4moe): q/k/v biases, a partial rotary, a dense first layer, then mixtures whose
router's sigmoid probabilities plus a selection bias choose the experts and the probabilities alone
weigh them (divided by their sum, times 2.5), beside an ungated shared expert; NextN blocks past the
trunk ignored. Against the float64 reference on every way of running a step, and end to end through
the openai client."""

import struct

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

from webapp.engine.kernels import abi
from webapp.engine.model.block import TransformerBlock
from webapp.engine.model.feed_forward import DenseFeedForward
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.routed import RoutedFeedForward
from webapp.engine.model.steps import KernelJitSteps, OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model

RNG = np.random.default_rng(12)
PROMPT = [int(t) for t in RNG.integers(2, 4000, 16)]
LONG = [int(t) for t in RNG.integers(2, 4000, 70)]
DENSE = 96  # the leading dense layer's width: another than the experts' (64)
# the float32 files' bound on the largest logit difference: three times other architectures' 1e-4, as
# these files' hidden states come near cancelling at a few positions, which magnifies float32
# rounding enough that the products' summation order alone moves them across 1e-4 (bench/RESULTS.md,
# 2026-12-07); a routing, norm or shared-expert mistake moves them by orders of magnitude more
F32_BOUND = 3e-4


@pytest.fixture(autouse=True)
def _tinygrad_here():
    use_tinygrad_from_this_thread()


def _file(tmp_path, matrix_type="F32", name="glm4moe.gguf", **kwargs) -> str:
    # float32 matrices: the kernels' products are then exact enough that no router near-tie flips an expert
    sizes = {"dim": 256, "hidden": 256, "experts": (8, 2, 256)} if matrix_type == "Q4_K_M" else {"hidden": DENSE, "experts": (8, 2, 64)}
    kwargs = {"n_layers": 3, "rotary_dim": 8, "nextn_layers": 1} | kwargs  # rotary: half of each head (16), as GLM-4.5's
    return write_tiny_gguf(str(tmp_path / name), "glm4moe", matrix_type=matrix_type, seed=4, **sizes, **kwargs)


@pytest.fixture(scope="module")
def glm4moe(tmp_path_factory):
    path = _file(tmp_path_factory.mktemp("glm4moe"))
    return path, Reference(path)


def test_in_one_call_the_model_matches_the_reference(glm4moe):
    path, ref = glm4moe
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, OneCallSteps)
    dense, *routed = steps.model.blocks  # the trunk's three: the NextN block is not a layer
    assert type(dense) is TransformerBlock and type(dense.ffn) is DenseFeedForward and dense.layer_tensors.matrices.down.cols == DENSE
    assert all(isinstance(b.ffn, RoutedFeedForward) and b.ffn.expert_blocks is not None and b.ffn.shared.gate is None for b in routed)
    F = abi.ExpertsFlag
    experts = routed[0].layer_tensors.experts
    assert experts.flags == F.NORM_WEIGHTS | F.SIGMOID | F.SELECTION_BIAS | F.SHARED_UNGATED and experts.weights_scale == 2.5
    assert experts.shared_ffn_dim == 64
    assert off_by(steps.score(PROMPT, slot=0, start=0), ref.logits(PROMPT)) < F32_BOUND
    # the NextN block's tensors are in the file and never read; the dense layer routes no token
    assert len(steps.model.blocks) == 3 and "blk.3.nextn.eh_proj.weight" in Reference(path).w
    routed_tokens = steps.model.routed_tokens()
    assert routed_tokens.shape == (2, 8) and (routed_tokens.sum(-1) == len(PROMPT) * 2).all()


def test_the_selection_bias_chooses_the_experts_and_the_probabilities_weigh_them(glm4moe):
    path, ref = glm4moe
    got = load_steps(path, slots=2, context=256).score(PROMPT, slot=0, start=0)
    ref.logits(PROMPT)
    unbiased = Reference(path)
    for i in (1, 2):
        del unbiased.w[f"blk.{i}.exp_probs_b.bias"]
    # the bias changes some token's choice, and so the logits
    chosen, _ = ref.routing(ref.ffn_inputs[1], "blk.1.")
    chosen_unbiased, _ = unbiased.routing(ref.ffn_inputs[1], "blk.1.")
    assert (np.sort(chosen, -1) != np.sort(chosen_unbiased, -1)).any(-1).sum() >= 2
    assert off_by(got, unbiased.logits(PROMPT)) > 0.05
    weighed_with_bias = Reference(path)
    weighed_with_bias.bias_weighs = True
    assert off_by(got, weighed_with_bias.logits(PROMPT)) > 0.05
    # and the other ingredients each matter: the scale, the division by the sum, the sigmoid, the shared expert
    for change in ({"weights_scale": 1.0}, {"norm_weights": False}, {"sigmoid": False}):
        other = Reference(path)
        for name, value in change.items():
            setattr(other, name, value)
        assert off_by(got, other.logits(PROMPT)) > 0.05, change
    without_shared = Reference(path)
    for i in (1, 2):
        del without_shared.w[f"blk.{i}.ffn_gate_shexp.weight"]
    assert off_by(got, without_shared.logits(PROMPT)) > 0.05


def test_a_long_prompt_in_chunks_matches(glm4moe):
    path, ref = glm4moe
    assert_chunked_prefill_matches(load_steps(path, slots=2, context=256), ref.logits(LONG), LONG, 16, 1e-4)


def test_tinygrad_routes_by_the_biased_sigmoid_beside_the_dense_layer(glm4moe):
    path, ref = glm4moe
    assert_tinygrad_path_matches(path, ref.logits(PROMPT + [42]), PROMPT, 42)


def test_five_kernels_around_a_product_without_one_match_the_reference(tmp_path):
    """The attention's output matrix without a kernel: the experts and the shared expert on tinygrad."""
    path = _file(tmp_path, float_matrices=("attn_output.weight",))
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, KernelJitSteps)
    assert off_by(steps.prefill(PROMPT, slot=0, start=0), Reference(path).logits(PROMPT)[-1]) < 0.02


def test_q_and_k_norms_softmax_routing_and_no_shared_expert_from_the_file(tmp_path):
    """GLM-4.5 (355B)'s q/k norms, expert_gating_func 1 (softmax) with no scale or division, two
    leading dense layers and no shared expert (expert_shared_count 0: routed experts alone)."""
    metadata = {"expert_gating_func": 1, "expert_weights_norm": False, "expert_weights_scale": 1.0}
    metadata |= {"leading_dense_block_count": 2, "expert_shared_count": 0}
    path = _file(tmp_path, qk_norm=True, metadata=metadata, nextn_layers=0)
    steps = load_steps(path, slots=2, context=256)
    assert steps.model.config.qk_norm and not steps.model.config.expert_sigmoid
    kinds = [(type(b).__name__, type(b.ffn).__name__, getattr(b.ffn, "shared", None)) for b in steps.model.blocks]
    assert kinds == [("TransformerBlock", "DenseFeedForward", None)] * 2 + [("TransformerBlock", "RoutedFeedForward", None)]
    assert off_by(steps.score(PROMPT, slot=0, start=0), Reference(path).logits(PROMPT)) < F32_BOUND


@pytest.mark.parametrize("matrix_type, tolerance", [("Q8_0", 0.05), ("Q4_K_M", 0.1)])
def test_quantized_files_match_the_reference_where_the_routers_choice_holds(tmp_path, matrix_type, tolerance):
    path = _file(tmp_path, matrix_type)
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, OneCallSteps)
    assert_matches_where_the_router_decides(steps.score(PROMPT, slot=0, start=0), Reference(path), PROMPT, tolerance)


@pytest.mark.parametrize("matrix_type", ["Q8_0", "Q4_K_M"])
def test_a_lane_is_the_same_alone_and_among_others_and_prefill_equals_decode(tmp_path, matrix_type):
    assert_a_lane_does_not_depend_on_the_others(load_steps(_file(tmp_path, matrix_type), slots=4, context=256), PROMPT, 4)


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"expert_group_count": 4, "expert_group_used_count": 2}, "expert_group_count = 4 .*group-limited"),
        ({"expert_gating_func": 3}, "expert_gating_func = 3"),
        ({"expert_weights_scale": float("inf")}, "expert_weights_scale = inf"),
        ({"expert_weights_norm": 1}, "expert_weights_norm = 1"),
        ({"leading_dense_block_count": 9}, "leading_dense_block_count = 9"),
        ({"nextn_predict_layers": 4}, "nextn_predict_layers = 4"),
    ],
)
def test_a_file_whose_routing_cannot_be_served_is_refused(tmp_path, metadata, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(_file(tmp_path, "Q8_0", metadata=metadata), slots=1, context=32)


def test_a_selection_bias_of_the_wrong_length_is_refused(tmp_path):
    path = _file(tmp_path, "Q8_0")
    data = bytearray(open(path, "rb").read())
    # the tensor's header entry: its name, then its dimension count (uint32 1) and length (uint64 8)
    name = b"blk.2.exp_probs_b.bias"
    at = data.index(name) + len(name)
    assert data[at : at + 12] == struct.pack("<IQ", 1, 8)
    data[at : at + 12] = struct.pack("<IQ", 1, 7)  # 7 numbers for 8 experts
    open(path, "wb").write(bytes(data))
    with pytest.raises(ModelLoadError, match="blk.2.exp_probs_b.bias' has shape 1 x 7; the file's metadata implies 1 x 8"):
        load_model(path, slots=1, context=32)


def test_the_server_answers_the_openai_client(tmp_path):
    with tiny_engine_server(_file(tmp_path, "Q8_0"), slots=2, queue_limit=2) as (engine, srv):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="glm4moe", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
        again = client.chat.completions.create(model="glm4moe", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
        assert again.choices[0].message.content == reply.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        client.close()
