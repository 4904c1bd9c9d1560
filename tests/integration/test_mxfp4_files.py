"""MXFP4 (gpt-oss's expert weights) on the CPU kernels and on tinygrad's path: matrices at gpt-oss's
widths (hidden 2880, each expert's feed-forward 2880), 3-D expert tensors stored expert by expert, and
a qwen3moe file quantized as llama-quantize's MXFP4_MOE (experts MXFP4, the rest Q8_0) against the
float64 reference. test_kernels.py checks the format's blocks, interleaving and batch invariance with
every other type's."""

import logging

import gguf
import numpy as np
import pytest
from support.tiny_models import (
    Reference,
    assert_a_lane_does_not_depend_on_the_others,
    assert_tinygrad_path_matches,
    assert_top1_where_float64_decides,
    load_steps,
    write_tiny_gguf,
)
from test_kernels import assert_rows_are_their_blocks_product, dequantize, interleaved_type, random_blocks
from tinygrad import Tensor
from tinygrad.llm.gguf import ggml_data_to_tensor

from webapp.engine.kernels.abi import BlockType, Isa
from webapp.engine.kernels.cpu import QuantizedCPU
from webapp.engine.model.routed import RoutedFeedForward
from webapp.engine.model.steps import OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

MXFP4 = int(BlockType.MXFP4)
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 77, 88, 99, 1234, 5]
EXPERTS = (8, 2, 32)  # count, used a token, each one's width (tests/integration/test_moe.py's)


@pytest.fixture(autouse=True)
def _tinygrad_here():
    use_tinygrad_from_this_thread()


def _kernels() -> QuantizedCPU:
    kernels = QuantizedCPU.load()
    assert kernels is not None
    return kernels


@pytest.mark.parametrize(("rows", "cols"), [(2880, 2880), (2883, 2880)], ids=["gpt-oss 2880 x 2880", "rows not in eights"])
def test_a_matrix_at_gpt_oss_widths_multiplies_every_row_right(rows, cols):
    """Rows in eights run on the interleaved tiles, other counts on the row kernel; the picked rows
    (the last one too) match the float64 product of their blocks at one token and at five."""
    kernels, rng = _kernels(), np.random.default_rng(rows)
    raw = random_blocks(MXFP4, rows, cols, rng)
    weight = kernels.block_weight(raw, MXFP4, cols)
    assert weight.ggml_type == (interleaved_type(kernels.isa, MXFP4) if rows % 8 == 0 and kernels.isa != Isa.GENERIC else MXFP4)
    picked = np.unique(np.concatenate([rng.choice(rows, 60, replace=False), [rows - 1]]))
    for tokens in (1, 5):
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        assert_rows_are_their_blocks_product(kernels.linear(Tensor(x), weight).numpy(), x, raw, MXFP4, picked, cols)


def test_an_expert_tensor_is_stored_expert_by_expert_and_each_multiplies_as_its_blocks():
    """gpt-oss's ffn_*_exps shape cut to four experts: repacked one expert at a time, the whole tensor
    then multiplies as the experts' matrices one over the other."""
    kernels, rng = _kernels(), np.random.default_rng(4)
    experts, rows, cols = 4, 2880, 2880
    raw = random_blocks(MXFP4, experts * rows, cols, rng)
    weight = kernels.expert_weight(raw, MXFP4, cols, experts)
    assert (weight.rows, weight.cols) == (experts * rows, cols) and weight.type_name == "MXFP4"
    x = rng.standard_normal((2, cols)).astype(np.float32)
    got = kernels.linear(Tensor(x), weight).numpy()
    for e in range(experts):
        assert_rows_are_their_blocks_product(got, x, raw, MXFP4, e * rows + np.array([0, 7, 8, 1001, rows - 1]), cols)


def test_tinygrads_dequantization_matches_the_reference():
    """The path every other device takes (tinygrad's gguf code) reads MXFP4 as the kernels do."""
    raw = random_blocks(MXFP4, 6, 96, np.random.default_rng(6))
    got = ggml_data_to_tensor(Tensor(raw.reshape(-1)), raw.size // 17 * 32, MXFP4).reshape(6, 96).numpy()
    np.testing.assert_allclose(got, dequantize(MXFP4, raw, 96), rtol=1e-6, atol=0)
    np.testing.assert_allclose(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(6, 96), got, rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("mxfp4") / "moe.MXFP4_MOE.gguf")
    return write_tiny_gguf(path, "qwen3moe", experts=EXPERTS, matrix_type="MXFP4_MOE", seed=3)


def test_a_qwen3moe_file_with_mxfp4_experts_runs_them_in_their_blocks_and_follows_the_reference(moe_file, caplog):
    with caplog.at_level(logging.INFO, logger="webapp.engine.model.transformer"):
        steps = load_steps(moe_file, slots=2, context=64)
    assert isinstance(steps, OneCallSteps)
    assert all(isinstance(b.ffn, RoutedFeedForward) and b.ffn.expert_blocks is not None for b in steps.model.blocks)
    assert "MXFP4 blocks (experts)" in caplog.text and "float16" not in caplog.text.split("weights:")[-1]
    ref = Reference(moe_file)
    want, got = ref.logits(PROMPT), steps.score(PROMPT, slot=0, start=0)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    assert_top1_where_float64_decides(got, want)


def test_the_same_file_on_tinygrads_path_follows_the_reference(moe_file):
    expected = Reference(moe_file).logits(PROMPT + [42])
    assert_tinygrad_path_matches(moe_file, expected, PROMPT, 42, tolerance=2e-3)


def test_a_tokens_numbers_through_mxfp4_experts_do_not_depend_on_the_other_lanes(moe_file):
    """Bit for bit: a sequence decoded alone, and among seven others that share its experts or not."""
    assert_a_lane_does_not_depend_on_the_others(load_steps(moe_file, slots=8, context=64), PROMPT, 8)
