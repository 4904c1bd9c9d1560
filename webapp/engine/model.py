"""A llama-family transformer (llama, qwen2, qwen3) on tinygrad, with a KV cache of many slots.

Contract: `Transformer.prefill` runs a chunk of one sequence's prompt into one slot and returns the
logits of its last token; `Transformer.decode` advances several sequences by one token each, every
lane at its own position in its own slot, and returns one row of logits per lane (NumPy arrays,
float32). Positions and slots enter the jitted steps as values, never as shapes, so sequences joining
and leaving never trigger a recompile, and each step writes only the cache rows it produces: on
the CPU kernels as an int32 `lanes` tensor the kernels read, elsewhere as bound symbolic variables.

On the CPU device, with the kernels in kernels/ loaded and every matrix in blocks they read, a step
is one direct call into them (`QuantizedCPU.step`, `tq_forward`): the embedding, then per layer norm
+ qkv product, attention (bias, q/k norms, RoPE, the cache write and the softmax), output product +
residual, norm + gate/up product, SwiGLU + down product + residual, then the final norm and the head.
Where some matrix's type has no kernel, the step is a TinyJit of kernels: a layer is one (`tq_layer`)
or, with such a matrix, five around tinygrad's float16 product. Every other device runs the whole
layer on tinygrad's kernels, float16 weights, with tinygrad's attention over the float16 KV cache.
Activations stay float32 on CPU, which has no float16 arithmetic.
"""

from __future__ import annotations

import logging
import math

import numpy as np

# tinygrad reads HCQ2 at import: webapp.engine.tinygrad_setup.prepare_tinygrad() runs before this.
from tinygrad import Device, Tensor, TinyJit, UOp, dtypes

from .device_buffers import StepBuffers, device_array
from .kernels.abi import MAX_HEAD_DIM, AttendFlag
from .kernels.cpu import BLOCK_FORMATS, BlockWeight, LayerMatrices, LayerTensors, QuantizedCPU
from .memory import plan as memory_plan
from .model_config import ModelConfig, ModelLoadError, check_tensors
from .rope import RopeUnsupported, inverse_frequencies
from .weights import BlockLinear, WeightSource, read_gguf

log = logging.getLogger(__name__)

# half the KV memory of float32 (0.86 instead of 1.7 GB for 8 slots x 4,096 positions of the default
# model), at the same speed as measured here
KV_DTYPE = dtypes.float16
# GGUF general.file_type values of unquantized files: all F32, mostly F16, mostly BF16. A quantized
# file's output head on tinygrad's kernels is stored as int8 with a scale per vocabulary row (see
# weights.FloatHead); unquantized files keep an exact float16 head.
FLOAT_FILE_TYPES = (0, 1, 32)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * (x.square().mean(-1, keepdim=True) + eps).rsqrt() * weight


def rotation(pos: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of the RoPE angles for positions pos (T,) or (B, 1, 1): computed once a step, read by every layer."""
    angles = pos.float().unsqueeze(-1) * inv_freq  # (..., half)
    return angles.cos().contiguous(), angles.sin().contiguous()


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the half-split pairs of x (..., T, head_dim) by the angles whose cos and sin are given."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)


# A layer's products with what surrounds them: one fused kernel when the matrix is in blocks on the
# CPU kernels, tinygrad's operations around the product otherwise.
def _after_norm(linear, x: Tensor, norm: Tensor, eps: float) -> Tensor:
    if isinstance(linear, BlockLinear):
        return linear.kernels.norm_linear(x, linear.weight, norm, eps)
    return linear(rms_norm(x, norm, eps))


def _plus(linear, x: Tensor, residual: Tensor) -> Tensor:
    if isinstance(linear, BlockLinear):
        return linear.kernels.residual_linear(x, linear.weight, residual)
    return (residual + linear(x)).contiguous()


def _swiglu_plus(linear, gate_up: Tensor, residual: Tensor) -> Tensor:
    if isinstance(linear, BlockLinear):
        return linear.kernels.swiglu_linear(gate_up, linear.weight, residual)
    hidden = gate_up.shape[-1] // 2
    return (residual + linear(gate_up[..., :hidden].silu() * gate_up[..., hidden:])).contiguous()


class Block:
    def __init__(self, config: ModelConfig, weights: WeightSource, layer: int, slots: int, context: int, kv_dtype):
        self.c = config
        p = f"blk.{layer}."
        self.w = {
            name: weights.vector(p + name)
            for name in ("attn_norm.weight", "ffn_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight")
            if weights.has(p + name)
        }
        # one product for q, k and v and one for gate and up: fewer, larger kernels run faster here
        self.qkv = weights.linear(*(p + f"attn_{n}.weight" for n in "qkv"))  # D -> H*Hd + 2*KvH*Hd
        self.gate_up = weights.linear(p + "ffn_gate.weight", p + "ffn_up.weight")  # D -> 2*F
        self.attn_output = weights.linear(p + "attn_output.weight")  # H*Hd -> D
        self.down = weights.linear(p + "ffn_down.weight")  # F -> D
        # the whole layer runs on the CPU kernels when they are loaded and can rotate its heads
        head_dim_ok = config.head_dim % 2 == 0 and config.head_dim <= MAX_HEAD_DIM
        self.kernels = weights.kernels if head_dim_ok else None
        bias_names = [p + f"attn_{n}.bias" for n in "qkv"] if config.qkv_bias else []
        self.qkv_bias = None  # added by tinygrad's product; on the kernels, by the attention kernel
        self.attend_extras = self.layer_tensors = None
        matrices = None
        if self.kernels is None:
            if bias_names:
                self.qkv_bias = Tensor.cat(*(weights.vector(n) for n in bias_names)).contiguous()
        else:
            # tq_attend's extras: the qkv bias, then the q and k norm weights, as the model has them
            names = bias_names + ([p + "attn_q_norm.weight", p + "attn_k_norm.weight"] if config.qk_norm else [])
            extras = [weights.vector_values(n) for n in names]
            if all(e is not None for e in extras):  # read from the file straight into one buffer
                self.attend_extras = device_array(np.concatenate(extras) if extras else np.zeros(1, np.float32))
            else:
                self.attend_extras = Tensor.cat(*(weights.vector(n) for n in names)).float().contiguous()
            self.attend_flags = int((AttendFlag.BIAS if config.qkv_bias else 0) | (AttendFlag.QK_NORM if config.qk_norm else 0))
            products = (self.qkv, self.attn_output, self.gate_up, self.down)
            # every product in blocks: the layer runs as one kernel; else five, tinygrad's products among them
            if all(isinstance(product, BlockLinear) for product in products):
                matrices = LayerMatrices(*(product.weight for product in products))
        # (k|v, slot, kv_head, position, head_dim); the extra last slot is scratch for padding lanes.
        shape = (2, slots + 1, config.n_kv_heads, context, config.head_dim)
        if Device.DEFAULT == "CPU":
            # the CPU allocator maps fresh zero pages: no kernel writes 0.9 GB of zeros at load, and memory
            # is only committed as positions fill
            self.cache = Tensor.empty(*shape, dtype=kv_dtype).realize()
            self.cache.uop.base.buffer.ensure_allocated()
        else:
            self.cache = Tensor.zeros(*shape, dtype=kv_dtype).contiguous()
        if matrices is not None:
            norms = (self.w["attn_norm.weight"], self.w["ffn_norm.weight"])
            self.layer_tensors = LayerTensors(matrices, *norms, self.cache, self.attend_extras, config.n_heads, self.attend_flags)

    def tensors(self) -> list[Tensor]:
        own = [*self.qkv.tensors(), *self.gate_up.tensors(), *self.attn_output.tensors(), *self.down.tensors(), self.cache]
        optional = [t for t in (self.qkv_bias, self.attend_extras) if t is not None]
        return own + optional + list(self.w.values())

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c, w = self.c, self.w
        B, T, _ = x.shape
        qkv = self.qkv(x, self.qkv_bias).contiguous()  # (B, T, H*Hd + 2*KvH*Hd)
        q_end, k_end = c.n_heads * c.head_dim, (c.n_heads + c.n_kv_heads) * c.head_dim
        q, k, v = qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
        q = q.reshape(B, T, c.n_heads, c.head_dim).transpose(1, 2)  # (B, H, T, Hd)
        k = k.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, KvH, T, Hd)
        v = v.reshape(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, KvH, T, Hd)
        if c.qk_norm:
            q, k = rms_norm(q, w["attn_q_norm.weight"], c.norm_eps), rms_norm(k, w["attn_k_norm.weight"], c.norm_eps)
        return q, k, v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """q (B, H, T, Hd) over k, v (B, KvH, S, Hd) with an additive mask (B or 1, T, S).

        Query heads sharing a kv head get their own axis and k, v broadcast over it: no reshape
        ever touches the symbolic S axis, which tinygrad would index with a division and a modulo
        by S on every load (the product with v ran 14x slower that way).
        """
        c = self.c
        B, H, T, Hd = q.shape
        group = c.n_heads // c.n_kv_heads
        q = q.reshape(B, c.n_kv_heads, group, T, Hd)
        scores = q @ k.unsqueeze(2).transpose(-1, -2) * (1.0 / math.sqrt(Hd))  # (B, KvH, group, T, S)
        probs = (scores + mask.unsqueeze(1).unsqueeze(1)).softmax(-1)
        out = (probs @ v.unsqueeze(2)).reshape(B, H, T, Hd)
        return out.transpose(1, 2).reshape(B, T, H * Hd)

    def _ffn_and_out(self, x: Tensor, attn: Tensor) -> Tensor:
        h = x + self.attn_output(attn)
        n = rms_norm(h, self.w["ffn_norm.weight"], self.c.norm_eps)
        gate_up = self.gate_up(n).contiguous()  # (B, T, 2*F)
        hidden = self.c.hidden_dim
        mixed = (gate_up[..., :hidden].silu() * gate_up[..., hidden:]).contiguous()
        return (h + self.down(mixed)).contiguous()

    def on_kernels(self, x: Tensor, lanes: Tensor, inv_freq: Tensor) -> Tensor:
        """The layer on the CPU kernels, as one or five of them: x (B, D) for B lanes, each a decode step's
        sequence or a prefill piece's token, lane b at position lanes[B + b] of slot lanes[b]. Prefill
        and decode thus compute a position identically, so prompt scoring equals generation."""
        c, w = self.c, self.w
        if self.layer_tensors is not None:  # every product in blocks: one kernel
            return self.kernels.layer(x, self.layer_tensors, lanes, inv_freq, c.norm_eps)
        attention = (self.cache, lanes, inv_freq, self.attend_extras, c.n_heads, self.attend_flags)
        qkv = _after_norm(self.qkv, x, w["attn_norm.weight"], c.norm_eps)
        attn = self.kernels.attend(qkv, *attention, c.norm_eps)
        h = _plus(self.attn_output, attn, x)
        return _swiglu_plus(self.down, _after_norm(self.gate_up, h, w["ffn_norm.weight"], c.norm_eps), h)

    def prefill(self, x: Tensor, slot: UOp, start: UOp, rotary: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """x (1, T, D) for positions start..start+T-1 of the sequence in `slot`."""
        T = x.shape[1]
        q, k, v = self._qkv(rms_norm(x, self.w["attn_norm.weight"], self.c.norm_eps))
        # contiguous after RoPE: fusing RoPE into symbolic-length attention overflows tinygrad's rewriter
        q = rope(q, *rotary).contiguous()
        k = rope(k, *rotary)
        kv = Tensor.stack(k[0], v[0]).cast(self.cache.dtype)  # (2, KvH, T, Hd)
        store = self.cache[:, slot, :, start : start + T, :].uop.store(kv.uop)
        cache = Tensor(self.cache.uop.after(store))
        keys = cache[0, slot, :, 0 : start + T, :].unsqueeze(0).float()  # (1, KvH, start+T, Hd)
        values = cache[1, slot, :, 0 : start + T, :].unsqueeze(0).float()
        return self._ffn_and_out(x, self._attend(q, keys, values, mask))

    def decode(self, x: Tensor, slots: list[UOp], positions: list[UOp], rotary: tuple[Tensor, Tensor], length: UOp, mask: Tensor) -> Tensor:
        """x (B, 1, D): lane b is at position positions[b] of the sequence in slots[b]; keys read up to `length`."""
        q, k, v = self._qkv(rms_norm(x, self.w["attn_norm.weight"], self.c.norm_eps))
        q = rope(q, *rotary).contiguous()
        k = rope(k, *rotary)
        kv = Tensor.stack(k, v).cast(self.cache.dtype)  # (2, B, KvH, 1, Hd)
        stores = [self.cache[:, s, :, p : p + 1, :].uop.store(kv[:, b].contiguous().uop) for b, (s, p) in enumerate(zip(slots, positions))]
        cache = Tensor(self.cache.uop.after(*stores))
        keys = Tensor.stack(*[cache[0, s, :, 0:length, :] for s in slots]).float()  # (B, KvH, length, Hd)
        values = Tensor.stack(*[cache[1, s, :, 0:length, :] for s in slots]).float()
        return self._ffn_and_out(x, self._attend(q, keys, values, mask))


class Transformer:
    def __init__(
        self,
        config: ModelConfig,
        weights: WeightSource,
        slots: int,
        context: int,
        max_chunk: int,
        inv_freq: np.ndarray,
        act_dtype=dtypes.float32,
        int8_head: bool = False,
    ):
        """`inv_freq` (head_dim / 2,) float32 are RoPE's inverse frequencies, as the file asks (rope.py)."""
        self.config, self.slots, self.context, self.act_dtype = config, slots, context, act_dtype
        self.embed = weights.embedding()  # token ids -> (..., D)
        self.output_norm = weights.vector("output_norm.weight")
        self.head = weights.head(config.vocab_size, int8_head)  # (B, D) -> (B, vocab)
        # a padded prefill chunk may write up to max_chunk - 1 junk positions past the context
        self.blocks = [Block(config, weights, i, slots, context + max_chunk, KV_DTYPE) for i in range(config.n_layers)]
        self.uses_cpu_kernels = weights.uses_kernels  # some matrix runs on the quantized CPU kernels
        # every layer runs on the CPU kernels, or none does (attention always, each product where its
        # type has one)
        self.kernels = self.blocks[0].kernels
        # a symbolic-length arange compiles to a reduce over length x length: slice a stored one instead
        self.key_positions = Tensor.arange(context + max_chunk).contiguous()
        # stored, not rebuilt from a Python list inside the jitted step: tinygrad replays such a constant
        # as a host copy that waits for the device, which was 60 full stalls per decode step
        self.inv_freq = Tensor(np.ascontiguousarray(inv_freq, dtype=np.float32)).contiguous()
        self.v_slot = UOp.variable("slot", 0, slots)
        self.v_start = UOp.variable("start", 0, context - 1)
        self.v_length = UOp.variable("length", 1, context)
        self._prefill_jits: dict[int, TinyJit] = {}
        self._decode_jits: dict[int, TinyJit] = {}
        self._copy_jit: TinyJit | None = None
        self.v_source = UOp.variable("source", 0, slots)
        self._buffers = StepBuffers()
        # a realize per layer: 150 separate ones took ~40% of loading, and one for all of them spent
        # 20 s in tinygrad's lowering of one long command list
        Tensor.realize(*self.embed.tensors(), self.output_norm, *self.head.tensors(), self.key_positions, self.inv_freq)
        for block in self.blocks:
            Tensor.realize(*block.tensors())
        self.whole_model = self._whole_model()

    def _whole_model(self):
        """The model for `QuantizedCPU.step` (a whole step as one call) when the embedding, the head and
        every layer's products are in blocks on the kernels; else None (jitted steps of a kernel or five
        a layer)."""
        embed, head = getattr(self.embed, "weight", None), getattr(self.head, "weight", None)
        layers = [block.layer_tensors for block in self.blocks]
        if self.kernels is None or not isinstance(embed, BlockWeight) or not isinstance(head, BlockWeight) or None in layers:
            return None
        return self.kernels.whole_model(embed, self.output_norm, head, self.inv_freq, layers, self.config.norm_eps)

    def _logits(self, x: Tensor) -> Tensor:
        """x (B, D) -> (B, vocab) float32 logits."""
        return self.head(rms_norm(x, self.output_norm, self.config.norm_eps).contiguous()).contiguous()

    def _step_on_kernels(self, tokens: Tensor, lanes: Tensor, picks: Tensor) -> Tensor:
        """A step on the CPU kernels, its B lanes a decode step's sequences or a prefill piece's tokens:
        tokens (B,), lanes (2B,) = each lane's slot, then its position, picks (R,) = the lanes whose
        logits are wanted (a decode step's every lane, a prefill piece's last real token). No symbolic
        variables, which tinygrad's replay would bind on every call. -> (R, vocab) logits."""
        x = self.embed(tokens)  # (B, D)
        for block in self.blocks:
            # realized layer by layer: the jit records each piece, and scheduling the whole step as
            # one graph cost time quadratic in its layers (tinygrad's store-hazard walk per store)
            x = block.on_kernels(x, lanes, self.inv_freq).realize()
        return self._logits(x[picks]).realize()

    def _prefill(self, tokens: Tensor, last: Tensor, slot: UOp, start: UOp) -> Tensor:
        positions = Tensor.arange(tokens.shape[1]) + start  # (T,)
        keys = self.key_positions[0 : start + tokens.shape[1]]
        mask = (keys.reshape(1, -1) > positions.reshape(-1, 1)).where(float("-inf"), 0.0).unsqueeze(0).contiguous()  # (1, T, S)
        rotary = rotation(positions, self.inv_freq)
        x = self.embed(tokens)  # (1, T, D)
        for block in self.blocks:
            x = block.prefill(x, slot, start, rotary, mask).realize()  # as in _step_on_kernels
        return self._logits(last @ x[0]).realize()  # (1, T) one-hot @ (T, D) -> (1, vocab)

    def _decode(self, tokens: Tensor, pos: Tensor, length: UOp, *lanes: UOp) -> Tensor:
        width = tokens.shape[0]
        slots, positions = list(lanes[:width]), list(lanes[width:])
        keys = self.key_positions[0:length].reshape(1, 1, -1)
        mask = (keys > pos.reshape(-1, 1, 1)).where(float("-inf"), 0.0).contiguous()  # (B, 1, length)
        rotary = rotation(pos.reshape(-1, 1, 1), self.inv_freq)  # (B, 1, 1, half): broadcast over heads
        x = self.embed(tokens).reshape(width, 1, -1)  # (B, 1, D)
        for block in self.blocks:
            x = block.decode(x, slots, positions, rotary, length, mask).realize()  # as in _step_on_kernels
        return self._logits(x[:, 0, :]).realize()  # (B, vocab)

    def prefill(self, tokens: list[int], slot: int, start: int, chunk: int) -> np.ndarray:
        """Run tokens at positions start.. in `slot`, padded to a fixed `chunk` (fixed shapes compile to
        kernels ~3x faster here than a symbolic length); logits (1, vocab) of the last real token."""
        n = len(tokens)
        assert 0 < n <= chunk and start + n <= self.context
        if self.whole_model is not None:  # one call, no padding: no compiled shapes to fit
            return self.kernels.step(self.whole_model, tokens, _prompt_lanes(slot, start, n), [n - 1])
        jit = self._prefill_jits.get(chunk)
        if jit is None:
            jit = self._prefill_jits[chunk] = _capturing_jit(self._prefill if self.kernels is None else self._step_on_kernels)
        padded = tokens + [0] * (chunk - n)
        if self.kernels is not None:
            lanes = self._buffers.fill("prefill lanes", _prompt_lanes(slot, start, chunk), dtypes.int32)
            picks = self._buffers.fill("prefill picks", [n - 1], dtypes.int32)
            return self._buffers.read(jit(self._buffers.fill("prefill tokens", padded, dtypes.int32), lanes, picks), 1)
        last = self._buffers.fill("prefill last", [[float(i == n - 1) for i in range(chunk)]], dtypes.float32)
        padded_in = self._buffers.fill("prefill tokens", [padded], dtypes.int32)
        return self._buffers.read(jit(padded_in, last, self.v_slot.bind(slot), self.v_start.bind(start)), 1)

    @property
    def mixes_steps(self) -> bool:
        """Whether prompt chunks and a decode step can run as one step (`prefill_and_decode`): on the
        CPU kernels' one-call steps, where lanes of any slot and position share a call."""
        return self.whole_model is not None

    def prefill_and_decode(
        self, chunks: list[tuple[list[int], int, int]], decoding: list[int], slots: list[int], positions: list[int]
    ) -> tuple[list[np.ndarray], np.ndarray]:
        """Prompt chunks (tokens, slot, start), each as `prefill` runs it, and `decode(decoding, slots,
        positions)` as one step, which reads the weights once for all of them: each chunk's last
        token's logits (vocab,), and the decode lanes' (len(decoding), vocab). A lane's numbers are
        those of a call of its own: every lane's keys are written before any lane attends, and lanes
        never mix. Each chunk's slot is its own."""
        chunk_slots = [slot for _, slot, _ in chunks]
        assert self.mixes_steps and chunks and all(t for t, _, _ in chunks) and len(set(chunk_slots + slots)) == len(chunk_slots + slots)
        tokens, lane_slots, lane_positions, picks = [], [], [], []
        for chunk, slot, start in chunks:
            tokens += chunk
            lane_slots += [slot] * len(chunk)
            lane_positions += range(start, start + len(chunk))
            picks.append(len(tokens) - 1)
        picks += range(len(tokens), len(tokens) + len(decoding))
        logits = self.kernels.step(self.whole_model, tokens + decoding, lane_slots + slots + lane_positions + positions, picks)
        return list(logits[: len(chunks)]), logits[len(chunks) :]

    def score(self, tokens: list[int], slot: int, start: int) -> np.ndarray:
        """Like `prefill`, but logits (len(tokens), vocab) for every token (prompt scoring). On the CPU
        kernels' one-call steps, one call; elsewhere, whose prefill keeps only the last token's logits,
        a width-1 decode step per token (~20 ms each on the default model, ~5 ms a token prefilled).
        Either way a position's logits are those generating it would give."""
        assert tokens and start + len(tokens) <= self.context
        if self.whole_model is not None:
            n = len(tokens)
            return self.kernels.step(self.whole_model, tokens, _prompt_lanes(slot, start, n), list(range(n)))
        return np.stack([self.decode([t], [slot], [start + i], 1)[0] for i, t in enumerate(tokens)])

    def _copy_prefix(self, source: UOp, target: UOp, length: UOp) -> None:
        for block in self.blocks:
            # staged through a buffer of its own: source and target rows live in one cache tensor
            rows = block.cache[:, source, :, 0:length, :].contiguous()
            block.cache[:, target, :, 0:length, :].assign(rows).realize()  # per layer, as in _prefill

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Copy the K/V of positions 0..length-1 from slot `source` to slot `target`, every layer."""
        assert source != target and 0 < length <= self.context
        if self._copy_jit is None:
            self._copy_jit = _capturing_jit(self._copy_prefix)
        self._copy_jit(self.v_source.bind(source), self.v_slot.bind(target), self.v_length.bind(length))
        if self.whole_model is not None:  # its steps read the caches outside tinygrad's queue
            Device[Device.DEFAULT].synchronize()

    def decode(self, tokens: list[int], slots: list[int], positions: list[int], width: int) -> np.ndarray:
        """One token for each lane; lanes past len(tokens) are padding written to the scratch slot. -> logits
        (len(tokens), vocab)."""
        n = len(tokens)
        assert 0 < n <= width
        if self.whole_model is not None:
            return self.kernels.step(self.whole_model, tokens, slots + positions, list(range(n)))
        pad = width - n
        tokens, slots, positions = tokens + [0] * pad, slots + [self.slots] * pad, positions + [0] * pad
        jit = self._decode_jits.get(width)
        if jit is None:
            jit = self._decode_jits[width] = _capturing_jit(self._decode if self.kernels is None else self._step_on_kernels)
        tokens_in = self._buffers.fill("decode tokens", tokens, dtypes.int32)
        if self.kernels is not None:
            lanes_in = self._buffers.fill("decode lanes", slots + positions, dtypes.int32)
            return self._buffers.read(jit(tokens_in, lanes_in, self._buffers.fill("decode picks", list(range(width)), dtypes.int32)), n)
        lanes = [UOp.variable(f"slot{b}", 0, self.slots).bind(s) for b, s in enumerate(slots)]
        lanes += [UOp.variable(f"pos{b}", 0, self.context - 1).bind(p) for b, p in enumerate(positions)]
        length = self.v_length.bind(max(positions) + 1)
        return self._buffers.read(jit(tokens_in, self._buffers.fill("decode positions", positions, dtypes.int32), length, *lanes), n)


def _prompt_lanes(slot: int, start: int, n: int) -> list[int]:
    """The kernels' lanes for n prompt tokens of `slot` from position `start`: their slots, then their positions."""
    return [slot] * n + list(range(start, start + n))


def use_tinygrad_from_this_thread() -> None:
    """tinygrad keeps one sqlite connection for its kernel cache, usable only by the thread that opened
    it. The server touches tinygrad from its model thread only; tests and benchmarks that also use it
    from another thread (the main thread, then an engine's model thread) drop the connection so the
    next user reopens it."""
    import tinygrad.helpers

    tinygrad.helpers._db_connection = None


def _capturing_jit(fn) -> TinyJit:
    """A TinyJit that captures on its first call. By default it first runs once eagerly, which
    schedules and compiles the whole step only for the capture to do it again: skipping that run
    cut warm-up from 116 to 80 s here."""
    jit = TinyJit(fn)
    jit.cnt = 1
    return jit


def _rope_frequencies(kv: dict, table: dict, config: ModelConfig) -> np.ndarray:
    """RoPE's inverse frequencies for this file, Llama 3's rope_freqs.weight factors applied (rope.py)."""
    factors = table.get("rope_freqs.weight")
    if factors is not None and (factors.ggml_type != 0 or factors.data is None):
        raise ModelLoadError(f"rope_freqs.weight is stored as GGML type {factors.ggml_type}; float32 expected")
    try:
        return inverse_frequencies(kv, config.arch, config.head_dim, None if factors is None else factors.data.view(np.float32)[0])
    except RopeUnsupported as e:
        raise ModelLoadError(str(e)) from e


def load_model(path: str, slots: int, context: int | None, max_chunk: int = 64, cpu_kernels: bool = True) -> tuple[Transformer, dict]:
    """Read a GGUF file; returns the model and the file's metadata (the tokenizer needs it).
    `cpu_kernels=False` keeps every matrix on tinygrad's float16 path, even where a kernel exists."""
    try:
        kv, table = read_gguf(path)
    except FileNotFoundError:
        raise
    except Exception as e:  # a truncated or foreign file fails deep inside the parser
        raise ModelLoadError(f"cannot parse {path} as GGUF: {e}") from e
    config = ModelConfig.from_gguf(kv, table)
    check_tensors(config, table)
    context = min(context or config.trained_context, config.trained_context)
    # CPUs here lack float16 arithmetic: compute in float32 there, reading float16 or block weights
    act_dtype = dtypes.float32 if Device.DEFAULT in ("CPU", "PYTHON") else dtypes.float16
    kernels = QuantizedCPU.load() if cpu_kernels else None
    memory = memory_plan(config, table, slots, context + max_chunk, set(BLOCK_FORMATS) if kernels is not None else set())
    memory.check()  # before any weight is read
    log.info("%s", memory.describe())
    weights = WeightSource(path, table, config.arch, config.n_heads, config.n_kv_heads, act_dtype, kernels)
    int8_head = kv.get("general.file_type") not in (None, *FLOAT_FILE_TYPES)
    inv_freq = _rope_frequencies(kv, table, config)
    model = Transformer(config, weights, slots, context, max_chunk, inv_freq, act_dtype=act_dtype, int8_head=int8_head)
    steps = (
        "one call each on the CPU kernels" if model.whole_model else "jitted, on " + ("the CPU kernels" if model.kernels else "tinygrad")
    )
    log.info(
        "loaded %s: %s, %d layers, dim %d, %d slots x %d positions; weights: %s; steps: %s",
        path,
        config.arch,
        config.n_layers,
        config.dim,
        slots,
        context,
        weights.describe(),
        steps,
    )
    return model, kv
