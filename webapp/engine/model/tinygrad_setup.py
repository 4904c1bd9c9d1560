"""`prepare_tinygrad()`: the process-wide tinygrad settings the engine runs with, made by one
explicit call instead of as a side effect of importing the model.

Call it before anything imports tinygrad: the real loader (`load_gguf_model`) calls it first, and so
do the tests' conftest and the benchmarks that import the model directly. It is idempotent. It
1. defaults `HCQ2=1` in the environment, which tinygrad reads once, at import, where the model runs
   on the CPU (`DEV=CPU`, or no `DEV` on a machine without an AMD or NVIDIA GPU). The HCQ2 runtime
   replays a captured step as one command buffer on a native worker thread instead of one Python
   call per kernel (hundreds of kernels a step), which one-token decode paid for in Python
   (bench/RESULTS.md, before the quantized kernels: the HCQ2 row, 0355ec7). Elsewhere it is left
   alone: under HCQ2 tinygrad's AMD backend imports a module its wheel does not ship. If tinygrad
   was imported before without it, a warning says so.
2. replaces `HCQ2Compiled._wait_signal`, tinygrad's wait for a worker's signal, with
   `_wait_without_spinning` (why: see there), and `HCQSignal.wait`, the GPUs' wait for a signal
   (NV, AMD), with `_signal_wait_without_spinning`: tinygrad's spins in Python for up to 200 ms,
   holding the GIL the streaming threads need. With another tinygrad that lacks them, nothing
   changes.

Importing this module imports nothing from tinygrad.
"""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger(__name__)

_prepared = False


def prepare_tinygrad() -> None:
    """Set HCQ2 (when tinygrad is not imported yet) and install the non-spinning wait; idempotent."""
    global _prepared
    if _prepared:
        return
    on_cpu = runs_on_cpu(os.environ.get("DEV"))
    if on_cpu and "tinygrad" in sys.modules and "HCQ2" not in os.environ:
        log.warning("tinygrad was imported before prepare_tinygrad(): HCQ2 is off, every kernel is a Python call")
    if on_cpu:
        os.environ.setdefault("HCQ2", "1")
    try:
        from tinygrad.runtime.support.hcq2 import HCQ2Compiled
    except ImportError:  # another tinygrad: keep its own wait
        pass
    else:
        HCQ2Compiled._wait_signal = _wait_without_spinning
    try:
        from tinygrad.runtime.support.hcq import HCQSignal
    except ImportError:
        pass
    else:
        HCQSignal.wait = _signal_wait_without_spinning
    _prepared = True


GPU_DEVICE_FILES = ("/dev/kfd", "/dev/nvidiactl")  # AMD's and NVIDIA's: tinygrad would pick that GPU


def runs_on_cpu(dev: str | None, device_files: tuple[str, ...] = GPU_DEVICE_FILES) -> bool:
    """Whether tinygrad's device will be the CPU: `DEV` names it (its first part: "CPU", "CPU:LLVM"),
    or names none on a machine without an AMD or NVIDIA GPU."""
    if dev:
        return dev.replace("+", ":").split(":")[0].upper() == "CPU"
    return not any(os.path.exists(path) for path in device_files)


def _poll_until(read, value: int, limit_s: float, on_stall, each_look=None) -> None:
    """Sleep until `read()` reaches `value`: 50 us doubling to 400 us between looks, so the GIL and
    the core are free meanwhile; `on_stall(seen)` once no progress was seen for `limit_s`;
    `each_look(waited_ms)` before each sleep, where given."""
    seen, since, pause = read(), time.perf_counter(), 0.00005
    while seen < value:
        if each_look is not None:
            each_look(int((time.perf_counter() - since) * 1000))
        time.sleep(pause)
        pause = min(pause * 2, 0.0004)
        if seen != (now := read()):
            seen, since = now, time.perf_counter()
        elif time.perf_counter() - since > limit_s:
            on_stall(seen)


def _wait_without_spinning(device, signal, value, timeout=None):
    """Wait for a worker's signal in sleeps, releasing the GIL and the core between looks.

    tinygrad's own wait spins in Python: with two cores that spin took one whole core and held
    the GIL the web threads need while the model thread waited for every step. Sleep-polling
    measured as fast and keeps the hang check. The sleeps double from 50 up to 400 us: that takes
    less of the model thread's CPU per step than fixed 50 us sleeps, at one lane and at eight, for
    the same step times (bench/RESULTS.md, figures moved out of code comments).
    """
    _poll_until(lambda: signal[0], value, (timeout or device.wait_timeout_ms) / 1000, lambda _: device.on_device_hang())


def _signal_wait_without_spinning(signal, value: int, timeout: int | None = None) -> None:
    """`HCQSignal.wait` in the same sleeps, with tinygrad's timeout and its device's own `_sleep` hook
    (NV's long sleep after 200 ms, fault checks)."""
    limit_ms = timeout or int(os.environ.get("HCQDEV_WAIT_TIMEOUT_MS", 30000))

    def timed_out(seen: int) -> None:
        raise RuntimeError(f"Wait timeout: {limit_ms} ms! (the signal is not set to {value}, but {seen})")

    _poll_until(lambda: signal.value, value, limit_ms / 1000, timed_out, signal._sleep)


def use_tinygrad_from_this_thread() -> None:
    """tinygrad keeps one sqlite connection for its kernel cache, usable only by the thread that opened
    it. The server touches tinygrad from its model thread only; tests and benchmarks that also use it
    from another thread (the main thread, then an engine's model thread) drop the connection so the
    next user reopens it."""
    import tinygrad.helpers

    tinygrad.helpers._db_connection = None


def free_cached_buffers() -> None:
    """Give back the device buffers tinygrad's allocator keeps for reuse after they are freed. A model
    set calls it on the model thread of each load (loads run one at a time): without it the default
    model's buffers stayed resident in that cache after every swap of two models
    (bench/model_set_memory.py; bench/RESULTS.md, several models in one server, and figures moved
    out of code comments), and a model of other shapes would never reuse them."""
    from tinygrad import Device

    free_cache = getattr(Device[Device.DEFAULT].allocator, "free_cache", None)
    if free_cache is not None:  # an LRU allocator
        free_cache()
