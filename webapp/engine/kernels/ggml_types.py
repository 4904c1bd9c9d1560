"""GGML's tensor types: one table of every type this server reads, and the names of those it cannot.

`GGML_TYPES[id] = (name, values per block, bytes per block)`; a plain number type is a block of one
value (the kernels read F32, F16 and BF16 in blocks of 32: kernels/cpu.py's BLOCK_FORMATS). Readable means a CPU kernel multiplies it (kernels/cpu.py's BLOCK_FORMATS, a subset) or
tinygrad's gguf code dequantizes it. Standard library only.
"""

GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    18: ("IQ3_XXS", 256, 98), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 39: ("MXFP4", 32, 17),
    20: ("IQ4_NL", 32, 18),
}  # fmt: skip
# readable through the CPU kernels only: tinygrad's gguf code has no dequantization for these, so a
# matrix of one of them on another device, or with the kernels off, is refused at load
KERNEL_ONLY_TYPES = {10: "Q2_K", 11: "Q3_K", 20: "IQ4_NL"}
UNREADABLE_TYPES = {9: "Q8_1", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 19: "IQ1_S", 29: "IQ1_M"}
