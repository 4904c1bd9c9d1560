"""What the device tinygrad runs on offers the model code, asked by capability instead of by name.

Contract: `device_capabilities(name=None)` describes tinygrad's default device (or the one named):
`host_memory`, its buffers are this process's memory, so the C kernels take them by address and NumPy
views read and write them in place; `runs_cpu_kernels`, the C kernels (webapp/engine/kernels) can run
on its buffers; `zeroed_allocations`, a fresh buffer is already zero (the CPU allocator maps fresh
pages), so a cache needs no kernel to clear it and commits memory only as positions fill;
`float16_compute`, activations are computed in float16 (a GPU's tensor cores) rather than float32
(CPUs here have no float16 arithmetic); `host_ram`, its allocations take this machine's RAM, so the
memory plan reads the host's free memory for it. The model code asks these; only this module knows which
device has which, so a new device is a new entry here, not a test of its name in model files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceCapabilities:
    name: str
    host_memory: bool
    runs_cpu_kernels: bool
    zeroed_allocations: bool
    float16_compute: bool
    host_ram: bool


# the devices whose buffers are host memory; PYTHON is tinygrad's reference interpreter, also on the host
_HOST_DEVICES = ("CPU",)
_FLOAT32_DEVICES = ("CPU", "PYTHON")
_HOST_RAM_DEVICES = ("CPU", "PYTHON")


def device_capabilities(name: str | None = None) -> DeviceCapabilities:
    """The capabilities of device `name` (tinygrad's DEV-style name, options after a colon ignored),
    or of tinygrad's default device."""
    if name is None:
        from tinygrad import Device

        name = Device.DEFAULT
    base = name.split(":")[0].upper()
    host = base in _HOST_DEVICES
    return DeviceCapabilities(
        name=base,
        host_memory=host,
        runs_cpu_kernels=host,
        zeroed_allocations=host,
        float16_compute=base not in _FLOAT32_DEVICES,
        host_ram=base in _HOST_RAM_DEVICES,
    )
