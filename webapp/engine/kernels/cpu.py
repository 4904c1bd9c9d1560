"""Quantized matrix products on every CPU core, as kernels inside tinygrad's captured steps.

Contract: `QuantizedCPU.load()` compiles `ggml_cpu.c` once per source and CPU feature set (cached on
disk, so a restart reuses it) and returns None where it cannot serve (not the CPU device, no clang, an
architecture without a trampoline). Its `linear(x, weight)` multiplies float32 activations (..., cols)
by a `BlockWeight` (a GGUF tensor's raw blocks, rows x cols); `norm_linear`, `residual_linear` and
`swiglu_linear` fuse what surrounds a layer's products into them; `attend` runs a layer's attention
from its qkv rows; `layer` runs all of a layer as one kernel; `embed(ids, weight)` gathers
dequantized rows. All return lazy tensors that run inside the surrounding TinyJit.

How it plugs into tinygrad 0.14: a kernel is an Ops.PROGRAM whose binary is a 12- or 16-byte
trampoline that jumps to our compiled function. tinygrad's CPU worker calls a program with every
buffer address (then every variable) as 64-bit arguments, so the jump lands in `tq_linear(out, w, x,
shape)` with its arguments in place. The shape travels as a small int32 tensor, not as code: one
library serves every matrix. tinygrad's own CPU kernels run on one thread; these run on all cores the
process may use (`os.sched_getaffinity`), with the library's own thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp

from ..device_buffers import device_array

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ggml_cpu.c")
# GGML type ids with a kernel, and (values, bytes) per block
BLOCK_FORMATS = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}
# tq_attend's flags: which of the bias and the q/k norms its `extras` input holds
ATTEND_BIAS, ATTEND_QK_NORM = 1, 2
MAX_HEAD_DIM = 512  # tq_attend's rotation buffer
# Idle pool threads spin this long before sleeping: a decode step's ~150 jobs come microseconds
# apart, and a sleeping thread takes tens of microseconds to wake.
SPIN_US = 100


def cpu_threads() -> int:
    """The cores this process may run on (a container's CPU set, taskset), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def simd_flags() -> list[str]:
    """Compiler flags for the widest SIMD this CPU reports that the kernels use (AVX2 with FMA and F16C)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    except OSError:
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= set(flags) else []


def _trampoline(address: int) -> bytes | None:
    """Machine code that jumps to `address`, leaving the argument registers and stack untouched."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return b"\x48\xb8" + struct.pack("<Q", address) + b"\xff\xe0"  # movabs rax, address; jmp rax
    if machine in ("aarch64", "arm64"):
        return struct.pack("<II", 0x58000050, 0xD61F0200) + struct.pack("<Q", address)  # ldr x16, #8; br x16
    return None


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tinyserve"


def compile_library(flags: list[str]) -> Path:
    """Build ggml_cpu.c into a shared library, once per source and flags."""
    source = SOURCE.read_bytes()
    command = ["clang", "-O3", "-shared", "-fPIC", "-fno-math-errno", *flags]
    key = hashlib.sha256(source + " ".join(command).encode()).hexdigest()[:16]
    target = _cache_dir() / f"ggml_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        pass
    try:
        subprocess.run([*command, "-o", tmp.name, str(SOURCE), "-lm", "-lpthread"], check=True, capture_output=True, text=True)
        os.replace(tmp.name, target)  # atomic: a concurrent start-up sees the old file or the whole new one
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)
    return target


@dataclass(frozen=True)
class BlockWeight:
    """A GGUF matrix kept in its file's block format: `raw` (rows, bytes per row) on the device."""

    raw: Tensor
    ggml_type: int
    rows: int
    cols: int

    @property
    def type_name(self) -> str:
        return BLOCK_FORMATS[self.ggml_type][0]

    @staticmethod
    def supports(ggml_type: int, cols: int) -> bool:
        return ggml_type in BLOCK_FORMATS and cols % BLOCK_FORMATS[ggml_type][1] == 0


class QuantizedCPU:
    def __init__(self, library: ctypes.CDLL, threads: int, simd: bool):
        self.library, self.threads, self.simd = library, threads, simd
        self._shapes: dict[tuple, Tensor] = {}
        self._programs: dict[str, bytes] = {}
        for name in ("tq_linear", "tq_norm_linear", "tq_residual_linear", "tq_swiglu_linear", "tq_embed", "tq_attend", "tq_layer"):
            address = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
            self._programs[name] = _trampoline(address)
        library.tq_start(ctypes.c_long(threads), ctypes.c_long(SPIN_US))

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
        kernels = cls(library, cpu_threads(), simd=bool(library.tq_simd()))
        log.info("quantized CPU kernels: %d threads, %s", kernels.threads, "AVX2" if kernels.simd else "portable C (no AVX2)")
        return kernels

    def _shape(self, *values: int) -> Tensor:
        tensor = self._shapes.get(values)
        if tensor is None:
            # not Tensor(array): one made from NumPy inside a jit's capture becomes a host copy that the
            # jit replays, waiting for the device, on every step (~0.2 ms each)
            tensor = self._shapes[values] = device_array(np.array(values, dtype=np.int32))
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
        return self._linear("tq_norm_linear", x, weight, weight.cols, norm.cast(dtypes.float32).contiguous(), extra_shape=(_bits(eps),))

    def residual_linear(self, x: Tensor, weight: BlockWeight, residual: Tensor) -> Tensor:
        """residual + x @ weight.T: the residual stream's add runs inside the product."""
        return self._linear("tq_residual_linear", x, weight, weight.cols, self._rows(residual, weight.rows))

    def swiglu_linear(self, gate_up: Tensor, weight: BlockWeight, residual: Tensor) -> Tensor:
        """residual + (silu(gate) * up) @ weight.T, for gate_up (..., 2 * cols) = gate | up."""
        return self._linear("tq_swiglu_linear", gate_up, weight, 2 * weight.cols, self._rows(residual, weight.rows))

    def _linear(self, name: str, x: Tensor, weight: BlockWeight, width: int, *extra: Tensor, extra_shape: tuple = ()) -> Tensor:
        lead = x.shape[:-1]
        tokens = int(np.prod(lead)) if lead else 1
        out = Tensor.empty(tokens, weight.rows, dtype=dtypes.float32)
        shape = self._shape(weight.ggml_type, weight.rows, weight.cols, tokens, *extra_shape)
        return self._call(name, out, weight.raw, self._rows(x, width), *extra, shape).reshape(*lead, weight.rows)

    @staticmethod
    def _rows(x: Tensor, width: int) -> Tensor:
        return x.reshape(-1, width).cast(dtypes.float32).contiguous()

    def embed(self, ids: Tensor, weight: BlockWeight) -> Tensor:
        """ids (...) int32 -> (..., cols) float32 rows of weight."""
        lead = ids.shape
        tokens = int(np.prod(lead)) if lead else 1
        out = Tensor.empty(tokens, weight.cols, dtype=dtypes.float32)
        shape = self._shape(weight.ggml_type, weight.rows, weight.cols, tokens)
        return self._call("tq_embed", out, weight.raw, ids.reshape(tokens).cast(dtypes.int32).contiguous(), shape).reshape(
            *lead, weight.cols
        )

    def attend(
        self, qkv: Tensor, cache: Tensor, lanes: Tensor, inv_freq: Tensor, extras: Tensor, heads: int, flags: int, eps: float
    ) -> Tensor:
        """A layer's attention for B lanes (a decode step's sequences, or a prefill piece's tokens) from
        its qkv rows (B, (heads + 2 kv_heads) Hd): adds the bias and applies the q/k norms (as `flags`
        and `extras` say), rotates q and k by RoPE at each lane's position (inverse frequencies
        `inv_freq`), writes each lane's key and value into the float16 KV cache (2, slots, kv_heads,
        positions, Hd), then attends over it. lanes (2B,) int32 = each lane's slot, then its position
        (it attends positions 0..pos). -> (B, heads * Hd) float32."""
        _, slots, kv_heads, positions, head_dim = cache.shape
        B = qkv.shape[0]
        out = Tensor.empty(B, heads * head_dim, dtype=dtypes.float32)
        shape = self._shape(B, heads, kv_heads, slots, positions, head_dim, flags, _bits(eps))
        return self._call("tq_attend", out, self._rows(qkv, (heads + 2 * kv_heads) * head_dim), cache, lanes, inv_freq, extras, shape)

    def layer(self, x: Tensor, matrices: LayerMatrices, norms: tuple[Tensor, Tensor], attention: tuple, eps: float) -> Tensor:
        """A whole transformer layer as one kernel (see tq_layer): x (B, D) float32 -> (B, D).
        `attention` = (cache, lanes, inv_freq, extras, heads, flags), as `attend` takes them."""
        cache, lanes, inv_freq, extras, heads, flags = attention
        _, slots, kv_heads, positions, head_dim = cache.shape
        B, D = x.shape
        out = Tensor.empty(B, D, dtype=dtypes.float32)
        m = matrices
        types = (m.qkv.ggml_type, m.o.ggml_type, m.gate_up.ggml_type, m.down.ggml_type)
        shape = self._shape(B, heads, kv_heads, slots, positions, head_dim, flags, _bits(eps), D, m.down.cols, *types)
        weights = (m.qkv.raw, m.o.raw, m.gate_up.raw, m.down.raw)
        attn_norm, ffn_norm = (n.cast(dtypes.float32).contiguous() for n in norms)
        return self._call("tq_layer", out, self._rows(x, D), *weights, attn_norm, ffn_norm, cache, lanes, inv_freq, extras, shape)


def _bits(value: float) -> int:
    """A float32's bits as an int32, for the kernels' int32 shape arrays."""
    return int(np.float32(value).view(np.int32))


@dataclass(frozen=True)
class LayerMatrices:
    """A layer's four products in blocks, for `QuantizedCPU.layer`."""

    qkv: BlockWeight
    o: BlockWeight
    gate_up: BlockWeight
    down: BlockWeight
