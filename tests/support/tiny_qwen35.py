"""A tiny random-weight Qwen3.5 file (llama.cpp's `qwen35`: Gated DeltaNet recurrent layers, every
`interval`-th layer gated full attention) and its float64 reference, written from llama.cpp's graph
(src/models/qwen35.cpp, delta-net-base.cpp, ggml's gated_delta_net) alone.

The reference runs the delta rule one token at a time, the recurrence's definition, where llama.cpp
(and a server) may run it in chunks: the two agreeing checks the chunking as well as the layer.
Conventions llama.cpp fixes and a reader easily gets wrong, kept here on purpose:
- attn_q's rows are, head after head, that head's query then its output gate;
- a recurrent value head j reads key head j % k_heads (ggml's broadcast tiles, it does not repeat
  each key head in place);
- ssm_a holds -exp(A_log) (no `.weight`), the decay is exp(softplus(alpha + dt_bias) * ssm_a);
- the rotary is IMRoPE over the first rope.dimension_count values; for text every section reads the
  same position, so it is NEOX's split-halves rotation.
"""

from __future__ import annotations

import gguf
import numpy as np
from support.k_quants import QUANTIZERS
from support.kv_quants import cached
from support.tiny_models import Reference, add_smollm_tokenizer, smollm_tokenizer_fields

# every matrix's width (dim, a feed-forward's, heads' outputs) a multiple of 32, so Q8_0 / Q4_0 blocks fit
SIZES = {
    "dim": 64,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 32,
    "rotary": 16,  # partial rotary, as Qwen3.5's 64 of 256
    "state": 32,  # a recurrent head's key and value size S
    "k_heads": 2,  # ssm.group_count
    "v_heads": 4,  # ssm.time_step_rank
    "conv_kernel": 4,
    "hidden": 128,
}


def is_recurrent(layer: int, interval: int) -> bool:
    """llama.cpp's default split without attention.recurrent_layers: full attention every interval-th layer."""
    return (layer + 1) % interval != 0


def write_tiny_qwen35(
    path: str,
    *,
    n_layers: int = 4,
    seed: int = 0,
    matrix_type: str = "F32",
    metadata: dict | None = None,
    interval: int = 4,
    experts: tuple[int, int, int] | None = None,
    shared: int = 0,
) -> str:
    """`matrix_type` F32 or a block type (e.g. "Q8_0", "Q4_0", or one of support.k_quants) for every 2-D
    layer matrix whose width holds whole blocks (the others, the embedding, norms, ssm_a, ssm_dt and
    ssm_conv1d stay F32); `metadata` replaces or adds keys (the architecture's prefix added), None
    removing one; a list is written as an int32 array (rope.dimension_sections). llama.cpp loads a file
    only with layers of both kinds (n_layers >= interval > 1): with none of one, GGML_ASSERT(buffer).
    With `experts` (count, used, width) a `qwen35moe` file: every layer's feed-forward a mixture of
    experts (softmax, the chosen weights divided by their sum) beside a shared expert `shared` wide
    behind its sigmoid gate."""
    s = SIZES
    D, H, KvH, Hd, F = s["dim"], s["heads"], s["kv_heads"], s["head_dim"], s["hidden"]
    S, Hk, Hv, K = s["state"], s["k_heads"], s["v_heads"], s["conv_kernel"]
    Kd, Vd = Hk * S, Hv * S
    rng = np.random.default_rng(seed)
    tok = smollm_tokenizer_fields()
    vocab = len(tok["tokenizer.ggml.tokens"])
    arch = "qwen35moe" if experts else "qwen35"
    keys = {"context_length": 512, "embedding_length": D, "block_count": n_layers, "feed_forward_length": F}
    keys |= {"attention.head_count": H, "attention.head_count_kv": KvH, "attention.key_length": Hd}
    keys |= {"attention.value_length": Hd, "attention.layer_norm_rms_epsilon": 1e-6}
    keys |= {"rope.freq_base": 10000.0, "rope.dimension_count": s["rotary"], "rope.dimension_sections": [3, 3, 2, 0]}
    keys |= {"ssm.conv_kernel": K, "ssm.state_size": S, "ssm.group_count": Hk, "ssm.time_step_rank": Hv}
    keys |= {"ssm.inner_size": Vd, "full_attention_interval": interval}
    if experts:
        keys |= {"expert_count": experts[0], "expert_used_count": experts[1], "expert_feed_forward_length": experts[2]}
        keys |= {"expert_shared_feed_forward_length": shared}
    w = gguf.GGUFWriter(path, arch)
    for key, value in (keys | (metadata or {})).items():
        if value is None:
            continue
        kinds = {str: w.add_string, float: w.add_float32, bool: w.add_bool, list: w.add_array}
        kinds.get(type(value), w.add_uint32)(f"{arch}.{key}", value)
    add_smollm_tokenizer(w)
    w.add_chat_template(tok["tokenizer.chat_template"])

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def add_matrix(name, array):
        qtype = None if matrix_type == "F32" else gguf.GGMLQuantizationType[matrix_type]
        if qtype is None or array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            w.add_tensor(name, array)
            return
        blocks = QUANTIZERS[qtype](array) if qtype in QUANTIZERS else gguf.quants.quantize(array, qtype)
        w.add_tensor(name, blocks, raw_dtype=qtype)

    w.add_tensor("token_embd.weight", mat(vocab, D) * D**0.25)  # the head too (no output.weight): small, or logits echo the input
    w.add_tensor("output_norm.weight", norm(D) * 8)  # logits of std ~20: decided greedy choices on random weights
    for i in range(n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(D))
        if is_recurrent(i, interval):
            add_matrix(p + "attn_qkv.weight", mat(2 * Kd + Vd, D))  # ne {D, conv_dim}: q, k, v channels
            add_matrix(p + "attn_gate.weight", mat(Vd, D))  # z
            w.add_tensor(p + "ssm_conv1d.weight", mat(2 * Kd + Vd, K))  # ne {K, conv_dim}
            w.add_tensor(p + "ssm_dt.bias", (0.5 * rng.standard_normal(Hv)).astype(np.float32))
            w.add_tensor(p + "ssm_a", -np.exp(rng.uniform(-1, 1, Hv)).astype(np.float32))  # -exp(A_log)
            add_matrix(p + "ssm_beta.weight", mat(Hv, D))
            add_matrix(p + "ssm_alpha.weight", mat(Hv, D))
            w.add_tensor(p + "ssm_norm.weight", norm(S))
            add_matrix(p + "ssm_out.weight", mat(D, Vd))
        else:
            add_matrix(p + "attn_q.weight", mat(2 * H * Hd, D))  # per head: Hd query rows, Hd gate rows
            add_matrix(p + "attn_k.weight", mat(KvH * Hd, D))
            add_matrix(p + "attn_v.weight", mat(KvH * Hd, D))
            add_matrix(p + "attn_output.weight", mat(D, H * Hd))
            w.add_tensor(p + "attn_q_norm.weight", norm(Hd))
            w.add_tensor(p + "attn_k_norm.weight", norm(Hd))
        w.add_tensor(p + "post_attention_norm.weight", norm(D))  # the feed-forward's input norm
        if experts:  # the router and the shared expert's gate stay F32, as the converter keeps them
            E, _, EF = experts
            w.add_tensor(p + "ffn_gate_inp.weight", mat(E, D) * 4)
            for name, (rows, cols) in (("gate", (EF, D)), ("up", (EF, D)), ("down", (D, EF))):
                add_matrix(p + f"ffn_{name}_exps.weight", np.stack([mat(rows, cols) for _ in range(E)]))
            w.add_tensor(p + "ffn_gate_inp_shexp.weight", mat(1, D).reshape(-1) * 2)
            add_matrix(p + "ffn_gate_shexp.weight", mat(shared, D))
            add_matrix(p + "ffn_up_shexp.weight", mat(shared, D))
            add_matrix(p + "ffn_down_shexp.weight", mat(D, shared))
            continue
        add_matrix(p + "ffn_gate.weight", mat(F, D))
        add_matrix(p + "ffn_up.weight", mat(F, D))
        add_matrix(p + "ffn_down.weight", mat(D, F))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _silu(x):
    return x / (1 + np.exp(-x))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


class Qwen35Reference(Reference):
    """Reference's float64 forward pass for qwen35 files, from position 0; full attention's keys and
    values rounded as a KV cache of `kv_type` holds them, the recurrent state kept exact."""

    def __init__(self, path: str, kv_type: str = "f16"):  # not Reference's: its fused-qkv split is phi3's
        self.kv_type = kv_type
        reader = gguf.GGUFReader(path)
        self.arch = reader.fields["general.architecture"].contents()
        f = lambda key: reader.fields[f"{self.arch}.{key}"].contents()  # noqa: E731
        self.n_heads, self.n_kv, self.n_layers = f("attention.head_count"), f("attention.head_count_kv"), f("block_count")
        self.eps, self.theta, self.rotary = f("attention.layer_norm_rms_epsilon"), f("rope.freq_base"), f("rope.dimension_count")
        self.scaling, self.factor, self.attn_factor = "linear", 1.0, 1.0  # what Reference._rope reads
        self.sections = reader.fields[f"{self.arch}.rope.dimension_sections"].contents()  # with `turned` positions
        self.state, self.k_heads, self.v_heads = f("ssm.state_size"), f("ssm.group_count"), f("ssm.time_step_rank")
        key = f"{self.arch}.full_attention_interval"
        self.interval = reader.fields[key].contents() if key in reader.fields else 4
        # qwen35moe's routing, as Reference.experts reads it: softmax, the chosen weights divided by their sum
        used = f"{self.arch}.expert_used_count"
        self.experts_used = reader.fields[used].contents() if used in reader.fields else 0
        self.sigmoid, self.norm_weights, self.weights_scale, self.bias_weighs = False, True, 1.0, False
        self.w = {}
        for t in reader.tensors:  # block types dequantized: the values the file's products read
            arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            self.w[t.name] = arr.reshape([int(d) for d in reversed(t.shape)])

    def hidden(self, tokens: list[int], inputs: dict[int, np.ndarray] | None = None, both_ways: tuple = (), turned=None) -> np.ndarray:
        """(T, dim): the final norm's output at every position; `inputs` and `turned` (an image's rows
        and M-RoPE's positions) as Reference.hidden takes them."""
        w = self.w
        x = w["token_embd.weight"][[t if 0 <= t < len(w["token_embd.weight"]) else 0 for t in tokens]]  # (T, D)
        for position, row in (inputs or {}).items():
            x[position] = row
        self.turned = turned
        for i in range(self.n_layers):
            p = f"blk.{i}."
            n = self._norm(x, w[p + "attn_norm.weight"])
            mix = self._recurrent(n, p) if is_recurrent(i, self.interval) else self._attention(n, p)
            h = x + mix
            m = self._norm(h, w[p + "post_attention_norm.weight"])
            if self.experts_used:
                x = h + self.experts(m, p)
                continue
            x = h + (_silu(m @ w[p + "ffn_gate.weight"].T) * (m @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        return self._norm(x, w["output_norm.weight"])

    def _attention(self, n, p):
        w, T, H, KvH = self.w, len(n), self.n_heads, self.n_kv
        Hd = w[p + "attn_q_norm.weight"].shape[0]
        qg = (n @ w[p + "attn_q.weight"].T).reshape(T, H, 2 * Hd)
        q, gate = qg[..., :Hd], qg[..., Hd:]  # (T, H, Hd) each
        k = (n @ w[p + "attn_k.weight"].T).reshape(T, KvH, Hd)
        v = (n @ w[p + "attn_v.weight"].T).reshape(T, KvH, Hd)
        pos = np.arange(T, dtype=np.float64) if self.turned is None else np.asarray(self.turned, dtype=np.float64)
        q = self._rope(self._norm(q, w[p + "attn_q_norm.weight"]), pos)
        k = self._rope(self._norm(k, w[p + "attn_k_norm.weight"]), pos)
        k, v = cached(k, self.kv_type), cached(v, self.kv_type)
        k, v = np.repeat(k, H // KvH, axis=1), np.repeat(v, H // KvH, axis=1)  # query head h reads h // (H / KvH)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(Hd) + np.triu(np.full((T, T), -np.inf), 1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", probs, v) * _sigmoid(gate)  # (T, H, Hd)
        return attn.reshape(T, -1) @ w[p + "attn_output.weight"].T

    def _recurrent(self, n, p):
        w, T, S, Hk, Hv = self.w, len(n), self.state, self.k_heads, self.v_heads
        Kd = Hk * S
        mixed = n @ w[p + "attn_qkv.weight"].T  # (T, conv_dim)
        z = (n @ w[p + "attn_gate.weight"].T).reshape(T, Hv, S)
        beta = _sigmoid(n @ w[p + "ssm_beta.weight"].T)  # (T, Hv)
        g = np.logaddexp(0, n @ w[p + "ssm_alpha.weight"].T + w[p + "ssm_dt.bias"]) * w[p + "ssm_a"]  # (T, Hv), < 0
        kernel = w[p + "ssm_conv1d.weight"]  # (conv_dim, K)
        K = kernel.shape[1]
        padded = np.concatenate([np.zeros((K - 1, mixed.shape[1])), mixed])  # zero history before position 0
        y = _silu(sum(kernel[:, j] * padded[j : j + T] for j in range(K)))  # (T, conv_dim)
        l2 = lambda u: u / np.sqrt((u * u).sum(-1, keepdims=True) + self.eps)  # noqa: E731
        q, k = l2(y[:, :Kd].reshape(T, Hk, S)), l2(y[:, Kd : 2 * Kd].reshape(T, Hk, S))
        v = y[:, 2 * Kd :].reshape(T, Hv, S)
        out = np.empty((T, Hv, S))
        for j in range(Hv):
            kh = j % Hk
            M = np.zeros((S, S))  # [key dim, value dim]
            for t in range(T):
                M *= np.exp(g[t, j])
                delta = (v[t, j] - k[t, kh] @ M) * beta[t, j]
                M += np.outer(k[t, kh], delta)
                out[t, j] = q[t, kh] @ M / np.sqrt(S)
        out = self._norm(out, w[p + "ssm_norm.weight"]) * _silu(z)
        return out.reshape(T, -1) @ w[p + "ssm_out.weight"].T
