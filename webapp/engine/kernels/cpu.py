"""Quantized matrix products on every CPU core, as kernels inside tinygrad's captured steps.

Contract: `QuantizedCPU.load()` compiles the kernels in `c/` once per source and rung of the ISA ladder
(build.py: the highest this CPU runs, or LLM_CPU_ISA's, a ValueError where the CPU cannot run that one;
cached on disk, so a restart reuses it) and returns None where it cannot serve (not the CPU device, no
clang, an architecture without a trampoline); its `isa` is the rung the library reports. Its `linear(x, weight)` multiplies float32 activations (..., cols)
by a `BlockWeight` (a GGUF tensor's raw blocks, rows x cols); `norm_linear`, `residual_linear` and
`swiglu_linear` fuse what surrounds a layer's products into them; `attend` runs a layer's attention
from its qkv rows; `layer` runs all of a layer as one kernel; `embed(ids, weight)` gathers
dequantized rows. These return lazy tensors that run inside the surrounding TinyJit. `step` runs a
whole step (a model gathered once by `whole_model`) as one direct call and returns NumPy logits.

How it plugs into tinygrad 0.14: a kernel is an Ops.PROGRAM whose binary is a 12- or 16-byte
trampoline that jumps to our compiled function. tinygrad's CPU worker calls a program with every
buffer address (then every variable) as 64-bit arguments, so the jump lands in `tq_linear(out, w, x,
shape)` with its arguments in place. The shape travels as a small tensor holding a struct of tq.h
(abi.py's mirror writes it), not as code: one library serves every matrix. tinygrad's own CPU kernels
run on one thread; these run on all cores the process may use (`os.sched_getaffinity`), with the
library's own thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import shutil
import struct
import subprocess

import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp

from webapp.engine.device.buffers import device_array, host_address
from webapp.engine.device.capabilities import device_capabilities
from webapp.engine.kernels import abi
from webapp.engine.kernels.abi import MAX_PARTS, STACK_HEADER_BYTES, STACKED
from webapp.engine.kernels.block_weight import BLOCK_FORMATS, BlockWeight
from webapp.engine.kernels.build import SOURCE, load_library, rung_for
from webapp.engine.kernels.layer_tables import LayerTensors, WholeModel, cache_layout, layer_attention, page_attention
from webapp.engine.kernels.step_lanes import checked_inputs, lane_values

log = logging.getLogger(__name__)


def cpu_threads() -> int:
    """The cores this process may run on (a container's CPU set, taskset), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _trampoline(address: int) -> bytes | None:
    """Machine code that jumps to `address`, leaving the argument registers and stack untouched."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return b"\x48\xb8" + struct.pack("<Q", address) + b"\xff\xe0"  # movabs rax, address; jmp rax
    if machine in ("aarch64", "arm64"):
        return struct.pack("<II", 0x58000050, 0xD61F0200) + struct.pack("<Q", address)  # ldr x16, #8; br x16
    return None


class QuantizedCPU:
    def __init__(self, library: ctypes.CDLL, threads: int, isa: abi.Isa):
        self.library, self.threads, self.isa = library, threads, isa
        self._shapes: dict[tuple, Tensor] = {}
        self._programs: dict[str, bytes] = {}
        for name in ("tq_linear", "tq_norm_linear", "tq_residual_linear", "tq_swiglu_linear", "tq_embed", "tq_attend", "tq_layer"):
            address = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
            self._programs[name] = _trampoline(address)
        # what a layer passes tq_layer for what it lacks (a mixture's router, up matrices and counts, a shared
        # expert's matrices and gate, the selection bias, Gemma's post-norms, gpt-oss's biases), which
        # tq_layer never reads: one buffer each, as a kernel's arguments are distinct buffers; enough for
        # a layer that lacks every one (its matrices, both norms and the five extras of `layer`)
        self._unread = [device_array(np.zeros(1, np.int64)) for _ in range(abi.LAYER_MATRICES + 2 + 5)]
        self._repack = library.tq_repack
        self._repack.argtypes, self._repack.restype = [ctypes.c_void_p] * 2 + [ctypes.POINTER(abi.Product)], ctypes.c_int
        self._forward = library.tq_forward
        self._forward.argtypes, self._forward.restype = [ctypes.c_void_p] * 5 + [ctypes.POINTER(abi.Step)] + [ctypes.c_void_p] * 2, None
        library.tq_start(ctypes.c_long(threads), ctypes.c_long(abi.SPIN_US))

    @classmethod
    @functools.cache
    def load(cls, isa: str = "auto") -> QuantizedCPU | None:
        """The kernels built for the rung named `isa` (build.rung_for's name, LLM_CPU_ISA's value), or None
        (with the reason logged) where they cannot run."""
        if not device_capabilities().runs_cpu_kernels:
            return None
        if _trampoline(0) is None:
            log.info("quantized CPU kernels: no trampoline for %s; using tinygrad's kernels", platform.machine())
            return None
        if shutil.which("clang") is None:
            log.info("quantized CPU kernels: clang not found; using tinygrad's kernels")
            return None
        rung, flags = rung_for(isa)  # a rung this CPU cannot run is refused (ValueError)
        try:
            library = load_library(rung, flags)  # RuntimeError where its interface or rung is not the expected one
        except (OSError, subprocess.CalledProcessError) as e:
            log.warning("quantized CPU kernels failed to build (%s); using tinygrad's kernels", getattr(e, "stderr", e))
            return None
        kernels = cls(library, cpu_threads(), rung.isa)
        log.info("quantized CPU kernels: %d threads, the %s rung (%s)", kernels.threads, rung.name, " ".join(flags) or "portable C")
        return kernels

    def block_weight(self, rows: np.ndarray, ggml_type: int, cols: int) -> BlockWeight:
        """A matrix's blocks (rows, bytes per row) onto the device, in the layout its products run fastest from: rows
        in eights of a type with an interleaved layout interleaved (tq_repack, formats.c), others as the file has them."""
        source = _checked_blocks(rows, ggml_type, cols)
        stored = Tensor.empty(*source.shape, dtype=dtypes.uint8).realize()  # written in place, from the file's map
        stored_type = self._repack(host_address(stored), source.ctypes.data, abi.Product(ggml_type, source.shape[0], cols))
        return BlockWeight(stored, stored_type, source.shape[0], cols)

    def expert_weight(self, rows: np.ndarray, ggml_type: int, cols: int, experts: int) -> BlockWeight:
        """Every expert's matrix of a mixture of experts (rows: experts x each one's rows, expert after
        expert), each in the layout `block_weight` gives it, one after the other: moe.c finds expert e's
        blocks at e times one matrix's bytes. Repacked one expert at a time, so eight interleaved rows
        never straddle two experts."""
        source = _checked_blocks(rows, ggml_type, cols)
        if source.shape[0] % experts:
            raise ValueError(f"{source.shape[0]} rows are not {experts} experts' matrices")
        each = source.shape[0] // experts
        stored = Tensor.empty(*source.shape, dtype=dtypes.uint8).realize()
        address, step = host_address(stored), each * source.shape[1]
        for e in range(experts):
            stored_type = self._repack(address + e * step, source[e * each].ctypes.data, abi.Product(ggml_type, each, cols))
        return BlockWeight(stored, stored_type, source.shape[0], cols)

    def stacked_weight(self, parts: list[tuple[np.ndarray, int]], cols: int) -> BlockWeight:
        """Matrices of different types (blocks, type) stacked by rows into one (STACKED): each part in
        the layout `block_weight` gives it, behind a header naming the parts' types and rows, so a Q4_K_M
        layer's q and k (Q4_K) and v (Q6_K) stay one product in its blocks, not a float16 copy."""
        sources = [(_checked_blocks(rows, ggml_type, cols), ggml_type) for rows, ggml_type in parts]
        if not 1 < len(sources) <= MAX_PARTS:
            raise ValueError(f"a stacked matrix has 2 to {MAX_PARTS} parts, not {len(sources)}")
        stored = Tensor.empty(1, STACK_HEADER_BYTES + sum(s.nbytes for s, _ in sources), dtype=dtypes.uint8).realize()
        address, offset, stored_parts = host_address(stored), STACK_HEADER_BYTES, []
        for source, ggml_type in sources:
            stored_type = self._repack(address + offset, source.ctypes.data, abi.Product(ggml_type, source.shape[0], cols))
            stored_parts.append((stored_type, source.shape[0]))
            offset += source.nbytes
        header = abi.StackHeader(len(stored_parts), (ctypes.c_int32 * MAX_PARTS)(*(t for t, _ in stored_parts)))
        header.rows[: len(stored_parts)] = [r for _, r in stored_parts]
        ctypes.memmove(address, ctypes.addressof(header), STACK_HEADER_BYTES)
        return BlockWeight(stored, STACKED, sum(r for _, r in stored_parts), cols, tuple(stored_parts))

    def _shape(self, shape: ctypes.Structure) -> Tensor:
        """One of tq.h's structs as a small tensor, made once per value."""
        key = (type(shape), bytes(shape))
        tensor = self._shapes.get(key)
        if tensor is None:
            # not Tensor(array): one made from NumPy inside a jit's capture becomes a host copy that the
            # jit replays, waiting for the device, on every step (bench/RESULTS.md, whole layers on
            # the kernels: the c9eaf6b row)
            tensor = self._shapes[key] = device_array(np.frombuffer(key[1], dtype=np.uint8))
        return tensor

    def _call(self, name: str, out: Tensor, *inputs: Tensor) -> Tensor:
        binary = self._programs[name]

        def program(*params: UOp) -> UOp:
            sink = UOp.sink(*(p.base for p in params), arg=KernelInfo(name=name))
            ids = tuple(range(len(params)))
            return UOp(
                Ops.PROGRAM,
                src=(
                    sink,
                    UOp(Ops.LINEAR, src=(*sink.src, sink)),
                    UOp(Ops.SOURCE, arg=f"// {name}: jump to {SOURCE.name}"),
                    UOp(Ops.BINARY, arg=binary),
                ),
                arg=ProgramInfo(name=name, local_size=(1, 1, 1), globals=ids, outs=(0,), ins=ids[1:]),
            )

        return Tensor.custom_kernel(out, *inputs, fxn=program)[0]

    def linear(self, x: Tensor, weight: BlockWeight) -> Tensor:
        """x (..., cols) float32 @ weight.T -> (..., rows) float32."""
        return self._linear("tq_linear", x, weight, weight.cols)

    def norm_linear(self, x: Tensor, weight: BlockWeight, norm: Tensor, eps: float) -> Tensor:
        """rms_norm(x) * norm, then the product: a layer's input norm runs inside its first kernel."""
        return self._linear("tq_norm_linear", x, weight, weight.cols, norm.cast(dtypes.float32).contiguous(), eps=eps)

    def residual_linear(self, x: Tensor, weight: BlockWeight, residual: Tensor) -> Tensor:
        """residual + x @ weight.T: the residual stream's add runs inside the product."""
        return self._linear("tq_residual_linear", x, weight, weight.cols, self._rows(residual, weight.rows))

    def swiglu_linear(self, gate_up: Tensor, weight: BlockWeight, residual: Tensor) -> Tensor:
        """residual + (silu(gate) * up) @ weight.T, for gate_up (..., 2 * cols) = gate | up."""
        return self._linear("tq_swiglu_linear", gate_up, weight, 2 * weight.cols, self._rows(residual, weight.rows))

    def _linear(self, name: str, x: Tensor, weight: BlockWeight, width: int, *extra: Tensor, eps: float = 0.0) -> Tensor:
        lead = x.shape[:-1]
        tokens = int(np.prod(lead)) if lead else 1
        out = Tensor.empty(tokens, weight.rows, dtype=dtypes.float32)
        shape = self._shape(abi.Product(weight.ggml_type, weight.rows, weight.cols, tokens, eps))
        return self._call(name, out, weight.raw, self._rows(x, width), *extra, shape).reshape(*lead, weight.rows)

    @staticmethod
    def _rows(x: Tensor, width: int) -> Tensor:
        return x.reshape(-1, width).cast(dtypes.float32).contiguous()

    def embed(self, ids: Tensor, weight: BlockWeight) -> Tensor:
        """ids (...) int32 -> (..., cols) float32 rows of weight."""
        lead = ids.shape
        tokens = int(np.prod(lead)) if lead else 1
        out = Tensor.empty(tokens, weight.cols, dtype=dtypes.float32)
        shape = self._shape(abi.Product(weight.ggml_type, weight.rows, weight.cols, tokens))
        return self._call("tq_embed", out, weight.raw, ids.reshape(tokens).cast(dtypes.int32).contiguous(), shape).reshape(
            *lead, weight.cols
        )

    def attend(
        self,
        qkv: Tensor,
        cache: Tensor,
        lanes: Tensor,
        inv_freq: Tensor,
        extras: Tensor,
        heads: int,
        flags: int,
        eps: float,
        scale: float,
        rotary: int = 0,
        rope_scale: float = 1.0,
        window: int = 0,
        tables: Tensor | np.ndarray | None = None,
        block_positions: int = 0,
        positions: int | None = None,
        kv_type: abi.KvType = abi.KvType.F16,
    ) -> Tensor:
        """A layer's attention for B lanes (a decode step's sequences, or a prefill piece's tokens) from
        its qkv rows (B, (heads + 2 kv_heads) Hd): adds the bias and applies the q/k norms (as `flags`
        and `extras` say), rotates q and k by RoPE at each lane's position (inverse frequencies
        `inv_freq`), writes each lane's key and value into the KV cache (2, slots, kv_heads,
        positions, a row of `kv_type`: float16 or Q8_0), then attends over it. lanes (2B,) int32 = each lane's slot, then its position
        (it attends positions 0..pos, or its last `window` of them; position p is row p % positions);
        `scale` multiplies q . k; RoPE turns each head's first `rotary` values (0: all of them), its
        cos and sin times `rope_scale`. -> (B, heads * Hd) float32.

        Paged (block_positions > 0): `cache` is a pool of blocks (2, blocks, kv_heads, block_positions,
        a row), each lane's slot a row of `tables` (rows, table_width) int32, the blocks holding its
        sequence's positions in order (tq.h's tq_attention); `positions`, the most a sequence
        reaches, defaults to table_width * block_positions. A tensor is read in place (rewrite it
        between calls), an array copied in at the call."""
        slots, kv_heads, cache_positions, head_dim = cache_layout(cache, kv_type)
        B = qkv.shape[0]
        out = Tensor.empty(B, heads * head_dim, dtype=dtypes.float32)
        attention = abi.Attention(
            B, heads, kv_heads, slots, cache_positions, head_dim, flags, eps, scale, rotary or head_dim, rope_scale, kv_type, window
        )
        table = self._unread[0]  # tq_attend leaves it unread unpaged
        if tables is not None:
            page_attention(attention, tuple(tables.shape), block_positions, positions)
            table = device_array(np.ascontiguousarray(tables, np.int32)) if isinstance(tables, np.ndarray) else tables
        shape = self._shape(attention)
        row_heads = heads + (1 if flags & abi.AttendFlag.LATENT else 2) * kv_heads  # latent: no value heads
        rows = self._rows(qkv, row_heads * head_dim)
        return self._call("tq_attend", out, rows, cache, lanes, inv_freq, extras, table, shape)

    def layer(self, x: Tensor, layer: LayerTensors, lanes: Tensor, inv_freq: Tensor, eps: float) -> Tensor:
        """A whole transformer layer as one kernel (see tq_layer): x (B, D) float32 -> (B, D); lanes and
        inv_freq as `attend` takes them, eps the norms' epsilon."""
        B, D = x.shape
        if layer.form & (abi.LayerForm.LATENT | abi.LayerForm.RECURRENT | abi.LayerForm.GATED_ATTENTION):
            raise ValueError("a latent, recurrent or gated attention layer runs in a whole step (whole_model) only")
        out = Tensor.empty(B, D, dtype=dtypes.float32)
        m = layer.matrices
        shape = self._shape(abi.LayerShape(layer_attention(layer, B, eps), D, m.down.cols, m.types, layer.experts, layer.form))
        unread = iter(self._unread)
        # tq_layer takes a layer's first LAYER_KERNEL_MATRICES (a latent layer's own run in whole steps only)
        weights = tuple(next(unread) if w is None else w.raw for w in m.in_order[: abi.LAYER_KERNEL_MATRICES])
        attn_norm, ffn_norm = (
            next(unread) if n is None else n.cast(dtypes.float32).contiguous() for n in (layer.attn_norm, layer.ffn_norm)
        )
        tokens = next(unread) if layer.expert_tokens is None else layer.expert_tokens
        post_norms = next(unread) if layer.post_norms is None else layer.post_norms
        biases = next(unread) if layer.biases is None else layer.biases
        shared_gate = next(unread) if layer.shared_gate is None else layer.shared_gate
        selection_bias = next(unread) if layer.selection_bias is None else layer.selection_bias
        extras = (layer.cache, lanes, inv_freq, layer.extras, tokens, post_norms, biases, shared_gate, selection_bias, shape)
        return self._call("tq_layer", out, self._rows(x, D), *weights, attn_norm, ffn_norm, *extras)

    def whole_model(
        self,
        embed: BlockWeight,
        norm: Tensor,
        head: BlockWeight,
        inv_freq: Tensor,
        layers: list[LayerTensors],
        eps: float,
        inv_freq_local: Tensor | None = None,
        embed_scale: float = 1.0,
        block_tables: np.ndarray | None = None,
        block_positions: int = 0,
        rope_sections: Tensor | None = None,
        deepstack: int = 0,
    ) -> WholeModel:
        """Everything `step` reads, by address (see tq_forward): the tensors must be realized, whole
        buffers, and stay alive with the model. `eps` is the norms' epsilon; `inv_freq_local` the
        LOCAL_ROPE layers' frequencies, `embed_scale` a factor on the embedding's rows.

        Paged: every layer's cache is a pool of blocks (2, blocks, kv_heads, block_positions, a row)
        and `block_tables` (rows, table_width) int32, C-contiguous, maps each lane's slot (a row) to
        its blocks. The kernels read the table by address at every step, so the caller rewrites it in
        place between steps and never replaces it; the model keeps it alive. Every layer then takes
        the step's positions, table_width * block_positions (tq_forward ignores layer_info's).
        `rope_sections` (rotary / 2,) int32: the M-RoPE section (0, 1, 2) each rotary pair turns by,
        where a step gives positions by section (`step`'s rope_positions); `deepstack`: an inputs row
        is that many more dims wide, what the first layers add after the embedding (Qwen3-VL)."""
        # the step's attention is its attention layers' (a hybrid's recurrent layers have none)
        first = next(layer for layer in layers if not layer.form & abi.LayerForm.RECURRENT)
        E = abi.ModelEntry
        model = {E.EMBED: embed.raw, E.NORM: norm, E.HEAD: head.raw, E.INV_FREQ: inv_freq, E.INV_FREQ_LOCAL: inv_freq_local}
        model[E.BLOCK_TABLES] = model[E.LORA] = None  # arrays' addresses, written below and by LoraTable: not tensors
        model[E.ROPE_SECTIONS] = rope_sections
        tensors = abi.in_table_order(model, [layer.table_entries for layer in layers])
        attention = layer_attention(first, 0, eps)  # its lanes are each step's
        if block_tables is not None:
            if block_tables.dtype != np.int32 or block_tables.ndim != 2 or not block_tables.flags.c_contiguous:
                raise ValueError(
                    f"block tables are a C-contiguous (rows, table_width) int32 array, not {block_tables.dtype} {block_tables.shape}"
                )
            if any(layer.window for layer in layers) or any(layer.cache.shape[3] != block_positions for layer in layers):
                raise ValueError(f"a paged model's layers have no window and caches of {block_positions}-position blocks")
            page_attention(attention, block_tables.shape, block_positions)
        experts = next((layer.experts for layer in layers if layer.experts.count), abi.Experts())
        # the dense layers' width (a mixture's leading dense layers differ from its experts')
        ffn_dim = next((layer.matrices.down.cols for layer in layers if not layer.experts.count), first.matrices.down.cols)
        dims = abi.Step(attention, embed.cols, ffn_dim, len(layers), head.rows, embed.ggml_type, head.ggml_type)
        dims.experts, dims.embed_scale, dims.deepstack = experts, embed_scale, deepstack
        dims.latent = next((layer.latent for layer in layers if layer.form & abi.LayerForm.LATENT), abi.Latent())
        dims.recurrent = next((layer.recurrent for layer in layers if layer.form & abi.LayerForm.RECURRENT), abi.Recurrent())
        info = np.array([layer.info for layer in layers], dtype=np.int32)  # abi.LAYER_INFO a layer
        table = np.array([0 if t is None else host_address(t) for t in tensors], dtype=np.uint64)
        if block_tables is not None:
            table[E.BLOCK_TABLES] = block_tables.ctypes.data
        return WholeModel(table, dims, info, tuple(t for t in tensors if t is not None), block_tables)

    def step(
        self,
        model: WholeModel,
        tokens: list[int],
        lanes: list[int],
        picks: list[int],
        hidden: bool = False,
        state_rows: list[int] | None = None,
        resume_rows: bool = False,
        inputs: np.ndarray | None = None,
        lora: int = 0,
        last_keys: list[int] | None = None,
        rope_positions: np.ndarray | None = None,
    ) -> np.ndarray:
        """A whole step (tq_forward) as one call on this thread, which works through the pool's jobs
        with it: tokens (B,), lanes (2B,) as `attend` takes them, picks = the lanes whose logits are
        wanted -> (len(picks), vocab) float32 logits; `hidden`: the final norm's output instead,
        (len(picks), dim), for embeddings; `state_rows` (B,): each lane's row of a recurrent layer's
        state, where it is not its slot's (gated_delta.c), its sequence's first lane taking the slot's
        state, or with `resume_rows` going on from the state its row holds; `inputs` (k, dim) float32:
        the embeddings of the tokens given as -1 - row (an image's rows); `lora`: its LoRA table's address
        for this step (LoraTable.address), or 0; `last_keys` (B,): the last key each lane attends,
        where some attend past their own position (ATTEND_KEYS_AHEAD); `rope_positions` (3, B): the
        positions each lane's rotary pairs turn by, by the model's M-RoPE sections (ATTEND_ROPE_POSITIONS;
        a model without sections refuses them). The model's tensors must not be
        in use by tinygrad's queue (callers synchronize after tinygrad work on the same tensors).

        Not a kernel inside a TinyJit like the others: a replayed capture adds Python before the kernel,
        a hop to tinygrad's worker thread and a wait for its end (bench/RESULTS.md, 56cc4f0)."""
        B = len(tokens)
        assert len(lanes) == 2 * B and (state_rows is None or (len(state_rows) == B and model.dims.recurrent.state))
        if rope_positions is not None and not model.table[abi.ModelEntry.ROPE_SECTIONS]:
            raise ValueError("positions by M-RoPE section for a model without sections")
        lane_array = lane_values(lanes[:B], lanes[B:], state_rows, last_keys, rope_positions)
        ids, rows = (np.ascontiguousarray(v, dtype=np.int32) for v in (tokens, picks))
        given = checked_inputs(ids, inputs, model.dims.dim * (1 + model.dims.deepstack))
        out = np.empty((len(rows), model.dims.dim if hidden else model.dims.vocab), dtype=np.float32)
        lane_rows = abi.LaneRows.SLOTS if state_rows is None else abi.LaneRows.RESUME if resume_rows else abi.LaneRows.GIVEN
        outputs = abi.StepOutput.HIDDEN if hidden else abi.StepOutput.LOGITS
        step = model.step(B, len(rows), outputs, lane_rows, last_keys is not None, rope_positions is not None)
        model.table[abi.ModelEntry.LORA] = lora
        addresses = (out.ctypes.data, ids.ctypes.data, lane_array.ctypes.data, rows.ctypes.data, model.table.ctypes.data)
        self._forward(*addresses, step, model.layer_info.ctypes.data, None if given is None else given.ctypes.data)
        return out


def _checked_blocks(rows: np.ndarray, ggml_type: int, cols: int) -> np.ndarray:
    """rows as a C-contiguous (rows, bytes per row) uint8 array, or ValueError: the C side trusts the
    shape it is given, and a row of another size would read and write past the buffers."""
    if ggml_type not in BLOCK_FORMATS:
        raise ValueError(f"GGML type {ggml_type} has no CPU kernel")
    name, values, nbytes = BLOCK_FORMATS[ggml_type]
    source = np.ascontiguousarray(rows)
    if cols % values or source.ndim != 2 or source.dtype != np.uint8 or source.shape[1] != cols // values * nbytes:
        raise ValueError(f"{name} matrix of {cols} columns cannot be stored as {source.dtype} {source.shape} bytes")
    return source
