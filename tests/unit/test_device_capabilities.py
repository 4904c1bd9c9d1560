"""The device seam: what each device offers the model code, by capability."""

from webapp.engine.device.capabilities import device_capabilities


def test_the_cpu_shares_host_memory_runs_the_c_kernels_and_computes_in_float32():
    cpu = device_capabilities("CPU")
    assert (cpu.host_memory, cpu.runs_cpu_kernels, cpu.zeroed_allocations, cpu.float16_compute) == (True, True, True, False)
    assert cpu.host_ram


def test_an_accelerator_keeps_its_own_memory_and_computes_in_float16():
    for name in ("NV", "CUDA", "AMD", "METAL", "nv:ptx"):
        gpu = device_capabilities(name)
        assert not (gpu.host_memory or gpu.runs_cpu_kernels or gpu.zeroed_allocations or gpu.host_ram), name
        assert gpu.float16_compute, name


def test_tinygrads_python_interpreter_computes_in_float32_off_the_host_kernels():
    python = device_capabilities("PYTHON")
    assert not python.float16_compute and not python.runs_cpu_kernels and python.host_ram


def test_the_default_is_tinygrads_default_device():
    from tinygrad import Device

    assert device_capabilities().name == Device.DEFAULT.split(":")[0].upper()
