"""DeepSeek-V2's token mixer (llama.cpp's `deepseek2`): multi-head latent attention (`LatentAttention`),
a mixer as attention.py states it; the layer holds it beside its feed-forward (a dense SwiGLU in the
leading layers, else a mixture of experts with shared experts: feed_forward.py, routed.py).

Contract: `LatentAttention` fills Attention's hooks. With n = rms_norm(x) * attn_norm:
    [q_a | c | k_pe] = W_qkv . n   (W_qkv: q_a's rows, or q's without a q_lora rank, over kv_a_mqa's)
    q = W_q_b . rms_norm(q_a) * q_a_norm;  a head's q = [q_nope | q_pe]
    key row (one for every head, what the cache holds) = [RoPE(k_pe) | rms_norm(c) * kv_a_norm]
    query h = [RoPE(q_pe_h) | W_k_b[h] . q_nope_h]
    out = W_o . [W_v_b[h] . softmax(query h . keys * scale) . keys' latent values  for each head h]
This is llama.cpp's MLA with absorption: q . k of the decompressed heads equals query . key row, so
the cache keeps L + R values a position (576 for DeepSeek-V2-Lite, where full keys and values would
take 16 x 320). The rope values lead the row, so the kernels' RoPE (a head's first values) turns them.
On the CPU kernels with every product in blocks the layer runs inside the whole-model step (mla.c);
with some product outside blocks, tinygrad's operations around the kernels' attention (ATTEND_LATENT);
elsewhere tinygrad's path, the per-head matrices float16 (heads, rows, cols).
"""

from __future__ import annotations

from tinygrad import Tensor, UOp

from webapp.engine.kernels import abi
from webapp.engine.kernels.abi import AttendFlag
from webapp.engine.kernels.block_weight import BlockWeight
from webapp.engine.model.attention import Attention
from webapp.engine.model.lane_rows import lane_rows, write_lane_rows
from webapp.engine.model.ops import attended, rms_norm, rope
from webapp.engine.model.products import float32_buffer
from webapp.engine.model.weights import BlockLinear, WeightSource


class LatentAttention(Attention):
    def _load_products(self, weights: WeightSource, p: str) -> None:
        c, m = self.c, self.c.latent
        # q (or q_a) and the latent both read the normed input: one product
        self.qkv = weights.linear(p + ("attn_q_a.weight" if m.q_lora else "attn_q.weight"), p + "attn_kv_a_mqa.weight")
        self.q_b = weights.linear(p + "attn_q_b.weight") if m.q_lora else None
        self.attn_output = weights.linear(p + "attn_output.weight")  # H*V -> D
        self.norm_names = ([p + "attn_q_a_norm.weight"] if m.q_lora else []) + [p + "attn_kv_a_norm.weight"]
        self.norms = {name: weights.vector(name) for name in self.norm_names}
        self.head_blocks = None  # k_b and v_b in blocks, a head's matrix after another's, where the other products are
        if self._products_in_blocks:
            blocks = [weights.experts(p + f"attn_{n}_b.weight", c.n_heads) for n in "kv"]
            self.head_blocks = None if None in blocks else blocks
        if self.head_blocks is None:
            self.k_b, self.v_b = (weights.float_experts(p + f"attn_{n}_b.weight", transposed=True) for n in "kv")  # (H, N, L), (H, L, V)

    @property
    def _products_in_blocks(self) -> bool:
        return all(isinstance(w, BlockLinear) for w in (self.qkv, self.attn_output, self.q_b or self.qkv))

    @property
    def in_blocks(self) -> bool:
        return self._products_in_blocks and self.head_blocks is not None

    def _load_tinygrad_attention(self, weights: WeightSource, p: str) -> None:
        """Nothing: latent attention has no q/k/v biases."""

    def _kernel_attention(self, weights: WeightSource, p: str) -> tuple[Tensor, int]:
        return float32_buffer(weights, self.norm_names), int(AttendFlag.LATENT)

    def blocks(self) -> dict | None:
        if not self.in_blocks:
            return None
        k_b, v_b = self.head_blocks
        return {"qkv": self.qkv.weight, "o": self.attn_output.weight, "q_b": self.q_b.weight if self.q_b else None, "k_b": k_b, "v_b": v_b}

    form = int(abi.LayerForm.LATENT)

    def kernel_extras(self) -> dict:
        m = self.c.latent
        return {"latent": abi.Latent(m.q_lora, m.kv_lora, m.nope, m.rope, m.v_dim)}

    def tensors(self) -> list[Tensor]:
        products = [*(self.q_b.tensors() if self.q_b else []), *self.norms.values()]
        products += [b.raw for b in self.head_blocks] if self.head_blocks else [self.k_b, self.v_b]
        return super().tensors() + products

    # the layer's numbers, on every path
    def _projected(self, n: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """n (..., D) normed -> q_nope (..., H, N), q_pe (..., H, R), the normed latent (..., L), k_pe (..., R)."""
        c, m = self.c, self.c.latent
        first = m.q_lora or c.n_heads * (m.nope + m.rope)
        a = self.qkv(n).contiguous()
        q = a[..., :first]
        if m.q_lora:
            q = self.q_b(rms_norm(q, self.norms[self.norm_names[0]], c.norm_eps).contiguous()).contiguous()
        q = q.reshape(*q.shape[:-1], c.n_heads, m.nope + m.rope)
        latent = rms_norm(a[..., first : first + m.kv_lora], self.norms[self.norm_names[-1]], c.norm_eps)
        return q[..., : m.nope], q[..., m.nope :], latent, a[..., first + m.kv_lora :]

    def _absorbed(self, q_nope: Tensor) -> Tensor:
        """(..., H, N) -> (..., H, L): each head's W_k_b . q_nope, on tinygrad's path."""
        return (q_nope.unsqueeze(-2) @ self.k_b.cast(q_nope.dtype)).squeeze(-2)

    def _heads_out(self, attended: Tensor) -> Tensor:
        """(..., H, L) -> (..., H * V): each head's W_v_b . its attended latent, on tinygrad's path."""
        out = (attended.unsqueeze(-2) @ self.v_b.cast(attended.dtype)).squeeze(-2)
        return out.reshape(*out.shape[:-2], -1)

    def _latent_attend(self, queries: Tensor, keys: Tensor, mask: Tensor) -> Tensor:
        """queries (B, H, T, R+L) over key rows (B, H or 1, S, R+L) (repeated over the heads or
        broadcast: lane_rows.py), an additive mask (B or 1, T, S) -> (B, T, H, L)."""
        scores = queries @ keys.transpose(-1, -2) * self.c.score_scale + mask.unsqueeze(1)
        out = attended(scores, keys[..., self.c.latent.rope :])  # (B, H, T, L)
        return out.transpose(1, 2)

    def _queries_and_key(self, n: Tensor, rotary: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """n (B, T, D) normed -> queries (B, H, T, R+L) and key rows (B, T, R+L), rotated."""
        q_nope, q_pe, latent, k_pe = self._projected(n)
        q_pe = rope(q_pe.transpose(1, 2), *rotary)  # (B, H, T, R)
        queries = q_pe.cat(self._absorbed(q_nope).transpose(1, 2), dim=-1).contiguous()
        k_pe = rope(k_pe.unsqueeze(1), *rotary)[:, 0]  # a head's axis, as the rotations broadcast over one
        return queries, k_pe.cat(latent, dim=-1)

    def prefill(self, n: Tensor, slot: UOp, start: UOp, rotary: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        T = n.shape[1]
        queries, key = self._queries_and_key(n, rotary)
        store = self.cache[0, slot, 0, start : start + T, :].uop.store(self.kv_type.store(key[0]).uop)
        cache = Tensor(self.cache.uop.after(store))
        keys = self.kv_type.load(cache[0, slot, 0, 0 : start + T, :]).unsqueeze(0).unsqueeze(1)  # (1, 1, S, R+L)
        return self._heads_out(self._latent_attend(queries, keys, mask))

    def decode(self, n: Tensor, slots: Tensor, positions: Tensor, rotary: tuple[Tensor, Tensor], length: UOp, mask: Tensor) -> Tensor:
        queries, key = self._queries_and_key(n, rotary)  # key (B, 1, R+L)
        rows = self.kv_type.store(key).reshape(1, key.shape[0], 1, -1)  # (1, B, 1, row): one kind, one head
        cache = write_lane_rows(self.cache, rows, slots, positions)
        keys = self.kv_type.load(lane_rows(cache, 0, slots, length, self.c.n_heads)[:, 0])  # (B, H, length, R+L)
        return self._heads_out(self._latent_attend(queries, keys, mask))

    def on_kernels(self, x: Tensor, norm: Tensor, lanes: Tensor, inv_freq: Tensor) -> Tensor:
        """Where some product of the model is outside blocks: tinygrad's products around the kernels'
        latent attention (the whole layer in blocks runs only inside tq_forward)."""
        c, m = self.c, self.c.latent
        B = x.shape[0]
        q_nope, q_pe, latent, k_pe = self._projected(rms_norm(x, norm, c.norm_eps))
        if self.head_blocks is not None:  # (B, H, N) a head at a time through its blocks
            k_b = self.head_blocks[0]
            absorbed = Tensor.stack(
                *[self.kernels.linear(q_nope[:, h].contiguous(), _head(k_b, h, c.n_heads)) for h in range(c.n_heads)], dim=1
            )
        else:
            absorbed = self._absorbed(q_nope)
        queries = q_pe.cat(absorbed, dim=-1)  # (B, H, R+L), rotated by the kernel
        rows = queries.cat(k_pe.cat(latent, dim=-1).unsqueeze(1), dim=1).reshape(B, -1).float().contiguous()
        attention = (self.cache, lanes, inv_freq, self.extras, c.n_heads, self.flags)
        attn = self.kernels.attend(rows, *attention, c.norm_eps, c.score_scale, m.rope, 1.0, kv_type=self.kv_type.abi)
        attended = attn.reshape(B, c.n_heads, m.rope + m.kv_lora)[..., m.rope :]
        if self.head_blocks is not None:
            v_b = self.head_blocks[1]
            out = Tensor.stack(
                *[self.kernels.linear(attended[:, h].contiguous(), _head(v_b, h, c.n_heads)) for h in range(c.n_heads)], dim=1
            )
            out = out.reshape(B, -1)
        else:
            out = self._heads_out(attended)
        return out.contiguous()


def _head(block: BlockWeight, h: int, heads: int) -> BlockWeight:
    """Head h's matrix of a per-head tensor stored head after head (QuantizedCPU.expert_weight)."""
    rows = block.rows // heads
    return BlockWeight(block.raw[h * rows : (h + 1) * rows].contiguous(), block.ggml_type, rows, block.cols)
