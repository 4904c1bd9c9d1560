"""Multi-head latent attention's sizes in a GGUF file (DeepSeek-V2's MLA, llama.cpp's `deepseek2`).

Contract: `latent_sizes(kv, arch, ...)` reads and checks the keys MLA adds and returns a `Latent`, or
raises ModelLoadError naming the key at fault; `latent_tensor_shapes(config, prefix)` lists a layer's
attention tensors with the shapes the sizes imply. Files as llama.cpp's converter writes them since
MLA's absorption: attention.key_length = kv_lora_rank + rope (the latent row a position caches),
head_count_kv = 1, key_length_mla / value_length_mla = a head's query and output widths, and k_b /
v_b split out of kv_b (an older file's attn_kv_b alone is refused: converted again, it serves).

The score scale follows llama.cpp's deepseek2 graph: 1 / sqrt(key_length_mla), times YaRN's mscale
squared, mscale = 1 + 0.1 * mscale_all_dim * ln(factor) (the file's yarn_log_multiplier is 0.1 *
mscale_all_dim); the rotated values themselves are not scaled then (llama.cpp sets the rotation's
attention factor to mscale / mscale_all_dim = 1 for deepseek2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from webapp.engine.model.load_error import ModelLoadError


@dataclass(frozen=True)
class Latent:
    q_lora: int  # the rank of q's low-rank product (0: q is one product of the layer's input)
    kv_lora: int  # the latent's width: what a position caches, besides its rope values
    nope: int  # a query head's values without RoPE...
    rope: int  # ...and with it (rope.dimension_count: the key's shared rope values too)
    v_dim: int  # a head's output before W_o
    score_scale: float


def latent_sizes(kv: dict, arch: str, head_dim: int, n_kv_heads: int, rotary: int, n_heads: int, count) -> Latent:
    """`count(key, default)` reads a whole number key of `arch` as ModelConfig.from_gguf does."""

    kv_lora = count("attention.kv_lora_rank")
    q_lora = count("attention.q_lora_rank", 0, low=0)
    key_mla, value_mla = count("attention.key_length_mla", 0, low=0), count("attention.value_length_mla", 0, low=0)
    if not key_mla or not value_mla:
        raise ModelLoadError(
            f"this {arch} file lacks {arch}.attention.key_length_mla / value_length_mla (written before llama.cpp split "
            "attn_kv_b for MLA): convert the model again with a current llama.cpp"
        )
    if n_kv_heads != 1 or head_dim != kv_lora + rotary:
        raise ModelLoadError(
            f"{arch} with MLA caches one latent row: expected head_count_kv 1 and key_length {kv_lora + rotary} "
            f"(kv_lora_rank {kv_lora} + rope {rotary}), not {n_kv_heads} and {head_dim}"
        )
    nope = key_mla - rotary
    if nope < 1 or kv_lora % 32 or value_mla % 2:
        raise ModelLoadError(
            f"{arch} sizes key_length_mla {key_mla}, rope {rotary}, kv_lora_rank {kv_lora}: not an MLA layer this server runs"
        )
    if kv.get(f"{arch}.attention.temperature_scale"):
        raise ModelLoadError(f"{arch}.attention.temperature_scale (Mistral Large's attention temperature) is not supported")
    mscale = 1.0
    if kv.get(f"{arch}.rope.scaling.type") == "yarn":
        if f"{arch}.rope.scaling.yarn_log_multiplier" not in kv:
            raise ModelLoadError(f"{arch} with YaRN needs {arch}.rope.scaling.yarn_log_multiplier, as DeepSeek-V2 files carry it")
        factor = float(kv.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        mscale_all_dim = float(kv[f"{arch}.rope.scaling.yarn_log_multiplier"]) / 0.1
        if not (math.isfinite(factor) and factor >= 1 and math.isfinite(mscale_all_dim)):
            raise ModelLoadError(f"{arch} YaRN factor {factor} / log multiplier: expected finite numbers, a factor of 1 or more")
        mscale = 1.0 + 0.1 * mscale_all_dim * math.log(factor)
    return Latent(q_lora, kv_lora, nope, rotary, value_mla, mscale * mscale / math.sqrt(key_mla))


def latent_tensor_shapes(config, p: str) -> dict[str, tuple[int, int]]:
    """A latent layer's attention tensors and norms (rows, cols), as weights.read_gguf gives them: k_b
    and v_b are 3-D, a head's matrix after another's."""
    m, H, D = config.latent, config.n_heads, config.dim
    q = H * (m.nope + m.rope)
    shapes = {p + "attn_norm.weight": (1, D), p + config.ffn_norm_name: (1, D), p + "attn_output.weight": (D, H * m.v_dim)}
    if m.q_lora:
        shapes |= {p + "attn_q_a.weight": (m.q_lora, D), p + "attn_q_a_norm.weight": (1, m.q_lora), p + "attn_q_b.weight": (q, m.q_lora)}
    else:
        shapes[p + "attn_q.weight"] = (q, D)
    shapes |= {p + "attn_kv_a_mqa.weight": (m.kv_lora + m.rope, D), p + "attn_kv_a_norm.weight": (1, m.kv_lora)}
    return shapes | {p + "attn_k_b.weight": (H * m.kv_lora, m.nope), p + "attn_v_b.weight": (H * m.v_dim, m.kv_lora)}


def latent_rope_rows(config) -> dict[str, tuple[int, int]]:
    """ModelConfig.rope_rows of a latent layer: each q head ends with its rope values, kv_a with the key's."""
    m = config.latent
    return {"attn_q_b.weight" if m.q_lora else "attn_q.weight": (config.n_heads, m.rope), "attn_kv_a_mqa.weight": (1, m.rope)}
