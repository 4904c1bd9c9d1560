"""OLMo 2's and EXAONE 4's layers read the residual stream without input norms (the kernels'
UNNORMED_INPUTS form), their only norms their sublayers' outputs' and q/k's: against the float64
reference in one call and with a matrix outside the kernels (five kernels a layer, the norms skipped
there too); the same file read as if it had input norms is another model, much further off. EXAONE
4's 32B alone (64 layers) has sliding windows and global layers without RoPE."""

import numpy as np
import pytest
from support.tiny_models import Reference, load_steps, off_by, write_tiny_gguf

from webapp.engine.kernels.abi import LayerForm
from webapp.engine.model.steps import KernelJitSteps, OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

PROMPT = [int(t) for t in np.random.default_rng(7).integers(2, 4000, 16)]


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    use_tinygrad_from_this_thread()
    return write_tiny_gguf(str(tmp_path_factory.mktemp("olmo2") / "olmo2.gguf"), "olmo2", matrix_type="Q8_0")


def _with_input_norms(ref: Reference) -> Reference:
    ref.w |= {f"blk.{i}.{name}": np.ones(64) for i in range(ref.n_layers) for name in ("attn_norm.weight", "ffn_norm.weight")}
    return ref


def test_one_call_reads_the_stream_unnormed(olmo2):
    steps = load_steps(olmo2, slots=2, context=256)
    assert isinstance(steps, OneCallSteps)
    assert all(b.layer_tensors.form & LayerForm.UNNORMED_INPUTS and b.layer_tensors.attn_norm is None for b in steps.model.blocks)
    got = steps.score(PROMPT, slot=0, start=0)
    ours = off_by(got, Reference(olmo2).logits(PROMPT))
    assert ours < 0.03  # Q8_0's int8-rounded activations
    assert off_by(got, _with_input_norms(Reference(olmo2)).logits(PROMPT)) > 3 * ours


def test_five_kernels_a_layer_read_it_unnormed_too(tmp_path):
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "olmo2.gguf"), "olmo2", matrix_type="Q8_0", float_matrices=("ffn_down.weight",))
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, KernelJitSteps) and steps.model.blocks[0].layer_tensors is None
    assert off_by(steps.score(PROMPT, slot=0, start=0), Reference(path).logits(PROMPT)) < 0.03


def test_exaone4_32b_layers_are_windowed_and_its_global_ones_unrotated(tmp_path):
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "exaone4.gguf"), "exaone4", n_layers=64, dim=32, hidden=64, matrix_type="F32")
    steps = load_steps(path, slots=2, context=256)
    config = steps.model.config
    assert [config.window(i) for i in range(4)] == [4, 4, 4, 0] and [config.rotates(i) for i in range(4)] == [True, True, True, False]
    ref = Reference(path)
    got = steps.score(PROMPT, slot=0, start=0)
    ours = off_by(got, ref.logits(PROMPT))
    assert ours < 1e-3
    ref.no_rope_every = 0  # every layer rotated: another model
    assert off_by(got, ref.logits(PROMPT)) > 3 * ours


def test_exaone4_other_sizes_have_neither(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "exaone4.gguf"), "exaone4", n_layers=30, dim=32, hidden=64, matrix_type="F32")
    config = load_steps(path, slots=1, context=64).model.config
    assert all(config.window(i) == 0 and config.rotates(i) for i in range(30))
