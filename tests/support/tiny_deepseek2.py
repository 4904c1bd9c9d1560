"""A tiny random-weight DeepSeek-V2 file (llama.cpp's `deepseek2`, multi-head latent attention) and
its float64 reference, written from the GGUF layout alone.

The reference decompresses the latent into full keys and values a head (k_nope = c . W_k_b[h],
v = W_v_b[h] . c), the form the model was trained in, where the server absorbs W_k_b into the query
and caches the latent row: the two agreeing checks the absorption as well as the layer. Rotary pairs
are interleaved in the file's rows (llama.cpp's "norm" RoPE for deepseek2).
"""

from __future__ import annotations

import gguf
import numpy as np
from support.k_quants import QUANTIZERS
from support.kv_quants import cached
from support.tiny_models import Reference, add_smollm_tokenizer, smollm_tokenizer_fields

# dim, heads, nope, rope, latent (kv_lora), a head's output; every width a multiple of 32 where a
# product reads it (block rows), the latent row (rope + latent) too for an 8-bit KV cache
SIZES = {"dim": 64, "heads": 4, "nope": 32, "rope": 32, "kv_lora": 64, "v_dim": 32}


def write_tiny_deepseek2(
    path: str,
    *,
    n_layers: int = 2,
    q_lora: int = 0,
    hidden: int = 128,
    seed: int = 0,
    matrix_type: str = "F32",
    metadata: dict | None = None,
    float_matrices: tuple[str, ...] = (),
    experts: tuple[int, int, int] | None = None,
    shared: int = 1,
    selection_bias: bool = False,
) -> str:
    """Every layer dense (no expert_count, as llama.cpp's converter writes a DeepSeek-style file
    without experts), or with `experts` (count, used, width) the first layer dense and the others
    mixtures (softmax routing, as DeepSeek-V2's, unless `metadata` says otherwise) with `shared`
    ungated shared experts of that width and, with `selection_bias`, DeepSeek-V3's exp_probs_b.bias;
    `q_lora` > 0 gives q a low-rank product (DeepSeek-V2, not -Lite); `matrix_type` F32 or a block type of support.k_quants (the latent's norms stay F32);
    matrices named with an end in `float_matrices` are F64, a type no kernel reads."""
    s = SIZES
    D, H, N, R, L, V = s["dim"], s["heads"], s["nope"], s["rope"], s["kv_lora"], s["v_dim"]
    rng = np.random.default_rng(seed)
    vocab = len(smollm_tokenizer_fields()["tokenizer.ggml.tokens"])
    arch = "deepseek2"
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(n_layers)
    w.add_context_length(512)
    w.add_embedding_length(D)
    w.add_feed_forward_length(hidden)
    w.add_head_count(H)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(L + R)
    w.add_value_length(L)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(R)
    numbers = {"attention.kv_lora_rank": L, "attention.key_length_mla": N + R, "attention.value_length_mla": V}
    numbers |= {"leading_dense_block_count": 1 if experts else n_layers, "expert_feed_forward_length": experts[2] if experts else hidden}
    numbers |= {"expert_shared_count": shared if experts else 0}
    numbers |= {"expert_count": experts[0], "expert_used_count": experts[1]} if experts else {}
    numbers["attention.q_lora_rank"] = q_lora  # 0: q in one product (llama.cpp reads the key unless 27 layers deep)
    for key, value in numbers.items():
        w.add_uint32(f"{arch}.{key}", value)
    for key, value in (metadata or {}).items():
        kinds = {str: w.add_string, float: w.add_float32, bool: w.add_bool}
        add = kinds.get(type(value), w.add_uint32)
        add(f"{arch}.{key}", value)
    add_smollm_tokenizer(w)
    w.add_chat_template(smollm_tokenizer_fields()["tokenizer.chat_template"])

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def add_matrix(name, array):
        if name.endswith(float_matrices):
            w.add_tensor(name, array.astype(np.float64))
            return
        if matrix_type == "F32":
            w.add_tensor(name, array)
            return
        qtype = gguf.GGMLQuantizationType[matrix_type]
        rows = array.reshape(-1, array.shape[-1])
        blocks = QUANTIZERS[qtype](rows) if qtype in QUANTIZERS else gguf.quants.quantize(rows, qtype)
        w.add_tensor(name, blocks.reshape(*array.shape[:-1], -1), raw_dtype=qtype)

    w.add_tensor("token_embd.weight", mat(vocab, D) * D**0.5)
    w.add_tensor("output_norm.weight", norm(D) * 4)  # decided greedy choices on random weights
    add_matrix("output.weight", mat(vocab, D))
    for i in range(n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(D))
        if q_lora:
            add_matrix(p + "attn_q_a.weight", mat(q_lora, D))
            w.add_tensor(p + "attn_q_a_norm.weight", norm(q_lora))
            add_matrix(p + "attn_q_b.weight", mat(H * (N + R), q_lora))
        else:
            add_matrix(p + "attn_q.weight", mat(H * (N + R), D))
        add_matrix(p + "attn_kv_a_mqa.weight", mat(L + R, D))
        w.add_tensor(p + "attn_kv_a_norm.weight", norm(L))
        add_matrix(p + "attn_k_b.weight", np.stack([mat(L, N) for _ in range(H)]))  # (H, L, N): ne {N, L, H}
        add_matrix(p + "attn_v_b.weight", np.stack([mat(V, L) for _ in range(H)]))  # (H, V, L): ne {L, V, H}
        add_matrix(p + "attn_output.weight", mat(D, H * V))
        w.add_tensor(p + "ffn_norm.weight", norm(D))
        if experts and i >= 1:
            count, _, width = experts
            w.add_tensor(p + "ffn_gate_inp.weight", mat(count, D) * 2)  # F32, as llama-quantize keeps it
            for name, rows, cols in (("gate", width, D), ("up", width, D), ("down", D, width)):
                add_matrix(p + f"ffn_{name}_exps.weight", np.stack([mat(rows, cols) for _ in range(count)]))
            if shared:  # ungated, `shared` experts of the routed ones' width as one
                for name, rows, cols in (("gate", shared * width, D), ("up", shared * width, D), ("down", D, shared * width)):
                    add_matrix(p + f"ffn_{name}_shexp.weight", mat(rows, cols))
            if selection_bias:
                w.add_tensor(p + "exp_probs_b.bias", (0.2 * rng.standard_normal(count)).astype(np.float32))
            continue
        add_matrix(p + "ffn_gate.weight", mat(hidden, D))
        add_matrix(p + "ffn_up.weight", mat(hidden, D))
        add_matrix(p + "ffn_down.weight", mat(D, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class LatentReference(Reference):
    """Reference's float64 forward pass for deepseek2 files: decompressed heads over the latent, as
    the KV cache rounds it (its rows: RoPE(k_pe) and the normed latent, float16)."""

    def __init__(self, path: str, kv_type: str = "f16"):
        super().__init__(path, kv_type)
        reader = gguf.GGUFReader(path)
        f = lambda key: int(reader.fields[f"deepseek2.{key}"].contents())  # noqa: E731
        self.kv_lora, self.rope_dims = f("attention.kv_lora_rank"), f("rope.dimension_count")
        self.nope = f("attention.key_length_mla") - self.rope_dims
        self.v_dim = f("attention.value_length_mla")
        self.scale = 1 / np.sqrt(self.nope + self.rope_dims)
        mul = reader.fields.get("deepseek2.rope.scaling.yarn_log_multiplier")
        if self.scaling == "yarn" and mul:  # DeepSeek's mscale squared on the scores (latent_config.py)
            self.scale *= (1 + float(mul.contents()) * np.log(self.factor)) ** 2
        self.rotary = None  # _rope is given a head's rope values alone
        norm = reader.fields.get("deepseek2.expert_weights_norm")
        self.norm_weights = bool(norm.contents()) if norm else False  # deepseek2: divided only where the file says

    def _interleaved_rope(self, x, positions):  # x (T, heads, R): consecutive values are a pair, YaRN's frequencies
        out = self._rope(x, positions)
        return out / (1 + 0.1 * np.log(self.factor)) if self.scaling == "yarn" else out  # deepseek2: cos and sin unscaled

    def hidden(self, tokens: list[int]) -> np.ndarray:
        w, T, H, N, R, L = self.w, len(tokens), self.n_heads, self.nope, self.rope_dims, self.kv_lora
        x = w["token_embd.weight"][tokens]
        pos = np.arange(T, dtype=np.float64)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            n = self._norm(x, w[p + "attn_norm.weight"])
            if p + "attn_q_a.weight" in w:
                q = self._norm(n @ w[p + "attn_q_a.weight"].T, w[p + "attn_q_a_norm.weight"]) @ w[p + "attn_q_b.weight"].T
            else:
                q = n @ w[p + "attn_q.weight"].T
            q = q.reshape(T, H, N + R)
            kv = n @ w[p + "attn_kv_a_mqa.weight"].T
            latent = cached(self._norm(kv[:, :L], w[p + "attn_kv_a_norm.weight"])[:, None, :], self.kv_type)[:, 0]  # (T, L)
            k_pe = cached(self._interleaved_rope(kv[:, None, L:], pos), self.kv_type)  # (T, 1, R)
            q_pe = self._interleaved_rope(q[..., N:], pos)
            k_nope = np.einsum("sl,hln->shn", latent, w[p + "attn_k_b.weight"])  # (S, H, N)
            values = np.einsum("hvl,sl->shv", w[p + "attn_v_b.weight"], latent)  # (S, H, V)
            scores = np.einsum("thn,shn->hts", q[..., :N], k_nope) + np.einsum("thr,sr->hts", q_pe, k_pe[:, 0])
            scores = scores * self.scale + np.triu(np.full((T, T), -np.inf), 1)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn = np.einsum("hts,shv->thv", probs, values).reshape(T, -1)
            x = x + attn @ w[p + "attn_output.weight"].T
            h = self._norm(x, w[p + "ffn_norm.weight"])
            if p + "ffn_gate_inp.weight" in w:
                x = x + self.experts(h, p)
                continue
            gate = h @ w[p + "ffn_gate.weight"].T
            x = x + ((gate / (1 + np.exp(-gate))) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        return self._norm(x, w["output_norm.weight"])
