"""Every rung of the ISA ladder this CPU runs (build.py's RUNGS) against the generic build: every block
format's products (interleaved tiles and row kernels, tokens across a group of eight), the fused
SwiGLU linear, attention over float16 and Q8_0 caches (lanes alone and lanes of one sequence), and a
vision encoder's products and attention (their vectors as wide as the rung's registers).

Each rung matches the generic build within the float32 rounding the AVX2 tests allow against float64
(test_kernels.py). The x86 rungs above AVX2 run AVX2's kernels, the VNNI ones with dpbusd only where
maddubs' int16 sums cannot saturate (x86_avx2.c), and the AVX-512 ones 512-bit tiles each of whose
lanes does what AVX2's tile does for its row, so they must give AVX2's bits exactly; not so the float
formats' products (c/float_gemm.c: float additions, in 16-lane vectors on AVX-512 where AVX2 has 8,
so in another order), which match within float32's rounding like every rung. The products'
matrices have rows in pairs of groups (the 512-bit tiles), a lone group after them, and rows outside groups. A rung this
CPU lacks is skipped; LLM_CPU_ISA's refusal of one is checked on described CPUs.
"""

import ctypes
import functools
import re

import numpy as np
import pytest
from support.kv_quants import q8_rows
from test_kernels import TYPES, dequantize, random_blocks

from webapp.engine.kernels.abi import Attention, BlockType, Isa, KvType, Product
from webapp.engine.kernels.block_weight import BLOCK_FORMATS
from webapp.engine.kernels.build import RUNG_NAMES, RUNGS, SOURCES, executable_rungs, load_library, rung_for
from webapp.engine.kernels.vision_encoder import VisionEncoderKernels

RUNNABLE = {rung.name: flags for rung, flags in executable_rungs()}
FLOAT_TYPES = (BlockType.F32, BlockType.F16, BlockType.BF16)
SIMD_RUNGS = [rung.name for rung in RUNGS if rung.isa != Isa.GENERIC]


@functools.cache
def _built(name: str) -> ctypes.CDLL:
    library = load_library(RUNG_NAMES[name], RUNNABLE[name])  # checks tq_isa is the rung's id
    library.tq_start(ctypes.c_long(3), ctypes.c_long(50))
    return library


def rung_library(name: str) -> ctypes.CDLL:
    """The kernels built for the rung `name`, once a test session; skipped where this CPU lacks it."""
    if name not in RUNNABLE:
        pytest.skip(f"this CPU cannot run the {name} rung")
    return _built(name)


def bit_twin(name: str) -> ctypes.CDLL | None:
    """The build whose bits the rung `name` must give: AVX2's for the x86 rungs above it (they run its
    kernels), else none."""
    rung, avx2 = RUNG_NAMES[name], RUNG_NAMES["avx2"]
    return _built("avx2") if rung.machines == avx2.machines and rung.isa > avx2.isa else None


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def _product(library: ctypes.CDLL, raw: np.ndarray, ggml_type: int, cols: int, x: np.ndarray, swiglu: bool = False) -> np.ndarray:
    """x times the matrix `raw`, stored as this build stores it (tq_repack); swiglu: x is gate | up."""
    rows, tokens = raw.shape[0], x.shape[0]
    packed = np.empty_like(raw)
    stored = library.tq_repack(_ptr(packed), _ptr(raw), ctypes.byref(Product(ggml_type, rows, cols)))
    out = np.zeros((tokens, rows), np.float32)
    shape = ctypes.byref(Product(stored, rows, cols, tokens))
    if swiglu:
        library.tq_swiglu_linear(_ptr(out), _ptr(packed), _ptr(x), _ptr(np.zeros((tokens, rows), np.float32)), shape)
    else:
        library.tq_linear(_ptr(out), _ptr(packed), _ptr(x), shape)
    return out


def _same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("name", SIMD_RUNGS)
def test_every_formats_products_match_the_generic_build(name):
    """Rows in eights (the interleaved tiles) and not (the row kernels), 1, 5 and 9 tokens."""
    library, generic, twin = rung_library(name), rung_library("generic"), bit_twin(name)
    for ggml_type in TYPES:
        rng = np.random.default_rng(ggml_type)
        cols = 96 if BLOCK_FORMATS[ggml_type][1] == 32 else 512
        for rows in (40, 37):
            raw = random_blocks(ggml_type, rows, cols, rng)
            bound = 1e-4 * np.abs(dequantize(ggml_type, raw, cols)).max() * cols**0.5
            for tokens in (1, 5, 9):
                x = rng.standard_normal((tokens, cols)).astype(np.float32)
                got = _product(library, raw, ggml_type, cols, x)
                np.testing.assert_allclose(
                    got, _product(generic, raw, ggml_type, cols, x), rtol=1e-4, atol=bound, err_msg=f"type {ggml_type}"
                )
                if twin is not None and ggml_type not in FLOAT_TYPES:
                    _same_bits(got, _product(twin, raw, ggml_type, cols, x))


@pytest.mark.parametrize("name", SIMD_RUNGS)
def test_the_vision_encoders_products_and_attention_match_the_generic_build(name):
    """Products over columns in pieces with a tail, rows and outputs past whole tiles; a head of 72
    (8 past a whole 16-wide vector) over keys past whole tiles."""
    ours, generic = VisionEncoderKernels(rung_library(name)), VisionEncoderKernels(rung_library("generic"))
    rng = np.random.default_rng(5)
    x, bias = rng.standard_normal((9, 1100)).astype(np.float32), rng.standard_normal(13).astype(np.float32)
    for weight in ((rng.standard_normal((13, 1100)) / 33).astype(np.float16), (rng.standard_normal((13, 1100)) / 33).astype(np.float32)):
        np.testing.assert_allclose(ours.linear(x, weight, bias), generic.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    q, k, v = (rng.standard_normal((n, 72)).astype(np.float32) for n in (37, 161, 161))
    kt, got, expected = np.ascontiguousarray(k.T), np.empty((37, 72), np.float32), np.empty((37, 72), np.float32)
    ours.attention(q * np.float32(72**-0.5), kt, v, got)
    generic.attention(q * np.float32(72**-0.5), kt, v, expected)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", SIMD_RUNGS)
def test_the_swiglu_linear_matches_the_generic_build(name):
    library, generic, twin = rung_library(name), rung_library("generic"), bit_twin(name)
    rng = np.random.default_rng(4)
    raw = random_blocks(8, 40, 96, rng)
    gate_up = rng.standard_normal((6, 2 * 96)).astype(np.float32)
    got = _product(library, raw, 8, 96, gate_up, swiglu=True)
    np.testing.assert_allclose(got, _product(generic, raw, 8, 96, gate_up, swiglu=True), rtol=1e-4, atol=1e-3)
    if twin is not None:
        _same_bits(got, _product(twin, raw, 8, 96, gate_up, swiglu=True))


def attention_inputs(kv_type: int, head_dim: int, slot_of: list[int], pos_of: list[int]):
    """tq_attend's inputs for random qkv rows over a random cache of `kv_type`: (qkv, cache, the lanes'
    slots then positions, inverse frequencies, Attention)."""
    rng = np.random.default_rng(head_dim + kv_type)
    heads, kv_heads, slots, positions = 6, 2, 4, 300
    values = rng.standard_normal((2, slots, kv_heads, positions, head_dim)).astype(np.float32)
    cache = q8_rows(values) if kv_type == KvType.Q8_0 else values.astype(np.float16)
    qkv = (rng.standard_normal((len(slot_of), (heads + 2 * kv_heads) * head_dim)) * 3).astype(np.float32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(head_dim // 2) * 2 / head_dim)).astype(np.float32)
    lanes = np.array(slot_of + pos_of, np.int32)
    shape = Attention(len(slot_of), heads, kv_heads, slots, positions, head_dim, 0, 0, head_dim**-0.5, head_dim, 1.0, kv_type=kv_type)
    return qkv, cache, lanes, inv_freq, shape


def _attend(library: ctypes.CDLL, kv_type: int, head_dim: int, slot_of: list[int], pos_of: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """tq_attend of random qkv rows over a random cache of `kv_type`: (the output, the cache after)."""
    qkv, cache, lanes, inv_freq, shape = attention_inputs(kv_type, head_dim, slot_of, pos_of)
    out = np.empty((shape.lanes, shape.heads * head_dim), np.float32)
    library.tq_attend(
        _ptr(out), _ptr(qkv), _ptr(cache), _ptr(lanes), _ptr(inv_freq), _ptr(np.zeros(1, np.float32)), None, ctypes.byref(shape)
    )
    return out, cache


@pytest.mark.parametrize("name", SIMD_RUNGS)
@pytest.mark.parametrize("kv_type", [KvType.F16, KvType.Q8_0], ids=["f16", "q8_0"])
@pytest.mark.parametrize(
    ("slot_of", "pos_of"),
    [([2, 0, 3], [17, 0, 299]), ([1] * 5, [260, 261, 262, 263, 264])],
    ids=["lanes alone", "lanes of one sequence"],
)
def test_attention_matches_the_generic_build(name, kv_type, slot_of, pos_of):
    library, generic, twin = rung_library(name), rung_library("generic"), bit_twin(name)
    for head_dim in (64, 128):
        got, cache = _attend(library, kv_type, head_dim, slot_of, pos_of)
        expected, generic_cache = _attend(generic, kv_type, head_dim, slot_of, pos_of)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
        if kv_type == KvType.F16:  # a rotated key may round to the neighbouring float16 (FMA or not)
            np.testing.assert_allclose(cache.astype(np.float32), generic_cache.astype(np.float32), rtol=2e-3)
        if twin is not None:
            twin_out, twin_cache = _attend(twin, kv_type, head_dim, slot_of, pos_of)
            _same_bits(got, twin_out)
            np.testing.assert_array_equal(cache.view(np.uint8), twin_cache.view(np.uint8))


def test_each_rung_this_cpu_runs_reports_its_id():
    for name in RUNNABLE:
        assert _built(name).tq_isa() == RUNG_NAMES[name].isa


ZEN4 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
HASWELL = frozenset({"avx2", "fma", "f16c"})
ALDER_LAKE = HASWELL | {"avx_vnni"}


def test_the_highest_automatic_rung_a_cpu_runs_is_chosen_and_a_higher_one_when_named():
    # a rung is chosen by default once it wins at every step kind: AVX-512 VNNI's tiles do; the others
    # are built only when named
    assert [rung.name for rung in RUNGS if rung.automatic] == ["generic", "avx2", "avx512_vnni"]
    assert rung_for(None, "x86_64", ZEN4)[0].name == "avx512_vnni" and rung_for("avx2", "x86_64", ZEN4)[0].name == "avx2"
    assert rung_for("auto", "x86_64", ZEN4 - {"avx512_vnni"})[0].name == "avx2"
    assert rung_for("auto", "x86_64", HASWELL)[0].name == "avx2"
    assert rung_for("avx2_vnni", "x86_64", ALDER_LAKE) == (RUNG_NAMES["avx2_vnni"], ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"))
    assert rung_for(None, "x86_64", frozenset({"sse4_2"}))[0].name == "generic"
    assert rung_for(None, "aarch64", frozenset({"asimd", "asimddp"}))[0].name == "generic"
    # the ARM rungs, tested under qemu (test_arm_kernels.py), are built when named until measured on ARM
    assert rung_for("neon_dotprod", "aarch64", frozenset({"asimd", "asimddp"}))[1] == ("-march=armv8.2-a+dotprod", "-DTQ_NEON_RUNG")
    with pytest.raises(ValueError, match="LLM_CPU_ISA=neon_dotprod: .*lacks asimddp.*highest it runs is neon"):
        rung_for("neon_dotprod", "aarch64", frozenset({"asimd"}))
    # AVX-512 VNNI gives the 256-bit rung its dpbusd too, through AVX512-VL
    assert "-mavx512vnni" in rung_for("avx2_vnni", "x86_64", ZEN4)[1]
    assert [rung.name for rung, _ in executable_rungs("x86_64", ZEN4 - {"avx512_vnni"})] == ["generic", "avx2", "avx512"]


def test_the_override_refuses_a_rung_the_cpu_cannot_run():
    with pytest.raises(
        ValueError, match=r"LLM_CPU_ISA=avx512: this CPU cannot run .*lacks avx512bw, avx512f, avx512vl.*highest it runs is avx2_vnni"
    ):
        rung_for("avx512", "x86_64", ALDER_LAKE)
    with pytest.raises(ValueError, match="LLM_CPU_ISA=avx2: .*it is for amd64, x86_64, this machine is aarch64"):
        rung_for("avx2", "aarch64", frozenset({"asimd"}))
    with pytest.raises(
        ValueError, match="LLM_CPU_ISA='sse9': one of auto, generic, avx2, avx2_vnni, avx512, avx512_vnni, neon, neon_dotprod, neon_i8mm"
    ):
        rung_for("sse9", "x86_64", ZEN4)
    assert rung_for("generic", "x86_64", ZEN4)[0].isa == Isa.GENERIC  # a lower rung is always allowed


def test_every_name_of_the_seam_has_its_line_in_the_fallback_list():
    """fallback.h gives each function isa.h declares the highest version the build has; a name without
    its arm there would be left undefined (generic builds) or defined twice (a rung's)."""
    seam = (SOURCES / "isa.h").read_text()
    names = set(re.findall(r"^static (?!inline)[a-z0-9_ ]+?[ *](\w+)\(", seam, re.M))  # declared, not defined there
    fallback = (SOURCES / "fallback.h").read_text()
    assert len(names) == 11 and names == set(re.findall(r"^#define (\w+)_generic \1$", fallback, re.M))
    assert names == set(re.findall(r"^#define HAS_AVX2_(\w+) 1$", fallback, re.M))


def test_the_setting_names_the_rung_a_model_is_loaded_with(tmp_path):
    from support.tiny_models import write_tiny_gguf

    from webapp.engine.model.transformer import load_model
    from webapp.engine.serving.settings import engine_settings

    path = write_tiny_gguf(str(tmp_path / "m.gguf"), matrix_type="Q8_0")
    assert engine_settings({"MODEL": path}).cpu_isa == "auto"
    isa = engine_settings({"MODEL": path, "CPU_ISA": "generic"}).cpu_isa
    model, _ = load_model(path, slots=1, context=64, cpu_isa=isa)
    assert model.kernels.isa == Isa.GENERIC
    with pytest.raises(ValueError, match="LLM_CPU_ISA='sse9'"):
        load_model(path, slots=1, context=64, cpu_isa="sse9")
