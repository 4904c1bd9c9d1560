"""How a step runs: one object per way, chosen once at load.

- `OneCallSteps`: the whole step as one call into the CPU kernels (every matrix in blocks they read).
- `KernelJitSteps`: captured jits of the CPU kernels' layers (some matrix without a kernel).
- `TinygradJitSteps`: captured jits of tinygrad's kernels (every other device, or no CPU kernels).

`steps_for(model, prefill_chunk)` picks the first that fits the loaded model; the runner and the
engine see only the `Steps` interface (`base.py`).
"""

from __future__ import annotations

from webapp.engine.model.steps.base import Steps
from webapp.engine.model.steps.kernel_jit import KernelJitSteps
from webapp.engine.model.steps.one_call import OneCallSteps
from webapp.engine.model.steps.tinygrad_jit import TinygradJitSteps

__all__ = ["KernelJitSteps", "OneCallSteps", "Steps", "TinygradJitSteps", "steps_for"]


def steps_for(model, prefill_chunk: int) -> Steps:
    if OneCallSteps.fits(model):
        return OneCallSteps(model)
    if model.kernels is not None:
        return KernelJitSteps(model, prefill_chunk)
    return TinygradJitSteps(model, prefill_chunk)
