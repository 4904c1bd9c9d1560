"""tinygrad's path's matrices in the file's blocks (model/device_blocks.py): every type it keeps so
dequantizes as test_kernels.py's NumPy reference does, and its product with the activations is one
kernel that reads the blocks, not a float copy of them (tinygrad's CPU backend)."""

import numpy as np
import pytest
from test_kernels import dequantize, random_blocks
from tinygrad import GlobalCounters, Tensor, dtypes

from webapp.engine.model.device_blocks import DEVICE_BLOCK_TYPES, DeviceBlockLinear, dequantized
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

ROWS, COLS = 64, 512


@pytest.mark.parametrize("ggml_type", sorted(DEVICE_BLOCK_TYPES))
def test_the_blocks_dequantize_as_the_reference(ggml_type):
    use_tinygrad_from_this_thread()
    raw = random_blocks(ggml_type, ROWS, COLS, np.random.default_rng(ggml_type))
    got = dequantized(Tensor(raw), ggml_type, ROWS, COLS).float().numpy()
    np.testing.assert_allclose(got, dequantize(ggml_type, raw, COLS), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("ggml_type", sorted(DEVICE_BLOCK_TYPES))
def test_a_product_is_one_kernel_reading_the_blocks(ggml_type):
    use_tinygrad_from_this_thread()
    raw = random_blocks(ggml_type, ROWS, COLS, np.random.default_rng(ggml_type))
    linear = DeviceBlockLinear([(Tensor(raw).realize(), ggml_type, ROWS)], COLS)
    x = Tensor(np.random.default_rng(1).standard_normal((2, COLS), dtype=np.float32)).realize()
    GlobalCounters.reset()
    y = linear(x).realize()
    assert GlobalCounters.kernel_count == 1
    assert GlobalCounters.global_mem <= raw.nbytes + x.nbytes() + y.nbytes() + 64  # no float copy of W
    want = x.numpy().astype(np.float64) @ dequantize(ggml_type, raw, COLS).T
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    assert y.dtype == dtypes.float32
