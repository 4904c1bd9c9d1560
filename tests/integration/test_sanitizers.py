"""The C kernels under AddressSanitizer and UndefinedBehaviorSanitizer: the kernel tests run again in a
process with clang's ASan runtime preloaded and LLM_CPU_SANITIZE=1 (build.py: the same sources built
with -fsanitize=address,undefined, every finding fatal), and must find nothing; and a copy of the
kernels with one deliberately broken (gelu writing past its array) is caught, which proves the
sanitizers' build is the one that runs."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from webapp.engine.kernels.build import SANITIZE_VARIABLE, SOURCES

ROOT = Path(__file__).resolve().parents[2]
# the kernel tests: every block format's products and repacking at awkward shapes, every rung this CPU
# runs against the generic build, the attention (float16 and 8-bit caches, paged at block edges),
# the vision encoder's kernels, the GGUF fuzz (whose loads run the kernels on what they read), and
# LoRA lanes beside each other (lora.c, on adapters of every rank the lanes mix)
KERNEL_TESTS = (
    "tests/integration/test_kernels.py",
    "tests/integration/test_isa_ladder.py",
    "tests/integration/test_paged_attention.py",
    "tests/integration/test_kv_q8.py",
    "tests/integration/test_vision_encoder_kernels.py",
    "tests/integration/test_gguf_fuzz.py",
    "tests/integration/test_lora.py::test_a_lane_is_its_own_beside_others_with_other_adapters",
)
# what only reads the compiler's assembly runs no kernel: nothing for the sanitizers to watch
ASSEMBLY_ONLY = "not compiles_its_integer_dots and not take_no_gathers"
FINDINGS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer")


def asan_runtime() -> str | None:
    if shutil.which("clang") is None:
        return None
    name = f"libclang_rt.asan-{platform.machine()}.so"
    path = subprocess.run(["clang", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def sanitized_env(logs: Path) -> dict[str, str]:
    """A process's environment for the sanitizers' build; what they find is written under `logs` (a
    finding ends the process at once, before pytest could show what it captured)."""
    runtime = asan_runtime()
    if runtime is None:
        pytest.skip("clang's AddressSanitizer runtime is not installed")
    return {
        **os.environ,
        "LD_PRELOAD": runtime,
        SANITIZE_VARIABLE: "1",
        # Python's own allocations are not ours to judge; every finding in the kernels stops the process
        "ASAN_OPTIONS": f"detect_leaks=0:halt_on_error=1:allocator_may_return_null=1:log_path={logs}/asan",
        "UBSAN_OPTIONS": f"print_stacktrace=1:halt_on_error=1:log_path={logs}/ubsan",
    }


def findings(logs: Path) -> str:
    return "".join(path.read_text(errors="replace") for path in sorted(logs.iterdir()))


def test_the_kernel_tests_find_nothing_under_the_sanitizers(tmp_path):
    env = sanitized_env(tmp_path)
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", ASSEMBLY_ONLY, *KERNEL_TESTS]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    output = done.stdout + done.stderr
    assert not findings(tmp_path), findings(tmp_path)[:6000]  # the finding and its innermost frames
    assert not [finding for finding in FINDINGS if finding in output], output[-6000:]
    assert done.returncode == 0, output[-6000:]
    assert " passed" in output.splitlines()[-1], output[-2000:]


def test_a_kernel_that_writes_past_its_array_is_caught(tmp_path):
    (logs := tmp_path / "logs").mkdir()
    env = sanitized_env(logs)
    broken = tmp_path / "c"
    shutil.copytree(SOURCES, broken)
    source = broken / "vision_encoder.c"
    text = source.read_text()
    assert "for (; i + VEC <= to; i += VEC)" in text
    source.write_text(text.replace("for (; i + VEC <= to; i += VEC)", "for (; i < to; i += VEC)"))  # its last vector runs past n
    script = f"""
import ctypes, sys
import numpy as np
from pathlib import Path
from webapp.engine.kernels.build import compile_library
library = ctypes.CDLL(str(compile_library([], Path({str(broken)!r}))))
library.tq_gelu_tanh.argtypes = [ctypes.c_void_p, ctypes.c_long]
x = np.zeros(1001, np.float32)
library.tq_gelu_tanh(x.ctypes.data, x.size)
print("not caught")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert "not caught" not in done.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in findings(logs), done.stderr[-3000:]
    assert done.returncode != 0
