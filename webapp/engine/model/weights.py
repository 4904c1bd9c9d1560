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
import pathlib
import struct
from collections import Counter
from dataclasses import dataclass

import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinygrad.llm.gguf import ggml_data_to_tensor

from webapp.engine.kernels.cpu import BLOCK_FORMATS, BlockWeight, QuantizedCPU
from webapp.engine.model.device_buffers import device_array
from webapp.engine.model.ggml_types import GGML_TYPES

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
    data: np.ndarray | None  # (rows, bytes per row) uint8; None for a type without a kernel (F32 vectors have it)
    shape: tuple[int, ...] = ()  # as tinygrad's tensors have it: the file's dimensions, last first
    start: int = 0  # where its bytes lie in the file
    nbytes: int = 0


# struct format of one scalar metadata value, by GGUF value type; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf(path: str) -> tuple[dict, dict[str, RawTensor]]:
    """A GGUF file's metadata and its tensors with their raw bytes, through one memory map: only the
    pages the header and the used tensors occupy are ever read. (tinygrad's gguf_load also builds a
    lazy tensor per weight: ~2 s here; gguf's GGUFReader ~5 s.)"""
    file = np.memmap(path, dtype=np.uint8, mode="r")
    pos, where = 0, "the header"

    def take(fmt: str) -> tuple:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(file):
            raise ValueError(f"the file ends at byte {len(file)}, inside {where}")
        values = struct.unpack_from(fmt, file, pos)
        pos += size
        return values

    def text() -> str:
        nonlocal pos
        (length,) = take("<Q")
        if pos + length > len(file):
            raise ValueError(f"a string of {length} bytes in {where} runs past the file's end")
        pos += length
        try:
            return bytes(file[pos - length : pos]).decode()
        except UnicodeDecodeError:
            raise ValueError(f"a string in {where} is not UTF-8") from None

    def value(kind: int):
        if kind == 8:
            return text()
        if kind == 9:
            item, count = take("<IQ")
            if count > len(file) - pos:  # every item takes a byte at least
                raise ValueError(f"an array of {count} items in {where} is longer than the file")
            if item in _SCALARS:
                return list(take(f"<{count}{_SCALARS[item]}"))
            return [value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"{where} has value type {kind}, which GGUF does not define")
        return take("<" + _SCALARS[kind])[0]

    magic, version, n_tensors, n_kv = take("<4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a GGUF v2/v3 file")
    if n_kv > len(file) // 12 or n_tensors > len(file) // 24:  # the smallest entry of each
        raise ValueError(f"the header claims {n_kv} metadata entries and {n_tensors} tensors, more than {len(file)} bytes can hold")
    metadata = {}
    for i in range(n_kv):
        where = f"metadata entry {i}"
        key = text()
        where = f"metadata entry {i} ({key!r})"
        (kind,) = take("<I")
        metadata[key] = value(kind)
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or not 1 <= alignment <= 1 << 16:
        raise ValueError(f"general.alignment = {alignment!r}: expected a small positive whole number")
    infos = []
    for i in range(n_tensors):
        where = f"tensor {i}'s entry"
        name, (n_dims,) = text(), take("<I")
        if n_dims > 4:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions; GGUF allows at most 4")
        dims = take(f"<{n_dims}Q")
        ggml_type, offset = take("<IQ")
        infos.append((name, dims, ggml_type, offset))
    data_start = -(-pos // alignment) * alignment
    table = {}

    def extent(name: str, start: int, nbytes: int) -> np.ndarray:
        if start + nbytes > len(file):
            raise ValueError(f"tensor {name!r} ends at byte {start + nbytes}, past the file's end ({len(file)} bytes)")
        return file[start : start + nbytes]

    for name, dims, ggml_type, offset in infos:
        _, values, block_bytes = GGML_TYPES.get(ggml_type, (None, 1, 0))  # a type it cannot read: no bytes to check
        elements, start, shape = int(np.prod(dims, dtype=object)), data_start + offset, tuple(reversed(dims))
        if elements % values:
            raise ValueError(f"tensor {name!r} of {elements} values is not whole blocks of {values}")
        nbytes = elements // values * block_bytes
        data = extent(name, start, nbytes)  # every readable tensor lies inside the file
        if len(dims) == 1 and ggml_type == 0:  # a float32 vector (norms, biases), read as bytes
            table[name] = RawTensor(0, 1, dims[0], data.reshape(1, -1), shape, start, nbytes)
        elif len(dims) != 2:
            table[name] = RawTensor(ggml_type, 1, elements, None, shape, start, nbytes)
        else:
            cols, rows = dims
            blocks = data.reshape(rows, -1) if ggml_type in BLOCK_FORMATS and cols % BLOCK_FORMATS[ggml_type][1] == 0 else None
            table[name] = RawTensor(ggml_type, rows, cols, blocks, shape, start, nbytes)
    return metadata, table


class WeightSource:
    def __init__(
        self, path: str, table: dict[str, RawTensor], arch: str, n_heads: int, n_kv_heads: int, act_dtype, kernels: QuantizedCPU | None
    ):
        """`table` is the file's tensors as `read_gguf` gives them; their raw blocks feed `kernels` when
        given, and tinygrad's lazily dequantized tensors everything else."""
        self.path, self.names, self.act_dtype, self.kernels = path, set(table), act_dtype, kernels
        self._table = table
        self._raw = table if kernels is not None else {}
        self._file: Tensor | None = None
        # llama files interleave each head's rotary pairs in q and k rows
        self._rope_heads = {"attn_q.weight": n_heads, "attn_k.weight": n_kv_heads} if arch == "llama" else {}
        self.forms: Counter = Counter()  # which form each matrix took, for the log
        self._blocks: dict[tuple[str, ...], BlockWeight | None] = {}  # a tied head shares the embedding's blocks

    def tinygrad_tensor(self, name: str) -> Tensor:
        """One tensor of the file as tinygrad dequantizes it, lazily, from its bytes alone: only they are
        copied from the file (tinygrad's gguf_load copies the whole file to the device first, and
        parses it again after read_gguf checked it)."""
        raw = self._table[name]
        if self._file is None:
            self._file = Tensor(pathlib.Path(self.path))
        data = self._file[raw.start : raw.start + raw.nbytes].to(Device.DEFAULT)
        return ggml_data_to_tensor(data, int(np.prod(raw.shape)), raw.ggml_type).reshape(raw.shape)

    def has(self, name: str) -> bool:
        return name in self.names

    def vector(self, name: str) -> Tensor:
        values = self.vector_values(name)
        if values is not None:
            return device_array(values)
        return self.tinygrad_tensor(name).cast(self.act_dtype).contiguous()

    def vector_values(self, name: str) -> np.ndarray | None:
        """A float32 vector read from the file, on the CPU kernels' path (None elsewhere)."""
        raw = self._raw.get(name)
        if raw is None or raw.ggml_type != 0 or self.act_dtype != dtypes.float32:
            return None
        return raw.data.view(np.float32)[0]

    def _rope_heads_of(self, name: str) -> int | None:
        return next((n for suffix, n in self._rope_heads.items() if name.endswith(suffix)), None)

    def _float(self, name: str) -> Tensor:
        t = self.tinygrad_tensor(name)
        heads = self._rope_heads_of(name)
        return unpermute_rope_rows(t, heads) if heads else t

    def _block(self, names: tuple[str, ...]) -> BlockWeight | None:
        if names not in self._blocks:
            self._blocks[names] = self._read_blocks(names)
        return self._blocks[names]

    def _read_blocks(self, names: tuple[str, ...]) -> BlockWeight | None:
        """The matrices' blocks stacked by rows, when each has a type with a kernel: one matrix of that
        type when they share it, else a stacked one of parts (Q4_K_M files store some layers' v in
        Q6_K beside q and k in Q4_K)."""
        if self.kernels is None or any(n not in self._raw for n in names):
            return None
        raws = [self._raw[n] for n in names]
        cols = raws[0].cols
        if any(r.cols != cols or r.data is None for r in raws):
            return None
        parts = []
        for name, raw in zip(names, raws):
            rows = raw.data  # (rows, bytes per row)
            heads = self._rope_heads_of(name)
            parts.append(unpermute_rope_rows(rows, heads) if heads else rows)
        # consecutive matrices of one type are one part (q and k of a Q4_K_M layer; all of them, mostly)
        merged: list[tuple[list[np.ndarray], int]] = []
        for rows, raw in zip(parts, raws):
            if merged and merged[-1][1] == raw.ggml_type:
                merged[-1][0].append(rows)
            else:
                merged.append(([rows], raw.ggml_type))
        stacked = [(np.concatenate(rows) if len(rows) > 1 else rows[0], t) for rows, t in merged]
        if len(stacked) == 1:
            return self.kernels.block_weight(*stacked[0], cols)
        return self.kernels.stacked_weight(stacked, cols)

    def linear(self, *names: str):
        block = self._block(names)
        if block is not None:
            if block.parts:  # stacked: each matrix under its own type
                for name in names:
                    self.forms[f"{BLOCK_FORMATS[self._raw[name].ggml_type][0]} blocks (stacked)"] += 1
            else:
                self.forms[block.form] += len(names)
            return BlockLinear(self.kernels, block)
        self.forms["float16"] += len(names)
        return FloatLinear(Tensor.cat(*(self._float(n) for n in names)) if len(names) > 1 else self._float(names[0]))

    def embedding(self):
        """token ids (...) -> (..., D) activations."""
        block = self._block(("token_embd.weight",))
        if block is not None:
            self.forms[block.form] += 1
            return _BlockEmbedding(self.kernels, block, self.act_dtype)
        self.forms["float16"] += 1
        return _FloatEmbedding(self.tinygrad_tensor("token_embd.weight").cast(WEIGHT_DTYPE).contiguous(), self.act_dtype)

    def head(self, vocab: int, int8: bool):
        """x (B, D) -> (B, vocab) float32 logits; the embedding's matrix when the file ties them."""
        name = "output.weight" if "output.weight" in self.names else "token_embd.weight"
        block = self._block((name,))
        if block is not None:
            self.forms[block.form] += 1
            linear = BlockLinear(self.kernels, block)
            return _BlockHead(linear)
        self.forms["int8 head" if int8 else "float16"] += 1
        return FloatHead(self.tinygrad_tensor(name), vocab, int8)

    @property
    def uses_kernels(self) -> bool:
        return any("blocks" in form for form in self.forms)

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
        self.linear, self.weight = linear, linear.weight

    def __call__(self, x: Tensor) -> Tensor:
        return self.linear(x).float()

    def tensors(self) -> list[Tensor]:
        return self.linear.tensors()
