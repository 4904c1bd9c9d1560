"""The waits prepare_tinygrad installs for tinygrad's devices (model/tinygrad_setup.py): a GPU
signal's wait sleeps between looks, so other Python threads (the streaming handlers) run while the
model thread waits; it keeps tinygrad's timeout and its device's own sleep hook. And which device
gets HCQ2."""

import threading
import time

import pytest

from webapp.engine.model.tinygrad_setup import _signal_wait_without_spinning, runs_on_cpu


class FakeSignal:
    """A device signal whose value a 'GPU' thread sets after `delay` seconds."""

    def __init__(self, delay: float | None):
        self.value, self.hook_calls = 0, 0
        if delay is not None:
            threading.Timer(delay, self._set).start()

    def _set(self):
        self.value = 1

    def _sleep(self, waited_ms: int):  # the device's own hook, as NVSignal has one
        self.hook_calls += 1


def _spin(signal, value: int) -> None:
    """tinygrad's own wait, in short: look again at once, in Python, holding the GIL."""
    while signal.value < value:
        signal._sleep(0)


def _counted_while_waiting(wait) -> tuple[int, float, int]:
    """How far a Python thread counts while `wait` waits 0.2 s for a signal; the wait's length; how
    many times the wait looked at the signal."""
    began = time.perf_counter()
    signal, counted, stop = FakeSignal(delay=0.2), [0], threading.Event()

    def count():  # a handler thread's Python work while the model thread waits
        while not stop.is_set():
            counted[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    wait(signal, 1)
    waited = time.perf_counter() - began
    stop.set()
    counter.join()
    assert signal.value == 1 and signal.hook_calls > 10
    return counted[0], waited, signal.hook_calls


def test_a_signal_wait_lets_other_threads_run_and_returns_when_set():
    # A busy machine (the rest of the suite's threads, the other core) blurs one round's counts:
    # the wait must let the counter run further than the spin in one of three alternated rounds.
    rounds = []
    for _ in range(3):
        ours, waited, looks = _counted_while_waiting(_signal_wait_without_spinning)
        spinning, _, spin_looks = _counted_while_waiting(_spin)
        assert 0.19 < waited < 0.5
        assert looks * 10 < spin_looks  # it sleeps between looks: the spin looks all the time
        rounds.append(ours / max(1, spinning))
        if rounds[-1] > 1.3:  # the spinning wait held the GIL half of the time
            break
    assert max(rounds) > 1.3, rounds


def test_a_signal_that_never_comes_times_out_as_tinygrads_does():
    with pytest.raises(RuntimeError, match="Wait timeout: 50 ms"):
        _signal_wait_without_spinning(FakeSignal(delay=None), 1, timeout=50)


def test_hcq2_is_for_the_cpu_alone():
    assert runs_on_cpu("CPU") and runs_on_cpu("cpu:LLVM") and runs_on_cpu(None, device_files=())
    assert not runs_on_cpu("AMD") and not runs_on_cpu("NV") and not runs_on_cpu("MOCK+NULL:PTX:sm_90")
    assert not runs_on_cpu(None, device_files=(__file__,))  # a GPU's device file exists: tinygrad picks it
