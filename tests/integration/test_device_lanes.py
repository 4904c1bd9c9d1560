"""tinygrad's decode step with its lanes' slots and positions as device tensors (model/lane_rows.py),
on tinygrad's CPU backend: the rows land where NumPy says and nowhere else, and a lane decodes the
same alone, beside others at other slots and positions, and in a step padded to a wider width."""

import numpy as np
import pytest
from support.tiny_deepseek2 import write_tiny_deepseek2
from support.tiny_models import load_steps, write_tiny_gguf
from tinygrad import Tensor, dtypes

from webapp.engine.model.lane_rows import lane_rows, write_lane_rows
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

RNG = np.random.default_rng(46)
PROMPT = [int(t) for t in RNG.integers(2, 200, 12)]


@pytest.mark.parametrize("dtype", [np.float16, np.uint8])  # float16 rows, and q8_0's bytes
def test_each_lane_writes_its_row_at_its_slot_and_position_and_nothing_else(dtype):
    use_tinygrad_from_this_thread()
    kinds, slots, heads, positions, row = 2, 5, 3, 16, 34
    cache = (RNG.standard_normal((kinds, slots + 1, heads, positions, row)) * 50).astype(dtype)
    rows = (RNG.standard_normal((kinds, 4, heads, row)) * 50).astype(dtype)
    lane_slots, lane_positions = [2, 0, 4, 5], [15, 0, 7, 0]  # the last a padding lane, on the scratch slot
    got = write_lane_rows(
        Tensor(cache).contiguous(), Tensor(rows), Tensor(lane_slots, dtype=dtypes.int32), Tensor(lane_positions, dtype=dtypes.int32)
    ).numpy()
    want = cache.copy()
    for lane, (slot, position) in enumerate(zip(lane_slots, lane_positions)):
        want[:, slot, :, position] = rows[:, lane]
    np.testing.assert_array_equal(got, want)


def test_lane_rows_read_each_lanes_slot_up_to_the_length_repeated_for_its_query_heads():
    use_tinygrad_from_this_thread()
    cache = RNG.standard_normal((2, 4, 2, 16, 8)).astype(np.float32)
    slots = [3, 1, 3]
    got = lane_rows(Tensor(cache), 1, Tensor(slots, dtype=dtypes.int32), 9, group=3).numpy()
    np.testing.assert_array_equal(got, np.repeat(cache[1][slots][:, :, None, :9], 3, axis=2))


def _file(tmp_path, arch: str) -> str:
    if arch == "deepseek2":  # latent attention: one row a position for every head
        return write_tiny_deepseek2(str(tmp_path / "ds.gguf"), q_lora=64)
    return write_tiny_gguf(str(tmp_path / f"{arch}.gguf"), arch)


@pytest.mark.parametrize("arch", ["llama", "deepseek2"])
def test_a_lane_decodes_alike_alone_beside_others_and_padded(tmp_path, arch):
    """Bit for bit where the width is the same (the products' kernels are the width's); across widths
    within float16's rounding of the products."""
    use_tinygrad_from_this_thread()
    steps = load_steps(_file(tmp_path, arch), slots=8, context=64, cpu_kernels=False)
    prompts = [PROMPT[: 3 + i] for i in range(5)]
    for slot, prompt in enumerate(prompts):
        steps.prefill(prompt, slot=slot, start=0)
    alone = steps.decode([42], slots=[0], positions=[len(prompts[0])])[0]
    beside = steps.decode([42, 7, 8], slots=[0, 3, 4], positions=[len(prompts[0]), len(prompts[3]), len(prompts[4])])
    reordered = steps.decode([8, 7, 42], slots=[4, 3, 0], positions=[len(prompts[4]), len(prompts[3]), len(prompts[0])])  # width 4
    np.testing.assert_array_equal(reordered[2], beside[0])
    np.testing.assert_array_equal(reordered[:2], beside[:0:-1])
    np.testing.assert_allclose(beside[0], alone, atol=2e-3 * np.abs(alone).max())
    # each lane read its own slot: slot 3's sequence decoded alone gives its row
    np.testing.assert_allclose(steps.decode([7], slots=[3], positions=[len(prompts[3])])[0], beside[1], atol=2e-3 * np.abs(alone).max())
