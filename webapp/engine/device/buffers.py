"""Host values into device buffers without going through tinygrad's scheduler.

`device_array(array)` makes a realized tensor holding a NumPy array (weights, norms, the kernels'
shape arrays); `StepBuffers` holds the tensors a jitted step reads its per-call values from (token
ids, lanes), rewrites them in place, and reads a step's output back. Realizing `Tensor(array)`
instead schedules and lowers a copy per tensor, which was most of loading's time and a large part
of every decode step's host time; `Tensor.numpy()` on the output scheduled another. This is the
device seam's lowest layer: the only place that reaches into a tinygrad buffer's memory, and the one
that knows which devices share memory with the host.
"""

from __future__ import annotations

import ctypes

import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinygrad.uop.ops import Ops

from webapp.engine.device.capabilities import device_capabilities

_DTYPES = {
    np.dtype(np.uint8): dtypes.uint8,
    np.dtype(np.int32): dtypes.int32,
    np.dtype(np.int64): dtypes.int64,
    np.dtype(np.uint64): dtypes.uint64,
    np.dtype(np.float16): dtypes.float16,
    np.dtype(np.float32): dtypes.float32,
}


def device_array(array: np.ndarray) -> Tensor:
    """A realized tensor holding `array` (uint8, int32, int64, uint64, float16 or float32), copied
    straight into its buffer. Safe inside a jit's capture too: nothing is scheduled, so the jit has
    no host copy to replay."""
    tensor = Tensor.empty(*array.shape, dtype=_DTYPES[array.dtype]).realize()
    _copy_in(tensor, array)
    return tensor


def overwrite(tensor: Tensor, array: np.ndarray) -> None:
    """Copy `array` into a realized tensor's buffer, the same shape and dtype, in place, once the
    device's queued work is done: a jit that reads the tensor reads the new values."""
    assert tensor.shape == array.shape and _DTYPES[array.dtype] == tensor.dtype
    Device[tensor.device].synchronize()
    _copy_in(tensor, array)


def _copy_in(tensor: Tensor, array: np.ndarray) -> None:
    buffer = tensor.uop.base.buffer.ensure_allocated()
    source = np.require(array, requirements=["C", "W"])  # the copy-in wants a writable buffer, not the file's map
    buffer.allocator._copyin(buffer._buf, memoryview(source).cast("B"))


def host_address(tensor: Tensor) -> int:
    """Where a realized CPU tensor's values start in this process's memory, for kernels that take
    tensors by address. The tensor must stay alive, unmoved, as long as a kernel may read it."""
    buffer = _whole_buffer(tensor)
    assert device_capabilities().host_memory and buffer is not None, "not a whole CPU buffer"
    return buffer.ensure_allocated()._buf.va_addr


def host_values(tensor: Tensor, dtype) -> np.ndarray:
    """A copy of a realized CPU tensor's values as they are now, kernels' writes by address included
    (nothing is scheduled, so nothing waits for tinygrad's queue)."""
    return _host_view(_whole_buffer(tensor), np.dtype(dtype)).copy()


def host_view(tensor: Tensor) -> np.ndarray:
    """A realized CPU tensor's memory as a NumPy array of its shape (no copy): what kernels write by
    address shows through it, and its writes are the tensor's."""
    buffer = _whole_buffer(tensor)
    assert device_capabilities().host_memory and buffer is not None, "not a whole CPU buffer"
    return _host_view(buffer.ensure_allocated(), np.dtype(tensor.dtype.fmt)).reshape(tensor.shape)


def _whole_buffer(tensor: Tensor):
    """The buffer holding a tensor's values in its own order (a realized buffer, or a reshape of one),
    else None (a view: a slice, a permutation, or not realized)."""
    uop = tensor.uop
    while uop.op is Ops.RESHAPE:
        uop = uop.src[0]
    return uop.buffer if uop.op is Ops.BUFFER else None


def _host_view(buffer, dtype: np.dtype) -> np.ndarray:
    """A NumPy array over a CPU buffer's memory (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * buffer.nbytes).from_address(buffer._buf.va_addr)).view(dtype)


class StepBuffers:
    """Realized tensors that the jitted steps read their per-call values from, rewritten in place,
    and the reading of a step's output.

    Fresh input tensors built from Python lists went through tinygrad's scheduler on every call:
    model-thread time on every decode step, before the step could start."""

    def __init__(self):
        self._tensors: dict[tuple, Tensor] = {}
        self._host_views: dict[tuple, np.ndarray] = {}
        self._output_views: dict[object, tuple[object, np.ndarray]] = {}  # buffer -> (buffer, view): keeps it alive

    def fill(self, name: str, values: list, dtype) -> Tensor:
        array = np.ascontiguousarray(values, dtype=np.dtype(dtype.fmt))
        key = (name, array.shape)
        tensor = self._tensors.get(key)
        if tensor is None:
            tensor = self._tensors[key] = Tensor(array).contiguous().realize()
            buffer = tensor.uop.base.realized
            if device_capabilities().host_memory:  # host memory: later calls write it through a NumPy view
                self._host_views[key] = _host_view(buffer, array.dtype)
            return tensor
        view = self._host_views.get(key)
        if view is not None:
            # every step that reads these inputs ends by waiting for its logits, so none still runs:
            # the copy-in's device wait and tinygrad's bookkeeping cost more than the step's own inputs
            view[:] = array.reshape(-1)
            return tensor
        buffer = tensor.uop.base.realized
        buffer.allocator._copyin(buffer._buf, memoryview(array).cast("B"))  # waits for the device first
        return tensor

    def read(self, output: Tensor, rows: int) -> np.ndarray:
        """A copy of the first `rows` rows of a jitted step's output. On the CPU device, once the
        device is idle, straight from the output's memory: a jit replays into the same buffer every
        call, and `Tensor.numpy()` scheduled a copy each time (a large share of a decode step's host time)."""
        buffer = _whole_buffer(output) if device_capabilities().host_memory else None
        if buffer is None:
            return output.numpy()[:rows]
        entry = self._output_views.get(buffer)
        if entry is None:
            entry = self._output_views[buffer] = (buffer, _host_view(buffer, np.dtype(output.dtype.fmt)).reshape(output.shape))
        Device[Device.DEFAULT].synchronize()
        return entry[1][:rows].copy()
