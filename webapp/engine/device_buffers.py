"""Host values into device buffers without going through tinygrad's scheduler.

`device_array(array)` makes a realized tensor holding a NumPy array (weights, norms, the kernels'
shape arrays); `StepInputs` holds the tensors a jitted step reads its per-call values from (token
ids, lanes) and rewrites them in place. Realizing `Tensor(array)` instead schedules and lowers a
copy per tensor: most of loading's time, and 3.4 ms of every decode step.
"""

from __future__ import annotations

import ctypes

import numpy as np
from tinygrad import Device, Tensor, dtypes

_DTYPES = {np.dtype(np.uint8): dtypes.uint8, np.dtype(np.int32): dtypes.int32, np.dtype(np.float32): dtypes.float32}


def device_array(array: np.ndarray) -> Tensor:
    """A realized tensor holding `array` (uint8, int32 or float32), copied straight into its buffer.
    Safe inside a jit's capture too: nothing is scheduled, so the jit has no host copy to replay."""
    tensor = Tensor.empty(*array.shape, dtype=_DTYPES[array.dtype]).realize()
    buffer = tensor.uop.base.buffer.ensure_allocated()
    source = np.require(array, requirements=["C", "W"])  # the copy-in wants a writable buffer, not the file's map
    buffer.allocator._copyin(buffer._buf, memoryview(source).cast("B"))
    return tensor


class StepInputs:
    """Realized tensors that the jitted steps read their per-call values from, rewritten in place.

    Fresh input tensors built from Python lists went through tinygrad's scheduler on every call:
    3.4 ms of the model thread per decode step, before the step could start."""

    def __init__(self):
        self._tensors: dict[tuple, Tensor] = {}
        self._host_views: dict[tuple, np.ndarray] = {}

    def fill(self, name: str, values: list, dtype) -> Tensor:
        array = np.ascontiguousarray(values, dtype=np.dtype(dtype.fmt))
        key = (name, array.shape)
        tensor = self._tensors.get(key)
        if tensor is None:
            tensor = self._tensors[key] = Tensor(array).contiguous().realize()
            buffer = tensor.uop.base.realized
            if Device.DEFAULT == "CPU":  # host memory: later calls write it through a NumPy view
                address = buffer._buf.va_addr
                self._host_views[key] = np.ctypeslib.as_array((ctypes.c_uint8 * buffer.nbytes).from_address(address)).view(array.dtype)
            return tensor
        view = self._host_views.get(key)
        if view is not None:
            # every step that reads these inputs ends by waiting for its logits, so none still runs:
            # the copy-in's device wait and tinygrad's bookkeeping took ~0.25 ms per input here
            view[:] = array.reshape(-1)
            return tensor
        buffer = tensor.uop.base.realized
        buffer.allocator._copyin(buffer._buf, memoryview(array).cast("B"))  # waits for the device first
        return tensor
