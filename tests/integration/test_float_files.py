"""F32, F16 and BF16 files on the CPU kernels: their matrices stay in the file's bytes (an F16 or BF16
download is not copied a second time as float16), multiply against the activations as floats, and
follow the float64 reference as closely as float32 sums allow; a served F16 file answers the openai
client. A float matrix whose rows are not whole 32-value blocks keeps tinygrad's float16 copy."""

import logging

import numpy as np
import openai
import pytest
from support import tiny_engine_server
from support.tiny_models import Reference, load_steps, write_tiny_gguf
from tinygrad import Device, Tensor, dtypes

from webapp.engine.kernels.cpu import QuantizedCPU
from webapp.engine.model.gguf import read_gguf
from webapp.engine.model.steps import OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.weights import BlockLinear, FloatLinear

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 77, 88, 99, 1234, 5]
on_kernels = pytest.mark.skipif(Device.DEFAULT != "CPU", reason="the CPU kernels' path")


def _matches_the_reference(steps, path: str, tolerance: float) -> None:
    expected = Reference(path).logits(PROMPT + [42])
    np.testing.assert_allclose(steps.prefill(PROMPT, slot=0, start=0), expected[len(PROMPT) - 1], atol=tolerance, rtol=tolerance)
    got = steps.decode([42], slots=[0], positions=[len(PROMPT)])[0]
    np.testing.assert_allclose(got, expected[len(PROMPT)], atol=tolerance, rtol=tolerance)


@on_kernels
def test_an_f16_files_matrices_embedding_and_tied_head_stay_in_its_bytes(tmp_path, caplog):
    """Every matrix of a tied F16 file is its own bytes on the kernels: no float16 copy anywhere, the
    head the embedding's very tensor, a step one call; and the logits are the reference's."""
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "f16.gguf"), "qwen3", matrix_type="F16", tied=True)
    with caplog.at_level(logging.INFO, logger="webapp.engine.model"):
        steps = load_steps(path, slots=2, context=64)
    model = steps.model
    assert isinstance(steps, OneCallSteps)
    products = [m for b in model.blocks for m in (b.qkv, b.attn_output, b.ffn.gate_up, b.ffn.down)]
    assert all(isinstance(m, BlockLinear) and m.weight.type_name == "F16" for m in products)
    assert model.head.weight is model.embed.weight and model.embed.weight.type_name == "F16"
    weights = [t for b in model.blocks for t in b.tensors()[:4]] + model.embed.tensors() + model.head.tensors()
    assert all(t.dtype == dtypes.uint8 for t in weights)
    _, table = read_gguf(path)
    o = table["blk.1.attn_output.weight"]
    np.testing.assert_array_equal(model.blocks[1].attn_output.weight.raw.numpy(), o.data)  # the file's bytes, not repacked
    assert "F16 (the file's bytes)" in caplog.text and "float16" not in caplog.text.split("weights:")[-1]
    _matches_the_reference(steps, path, 1e-3)


@on_kernels
@pytest.mark.parametrize(("arch", "matrix_type"), [("llama", "BF16"), ("qwen2", "F32"), ("qwen3", "BF16")])
def test_bf16_and_f32_files_match_the_float64_reference(tmp_path, arch, matrix_type):
    """llama's q and k rows regrouped from the file's bytes, qwen2's biases, qwen3's q/k norms; the
    weights exact, the activations float32: float32 sums apart from float64."""
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "m.gguf"), arch, matrix_type=matrix_type)
    steps = load_steps(path, slots=2, context=64)
    assert isinstance(steps, OneCallSteps) and steps.model.blocks[0].qkv.weight.type_name == matrix_type
    _matches_the_reference(steps, path, 1e-3)


@on_kernels
def test_a_float_matrix_whose_rows_are_not_whole_blocks_keeps_tinygrads_float16_copy(tmp_path):
    """An FFN of 80: ffn_down's rows (80 values) are not whole 32-value blocks, so it alone is a float16
    copy (the reference rounds it alike) and its layers run as five kernels around tinygrad's product."""
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "odd.gguf"), "qwen3", matrix_type="F32", hidden=80)
    steps = load_steps(path, slots=2, context=64)
    block = steps.model.blocks[0]
    assert isinstance(block.ffn.down, FloatLinear) and isinstance(block.ffn.gate_up, BlockLinear)
    assert not isinstance(steps, OneCallSteps)
    _matches_the_reference(steps, path, 1e-3)


@on_kernels
@pytest.mark.parametrize("tokens", [1, 6])
def test_float_parts_stack_with_quantized_ones_and_fuse_the_norm_residual_and_swiglu(tokens):
    """A matrix stacked from F16, Q8_0 and BF16 parts multiplies as its parts do, the F16 and BF16 ones
    against the unrounded activations (after the rms norm, or silu(gate) * up), Q8_0 against int8."""
    from integration.test_kernels import int8_product, random_blocks

    use_tinygrad_from_this_thread()
    kernels = QuantizedCPU.load()
    rng = np.random.default_rng(tokens)
    cols, parts = 96, [(1, 40), (8, 16), (30, 37)]
    raws = [random_blocks(t, rows, cols, rng) for t, rows in parts]
    stacked = kernels.stacked_weight([(raw, t) for raw, (t, _) in zip(raws, parts)], cols)
    assert stacked.type_name == "F16+Q8_0+BF16"
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    residual = rng.standard_normal((tokens, 93)).astype(np.float32)
    gate_up = rng.standard_normal((tokens, 2 * cols)).astype(np.float32)
    normed = x / np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True) + 1e-6) * norm
    gate = gate_up[:, :cols].astype(np.float64)
    mixed = gate / (1 + np.exp(-gate)) * gate_up[:, cols:]

    def expected(inputs: np.ndarray) -> np.ndarray:
        return np.concatenate([int8_product(t, raw, inputs, cols) for raw, (t, _) in zip(raws, parts)], axis=1)

    got = {
        "norm": kernels.norm_linear(Tensor(x), stacked, Tensor(norm), 1e-6).numpy(),
        "residual": kernels.residual_linear(Tensor(x), stacked, Tensor(residual)).numpy() - residual,
        "swiglu": kernels.swiglu_linear(Tensor(gate_up), stacked, Tensor(residual)).numpy() - residual,
    }
    for name, inputs in (("norm", normed), ("residual", x), ("swiglu", mixed)):
        np.testing.assert_allclose(got[name], expected(inputs), rtol=1e-4, atol=1e-4, err_msg=name)


@on_kernels
def test_a_server_answers_the_openai_client_with_an_f16_file(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "served.f16.gguf"), "qwen3", matrix_type="F16", tied=True)
    with tiny_engine_server(path, slots=2, queue_limit=2) as (_, srv):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="f16", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
        client.close()
