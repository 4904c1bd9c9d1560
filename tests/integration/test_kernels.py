"""The quantized CPU kernels against a NumPy reference of each GGUF block format (float64 products).

Every supported type, on shapes whose rows are not a multiple of any SIMD width and token counts that
cross the kernels' groups of four, through the SIMD build the server uses and the portable C build,
called directly and inside a captured tinygrad step.
"""

import ctypes
import platform
import subprocess

import gguf
import numpy as np
import pytest
from tinygrad import Tensor, TinyJit

from webapp.engine.kernels.abi import ROWS_X8, ROWS_X16, AttendFlag, Attention, Isa, Product
from webapp.engine.kernels.block_weight import BLOCK_FORMATS, BlockWeight
from webapp.engine.kernels.build import RUNG_NAMES, SOURCE
from webapp.engine.kernels.cpu import QuantizedCPU
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

TYPES = sorted(BLOCK_FORMATS)
# the sixteen values of IQ4_NL's and IQ4_XS's 4-bit indices
IQ4_TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float64)
# MXFP4's E2M1 codes, doubled: a sign bit over 0, 0.5, 1, 1.5, 2, 3, 4, 6 (the scale is halved to match)
MXFP4_TABLE = np.array([0, 1, 2, 3, 4, 6, 8, 12, -0.0, -1, -2, -3, -4, -6, -8, -12], np.float64)


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


FLOATS = {0: np.float32, 1: np.float16, 30: np.float32}  # F32, F16, BF16 (a float32's upper half): the float formats


def random_blocks(ggml_type: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) of random quants with sane float16 scales, or of random floats."""
    _, values, size = BLOCK_FORMATS[ggml_type]
    if ggml_type in FLOATS:
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(cols**-0.5)).astype(FLOATS[ggml_type])
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8) if ggml_type == 30 else w.view(np.uint8)
    blocks = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    scales = lambda: _fp16_bytes(rng.uniform(0.005, 0.05, size=(rows, cols // values)))  # noqa: E731
    if ggml_type in (2, 3, 6, 7, 8, 20):
        blocks[..., 0:2] = scales()
    if ggml_type in (3, 7):
        blocks[..., 2:4] = _fp16_bytes(rng.uniform(-0.2, 0.2, size=(rows, cols // values)))
    if ggml_type in (12, 13):
        blocks[..., 0:2], blocks[..., 2:4] = scales(), scales()
    if ggml_type == 14:
        blocks[..., 208:210] = scales()
    if ggml_type == 10:
        blocks[..., 80:82], blocks[..., 82:84] = scales(), scales()
    if ggml_type == 11:
        blocks[..., 108:110] = scales()
    if ggml_type == 23:
        blocks[..., 0:2] = scales()
    if ggml_type == 39:  # MXFP4: E8M0 scales 2^-9 .. 2^-4 (the doubled levels reach 12), and now and then the smallest two
        blocks[..., 0] = rng.choice(np.array([0, 1, *range(119, 125)], np.uint8), size=(rows, cols // values), p=[0.02, 0.02] + [0.16] * 6)
    return blocks.reshape(rows, -1)


def dequantize(ggml_type: int, raw: np.ndarray, cols: int) -> np.ndarray:
    """The reference: each format's layout written out in NumPy, float64 (rows, cols)."""
    _, values, size = BLOCK_FORMATS[ggml_type]
    if ggml_type in FLOATS:
        as_float32 = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if ggml_type == 30 else raw.view(FLOATS[ggml_type])
        return as_float32.astype(np.float64).reshape(raw.shape[0], cols)
    b = raw.reshape(-1, size)
    f16 = lambda lo: b[:, lo : lo + 2].copy().view(np.float16).astype(np.float64)  # (blocks, 1)  # noqa: E731
    nib = lambda q: np.concatenate([q & 15, q >> 4], axis=-1).astype(np.float64)  # noqa: E731
    if ggml_type == 2:
        out = (nib(b[:, 2:18]) - 8) * f16(0)
    elif ggml_type == 3:
        out = nib(b[:, 4:20]) * f16(0) + f16(2)
    elif ggml_type == 8:
        out = b[:, 2:34].view(np.int8).astype(np.float64) * f16(0)
    elif ggml_type in (6, 7):  # Q5_0, Q5_1: the nibbles plus 16 where bit i of the little-endian word before them is set
        at = 2 if ggml_type == 6 else 4
        fifth = (b[:, at : at + 4].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
        q = nib(b[:, at + 4 : at + 20]) + 16 * fifth
        out = (q - 16) * f16(0) if ggml_type == 6 else q * f16(0) + f16(2)
    elif ggml_type == 20:  # IQ4_NL: each nibble indexes GGML's 16 levels
        levels = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float64)
        out = levels[nib(b[:, 2:18]).astype(np.int64)] * f16(0)
    elif ggml_type in (12, 13):  # Q5_K: Q4_K plus a fifth bit per value, bit j of byte i for value i of sub-block j
        s = b[:, 4:16].astype(np.int64)
        sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
        mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
        qs = b[:, 16:144].reshape(-1, 4, 32) if ggml_type == 12 else b[:, 48:176].reshape(-1, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float64)
        if ggml_type == 13:
            q += 16 * ((b[:, None, 16:48] >> np.arange(8)[None, :, None]) & 1)
        out = (f16(0)[:, :, None] * sc[:, :, None] * q - f16(2)[:, :, None] * mn[:, :, None]).reshape(-1, 256)
    elif ggml_type in (10, 11):  # value i = 128h + 32j + pos: bit pair j of byte 32h + pos, one (sub-)scale per 16 values
        h, j, pos = np.arange(256) // 128, np.arange(256) // 32 % 4, np.arange(256) % 32
        low = b[:, (16 if ggml_type == 10 else 32) + 32 * h + pos].astype(np.int64) >> (2 * j) & 3  # (blocks, 256)
        if ggml_type == 10:
            sm = np.repeat(b[:, 0:16].astype(np.int64), 16, axis=1)
            out = f16(80) * (sm & 15) * low - f16(82) * (sm >> 4)
        else:  # Q3_K: a third bit (bit 4h + j of byte pos) and sixteen 6-bit scales minus 32, values minus 4
            s, k = b[:, 96:108].astype(np.int64), np.arange(16)
            sc = ((s[:, k % 8] >> 4 * (k // 8)) & 15 | ((s[:, 8 + k % 4] >> 2 * (k // 4)) & 3) << 4) - 32
            high = b[:, pos].astype(np.int64) >> (4 * h + j) & 1
            out = f16(108) * np.repeat(sc, 16, axis=1) * (low + 4 * high - 4)
    elif ggml_type == 39:  # MXFP4: doubled E2M1 codes times 2^(e - 128)
        scale = np.ldexp(1.0, b[:, :1].astype(np.int64) - 128)
        out = MXFP4_TABLE[nib(b[:, 1:17]).astype(np.int64)] * scale
    elif ggml_type == 23:  # IQ4_XS: eight 6-bit scales minus 32, 4-bit indices into the IQ4 table as Q4_0 packs them
        j = np.arange(8)
        high = b[:, 2].astype(np.int64) | b[:, 3].astype(np.int64) << 8
        sc = ((b[:, 4 + j // 2].astype(np.int64) >> 4 * (j % 2)) & 15 | ((high[:, None] >> 2 * j) & 3) << 4) - 32
        index = np.concatenate([b[:, 8:136].reshape(-1, 8, 16) & 15, b[:, 8:136].reshape(-1, 8, 16) >> 4], axis=2)
        out = (f16(0)[:, :, None] * sc[:, :, None] * IQ4_TABLE[index]).reshape(-1, 256)
    else:  # Q6_K
        ql, qh = b[:, 0:128].astype(np.int64), b[:, 128:192].astype(np.int64)
        sc = b[:, 192:208].view(np.int8).astype(np.float64)
        out = np.empty((len(b), 256))
        for half in range(2):
            l0, l1, h = ql[:, 64 * half : 64 * half + 32], ql[:, 64 * half + 32 : 64 * half + 64], qh[:, 32 * half : 32 * half + 32]
            subs = [
                (l0 & 15) | ((h & 3) << 4),
                (l1 & 15) | (((h >> 2) & 3) << 4),
                (l0 >> 4) | (((h >> 4) & 3) << 4),
                (l1 >> 4) | (((h >> 6) & 3) << 4),
            ]
            for k, q in enumerate(subs):
                scale = np.repeat(sc[:, 8 * half + 2 * k : 8 * half + 2 * k + 2], 16, axis=1)
                out[:, 128 * half + 32 * k : 128 * half + 32 * k + 32] = (q - 32) * scale
        out *= f16(208)
    return out.reshape(raw.shape[0], cols)


# How the kernels round a format's activations to int8 (isa.h's ACT_*), 32 values a scale: Q8_1 for
# these and Q8_0 (the scale in float16) for the 32-value formats, as llama.cpp's CPU backend does for
# the same weights; a float32 scale for the K-quants and IQ4_XS.
Q8_1_FORMATS, F32_SCALE_FORMATS = {3, 7}, {10, 11, 12, 13, 14, 23}


def quantize_activations(x: np.ndarray, ggml_type: int) -> tuple[np.ndarray, np.ndarray]:
    """x rounded as the kernels round it for `ggml_type`'s products: the values q * d (float64, x's
    shape) and each 32 values' s, d * sum(q), as the kernels keep it (tokens, cols / 32)."""
    spans = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(spans).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.rint(spans * inv)
    if ggml_type in F32_SCALE_FORMATS:
        d = np.where(inv > 0, np.float32(1) / np.where(inv > 0, inv, 1), np.float32(0)).astype(np.float32)
    else:
        d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    sums = q.reshape(x.shape[0], -1, 32).sum(-1)
    if ggml_type in Q8_1_FORMATS:  # in float16, from d before its rounding
        s = ((amax[..., 0] / np.float32(127)) * sums).astype(np.float16)
    else:
        s = d[..., 0] * sums
    return (q * d).reshape(x.shape).astype(np.float64), s.astype(np.float64)


def int8_product(ggml_type: int, raw: np.ndarray, x: np.ndarray, cols: int) -> np.ndarray:
    """The reference product (tokens, rows), float64, of x and the rows of `raw`, as the kernels
    compute it up to the order of float32 sums: x as it is for the float formats, else rounded to int8
    (quantize_activations); a Q4_1 or Q5_1 block's min times the activations' own s."""
    w = dequantize(ggml_type, raw, cols)
    if ggml_type in FLOATS:
        return x.astype(np.float64) @ w.T
    values, s = quantize_activations(x, ggml_type)
    if ggml_type not in Q8_1_FORMATS:
        return values @ w.T
    mins = raw.reshape(raw.shape[0], cols // 32, -1)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    return values @ (w - np.repeat(mins, 32, axis=1)).T + s @ mins.T


def assert_rows_are_their_blocks_product(
    got: np.ndarray, x: np.ndarray, raw: np.ndarray, ggml_type: int, picked: np.ndarray, cols: int
) -> None:
    """A product's rows `picked` of `got` (tokens, rows) are the float64 product of those rows'
    blocks in `raw` with x's int8-rounded activations, within the kernels' float32 rounding."""
    w = dequantize(ggml_type, raw[picked], cols)
    np.testing.assert_allclose(
        got[:, picked], int8_product(ggml_type, raw[picked], x, cols), rtol=1e-4, atol=1e-4 * np.abs(w).max() * cols**0.5
    )


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def _ref(shape: ctypes.Structure):
    """A pointer to one of tq.h's structs (abi.py's mirror), as the kernels take their shapes."""
    return ctypes.byref(shape)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_dequantize_matches_the_reference_and_gguf(library, ggml_type):
    rng = np.random.default_rng(ggml_type)
    cols = BLOCK_FORMATS[ggml_type][1] * 2
    raw = random_blocks(ggml_type, 5, cols, rng)
    expected = dequantize(ggml_type, raw, cols)
    np.testing.assert_allclose(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).reshape(5, cols), expected, rtol=1e-6)
    got = np.empty((5, cols), np.float32)
    library.tq_dequantize(_ptr(got), _ptr(raw), _ref(Product(ggml_type, 5, cols, 1)))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_products_match_float64(library, ggml_type, tokens):
    rng = np.random.default_rng(tokens * 100 + ggml_type)
    rows, cols = 37, BLOCK_FORMATS[ggml_type][1] * (3 if BLOCK_FORMATS[ggml_type][1] == 32 else 2)
    raw = random_blocks(ggml_type, rows, cols, rng)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    got = np.empty((tokens, rows), np.float32)
    library.tq_linear(_ptr(got), _ptr(raw), _ptr(x), _ref(Product(ggml_type, rows, cols, tokens)))
    w = dequantize(ggml_type, raw, cols)
    # exact up to float32 sums once x is rounded as the kernels round it; close to the unrounded product
    np.testing.assert_allclose(got, int8_product(ggml_type, raw, x, cols), rtol=1e-4, atol=1e-4 * np.abs(w).max() * cols**0.5)
    exact = x.astype(np.float64) @ w.T
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("ggml_type", TYPES)
def test_each_token_row_is_independent_of_the_others(library, ggml_type):
    """Batch invariance, every format (the float ones' sums too): a row's result is bit-identical
    whatever else shares the call, alone or among the eight tokens of a pass and the three after it."""
    rng = np.random.default_rng(7)
    cols = 96 if BLOCK_FORMATS[ggml_type][1] == 32 else 512
    raw = random_blocks(ggml_type, 40, cols, rng)
    x = rng.standard_normal((11, cols)).astype(np.float32)
    shape = lambda t: _ref(Product(ggml_type, 40, cols, t))  # noqa: E731
    together, alone = np.empty((11, 40), np.float32), np.empty((1, 40), np.float32)
    library.tq_linear(_ptr(together), _ptr(raw), _ptr(x), shape(11))
    for t in range(11):
        library.tq_linear(_ptr(alone), _ptr(raw), _ptr(np.ascontiguousarray(x[t : t + 1])), shape(1))
        assert np.array_equal(alone[0], together[t])


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("rows", [1, 8, 9])
def test_one_block_rows_match_their_blocks_product(library, ggml_type, rows):
    """The smallest shapes a file can give: rows of one block, one row, a single interleaved eight and
    one row past it (the sanitizers' run reads these for any access past the blocks)."""
    rng = np.random.default_rng(rows * 1000 + ggml_type)
    cols = BLOCK_FORMATS[ggml_type][1]
    raw = random_blocks(ggml_type, rows, cols, rng)
    packed, stored_type = _repack(library, raw, ggml_type, cols)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    got = np.empty((5, rows), np.float32)
    library.tq_linear(_ptr(got), _ptr(packed), _ptr(x), _ref(Product(stored_type, rows, cols, 5)))
    w = dequantize(ggml_type, raw, cols)
    np.testing.assert_allclose(got, int8_product(ggml_type, raw, x, cols), rtol=1e-4, atol=1e-4 * np.abs(w).max() * cols**0.5)


def interleaved_type(isa: int, ggml_type: int) -> int:
    """The type a build for `isa` stores a matrix of `ggml_type` with rows in eights as: in pairs of
    groups (ROWS_X16) for the AVX-512 tiles, in groups (ROWS_X8) for AVX2's."""
    return (ROWS_X16 if isa in (Isa.AVX512, Isa.AVX512_VNNI) else ROWS_X8) + ggml_type


def _repack(library, raw: np.ndarray, ggml_type: int, cols: int) -> tuple[np.ndarray, int]:
    packed = np.empty_like(raw)
    stored_type = library.tq_repack(_ptr(packed), _ptr(raw), _ref(Product(ggml_type, raw.shape[0], cols)))
    return packed, stored_type


@pytest.mark.parametrize("ggml_type", [2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 39])
@pytest.mark.parametrize("rows", [40, 37])
def test_interleaved_rows_give_the_same_products_rows_and_invariance(library, ggml_type, rows):
    """Every format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4) with rows in eights is stored
    interleaved where the SIMD kernels serve (other row counts and the portable build keep the file's layout): every product, dequantized row and
    embedding lookup stays that of the file's blocks, and a token's row is the same alone or among others."""
    rng = np.random.default_rng(rows + ggml_type)
    cols = 96 if BLOCK_FORMATS[ggml_type][1] == 32 else 512
    raw = random_blocks(ggml_type, rows, cols, rng)
    packed, stored_type = _repack(library, raw, ggml_type, cols)
    interleaved = library.tq_isa() != Isa.GENERIC and rows % 8 == 0
    # in pairs of groups, 40 rows' fifth group is alone
    assert stored_type == (interleaved_type(library.tq_isa(), ggml_type) if interleaved else ggml_type)
    assert np.array_equal(packed, raw) != interleaved and np.array_equal(np.sort(packed, axis=None), np.sort(raw, axis=None))
    w = dequantize(ggml_type, raw, cols)
    rows_out = np.empty((rows, cols), np.float32)
    library.tq_dequantize(_ptr(rows_out), _ptr(packed), _ref(Product(stored_type, rows, cols, 1)))
    np.testing.assert_allclose(rows_out, w, rtol=1e-6, atol=1e-7)
    ids = np.array([rows - 1, 0, 9], np.int32)
    embedded = np.empty((3, cols), np.float32)
    library.tq_embed(_ptr(embedded), _ptr(packed), _ptr(ids), _ref(Product(stored_type, rows, cols, 3)))
    np.testing.assert_allclose(embedded, w[ids], rtol=1e-6, atol=1e-7)
    x = rng.standard_normal((9, cols)).astype(np.float32)
    together, alone = np.empty((9, rows), np.float32), np.empty((1, rows), np.float32)
    library.tq_linear(_ptr(together), _ptr(packed), _ptr(x), _ref(Product(stored_type, rows, cols, 9)))
    np.testing.assert_allclose(together, int8_product(ggml_type, raw, x, cols), rtol=1e-4, atol=1e-4 * np.abs(w).max() * cols**0.5)
    for t in (0, 4, 8):
        library.tq_linear(_ptr(alone), _ptr(packed), _ptr(np.ascontiguousarray(x[t : t + 1])), _ref(Product(stored_type, rows, cols, 1)))
        assert np.array_equal(alone[0], together[t])


def test_kernels_run_inside_a_captured_tinygrad_step():
    use_tinygrad_from_this_thread()
    kernels = QuantizedCPU.load()
    assert kernels is not None, "the CPU device with clang should always get the kernels"
    rng = np.random.default_rng(3)
    raw = random_blocks(8, 50, 64, rng)
    weight = BlockWeight(Tensor(raw).realize(), 8, 50, 64)
    w = dequantize(8, raw, 64)

    @TinyJit
    def step(x: Tensor, ids: Tensor) -> Tensor:
        return (kernels.linear(x * 2, weight) + kernels.embed(ids, weight)[:, :50]).realize()

    for i in range(4):  # capture, then replays with new inputs
        x = rng.standard_normal((2, 64)).astype(np.float32)
        ids = np.array([i, 49 - i], np.int32)
        got = step(Tensor(x).realize(), Tensor(ids).realize()).numpy()
        np.testing.assert_allclose(got, int8_product(8, raw, 2 * x, 64) + w[ids][:, :50], rtol=1e-4, atol=1e-3)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True) + eps) * weight


@pytest.mark.parametrize("tokens", [1, 6])
def test_fused_linears_match_their_parts(library, tokens):
    """rms-norm before the product, the residual after it, and silu(gate) * up before it, each inside
    one kernel, against NumPy doing the same steps around the plain product."""
    rng = np.random.default_rng(5)
    rows, cols, eps = 40, 64, 1e-5
    raw = random_blocks(3, rows, cols, rng)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    residual = rng.standard_normal((tokens, rows)).astype(np.float32)
    gate_up = rng.standard_normal((tokens, 2 * cols)).astype(np.float32)
    got = np.empty((tokens, rows), np.float32)

    library.tq_norm_linear(_ptr(got), _ptr(raw), _ptr(x), _ptr(norm), _ref(Product(3, rows, cols, tokens, eps)))
    np.testing.assert_allclose(got, int8_product(3, raw, _rms_norm(x, norm, eps), cols), rtol=1e-4, atol=1e-3)

    library.tq_residual_linear(_ptr(got), _ptr(raw), _ptr(x), _ptr(residual), _ref(Product(3, rows, cols, tokens)))
    np.testing.assert_allclose(got, residual + int8_product(3, raw, x, cols), rtol=1e-4, atol=1e-3)

    library.tq_swiglu_linear(_ptr(got), _ptr(raw), _ptr(gate_up), _ptr(residual), _ref(Product(3, rows, cols, tokens)))
    gate, up = gate_up[:, :cols].astype(np.float64), gate_up[:, cols:]
    np.testing.assert_allclose(got, residual + int8_product(3, raw, gate / (1 + np.exp(-gate)) * up, cols), rtol=1e-4, atol=1e-3)


def _inverse_frequencies(head_dim: int) -> np.ndarray:
    return (1.0 / 10000.0 ** (np.arange(head_dim // 2) * 2 / head_dim)).astype(np.float32)


def _attend_inputs(rng, lanes_n, heads, kv_heads, head_dim):
    return rng.standard_normal((lanes_n, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)


def _rotate(x: np.ndarray, pos: int, inv_freq: np.ndarray) -> np.ndarray:
    angle = np.float32(pos) * inv_freq
    cos, sin = np.cos(angle.astype(np.float64)), np.sin(angle.astype(np.float64))
    half = len(inv_freq)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize(
    ("head_dim", "positions"),
    [(64, 40), (128 + 40, 40), (12, 40), (64, 700)],  # 32-wide value columns, then 8-wide ones too, scalar; a long context
)
def test_attention_writes_the_new_keys_then_matches_numpy(library, head_dim, positions):
    """Each lane writes its rotated key and its value at its position, rounded to float16 as NumPy
    rounds, then attends its own slot's float16 keys and values up to that position."""
    rng = np.random.default_rng(11)
    lanes_n, heads, kv_heads, slots = 3, 6, 2, 4
    slot_of, pos_of = [2, 0, 3], [17, 0, positions - 1] if positions < 256 else [256, 255, positions - 1]
    lanes = np.array(slot_of + pos_of, np.int32)
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    got = np.empty((lanes_n, heads * head_dim), np.float32)
    no_extras = np.zeros(1, np.float32)

    def step(cache, qkv, inv_freq):
        expected = cache.copy()
        for b, (slot, pos) in enumerate(zip(slot_of, pos_of)):
            k = qkv[b, q_end:k_end].reshape(kv_heads, head_dim)
            if inv_freq.any():
                k = _rotate(k.astype(np.float64), pos, inv_freq).astype(np.float32)
            with np.errstate(over="ignore"):
                expected[0, slot, :, pos] = k.astype(np.float16)
                expected[1, slot, :, pos] = qkv[b, k_end:].reshape(kv_heads, head_dim).astype(np.float16)
        shape = Attention(lanes_n, heads, kv_heads, slots, positions, head_dim, 0, 0, head_dim**-0.5, head_dim, 1.0)
        library.tq_attend(_ptr(got), _ptr(qkv), _ptr(cache), _ptr(lanes), _ptr(inv_freq), _ptr(no_extras), None, _ref(shape))
        # bit for bit without rotation (the rounding); within float32 rounding of the rotation with it
        np.testing.assert_allclose(cache.astype(np.float32), expected.astype(np.float32), rtol=2e-3 if inv_freq.any() else 0)

    cache = rng.standard_normal((2, slots, kv_heads, positions, head_dim)).astype(np.float16)
    extremes = np.zeros((lanes_n, (heads + 2 * kv_heads) * head_dim), np.float32)
    extremes[0, q_end : q_end + 8] = [1e-7, -3e-6, 6e-5, 7e4, 65519, 2049, 2051, 1e-30]  # subnormals, overflow, ties
    step(cache, extremes, np.zeros(head_dim // 2, np.float32))
    inv_freq = _inverse_frequencies(head_dim)
    qkv = (_attend_inputs(rng, lanes_n, heads, kv_heads, head_dim) * 3).astype(np.float32)
    step(cache, qkv, inv_freq)
    for b, (slot, pos) in enumerate(zip(slot_of, pos_of)):
        for h in range(heads):
            q = _rotate(qkv[b, h * head_dim : (h + 1) * head_dim].astype(np.float64), pos, inv_freq)
            k, v = (cache[i, slot, h // (heads // kv_heads), : pos + 1].astype(np.float64) for i in (0, 1))
            scores = k @ q / np.sqrt(head_dim)
            probs = np.exp(scores - scores.max())
            np.testing.assert_allclose(got[b, h * head_dim : (h + 1) * head_dim], probs / probs.sum() @ v, rtol=1e-4, atol=1e-4)


def test_attention_adds_the_bias_and_normalizes_q_and_k_heads(library):
    """qwen2's qkv bias and qwen3's per-head q/k norms, applied before the rotation: the key written
    and the output equal attention over the NumPy-prepared heads."""
    rng = np.random.default_rng(3)
    heads, kv_heads, head_dim, slots, positions, eps = 4, 2, 16, 2, 8, 1e-6
    group, width = heads // kv_heads, (heads + 2 * kv_heads) * head_dim
    qkv = _attend_inputs(rng, 1, heads, kv_heads, head_dim)
    bias = rng.standard_normal(width).astype(np.float32)
    q_norm, k_norm = (rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for _ in range(2))
    inv_freq = _inverse_frequencies(head_dim)
    lanes = np.array([1, 1], np.int32)  # slot 1, position 1: attends the key already at 0 and its own
    shape = Attention(
        1, heads, kv_heads, slots, positions, head_dim, AttendFlag.BIAS | AttendFlag.QK_NORM, eps, head_dim**-0.5, head_dim, 1.0
    )
    cache = rng.standard_normal((2, slots, kv_heads, positions, head_dim)).astype(np.float16)
    got = np.empty((1, heads * head_dim), np.float32)
    library.tq_attend(
        _ptr(got), _ptr(qkv), _ptr(cache), _ptr(lanes), _ptr(inv_freq), _ptr(np.concatenate([bias, q_norm, k_norm])), None, _ref(shape)
    )

    x = (qkv[0] + bias).astype(np.float64)
    q = _rotate(_rms_norm(x[: heads * head_dim].reshape(heads, head_dim), q_norm, eps), 1, inv_freq)
    k = _rotate(_rms_norm(x[heads * head_dim : (heads + kv_heads) * head_dim].reshape(kv_heads, head_dim), k_norm, eps), 1, inv_freq)
    np.testing.assert_allclose(cache[0, 1, :, 1], k, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(cache[1, 1, :, 1], x[(heads + kv_heads) * head_dim :].reshape(kv_heads, head_dim), rtol=2e-3, atol=2e-3)
    for h in range(heads):
        keys, values = (cache[i, 1, h // group, :2].astype(np.float64) for i in (0, 1))
        scores = keys @ q[h] / np.sqrt(head_dim)
        probs = np.exp(scores - scores.max())
        np.testing.assert_allclose(got[0, h * head_dim : (h + 1) * head_dim], probs / probs.sum() @ values, rtol=1e-3, atol=1e-3)


def test_a_lanes_attention_is_the_same_bits_alone_and_among_others(library):
    """Eight lanes share each kv head's keys among its query heads as one item; one lane alone runs a
    head per item, and lanes at different positions have different numbers of key chunks. A lane's
    output must not depend on which way it ran (batch invariance)."""
    rng = np.random.default_rng(8)
    lanes_n, heads, kv_heads, head_dim, slots, positions = 8, 12, 2, 64, 8, 600
    qkv = _attend_inputs(rng, lanes_n, heads, kv_heads, head_dim)
    inv_freq = _inverse_frequencies(head_dim)
    slot_of, pos_of = list(range(lanes_n)), [int(p) for p in rng.integers(0, positions, lanes_n)]
    cache = rng.standard_normal((2, slots, kv_heads, positions, head_dim)).astype(np.float16)
    together = np.empty((lanes_n, heads * head_dim), np.float32)
    shape = Attention(lanes_n, heads, kv_heads, slots, positions, head_dim, 0, 0, head_dim**-0.5, head_dim, 1.0)
    lanes = np.array(slot_of + pos_of, np.int32)
    library.tq_attend(
        _ptr(together), _ptr(qkv), _ptr(cache.copy()), _ptr(lanes), _ptr(inv_freq), _ptr(np.zeros(1, np.float32)), None, _ref(shape)
    )
    for b in range(lanes_n):
        alone = np.empty((1, heads * head_dim), np.float32)
        one = Attention(1, heads, kv_heads, slots, positions, head_dim, 0, 0, head_dim**-0.5, head_dim, 1.0)
        row = np.ascontiguousarray(qkv[b : b + 1])
        lane = np.array([slot_of[b], pos_of[b]], np.int32)
        library.tq_attend(
            _ptr(alone), _ptr(row), _ptr(cache.copy()), _ptr(lane), _ptr(inv_freq), _ptr(np.zeros(1, np.float32)), None, _ref(one)
        )
        np.testing.assert_array_equal(alone[0].view(np.uint32), together[b].view(np.uint32))


@pytest.mark.parametrize(
    ("ggml_type", "rows", "cols"),
    [(14, 49_152, 2_048), (12, 4_096, 2_048), (14, 151_936, 1_024), (12, 4_100, 1_280), (1, 49_152, 2_048), (30, 4_100, 2_048)],
    ids=["Q6_K 1.7B embedding", "Q4_K 1.7B qkv", "Q6_K Qwen vocabulary", "Q4_K rows not in eights", "F16 embedding", "BF16 4,100 rows"],
)
def test_k_quant_matrices_at_real_shapes_store_and_multiply_whole(ggml_type, rows, cols):
    """Q4_K_M files' matrices at the sizes that crashed the loader (a Qwen3-1.7B-shaped file's tied Q6_K
    embedding, its stacked Q4_K q/k/v): stored as the file's bytes, and every row's product right."""
    use_tinygrad_from_this_thread()
    kernels = QuantizedCPU.load()
    assert kernels is not None
    rng = np.random.default_rng(rows)
    raw = random_blocks(ggml_type, rows, cols, rng)
    weight = kernels.block_weight(raw, ggml_type, cols)
    interleaved = rows % 8 == 0 and kernels.isa != Isa.GENERIC and ggml_type not in FLOATS
    assert (weight.ggml_type, weight.rows, weight.cols) == (
        interleaved_type(kernels.isa, ggml_type) if interleaved else ggml_type,
        rows,
        cols,
    )
    stored = weight.raw.numpy()
    assert np.array_equal(stored, raw) if not interleaved else np.array_equal(np.sort(stored, axis=None), np.sort(raw, axis=None))
    x = rng.standard_normal((1, cols)).astype(np.float32)
    got = kernels.linear(Tensor(x), weight).numpy()
    picked = np.sort(rng.choice(rows, 64, replace=False))
    picked[-1] = rows - 1
    w = dequantize(ggml_type, raw[picked], cols)
    np.testing.assert_allclose(
        got[0, picked], int8_product(ggml_type, raw[picked], x, cols)[0], rtol=1e-4, atol=1e-4 * np.abs(w).max() * cols**0.5
    )


def stored_random_matrix(ggml_type: int, rows: int, cols: int):
    """The server's kernels, a generator, random blocks and the weight they store (interleaved where
    the rows come in eights and the build has tiles)."""
    use_tinygrad_from_this_thread()
    kernels = QuantizedCPU.load()
    assert kernels is not None
    rng = np.random.default_rng(rows + ggml_type)
    raw = random_blocks(ggml_type, rows, cols, rng)
    weight = kernels.block_weight(raw, ggml_type, cols)
    assert weight.ggml_type == (interleaved_type(kernels.isa, ggml_type) if rows % 8 == 0 and kernels.isa != Isa.GENERIC else ggml_type)
    return kernels, rng, raw, weight


@pytest.mark.parametrize("ggml_type", [23, 11, 10], ids=["IQ4_XS", "Q3_K", "Q2_K"])
@pytest.mark.parametrize(("rows", "cols"), [(49_152, 2_048), (4_100, 2_048)], ids=["1.7B embedding", "rows not in eights"])
def test_low_bit_matrices_at_real_shapes_multiply_every_row_right(ggml_type, rows, cols):
    """IQ4_XS, Q3_K and Q2_K at a Qwen3-1.7B embedding's size (interleaved in eights: the tiles) and at
    rows not in eights (the row kernels), a few tokens at once: the rows picked across the matrix, the
    last ones among them, match the float64 product of their blocks."""
    kernels, rng, raw, weight = stored_random_matrix(ggml_type, rows, cols)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    got = kernels.linear(Tensor(x), weight).numpy()
    picked = np.unique(np.concatenate([rng.choice(rows, 60, replace=False), np.arange(rows - 4, rows)]))
    assert_rows_are_their_blocks_product(got, x, raw, ggml_type, picked, cols)


@pytest.mark.parametrize(
    ("ggml_type", "rows", "cols"),
    [(6, 49_152, 2_048), (6, 4_100, 2_048), (7, 6_144, 2_048), (7, 4_100, 2_048), (20, 49_152, 2_048), (20, 4_100, 2_048)],
    ids=[
        "Q5_0 1.7B embedding",
        "Q5_0 rows not in eights",
        "Q5_1 1.7B ffn",
        "Q5_1 rows not in eights",
        "IQ4_NL 1.7B embedding",
        "IQ4_NL rows not in eights",
    ],
)
def test_q5_and_iq4_nl_matrices_at_real_shapes_multiply_whole(ggml_type, rows, cols):
    """Q5_0, Q5_1 and IQ4_NL matrices at a Qwen3-1.7B file's widths, through the server's kernels: rows
    in eights run on the interleaved tiles, other counts on the row kernels, and every row's product
    (the last row's too) is the float64 one, for token counts on either side of a group of four."""
    kernels, rng, raw, weight = stored_random_matrix(ggml_type, rows, cols)
    picked = np.sort(rng.choice(rows, 64, replace=False))
    picked[-1] = rows - 1
    for tokens in (1, 5):
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        assert_rows_are_their_blocks_product(kernels.linear(Tensor(x), weight).numpy(), x, raw, ggml_type, picked, cols)


def test_a_matrix_whose_bytes_do_not_fit_its_shape_is_refused_before_the_kernels_see_it():
    kernels = QuantizedCPU.load()
    assert kernels is not None
    raw = random_blocks(14, 16, 512, np.random.default_rng(0))
    with pytest.raises(ValueError, match="Q6_K matrix of 512 columns"):
        kernels.block_weight(raw[:, :-1], 14, 512)
    with pytest.raises(ValueError, match="Q6_K matrix of 500 columns"):
        kernels.block_weight(raw, 14, 500)
    with pytest.raises(ValueError, match="no CPU kernel"):
        kernels.block_weight(raw, 15, 512)  # Q8_K: llama.cpp's activations' type, never a file's


@pytest.mark.parametrize("tokens", [1, 5])
def test_a_stack_of_types_multiplies_as_its_parts_would(tokens):
    """A matrix stacked from parts of different types (Q4_K_M's q and k in Q4_K over v in Q6_K; a Q8_0
    part of 16 rows, stored interleaved): the product, with the norm before it and the residual after,
    equals the parts' own products side by side, bit for bit, and a token's row is the same alone."""
    use_tinygrad_from_this_thread()
    kernels = QuantizedCPU.load()
    assert kernels is not None
    rng = np.random.default_rng(tokens)
    cols, parts = 512, [(12, 40), (14, 37), (8, 16)]
    raws = [random_blocks(t, rows, cols, rng) for t, rows in parts]
    stacked = kernels.stacked_weight([(raw, t) for raw, (t, _) in zip(raws, parts)], cols)
    assert stacked.rows == 93 and stacked.type_name == "Q4_K+Q6_K+Q8_0"
    alone = [kernels.block_weight(raw, t, cols) for raw, (t, _) in zip(raws, parts)]
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    norm = Tensor(rng.uniform(0.5, 1.5, cols).astype(np.float32))
    residual = rng.standard_normal((tokens, 93)).astype(np.float32)
    got = kernels.residual_linear(Tensor(x), stacked, Tensor(residual)).numpy()
    expected = np.concatenate([kernels.linear(Tensor(x), w).numpy() for w in alone], axis=1) + residual
    np.testing.assert_array_equal(got, expected)
    normed = kernels.norm_linear(Tensor(x), stacked, norm, 1e-6).numpy()
    np.testing.assert_array_equal(normed, np.concatenate([kernels.norm_linear(Tensor(x), w, norm, 1e-6).numpy() for w in alone], axis=1))
    w = np.concatenate([dequantize(t, raw, cols) for raw, (t, _) in zip(raws, parts)])
    want = np.concatenate([int8_product(t, raw, x, cols) for raw, (t, _) in zip(raws, parts)], axis=1)
    np.testing.assert_allclose(got - residual, want, rtol=1e-4, atol=1e-4 * np.abs(w).max() * cols**0.5)
    np.testing.assert_array_equal(kernels.linear(Tensor(x[:1]), stacked).numpy()[0], kernels.linear(Tensor(x), stacked).numpy()[0])


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86 build")
@pytest.mark.parametrize("way", range(len(RUNG_NAMES["avx2_vnni"].ways)), ids=["AVX-VNNI", "AVX512-VNNI+VL"])
def test_each_way_of_the_vnni_rung_compiles_its_integer_dots_to_dpbusd(way):
    """dot_u8_add and dot_u8_quads are the one place the integer dot's instructions are chosen: built
    with either way of the avx2_vnni rung (build.py), every tile takes dpbusd with no kernel of its
    own. Compiled only: this CPU need not run it (test_isa_ladder.py runs the rungs it can)."""
    flags = RUNG_NAMES["avx2_vnni"].ways[way][1]
    build = subprocess.run(["clang", "-O3", "-S", "-o", "-", "-fno-math-errno", *flags, str(SOURCE)], capture_output=True, text=True)
    if build.returncode != 0 and "unknown argument" in build.stderr:
        pytest.skip(f"this clang lacks a flag: {build.stderr.strip()}")
    assert build.returncode == 0, build.stderr
    assert "vpdpbusd" in build.stdout


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86 build")
def test_the_avx512_rungs_norms_take_no_gathers():
    """Built with AVX-512's flags, clang vectorized the norms' square sums (linear.c) with gathers and
    masked stores, which made a one-lane step slower than AVX2's; SCALAR_LOOP keeps that loop scalar.
    Compiled only: this CPU need not run the rung."""
    flags = RUNG_NAMES["avx512_vnni"].ways[0][1]
    build = subprocess.run(["clang", "-O3", "-S", "-o", "-", "-fno-math-errno", *flags, str(SOURCE)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    body = build.stdout.split("\nlinear:", 1)[1].split(".Lfunc_end", 1)[0]
    assert "vfmadd" in body and "gather" not in body
