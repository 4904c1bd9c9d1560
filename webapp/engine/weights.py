"""GGUF tensors in the forms the transformer computes with: block-format matrices on the CPU kernels, float16 elsewhere.

Contract: `WeightSource(path, ...)` opens a GGUF file; `linear(*names)` returns a `Linear` for those
(out, in) matrices stacked by rows, `embedding()` the token lookup, `head()` the output projection,
`vector(name)` a norm or bias. Which form a matrix takes is decided here, once, and logged:

- `BlockLinear` keeps the file's quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) and multiplies them
  with the kernels in `kernels/cpu.py`, on every core. Used on the CPU device whenever the type has a
  kernel: a decode step then reads the file's bytes (97 MB for the default model) instead of float16
  copies (269 MB), and the weights take no more memory than the file's tensors.
- `FloatLinear` dequantizes once at load to float16, laid out (in, out), multiplied by tinygrad's own
  kernels: every other device, float files, and any type without a kernel.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter
from dataclasses import dataclass

import numpy as np
from tinygrad import Tensor, dtypes

from .kernels.cpu import BLOCK_FORMATS, BlockWeight, QuantizedCPU

log = logging.getLogger(__name__)

WEIGHT_DTYPE = dtypes.float16
HEAD_CHUNK = 3072  # lm-head columns per batch entry: one (vocab, D) product is a slow kernel, 16 of these a fast one


def unpermute_rope_rows(rows, n_heads: int):
    """llama GGUFs store q/k rows with each head's rotary pairs interleaved; regroup them as two halves.
    Works on a tinygrad (out, in) matrix and on a NumPy array of raw block rows alike."""
    out_dim = rows.shape[0]
    head_dim = out_dim // n_heads
    grouped = rows.reshape(n_heads, head_dim // 2, 2, *rows.shape[1:])
    swapped = grouped.transpose(1, 2) if isinstance(rows, Tensor) else grouped.swapaxes(1, 2)
    return swapped.reshape(rows.shape)


class FloatLinear:
    """y = x @ W.T with W stored (in, out) as float16: the product's cast fuses into tinygrad's kernel,
    and with the output axis contiguous its CPU kernels ran 1.6x (one token) to 2.3x (32 tokens)
    faster than float32 (out, in) here."""

    def __init__(self, w_out_in: Tensor):
        self.w = w_out_in.cast(WEIGHT_DTYPE).T.contiguous()  # (in, out)

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        return x.linear(self.w.cast(x.dtype), bias)

    def tensors(self) -> list[Tensor]:
        return [self.w]


class BlockLinear:
    """y = x @ W.T over W's GGUF blocks, on the quantized CPU kernels; float32 in and out."""

    def __init__(self, kernels: QuantizedCPU, weight: BlockWeight):
        self.kernels, self.weight = kernels, weight

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        y = self.kernels.linear(x, self.weight).cast(x.dtype)
        return y if bias is None else y + bias

    def tensors(self) -> list[Tensor]:
        return [self.weight.raw]


class FloatHead:
    """The output projection on tinygrad's kernels: (chunks, D, HEAD_CHUNK) float16, or int8 with a
    scale per vocabulary row for quantized files (a fifth of a decode step's bytes; one-token decode
    went from 20.0 to 17.2 ms here). int8 rounding is at most half a step of the row's max / 127."""

    def __init__(self, w: Tensor, vocab: int, int8: bool):
        self.vocab, self.scale = vocab, None
        if int8:
            w, scale = _int8_rows(w)
            self.scale = _head_chunks(scale)  # (chunks, 1, HEAD_CHUNK)
        self.w = _head_chunks(w.cast(WEIGHT_DTYPE) if not int8 else w)  # (chunks, D, HEAD_CHUNK)

    def __call__(self, x: Tensor) -> Tensor:
        chunks = x.unsqueeze(0) @ self.w.cast(x.dtype)  # (chunks, B, HEAD_CHUNK)
        if self.scale is not None:
            chunks = chunks * self.scale.cast(x.dtype)
        return chunks.permute(1, 0, 2).reshape(x.shape[0], -1)[:, : self.vocab].float()

    def tensors(self) -> list[Tensor]:
        return [self.w] + ([self.scale] if self.scale is not None else [])


def _head_chunks(w: Tensor) -> Tensor:
    """(vocab, D) -> (chunks, D, HEAD_CHUNK), the vocabulary zero-padded to whole chunks."""
    vocab, dim = w.shape
    chunk = min(HEAD_CHUNK, -(-vocab // 64) * 64)
    n = -(-vocab // chunk)
    return w.pad(((0, n * chunk - vocab), (0, 0))).reshape(n, chunk, dim).transpose(1, 2).contiguous()


def _int8_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """(vocab, D) -> int8 (vocab, D) and a float scale per row: w ~ q * scale, |error| <= scale / 2."""
    w = w.float()
    scale = w.abs().max(axis=1, keepdim=True) / 127.0  # (vocab, 1)
    q = (w / scale.maximum(1e-30)).round().cast(dtypes.int8)
    return q, scale


@dataclass(frozen=True)
class RawTensor:
    """One tensor of a GGUF file as stored: ggml type, (rows, cols), and its bytes (memory-mapped)."""

    ggml_type: int
    rows: int
    cols: int
    data: np.ndarray | None  # (rows, bytes per row) uint8; None for a type without a kernel


# bytes of one scalar metadata value, by GGUF value type; 8 is a string, 9 an array
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_tensor_table(path: str) -> dict[str, RawTensor]:
    """The 2-D tensors of a GGUF file with their raw bytes, skipping the metadata without decoding it
    (gguf's GGUFReader decodes every vocabulary string into NumPy views: ~5 s for 49k tokens).
    Everything is read through one memory map: only the pages the header and the used tensors
    occupy are ever read."""
    file = np.memmap(path, dtype=np.uint8, mode="r")
    pos, alignment = 0, 32

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from(fmt, file, pos)
        pos += struct.calcsize(fmt)
        return values

    def text() -> str:
        nonlocal pos
        (length,) = take("<Q")
        pos += length
        return bytes(file[pos - length : pos]).decode()

    def skip_value(kind: int) -> None:
        nonlocal pos
        if kind == 8:  # a string: its length, then its bytes
            (length,) = take("<Q")  # read before `pos +=` loads pos
            pos += length
        elif kind == 9:
            item, count = take("<IQ")
            if item in _SCALAR_BYTES:
                pos += _SCALAR_BYTES[item] * count
            else:
                for _ in range(count):
                    skip_value(item)
        else:
            pos += _SCALAR_BYTES[kind]

    magic, version, n_tensors, n_kv = take("<4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a GGUF v2/v3 file")
    for _ in range(n_kv):
        key, (kind,) = text(), take("<I")
        if key == "general.alignment":
            (alignment,) = take("<I")
        else:
            skip_value(kind)
    infos = []
    for _ in range(n_tensors):
        name, (n_dims,) = text(), take("<I")
        dims = take(f"<{n_dims}Q")
        ggml_type, offset = take("<IQ")
        infos.append((name, dims, ggml_type, offset))
    data_start = -(-pos // alignment) * alignment
    table = {}
    for name, dims, ggml_type, offset in infos:
        if len(dims) != 2:
            continue
        cols, rows = dims
        data = None
        if ggml_type in BLOCK_FORMATS and cols % BLOCK_FORMATS[ggml_type][1] == 0:
            _, values, nbytes = BLOCK_FORMATS[ggml_type]
            row_bytes = cols // values * nbytes
            start = data_start + offset
            data = file[start : start + rows * row_bytes].reshape(rows, row_bytes)
        table[name] = RawTensor(ggml_type, rows, cols, data)
    return table


class WeightSource:
    def __init__(
        self, path: str, tensors: dict[str, Tensor], arch: str, n_heads: int, n_kv_heads: int, act_dtype, kernels: QuantizedCPU | None
    ):
        """`tensors` are tinygrad's lazily dequantized tensors of the file (gguf_load); the raw blocks
        are read from the file itself when `kernels` is given."""
        self.tensors, self.act_dtype, self.kernels = tensors, act_dtype, kernels
        self._raw = read_tensor_table(path) if kernels is not None else {}
        # llama files interleave each head's rotary pairs in q and k rows
        self._rope_heads = {"attn_q.weight": n_heads, "attn_k.weight": n_kv_heads} if arch == "llama" else {}
        self.forms: Counter = Counter()  # which form each matrix took, for the log
        self._blocks: dict[tuple[str, ...], BlockWeight | None] = {}  # a tied head shares the embedding's blocks

    def has(self, name: str) -> bool:
        return name in self.tensors

    def vector(self, name: str) -> Tensor:
        return self.tensors[name].cast(self.act_dtype).contiguous()

    def _rope_heads_of(self, name: str) -> int | None:
        return next((n for suffix, n in self._rope_heads.items() if name.endswith(suffix)), None)

    def _float(self, name: str) -> Tensor:
        t = self.tensors[name]
        heads = self._rope_heads_of(name)
        return unpermute_rope_rows(t, heads) if heads else t

    def _block(self, names: tuple[str, ...]) -> BlockWeight | None:
        if names not in self._blocks:
            self._blocks[names] = self._read_blocks(names)
        return self._blocks[names]

    def _read_blocks(self, names: tuple[str, ...]) -> BlockWeight | None:
        """The matrices' blocks stacked by rows, when all share one type with a kernel."""
        if self.kernels is None or any(n not in self._raw for n in names):
            return None
        raws = [self._raw[n] for n in names]
        ggml_type, cols = raws[0].ggml_type, raws[0].cols
        if any(r.ggml_type != ggml_type or r.cols != cols or r.data is None for r in raws):
            return None
        parts = []
        for name, raw in zip(names, raws):
            rows = raw.data  # (rows, bytes per row)
            heads = self._rope_heads_of(name)
            parts.append(unpermute_rope_rows(rows, heads) if heads else rows)
        stacked = np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0])
        return BlockWeight(Tensor(stacked), ggml_type, stacked.shape[0], cols)

    def linear(self, *names: str):
        block = self._block(names)
        if block is not None:
            self.forms[f"{block.type_name} blocks"] += len(names)
            return BlockLinear(self.kernels, block)
        self.forms["float16"] += len(names)
        return FloatLinear(Tensor.cat(*(self._float(n) for n in names)) if len(names) > 1 else self._float(names[0]))

    def embedding(self):
        """token ids (...) -> (..., D) activations."""
        block = self._block(("token_embd.weight",))
        if block is not None:
            self.forms[f"{block.type_name} blocks"] += 1
            return _BlockEmbedding(self.kernels, block, self.act_dtype)
        self.forms["float16"] += 1
        return _FloatEmbedding(self.tensors["token_embd.weight"].cast(WEIGHT_DTYPE).contiguous(), self.act_dtype)

    def head(self, vocab: int, int8: bool):
        """x (B, D) -> (B, vocab) float32 logits; the embedding's matrix when the file ties them."""
        name = "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
        block = self._block((name,))
        if block is not None:
            self.forms[f"{block.type_name} blocks"] += 1
            linear = BlockLinear(self.kernels, block)
            return _BlockHead(linear)
        self.forms["int8 head" if int8 else "float16"] += 1
        return FloatHead(self.tensors[name], vocab, int8)

    @property
    def uses_kernels(self) -> bool:
        return any(form.endswith("blocks") for form in self.forms)

    def describe(self) -> str:
        return ", ".join(f"{n} {form}" for form, n in self.forms.most_common())


class _FloatEmbedding:
    def __init__(self, table: Tensor, act_dtype):
        self.table, self.act_dtype = table, act_dtype

    def __call__(self, tokens: Tensor) -> Tensor:
        return self.table[tokens].cast(self.act_dtype)

    def tensors(self) -> list[Tensor]:
        return [self.table]


class _BlockEmbedding:
    def __init__(self, kernels: QuantizedCPU, weight: BlockWeight, act_dtype):
        self.kernels, self.weight, self.act_dtype = kernels, weight, act_dtype

    def __call__(self, tokens: Tensor) -> Tensor:
        return self.kernels.embed(tokens, self.weight).cast(self.act_dtype)

    def tensors(self) -> list[Tensor]:
        return [self.weight.raw]


class _BlockHead:
    def __init__(self, linear: BlockLinear):
        self.linear = linear

    def __call__(self, x: Tensor) -> Tensor:
        return self.linear(x).float()

    def tensors(self) -> list[Tensor]:
        return self.linear.tensors()
