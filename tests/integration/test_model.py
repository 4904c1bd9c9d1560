"""The tinygrad transformer against a float64 NumPy reference, on tiny random GGUFs of each architecture."""

import os
import subprocess
import sys

import numpy as np
import pytest
from support import ROOT
from support.tiny_models import Reference, load_steps, off_by, write_tiny_gguf
from tinygrad import Device, dtypes

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.steps import OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model
from webapp.engine.model.weights import BlockLinear

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 77, 88, 99, 1234, 5]


# (architecture, KV cache type, how the file is written and loaded, logits' tolerance against the
# reference): each architecture with the float16 cache; the 8-bit cache on each way a step runs (one
# call, a layer as five kernels, tinygrad's kernels), with heads of 32 values (a Q8_0 block). The
# reference rounds keys and values as the cache does; on tinygrad's path, whose float16 products are
# already 0.003 off it with the float16 cache, a key near a Q8_0 rounding boundary may land a step
# away (0.006 measured)
EIGHT_BIT_HEADS = {"n_heads": 2, "n_kv_heads": 1}
MATRICES = ("attn_qkv.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight")
MATRICES += ("ffn_up.weight", "ffn_down.weight", "output.weight")
TINY_MODELS = {
    "llama": ("llama", "f16", {}, 1e-3),
    "qwen2": ("qwen2", "f16", {}, 1e-3),
    "qwen3": ("qwen3", "f16", {}, 1e-3),
    "qwen3moe": ("qwen3moe", "f16", {"experts": (8, 2, 32)}, 1e-3),
    "smollm3": ("smollm3", "f16", {"n_layers": 4}, 1e-3),  # four layers: its fourth has no RoPE
    "phi3": ("phi3", "f16", {}, 1e-3),  # q, k, v and gate, up fused
    "qwen3-q8_0-one-call": ("qwen3", "q8_0", EIGHT_BIT_HEADS, 1e-3),
    "llama-q8_0-five-kernels": ("llama", "q8_0", EIGHT_BIT_HEADS | {"float_matrices": ("attn_output.weight",)}, 1e-3),
    "qwen3moe-q8_0-one-call": ("qwen3moe", "q8_0", EIGHT_BIT_HEADS | {"experts": (8, 2, 32)}, 1e-3),
    "qwen2-q8_0-tinygrad": ("qwen2", "q8_0", EIGHT_BIT_HEADS | {"float_matrices": MATRICES, "cpu_kernels": False}, 0.015),
}


@pytest.fixture(scope="module", params=list(TINY_MODELS))
def tiny_steps_and_reference(request, tmp_path_factory):
    """A tiny random-weight model behind its steps (TINY_MODELS), its float64 reference and the tolerance."""
    use_tinygrad_from_this_thread()
    arch, kv_type, options, atol = TINY_MODELS[request.param]
    options = dict(options)
    cpu_kernels = options.pop("cpu_kernels", True)
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("m") / f"{arch}.gguf"), arch, **options)
    steps = load_steps(path, slots=3, context=64, kv_type=kv_type, cpu_kernels=cpu_kernels)
    return steps, Reference(path, kv_type), atol


def test_prefill_and_decode_match_float64_reference(tiny_steps_and_reference):
    steps, ref, atol = tiny_steps_and_reference
    expected = ref.logits(PROMPT + [42, 7])
    got = steps.prefill(PROMPT, slot=0, start=0)
    np.testing.assert_allclose(got, expected[len(PROMPT) - 1], atol=atol, rtol=1e-3)
    got = steps.decode([42], slots=[0], positions=[len(PROMPT)])[0]
    np.testing.assert_allclose(got, expected[len(PROMPT)], atol=atol, rtol=1e-3)
    got = steps.decode([7], slots=[0], positions=[len(PROMPT) + 1])[0]
    np.testing.assert_allclose(got, expected[len(PROMPT) + 1], atol=atol, rtol=1e-3)


def test_chunked_prefill_equals_single_chunk(tiny_steps_and_reference):
    steps, _, _ = tiny_steps_and_reference
    whole = steps.prefill(PROMPT, slot=1, start=0)
    for start in range(0, len(PROMPT), 5):
        chunked = steps.prefill(PROMPT[start : start + 5], slot=2, start=start)
    np.testing.assert_allclose(chunked, whole, atol=1e-4, rtol=1e-4)


def test_lanes_at_different_positions_and_slots_match_their_own_sequences(tiny_steps_and_reference):
    steps, ref, atol = tiny_steps_and_reference
    prompts = [PROMPT[:3], PROMPT[:9]]
    for slot, prompt in enumerate(prompts):
        steps.prefill(prompt, slot=slot, start=0)
    got = steps.decode([11, 12], slots=[0, 1], positions=[3, 9])
    for row, prompt, token in zip(got, prompts, [11, 12]):
        np.testing.assert_allclose(row, ref.logits(prompt + [token])[-1], atol=atol, rtol=1e-3)


def test_a_copied_prefix_continues_like_the_source_sequence(tiny_steps_and_reference):
    steps, ref, atol = tiny_steps_and_reference
    steps.prefill(PROMPT, slot=0, start=0)
    steps.prefill([9, 9, 9, 9], slot=2, start=0)  # stale rows the copy must overwrite
    steps.copy_prefix(0, 2, len(PROMPT) - 2)
    got = steps.prefill(PROMPT[-2:], slot=2, start=len(PROMPT) - 2)
    np.testing.assert_allclose(got, ref.logits(PROMPT)[-1], atol=atol, rtol=1e-3)
    got = steps.decode([42], slots=[2], positions=[len(PROMPT)])[0]
    np.testing.assert_allclose(got, ref.logits(PROMPT + [42])[-1], atol=atol, rtol=1e-3)


def test_quantized_file_gets_an_int8_head_close_to_the_reference(tmp_path):
    use_tinygrad_from_this_thread()
    # 7: mostly Q8_0; the head in F64, which no kernel reads, is on tinygrad's
    path = write_tiny_gguf(str(tmp_path / "q8.gguf"), "llama", file_type=7, float_matrices=("output.weight",))
    steps = load_steps(path, slots=1, context=64)
    assert steps.model.head.w.dtype == dtypes.int8
    expected = Reference(path).logits(PROMPT)[-1]
    got = steps.prefill(PROMPT, slot=0, start=0)
    # int8 rounding of each head row, not exactness: measured 0.03 at most on logits up to 4.2
    np.testing.assert_allclose(got, expected, atol=0.05)
    assert set(np.argsort(got)[-5:]) == set(np.argsort(expected)[-5:])
    assert np.argmax(got) == np.argmax(expected)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_layer_with_a_matrix_no_kernel_reads_runs_beside_whole_layer_kernels(tmp_path, arch):
    """Layer 1's k in F64: it runs as five kernels with tinygrad's product among them, layer 0 as one
    whole-layer kernel (tq_layer), in the same step; both agree with the float64 reference."""
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "mixed.gguf"), arch, matrix_type="Q8_0", float_matrices=("blk.1.attn_k.weight",))
    steps = load_steps(path, slots=1, context=64)
    assert [block.layer_tensors is not None for block in steps.model.blocks] == [True, False]
    expected = Reference(path).logits(PROMPT)[-1]
    got = steps.prefill(PROMPT, slot=0, start=0)
    assert np.argmax(got) == np.argmax(expected) and off_by(got, expected) < 0.05, off_by(got, expected)


def test_float_file_keeps_an_exact_float16_head(tmp_path):
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "f16.gguf"), "llama", file_type=1, float_matrices=("output.weight",))  # an F64 head
    steps = load_steps(path, slots=1, context=64)
    assert steps.model.head.w.dtype == dtypes.float16 and steps.model.head.scale is None


def test_unsupported_architecture_fails_with_a_clear_message(tmp_path):
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "mamba.gguf"), "mamba")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'"):
        load_model(path, slots=1, context=32)


def test_garbage_file_fails_with_a_clear_message(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ModelLoadError, match="cannot parse"):
        load_model(str(path), slots=1, context=32)


def test_a_truncated_file_names_the_tensor_that_runs_past_its_end(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "cut.gguf"), "qwen3", matrix_type="Q4_1")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    with pytest.raises(ModelLoadError, match="past the file's end"):
        load_model(path, slots=1, context=32)


@pytest.mark.parametrize(
    ("arch", "matrix_type", "float_matrices"),
    [
        ("qwen2", "Q4_0", ()),
        ("qwen2", "Q4_1", ()),
        ("qwen2", "Q8_0", ()),
        ("qwen3", "Q4_1", ()),
        ("qwen2", "Q8_0", ("attn_output.weight", "ffn_down.weight")),  # a layer of five kernels, two of tinygrad's
    ],
)
def test_quantized_matrices_run_on_block_kernels_close_to_the_reference(tmp_path, arch, matrix_type, float_matrices):
    """On the CPU, layer matrices and the head stay in the file's blocks; activations are rounded to int8
    (as llama.cpp rounds them for each format), so logits are close to the float64 reference, not equal. A model whose matrices are
    all in blocks runs a step as one kernel; a layer with a float matrix, as five kernels around
    tinygrad's product."""
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "q.gguf"), arch, matrix_type=matrix_type, float_matrices=float_matrices)
    steps = load_steps(path, slots=3, context=64)
    if Device.DEFAULT == "CPU":
        assert isinstance(steps.model.blocks[0].qkv, BlockLinear) and isinstance(steps.model.head.linear, BlockLinear)
        assert (steps.model.blocks[0].layer_tensors is None) == bool(float_matrices)
        assert isinstance(steps, OneCallSteps) != bool(float_matrices)  # else a step is one kernel
    _check_against_the_reference(steps, path)


@pytest.mark.parametrize(
    ("arch", "matrix_type", "tied"),
    [
        ("llama", "Q4_K", False),
        ("qwen3", "Q6_K", False),
        ("qwen3", "Q4_K_M", True),
        ("llama", "Q4_K_M", False),
        ("qwen3", "Q5_K", False),
        ("llama", "Q5_K_M", True),
    ],
)
def test_k_quant_files_run_on_block_kernels_close_to_the_reference(tmp_path, arch, matrix_type, tied):
    """Q4_K, Q5_K and Q6_K matrices (256 values a block), and Q4_K_M and Q5_K_M files' mixes of them:
    every layer matrix and the head in their blocks, the layers whose v differs from q and k in type
    included."""
    use_tinygrad_from_this_thread()
    shape = dict(n_layers=3, dim=256, hidden=512, n_heads=4, n_kv_heads=2)
    path = write_tiny_gguf(str(tmp_path / "k.gguf"), arch, matrix_type=matrix_type, tied=tied, **shape)
    steps = load_steps(path, slots=3, context=64)
    if Device.DEFAULT == "CPU":
        assert isinstance(steps.model.head.linear, BlockLinear) and all(isinstance(b.qkv, BlockLinear) for b in steps.model.blocks)
        assert isinstance(steps, OneCallSteps)  # a step is one call, mixed q/k/v types and all
    _check_against_the_reference(steps, path)


def _check_against_the_reference(steps, path: str) -> None:
    expected = Reference(path).logits(PROMPT + [42])
    got = steps.prefill(PROMPT, slot=0, start=0)
    scale, last = np.abs(expected).max(), expected[len(PROMPT) - 1]
    assert np.abs(got - last).max() < 0.03 * scale
    # our top-1 is the reference's, or ties it within the rounding (these random fixtures have near-ties)
    assert last[np.argmax(got)] >= last.max() - 0.03 * scale
    got = steps.decode([42], slots=[0], positions=[len(PROMPT)])[0]
    assert np.abs(got - expected[len(PROMPT)]).max() < 0.03 * scale
    # chunked prefill and decode lanes see exactly the numbers a single chunk does
    whole = steps.prefill(PROMPT, slot=1, start=0)
    for start in range(0, len(PROMPT), 5):
        chunked = steps.prefill(PROMPT[start : start + 5], slot=1, start=start)
    np.testing.assert_allclose(chunked, whole, atol=1e-4, rtol=1e-4)
    # prompt scoring: every position's logits, the last one's as prefill gives it (in one call on the
    # kernels' whole step, bit for bit; tinygrad's product rounds per shape)
    scored = steps.score(PROMPT, slot=1, start=0)
    assert scored.shape == (len(PROMPT), len(got))
    np.testing.assert_allclose(
        scored[-1], whole, atol=0 if isinstance(steps, OneCallSteps) else 1e-4, rtol=0 if isinstance(steps, OneCallSteps) else 1e-4
    )
    # a prefix copied by tinygrad's kernels is there for the next step, which may run outside its queue
    steps.prefill([9] * len(PROMPT), slot=0, start=0)
    steps.copy_prefix(1, 0, len(PROMPT))
    copied, source = (steps.decode([42], slots=[s], positions=[len(PROMPT)])[0] for s in (0, 1))
    np.testing.assert_array_equal(copied, source)
    assert steps.mixes == (isinstance(steps, OneCallSteps))
    if steps.mixes:  # prompt chunks and a decode step as one call: each lane as in its own call
        chunks_alone = [steps.prefill(PROMPT[:7], slot=0, start=0), steps.prefill([7, 8], slot=2, start=0)]
        firsts, rows = steps.prefill_and_decode([(PROMPT[:7], 0, 0), ([7, 8], 2, 0)], [42], [1], [len(PROMPT)])
        for got, alone in zip(firsts, chunks_alone, strict=True):
            np.testing.assert_array_equal(got, alone)
        np.testing.assert_array_equal(rows[0], source)
        # and drafted lanes beside them, each token as a verification of its own gives it
        lane = [42, 5, 6]
        alone = steps.verify([lane], [1], [len(PROMPT)])[0]
        firsts, lanes = steps.prefill_and_verify([(PROMPT[:7], 0, 0), ([7, 8], 2, 0)], [lane], [1], [len(PROMPT)])
        for got, chunk in zip(firsts, chunks_alone, strict=True):
            np.testing.assert_array_equal(got, chunk)
        np.testing.assert_array_equal(lanes[0], alone)
        np.testing.assert_array_equal(alone[0], source)


def test_importing_the_model_changes_nothing_until_prepare_tinygrad_is_called():
    """In a fresh interpreter: the import leaves the environment and tinygrad's wait alone; the one
    explicit call sets HCQ2 and installs our wait, and calling it again changes nothing."""
    script = """
import os
os.environ.pop("HCQ2", None)
from webapp.engine.model.tinygrad_setup import prepare_tinygrad, _wait_without_spinning
prepare_tinygrad()
assert os.environ["HCQ2"] == "1"
from tinygrad.runtime.support.hcq2 import HCQ2Compiled
assert HCQ2Compiled._wait_signal is _wait_without_spinning
prepare_tinygrad()
assert HCQ2Compiled._wait_signal is _wait_without_spinning
"""
    untouched = """
import os
os.environ.pop("HCQ2", None)
import webapp.engine.model.transformer
from tinygrad.runtime.support.hcq2 import HCQ2Compiled
from webapp.engine.model.tinygrad_setup import _wait_without_spinning
assert "HCQ2" not in os.environ and HCQ2Compiled._wait_signal is not _wait_without_spinning
"""
    on_amd = """
import os
os.environ.pop("HCQ2", None)
os.environ["DEV"] = "AMD"
from webapp.engine.model.tinygrad_setup import prepare_tinygrad, _signal_wait_without_spinning
prepare_tinygrad()
assert "HCQ2" not in os.environ  # under it, tinygrad's AMD backend imports a module its wheel lacks
import tinygrad.runtime.ops_amd
from tinygrad.runtime.support.hcq import HCQSignal
assert HCQSignal.wait is _signal_wait_without_spinning
"""
    for code in (script, untouched, on_amd):
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("matrix_type", ["Q4_1", "Q8_0", None])
def test_read_gguf_reads_what_gguf_and_tinygrad_read(tmp_path, matrix_type):
    from gguf import GGUFReader
    from tinygrad.llm.gguf import gguf_load

    from webapp.engine.model.gguf import read_gguf

    path = write_tiny_gguf(str(tmp_path / "t.gguf"), "qwen2", matrix_type=matrix_type)
    metadata, table = read_gguf(path)
    expected, _ = gguf_load(path)
    assert metadata.keys() == expected.keys()
    for key, value in expected.items():
        assert metadata[key] == value or isinstance(value, bytes), key  # tinygrad reads uint8 as bytes
    tensors = GGUFReader(path).tensors
    assert set(table) == {t.name for t in tensors}
    for tensor in tensors:
        raw = table[tensor.name]
        if len(tensor.shape) == 2:
            assert (raw.ggml_type, raw.cols, raw.rows) == (int(tensor.tensor_type), *map(int, tensor.shape))
        if raw.data is not None:  # a type with a kernel, or a float32 vector
            np.testing.assert_array_equal(raw.data.reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))
    layer_blocks = [raw.data is not None for name, raw in table.items() if name.startswith("blk.") and raw.rows > 1]
    assert all(layer_blocks)  # Q4_1, Q8_0 and F32 (None) all have kernels


def test_the_start_up_log_says_how_steps_run_and_whether_make_tune_can_change_them(tmp_path, caplog):
    """One strategy per way of running a step, chosen once at load; only steps that run tinygrad's
    kernels are offered `make tune`."""
    import logging

    from webapp.engine.model.steps import KernelJitSteps, TinygradJitSteps
    from webapp.engine.serving.loader import load_gguf_model

    use_tinygrad_from_this_thread()
    blocks = write_tiny_gguf(str(tmp_path / "q.gguf"), "qwen2", matrix_type="Q8_0")
    mixed = write_tiny_gguf(str(tmp_path / "f.gguf"), "qwen2", matrix_type="Q8_0", float_matrices=("ffn_down.weight",))
    with caplog.at_level(logging.INFO, logger="webapp.engine"):
        plain = load_gguf_model(blocks, slots=1, max_context=32, prefill_chunk=8, cpu_kernels=False)
    assert isinstance(plain.runner.steps, TinygradJitSteps)
    assert "steps: jitted, on tinygrad" in caplog.text and "make tune` (once) BEAM-searches them" in caplog.text
    if Device.DEFAULT != "CPU":
        return
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="webapp.engine"):
        one = load_gguf_model(blocks, slots=1, max_context=32, prefill_chunk=8)
        one.runner.warm_up(logging.getLogger("webapp.engine.serving.runner").info)
    assert isinstance(one.runner.steps, OneCallSteps) and one.runner.beam == 0
    assert "steps: one call each on the CPU kernels (no tinygrad kernel in a step" in caplog.text
    assert "not tuned" not in caplog.text and "compiling" not in caplog.text
    assert isinstance(load_gguf_model(mixed, slots=1, max_context=32, prefill_chunk=8).runner.steps, KernelJitSteps)
