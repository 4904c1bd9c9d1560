"""Quantized matrix products on every CPU core, as kernels inside tinygrad's captured steps.

Contract: `QuantizedCPU.load()` compiles the kernels in `c/` once per source and CPU feature set (cached on
disk, so a restart reuses it) and returns None where it cannot serve (not the CPU device, no clang, an
architecture without a trampoline). Its `linear(x, weight)` multiplies float32 activations (..., cols)
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
from dataclasses import dataclass, field

import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp

from webapp.engine.kernels import abi
from webapp.engine.kernels.abi import INTERLEAVED, MAX_PARTS, STACK_HEADER_BYTES, STACKED
from webapp.engine.kernels.build import SOURCE, compile_library, simd_flags
from webapp.engine.model.device_buffers import device_array, host_address
from webapp.engine.model.ggml_types import GGML_TYPES

log = logging.getLogger(__name__)

# The kernels read a plain float type (F32, F16, BF16: a GGML block of one value) in blocks of the
# activations' 32 values (format_float.c), so its rows are whole blocks like every other format's
ACTIVATION_BLOCK = 32


def _kernel_block(name: str, values: int, nbytes: int) -> tuple[str, int, int]:
    return (name, values, nbytes) if values > 1 else (name, ACTIVATION_BLOCK, ACTIVATION_BLOCK * nbytes)


# GGML type ids with a kernel: (name, values, bytes) per block as the kernels count them
BLOCK_FORMATS = {int(t): _kernel_block(*GGML_TYPES[t]) for t in abi.BlockType}


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


@dataclass(frozen=True)
class BlockWeight:
    """A GGUF matrix kept in its file's block format: `raw` (rows, bytes per row) on the device."""

    raw: Tensor
    ggml_type: int
    rows: int
    cols: int
    parts: tuple[tuple[int, int], ...] = ()  # a STACKED matrix's parts: (stored type, rows) each

    @property
    def type_name(self) -> str:
        """The file's type, e.g. "Q4_1"; a stacked matrix's parts' types, e.g. "Q4_K+Q4_K+Q6_K"."""
        if self.parts:
            return "+".join(BLOCK_FORMATS[_file_type(t)][0] for t, _ in self.parts)
        return BLOCK_FORMATS[_file_type(self.ggml_type)][0]

    @property
    def form(self) -> str:
        """How the start-up log names this matrix's form, e.g. "Q4_1 blocks (rows interleaved)"."""
        return stored_form(self.ggml_type) + (" (rows interleaved)" if INTERLEAVED < self.ggml_type < STACKED else "")


def _file_type(stored_type: int) -> int:
    """The GGML type of a stored (maybe interleaved) type."""
    return stored_type - INTERLEAVED if INTERLEAVED <= stored_type < STACKED else stored_type


def stored_form(ggml_type: int) -> str:
    """How the start-up log names a matrix kept in the file's type: "Q4_1 blocks", "F16 (the file's bytes)"."""
    name, values, _ = GGML_TYPES[_file_type(ggml_type)]
    return f"{name} (the file's bytes)" if values == 1 else f"{name} blocks"


class QuantizedCPU:
    def __init__(self, library: ctypes.CDLL, threads: int, simd: bool):
        self.library, self.threads, self.simd = library, threads, simd
        self._shapes: dict[tuple, Tensor] = {}
        self._programs: dict[str, bytes] = {}
        for name in ("tq_linear", "tq_norm_linear", "tq_residual_linear", "tq_swiglu_linear", "tq_embed", "tq_attend", "tq_layer"):
            address = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
            self._programs[name] = _trampoline(address)
        self._repack = library.tq_repack
        self._repack.argtypes, self._repack.restype = [ctypes.c_void_p] * 2 + [ctypes.POINTER(abi.Product)], ctypes.c_int
        self._forward = library.tq_forward
        self._forward.argtypes = [ctypes.c_void_p] * 5 + [ctypes.POINTER(abi.Step), ctypes.c_void_p]
        self._forward.restype = None
        library.tq_start(ctypes.c_long(threads), ctypes.c_long(abi.SPIN_US))

    @classmethod
    @functools.cache
    def load(cls) -> QuantizedCPU | None:
        """The kernels for this process, or None (with the reason logged) where they cannot run."""
        if Device.DEFAULT != "CPU":
            return None
        if _trampoline(0) is None:
            log.info("quantized CPU kernels: no trampoline for %s; using tinygrad's kernels", platform.machine())
            return None
        if shutil.which("clang") is None:
            log.info("quantized CPU kernels: clang not found; using tinygrad's kernels")
            return None
        flags = simd_flags()
        try:
            library = ctypes.CDLL(str(compile_library(flags)))
        except (OSError, subprocess.CalledProcessError) as e:
            log.warning("quantized CPU kernels failed to build (%s); using tinygrad's kernels", getattr(e, "stderr", e))
            return None
        if mismatches := abi.mismatches(library):  # a bug, not a missing feature: arguments would be misread
            raise RuntimeError(f"the kernels' interface differs from kernels/abi.py: {'; '.join(mismatches)}")
        kernels = cls(library, cpu_threads(), simd=bool(library.tq_simd()))
        log.info("quantized CPU kernels: %d threads, %s", kernels.threads, "AVX2" if kernels.simd else "portable C (no AVX2)")
        return kernels

    def block_weight(self, rows: np.ndarray, ggml_type: int, cols: int) -> BlockWeight:
        """A matrix's blocks (rows, bytes per row) onto the device, in the layout its products run
        fastest from: with rows in eights, every type with an interleaved layout (formats.c) interleaves them (tq_repack,
        same bytes; Q4 products ran 2.7-3.2x faster here at 1 to 32 tokens, Q8_0 1.4-1.9x, and a
        Q4_K_M file's decode 2.5x), other row counts and the float types (F32, F16, BF16) as the file
        has them."""
        source = _checked_blocks(rows, ggml_type, cols)
        stored = Tensor.empty(*source.shape, dtype=dtypes.uint8).realize()  # written in place, from the file's map
        stored_type = self._repack(host_address(stored), source.ctypes.data, abi.Product(ggml_type, source.shape[0], cols))
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
            # jit replays, waiting for the device, on every step (~0.2 ms each)
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
        self, qkv: Tensor, cache: Tensor, lanes: Tensor, inv_freq: Tensor, extras: Tensor, heads: int, flags: int, eps: float, scale: float
    ) -> Tensor:
        """A layer's attention for B lanes (a decode step's sequences, or a prefill piece's tokens) from
        its qkv rows (B, (heads + 2 kv_heads) Hd): adds the bias and applies the q/k norms (as `flags`
        and `extras` say), rotates q and k by RoPE at each lane's position (inverse frequencies
        `inv_freq`), writes each lane's key and value into the float16 KV cache (2, slots, kv_heads,
        positions, Hd), then attends over it. lanes (2B,) int32 = each lane's slot, then its position
        (it attends positions 0..pos); `scale` multiplies q . k. -> (B, heads * Hd) float32."""
        _, slots, kv_heads, positions, head_dim = cache.shape
        B = qkv.shape[0]
        out = Tensor.empty(B, heads * head_dim, dtype=dtypes.float32)
        shape = self._shape(abi.Attention(B, heads, kv_heads, slots, positions, head_dim, flags, eps, scale))
        return self._call("tq_attend", out, self._rows(qkv, (heads + 2 * kv_heads) * head_dim), cache, lanes, inv_freq, extras, shape)

    def layer(self, x: Tensor, layer: LayerTensors, lanes: Tensor, inv_freq: Tensor, eps: float) -> Tensor:
        """A whole transformer layer as one kernel (see tq_layer): x (B, D) float32 -> (B, D); lanes and
        inv_freq as `attend` takes them, eps the norms' epsilon."""
        _, slots, kv_heads, positions, head_dim = layer.cache.shape
        B, D = x.shape
        out = Tensor.empty(B, D, dtype=dtypes.float32)
        m = layer.matrices
        attention = abi.Attention(B, layer.heads, kv_heads, slots, positions, head_dim, layer.flags, eps, layer.score_scale)
        shape = self._shape(abi.LayerShape(attention, D, m.down.cols, (ctypes.c_int32 * 4)(*(w.ggml_type for w in m.in_order))))
        weights = tuple(w.raw for w in m.in_order)
        attn_norm, ffn_norm = (n.cast(dtypes.float32).contiguous() for n in (layer.attn_norm, layer.ffn_norm))
        extras = (layer.cache, lanes, inv_freq, layer.extras, shape)
        return self._call("tq_layer", out, self._rows(x, D), *weights, attn_norm, ffn_norm, *extras)

    def whole_model(
        self, embed: BlockWeight, norm: Tensor, head: BlockWeight, inv_freq: Tensor, layers: list[LayerTensors], eps: float
    ) -> WholeModel:
        """Everything `step` reads, by address (see tq_forward): the tensors must be realized, whole
        buffers, and stay alive with the model. `eps` is the norms' epsilon."""
        first = layers[0]
        _, slots, kv_heads, positions, head_dim = first.cache.shape
        E = abi.ModelEntry
        model = {E.EMBED: embed.raw, E.NORM: norm, E.HEAD: head.raw, E.INV_FREQ: inv_freq}
        tensors = abi.in_table_order(model, [layer.table_entries for layer in layers])
        attention = abi.Attention(0, first.heads, kv_heads, slots, positions, head_dim, first.flags, eps, first.score_scale)
        dims = abi.Step(attention, embed.cols, first.matrices.down.cols, len(layers), head.rows, embed.ggml_type, head.ggml_type)
        types = np.array([w.ggml_type for layer in layers for w in layer.matrices.in_order], dtype=np.int32)
        table = np.array([host_address(t) for t in tensors], dtype=np.uint64)
        return WholeModel(table, dims, types, tuple(tensors))

    def step(self, model: WholeModel, tokens: list[int], lanes: list[int], picks: list[int], hidden: bool = False) -> np.ndarray:
        """A whole step (tq_forward) as one call on this thread, which works through the pool's jobs
        with it: tokens (B,), lanes (2B,) as `attend` takes them, picks = the lanes whose logits are
        wanted -> (len(picks), vocab) float32 logits; `hidden`: the final norm's output instead,
        (len(picks), dim), for embeddings. The model's tensors must not be in use by
        tinygrad's queue (callers synchronize after tinygrad work on the same tensors).

        Not a kernel inside a TinyJit like the others: replaying the captured one-kernel step cost
        ~2.8 ms of a 15.5 ms one-token step here (1.3 ms of Python before the kernel started, 0.9 ms
        more inside it on tinygrad's worker thread, 0.6 ms to notice its end and copy the logits)."""
        ids, lane_values, rows = (np.ascontiguousarray(v, dtype=np.int32) for v in (tokens, lanes, picks))
        out = np.empty((len(rows), model.dims.dim if hidden else model.dims.vocab), dtype=np.float32)
        step = model.step(len(ids), len(rows), abi.StepOutput.HIDDEN if hidden else abi.StepOutput.LOGITS)
        addresses = (out.ctypes.data, ids.ctypes.data, lane_values.ctypes.data, rows.ctypes.data, model.table.ctypes.data)
        self._forward(*addresses, step, model.layer_types.ctypes.data)
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


@dataclass(frozen=True)
class LayerMatrices:
    """A layer's four products in blocks, for `QuantizedCPU.layer`."""

    qkv: BlockWeight
    o: BlockWeight
    gate_up: BlockWeight
    down: BlockWeight

    @property
    def in_order(self) -> tuple[BlockWeight, BlockWeight, BlockWeight, BlockWeight]:
        """The four as the kernels take them: qkv, o, gate_up, down."""
        return (self.qkv, self.o, self.gate_up, self.down)


@dataclass(frozen=True)
class LayerTensors:
    """What a layer's kernel reads besides its input: its matrices, norms, KV cache and attention's
    extras (as `QuantizedCPU.attend` takes them: heads and flags too)."""

    matrices: LayerMatrices
    attn_norm: Tensor
    ffn_norm: Tensor
    cache: Tensor
    extras: Tensor
    heads: int
    flags: int
    score_scale: float  # on q . k (ModelConfig.score_scale)

    @property
    def table_entries(self) -> dict[abi.LayerEntry, Tensor]:
        """This layer's tensors under their entries in tq_forward's model table."""
        E, m = abi.LayerEntry, self.matrices
        matrices = {E.QKV: m.qkv.raw, E.O: m.o.raw, E.GATE_UP: m.gate_up.raw, E.DOWN: m.down.raw}
        return matrices | {E.ATTN_NORM: self.attn_norm, E.FFN_NORM: self.ffn_norm, E.CACHE: self.cache, E.EXTRAS: self.extras}


@dataclass(frozen=True, eq=False)
class WholeModel:
    """A model for `QuantizedCPU.step`: the table of its tensors' addresses, what tq_forward's step says
    that no step changes, and the tensors themselves, which it keeps alive."""

    table: np.ndarray  # uint64, in abi.ModelEntry order, then abi.LayerEntry's for each layer
    dims: abi.Step  # every field but attention.lanes, picks and outputs
    layer_types: np.ndarray  # int32: each layer's qkv, o, gate_up, down types
    tensors: tuple[Tensor, ...]
    _steps: dict = field(default_factory=dict, compare=False)

    def step(self, lanes: int, picks: int, outputs: int = 0) -> abi.Step:
        """tq_forward's step for `lanes` lanes and `picks` rows of `outputs` (abi.StepOutput)."""
        step = self._steps.get((lanes, picks, outputs))
        if step is None:
            step = self._steps[lanes, picks, outputs] = abi.Step.from_buffer_copy(self.dims)
            step.attention.lanes, step.picks, step.outputs = lanes, picks, outputs
        return step
