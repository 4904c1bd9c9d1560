"""What a GGUF file says the transformer is, checked before any weight is read.

Contract: `ModelConfig.from_gguf(kv, table)` returns the architecture's numbers or raises
`ModelLoadError` naming the key at fault; `check_tensors(config, table)` raises it for the first
tensor the model reads that is missing, of a type this server cannot read, or of another shape than
the config implies. GGUF files are untrusted input: the CPU kernels trust every size they are given
(a q matrix of fewer rows than heads x head size would be read past its end), so a file that passes
here is one whose every read stays inside its tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# GGML types a matrix may have: those with a CPU kernel (kernels/cpu.py) and those tinygrad's gguf
# loader dequantizes; by name, for messages
READABLE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
    18: "IQ3_XXS", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 30: "BF16",
    39: "MXFP4",
}  # fmt: skip
OTHER_TYPES = {9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 19: "IQ1_S", 20: "IQ4_NL", 29: "IQ1_M"}
# (values, bytes) per block of each readable type; a plain number type is a block of one value
TYPE_SIZES = {
    0: (1, 4), 1: (1, 2), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2),
    2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    18: (256, 98), 21: (256, 110), 22: (256, 82), 23: (256, 136), 39: (32, 17),
}  # fmt: skip
# far past any real model: a file claiming more is corrupt, and would ask for absurd buffers
LIMITS = {"block_count": 1024, "embedding_length": 1 << 17, "feed_forward_length": 1 << 20, "attention.head_count": 1024}


class ModelLoadError(ValueError):
    """The GGUF file cannot be served: unsupported architecture, missing or malformed key or tensor."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    dim: int
    hidden_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    vocab_size: int
    rope_theta: float
    trained_context: int
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_gguf(cls, kv: dict, weights: dict) -> ModelConfig:
        arch = kv.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

        def need(key: str):
            if key not in kv:
                raise ModelLoadError(f"GGUF metadata is missing {key!r}")
            return kv[key]

        def count(key: str, default=None, low: int = 1):
            value = need(f"{arch}.{key}") if default is None else kv.get(f"{arch}.{key}", default)
            high = LIMITS.get(key, 1 << 31)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ModelLoadError(f"GGUF metadata {arch}.{key} = {value!r}: expected a whole number from {low} to {high}")
            return value

        dim, n_heads = count("embedding_length"), count("attention.head_count")
        n_kv_heads = count("attention.head_count_kv", n_heads)
        if n_heads % n_kv_heads:
            raise ModelLoadError(f"{n_heads} attention heads cannot share {n_kv_heads} KV heads evenly")
        head_dim = count("attention.key_length", dim // n_heads if dim >= n_heads else 0)
        if head_dim % 2:
            raise ModelLoadError(f"head size {head_dim} is odd: RoPE rotates pairs")
        eps = need(f"{arch}.attention.layer_norm_rms_epsilon")
        if not isinstance(eps, float) or not 0 < eps < 1:
            raise ModelLoadError(f"GGUF metadata {arch}.attention.layer_norm_rms_epsilon = {eps!r}: expected a small positive number")
        theta = kv.get(f"{arch}.rope.freq_base", 10000.0)
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not (math.isfinite(theta) and theta > 1):
            raise ModelLoadError(f"GGUF metadata {arch}.rope.freq_base = {theta!r}: expected a number above 1")
        tokens = need("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ModelLoadError("GGUF metadata tokenizer.ggml.tokens is not a list of tokens")
        return cls(
            arch=arch,
            n_layers=count("block_count"),
            dim=dim,
            hidden_dim=count("feed_forward_length"),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            norm_eps=eps,
            vocab_size=len(tokens),
            rope_theta=float(theta),
            trained_context=count("context_length"),
            qkv_bias="blk.0.attn_q.bias" in weights,
            qk_norm="blk.0.attn_q_norm.weight" in weights,
        )

    def tensor_shapes(self) -> dict[str, tuple[int, int]]:
        """Every tensor the model reads, as (rows, cols) the way weights.read_gguf gives them (a vector
        is one row)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        shapes = {"token_embd.weight": (self.vocab_size, self.dim), "output_norm.weight": (1, self.dim)}
        for i in range(self.n_layers):
            p = f"blk.{i}."
            shapes |= {
                p + "attn_norm.weight": (1, self.dim),
                p + "attn_q.weight": (q, self.dim),
                p + "attn_k.weight": (kv, self.dim),
                p + "attn_v.weight": (kv, self.dim),
                p + "attn_output.weight": (self.dim, q),
                p + "ffn_norm.weight": (1, self.dim),
                p + "ffn_gate.weight": (self.hidden_dim, self.dim),
                p + "ffn_up.weight": (self.hidden_dim, self.dim),
                p + "ffn_down.weight": (self.dim, self.hidden_dim),
            }
            if self.qk_norm:
                shapes |= {p + "attn_q_norm.weight": (1, self.head_dim), p + "attn_k_norm.weight": (1, self.head_dim)}
            if self.qkv_bias:
                shapes |= {p + "attn_q.bias": (1, q), p + "attn_k.bias": (1, kv), p + "attn_v.bias": (1, kv)}
        return shapes

    def required_tensors(self) -> list[str]:
        return list(self.tensor_shapes())


def check_tensors(config: ModelConfig, table: dict) -> None:
    """`table` as weights.read_gguf gives it (name -> RawTensor with ggml_type, rows, cols)."""
    shapes = config.tensor_shapes()
    if "output.weight" in table:
        shapes["output.weight"] = (config.vocab_size, config.dim)
    missing = [n for n in shapes if n not in table]
    if missing:
        raise ModelLoadError(f"GGUF file lacks tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for name, expected in shapes.items():
        raw = table[name]
        if raw.ggml_type not in READABLE_TYPES:
            known = OTHER_TYPES.get(raw.ggml_type, f"unknown type {raw.ggml_type}")
            raise ModelLoadError(f"tensor {name!r} is stored as {known}, which this server cannot read yet")
        if (raw.rows, raw.cols) != expected:
            raise ModelLoadError(
                f"tensor {name!r} has shape {raw.rows} x {raw.cols}; the file's metadata implies {expected[0]} x {expected[1]}"
            )
        values = TYPE_SIZES[raw.ggml_type][0]
        if raw.cols % values:
            raise ModelLoadError(
                f"tensor {name!r}: rows of {raw.cols} values are not whole {READABLE_TYPES[raw.ggml_type]} blocks of {values}"
            )
