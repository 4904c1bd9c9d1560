"""IQ4_XS's and MXFP4's blocks dequantized by tensor ops that fuse into a product's kernel.

Contract: `CODEBOOK_TYPES[ggml_type](blocks)` takes (n, bytes a block) uint8 blocks of that type
and returns their (n, values a block) float32 values, lazily, as GGML lays them out (ggml-quants.c's
dequantize_row_iq4_xs and dequantize_row_mxfp4; gguf's `quants` module is the tests' reference).
Each 4-bit code picks one of 16 values; the pick is a chain of comparisons, elementwise, where a
gather from a table would be a kernel of its own writing every value out.
"""

from __future__ import annotations

from tinygrad import Tensor, dtypes

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL's and IQ4_XS's
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # E2M1, doubled (the scale halves them)


def _picked(codes: Tensor, values: tuple[int, ...]) -> Tensor:
    """values[code] for every 4-bit code, float32."""
    # no starting tensor: a constant one of the codes' shape is written out as a buffer of its own
    out = (codes == 1).where(float(values[1]), float(values[0]))
    for code, value in enumerate(values[2:], 2):
        out = (codes == code).where(float(value), out)
    return out.cast(dtypes.float32)


def _nibbles(qs: Tensor) -> Tensor:
    """(..., 16) bytes -> (..., 32) codes: the 16 low nibbles, then the 16 high ones."""
    return Tensor.stack(qs.bitwise_and(15), qs.rshift(4), dim=-2).reshape(*qs.shape[:-1], 32)


def iq4_xs(blocks: Tensor) -> Tensor:
    """(n, 136): d (float16), the scales' high bits (uint16), their low bits (4 bytes), 128 bytes of
    codes -> (n, 256): eight runs of 32, each d * (its 6-bit scale - 32) * the codebook's value."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].bitcast(dtypes.float16).cast(dtypes.float32)  # (n, 1)
    high = blocks[:, 2:4].bitcast(dtypes.uint16).cast(dtypes.int32)  # (n, 1)
    low = blocks[:, 4:8]  # (n, 4): run 2i's low 4 bits in byte i's low nibble, run 2i + 1's in its high one
    low = Tensor.stack(low.bitwise_and(15), low.rshift(4), dim=-1).reshape(n, 8).cast(dtypes.int32)
    high = Tensor.cat(*[high.rshift(2 * run).bitwise_and(3) for run in range(8)], dim=-1)  # (n, 8)
    scale = d * (low + high * 16 - 32).cast(dtypes.float32)  # (n, 8)
    codes = _nibbles(blocks[:, 8:136].reshape(n, 8, 16))  # (n, 8, 32)
    return (scale.unsqueeze(-1) * _picked(codes, IQ4_VALUES)).reshape(n, 256)


def mxfp4(blocks: Tensor) -> Tensor:
    """(n, 17): an E8M0 exponent e, 16 bytes of codes -> (n, 32): 2^(e - 128) * the doubled E2M1 value."""
    e = blocks[:, 0:1].cast(dtypes.uint32)
    # 2^(e - 128) as float32 bits: a normal number from e = 2, the two below it subnormal
    bits = (e < 2).where((e == 0).where(0x00200000, 0x00400000), (e - 1) * (1 << 23))
    scale = bits.cast(dtypes.uint32).bitcast(dtypes.float32)  # (n, 1)
    return scale * _picked(_nibbles(blocks[:, 1:17]), MXFP4_VALUES)


CODEBOOK_TYPES = {23: iq4_xs, 39: mxfp4}
