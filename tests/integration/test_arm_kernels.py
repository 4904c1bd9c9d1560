"""The ARM rungs of the ISA ladder (build.py's neon, neon_dotprod and neon_i8mm: arm_neon*.c) on an x86
machine: the kernels cross-compiled for aarch64 with clang into a small program
(tests/support/arm_kernels.c) and run under qemu-aarch64, each rung on the narrowest CPU qemu models
that has its features (so an instruction beyond the rung would stop it), against the same program
built for the portable rung.

Every block format's products (1, 5 and 9 tokens, rows outside and inside groups of eight), the
fused SwiGLU linear and attention over float16 and Q8_0 caches match the generic aarch64 build within
the float32 rounding test_isa_ladder.py allows the x86 rungs; each product matches the float64
reference within the activations' int8 rounding, and a token's numbers are the same alone and beside
others. The two rungs without smmla do exact integer dots into the same lanes, so they give each
other's bits. Skipped, with what to install, where the cross toolchain or qemu is missing (make test
installs them as root).
"""

import functools
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from test_isa_ladder import attention_inputs
from test_kernels import TYPES, dequantize, random_blocks

from webapp.engine.kernels.abi import Isa, KvType
from webapp.engine.kernels.block_weight import BLOCK_FORMATS
from webapp.engine.kernels.build import RUNG_NAMES, RUNGS, SOURCES

PROGRAM = Path(__file__).parents[1] / "support" / "arm_kernels.c"
SYSROOT = Path("/usr/aarch64-linux-gnu")
ARM_RUNGS = [rung.name for rung in RUNGS if "aarch64" in rung.machines]
# the narrowest CPU qemu-aarch64 models for each rung: Cortex-A53 has NEON only, Neoverse N1 the dot
# product, and only qemu's "max" the int8 matrix multiply
QEMU_CPU = {"generic": "cortex-a53", "neon": "cortex-a53", "neon_dotprod": "neoverse-n1", "neon_i8mm": "max"}


def _missing() -> str | None:
    if not shutil.which("qemu-aarch64"):
        return "qemu-aarch64 (apt-get install qemu-user)"
    if not (SYSROOT / "lib" / "libc.a").exists() or not shutil.which("aarch64-linux-gnu-ld"):
        return "an aarch64 C library and linker (apt-get install libc6-dev-arm64-cross gcc-aarch64-linux-gnu)"
    return None


@functools.cache
def _program(name: str, tmp: Path) -> Path:
    flags = RUNG_NAMES[name].ways[0][1]  # the generic rung's: none
    binary = tmp / f"arm_kernels_{name}"
    command = [
        "clang",
        "--target=aarch64-linux-gnu",
        "-static",
        "-O3",
        "-fno-math-errno",
        *flags,
        f"-I{SOURCES}",
        str(PROGRAM),
        "-o",
        str(binary),
    ]
    built = subprocess.run([*command, "-lpthread", "-lm"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return binary


@pytest.fixture(scope="module")
def arm(tmp_path_factory):
    if (missing := _missing()) is not None:
        pytest.skip(f"the ARM kernels' tests need {missing}")
    tmp = tmp_path_factory.mktemp("arm")
    return lambda name: _program(name, tmp)


@dataclass(frozen=True)
class Request:
    """One request to the program: its bytes on stdin, and the arrays of its answer (dtype, shape)."""

    stdin: bytes
    answer: tuple[tuple[type, tuple[int, ...]], ...]
    kind: int = 0
    ggml_type: int = 0
    raw: np.ndarray | None = None
    x: np.ndarray | None = None


def _product(kind: int, ggml_type: int, raw: np.ndarray, x: np.ndarray) -> Request:
    head = np.array([kind, ggml_type, raw.shape[0], x.shape[1] // (1 + kind), x.shape[0]], np.int32)
    return Request(head.tobytes() + raw.tobytes() + x.tobytes(), ((np.float32, (x.shape[0], raw.shape[0])),), kind, ggml_type, raw, x)


def _attention(kv_type: int, head_dim: int, slot_of: list[int], pos_of: list[int]) -> Request:
    """tq_attend of random qkv rows over a random cache, test_isa_ladder.py's inputs."""
    qkv, cache, lanes, inv_freq, shape = attention_inputs(kv_type, head_dim, slot_of, pos_of)
    stdin = (
        np.array([2, 0, 0, 0, 0], np.int32).tobytes()
        + bytes(shape)
        + qkv.tobytes()
        + cache.tobytes()
        + lanes.tobytes()
        + inv_freq.tobytes()
    )
    return Request(stdin, ((np.float32, (shape.lanes, shape.heads * head_dim)), (np.uint8, (cache.nbytes,))), kind=2, ggml_type=kv_type)


def _requests() -> list[Request]:
    """Every format's products (rows in eights and not, 1/5/9 tokens), a SwiGLU linear, and attention
    over float16 and Q8_0 caches (lanes alone and lanes of one sequence)."""
    requests = []
    for ggml_type in TYPES:
        rng = np.random.default_rng(ggml_type)
        cols = 96 if BLOCK_FORMATS[ggml_type][1] == 32 else 512
        for rows in (40, 37):
            raw = random_blocks(ggml_type, rows, cols, rng)
            requests += [_product(0, ggml_type, raw, rng.standard_normal((tokens, cols)).astype(np.float32)) for tokens in (1, 5, 9)]
    for ggml_type in ALONE_TYPES:  # five tokens together, then each alone
        rng = np.random.default_rng(100 + ggml_type)
        raw, x = random_blocks(ggml_type, 37, 512, rng), rng.standard_normal((5, 512)).astype(np.float32)
        requests += [_product(0, ggml_type, raw, x)] + [_product(0, ggml_type, raw, x[t : t + 1]) for t in range(5)]
    rng = np.random.default_rng(4)
    requests.append(_product(1, 8, random_blocks(8, 40, 96, rng), rng.standard_normal((6, 2 * 96)).astype(np.float32)))
    for kv_type in (KvType.F16, KvType.Q8_0):
        for slot_of, pos_of in (([2, 0, 3], [17, 0, 299]), ([1] * 5, [260, 261, 262, 263, 264])):
            requests += [_attention(kv_type, head_dim, slot_of, pos_of) for head_dim in (64, 128)]
    return requests


ALONE_TYPES = (2, 3, 12, 14, 10)  # Q4_0, Q4_1, Q4_K, Q6_K, Q2_K: no min, a min a 32, a min a 16
REQUESTS = _requests()


@functools.cache
def _run(binary: Path, cpu: str) -> tuple[int, list[list[np.ndarray]]]:
    """The program's rung id and its answer to every request, run under qemu as `cpu`."""
    stdin = b"".join(request.stdin for request in REQUESTS)
    done = subprocess.run(["qemu-aarch64", "-cpu", cpu, str(binary)], input=stdin, capture_output=True, timeout=300, check=True)
    isa, at, answers = int(np.frombuffer(done.stdout[:4], np.int32)[0]), 4, []
    for request in REQUESTS:
        arrays = []
        for dtype, shape in request.answer:
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            arrays.append(np.frombuffer(done.stdout[at : at + size], dtype).reshape(shape))
            at += size
        answers.append(arrays)
    assert at == len(done.stdout)
    return isa, answers


def _answers(arm, name: str) -> tuple[int, list[np.ndarray]]:
    return _run(arm(name), QEMU_CPU[name])


def test_each_arm_rung_reports_its_id(arm):
    assert _answers(arm, "generic")[0] == Isa.GENERIC
    for name in ARM_RUNGS:
        assert _answers(arm, name)[0] == RUNG_NAMES[name].isa


@pytest.mark.parametrize("name", ARM_RUNGS)
def test_every_formats_products_match_the_generic_build(arm, name):
    _, got = _answers(arm, name)
    _, expected = _answers(arm, "generic")
    for request, (ours, *_), (portable, *_) in zip(REQUESTS, got, expected, strict=True):
        if request.kind == 2:
            continue
        cols = request.x.shape[1] // (1 + request.kind)
        bound = 1e-4 * np.abs(dequantize(request.ggml_type, request.raw, cols)).max() * cols**0.5 if request.kind == 0 else 1e-3
        np.testing.assert_allclose(ours, portable, rtol=1e-4, atol=bound, err_msg=f"type {request.ggml_type}")


@pytest.mark.parametrize("name", ARM_RUNGS)
def test_attention_matches_the_generic_build(arm, name):
    _, got = _answers(arm, name)
    _, expected = _answers(arm, "generic")
    for request, ours, portable in zip(REQUESTS, got, expected, strict=True):
        if request.kind != 2:
            continue
        (out, cache), (portable_out, portable_cache) = ours, portable
        np.testing.assert_allclose(out, portable_out, rtol=1e-4, atol=1e-4)
        if request.ggml_type == KvType.F16:  # a rotated key may round to the neighbouring float16
            np.testing.assert_allclose(
                cache.view(np.float16).astype(np.float32), portable_cache.view(np.float16).astype(np.float32), rtol=2e-3
            )
        else:
            np.testing.assert_array_equal(cache, portable_cache)


@pytest.mark.parametrize("name", ARM_RUNGS)
def test_a_tokens_product_is_the_same_alone_and_beside_others(arm, name):
    """What batching and prefill rely on: a token's numbers do not depend on the tokens sharing its call."""
    _, got = _answers(arm, name)
    for i, request in enumerate(REQUESTS):
        if request.kind == 0 and request.x.shape[0] == 5 and REQUESTS[i + 1].x.shape[0] == 1 and request.ggml_type in ALONE_TYPES:
            for t in range(5):
                np.testing.assert_array_equal(got[i][0][t].view(np.uint32), got[i + 1 + t][0][0].view(np.uint32))


def test_the_products_match_the_float64_reference(arm):
    """Within the activations' rounding to int8 (at most half a step a value, a step max |x| / 127)."""
    _, got = _answers(arm, ARM_RUNGS[-1])
    for request, (ours, *_) in zip(REQUESTS, got, strict=True):
        if request.kind != 0:
            continue
        w = dequantize(request.ggml_type, request.raw, request.x.shape[1])
        reference = request.x.astype(np.float64) @ w.T
        rounding = np.abs(w).sum(axis=1)[None, :] * np.abs(request.x).max(axis=1, keepdims=True) / 254
        assert np.all(np.abs(ours - reference) <= rounding + 1e-5), f"type {request.ggml_type}"


def test_the_two_neon_rungs_give_the_same_bits(arm):
    """sdot and NEON's widening multiply-adds are both exact integer sums into the same lanes, in the
    same float sums after."""
    (_, with_sdot), (_, without) = _answers(arm, "neon_dotprod"), _answers(arm, "neon")
    for ours, theirs in zip(with_sdot, without, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
