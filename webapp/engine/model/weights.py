"""GGUF tensors in the forms the transformer computes with: block-format matrices on the CPU kernels, float16 elsewhere.

Contract: `WeightSource(path, ...)` opens a GGUF file; `linear(*names)` returns a `Linear` for those
(out, in) matrices stacked by rows, `embedding()` the token lookup, `head()` the output projection,
`vector(name)` a norm or bias. Which form a matrix takes is decided here, once, and logged:

- `BlockLinear` keeps the file's bytes (a type of BLOCK_FORMATS: quantized blocks, or F32, F16 and
  BF16 floats) and multiplies them with the kernels in `kernels/cpu.py`, on every core. Used on the
  CPU device whenever the type has a kernel: a decode step then reads the file's bytes (97 MB for the
  default model) instead of float16 copies (269 MB), and the weights take no more memory than the
  file's tensors (an F16 or BF16 file is not copied a second time as float16).
- `DeviceBlockLinear` (device_blocks.py) keeps the file's bytes on every other device (and on the CPU
  with the kernels off) and dequantizes them inside tinygrad's product kernel, for the types whose
  dequantization fuses there (`DEVICE_BLOCK_TYPES`); the embedding alike (`DeviceBlockEmbedding`).
- `FloatLinear` dequantizes once at load to float16, laid out (in, out), multiplied by tinygrad's own
  kernels: any other type (or a float matrix on the CPU whose rows are not whole 32-value blocks).
"""

from __future__ import annotations

import logging
import pathlib
from collections import Counter

import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinygrad.llm.gguf import ggml_data_to_tensor

from webapp.engine.device.buffers import device_array
from webapp.engine.kernels.block_weight import BlockWeight, stored_form
from webapp.engine.kernels.cpu import QuantizedCPU
from webapp.engine.kernels.ggml_types import KERNEL_ONLY_TYPES
from webapp.engine.model.device_blocks import DEVICE_BLOCK_TYPES, DeviceBlockEmbedding, DeviceBlockLinear, row_bytes
from webapp.engine.model.gguf import RawTensor
from webapp.engine.model.load_error import ModelLoadError

log = logging.getLogger(__name__)

WEIGHT_DTYPE = dtypes.float16
HEAD_CHUNK = 3072  # lm-head columns per batch entry: one (vocab, D) product is a slow kernel, 16 of these a fast one


def unpermute_rope_rows(rows, n_heads: int, rotary: int | None = None):
    """llama GGUFs store q/k rows with each head's rotary pairs interleaved; regroup them as two halves.
    `rotary`: only each head's last `rotary` rows are pairs (DeepSeek-V2's q heads and latent row), the
    others stay. Works on a tinygrad (out, in) matrix and on a NumPy array of raw block rows alike."""
    out_dim = rows.shape[0]
    head_dim = out_dim // n_heads
    rotary = rotary or head_dim
    heads = rows.reshape(n_heads, head_dim, *rows.shape[1:])
    kept, turned = heads[:, : head_dim - rotary], heads[:, head_dim - rotary :]
    grouped = turned.reshape(n_heads, rotary // 2, 2, *rows.shape[1:])
    swapped = grouped.transpose(1, 2) if isinstance(rows, Tensor) else grouped.swapaxes(1, 2)
    turned = swapped.reshape(n_heads, rotary, *rows.shape[1:])
    if rotary < head_dim:
        turned = kept.cat(turned, dim=1) if isinstance(rows, Tensor) else np.concatenate([kept, turned], axis=1)
    return turned.reshape(rows.shape)


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


class WeightSource:
    def __init__(
        self, path: str, table: dict[str, RawTensor], rope_rows: dict[str, tuple[int, int]], act_dtype, kernels: QuantizedCPU | None
    ):
        """`table` is the file's tensors as `read_gguf` gives them; their raw blocks feed `kernels` when
        given, and tinygrad's lazily dequantized tensors everything else. `rope_rows`: the matrices
        (by name suffix) whose rows interleave rotary pairs, as (groups, rotated rows a group)."""
        self.path, self.names, self.act_dtype, self.kernels = path, set(table), act_dtype, kernels
        self._table = table
        self._raw = table if kernels is not None else {}
        self._file: Tensor | None = None
        # llama files interleave each head's rotary pairs in q and k rows
        self._rope_heads = rope_rows
        self.forms: Counter = Counter()  # which form each matrix took, for the log
        self.kept = 0  # how many of them stay in the file's bytes, on the kernels
        self._blocks: dict[tuple[str, ...], BlockWeight | None] = {}  # a tied head shares the embedding's blocks
        self._device_blocks: dict[tuple[str, ...], list | None] = {}  # on the device, alike

    def tinygrad_tensor(self, name: str) -> Tensor:
        """One tensor of the file as tinygrad dequantizes it, lazily, from its bytes alone: only they are
        copied from the file (tinygrad's gguf_load copies the whole file to the device first, and
        parses it again after read_gguf checked it)."""
        raw = self._table[name]
        if raw.ggml_type in KERNEL_ONLY_TYPES:  # tinygrad has no dequantization for these
            raise ModelLoadError(
                f"tensor {name!r} is stored as {KERNEL_ONLY_TYPES[raw.ggml_type]}, which only the CPU kernels read, "
                f"and they do not take it in this shape {tuple(raw.shape)}"
            )
        return ggml_data_to_tensor(self._file_bytes(raw), int(np.prod(raw.shape)), raw.ggml_type).reshape(raw.shape)

    def _file_bytes(self, raw: RawTensor) -> Tensor:
        """A tensor's bytes, copied from the file to the device (lazily)."""
        if self._file is None:
            self._file = Tensor(pathlib.Path(self.path))
        return self._file[raw.start : raw.start + raw.nbytes].to(Device.DEFAULT)

    def has(self, name: str) -> bool:
        return name in self.names

    def vector(self, name: str) -> Tensor:
        values = self.vector_values(name)
        if values is not None:
            return device_array(values)
        return self.tinygrad_tensor(name).cast(self.act_dtype).reshape(-1).contiguous()  # a matrix's rows one after another

    def vector_values(self, name: str) -> np.ndarray | None:
        """A float32 vector read from the file (a 2-D tensor's rows one after another), on the CPU
        kernels' path (None elsewhere)."""
        raw = self._raw.get(name)
        if raw is None or raw.ggml_type != 0 or raw.data is None or self.act_dtype != dtypes.float32:
            return None
        return raw.data.view(np.float32).reshape(-1)

    def _rope_heads_of(self, name: str) -> tuple[int, int] | None:
        return next((n for suffix, n in self._rope_heads.items() if name.endswith(suffix)), None)

    def _regrouped(self, name: str, rows):
        """A matrix's rows (values or raw blocks, NumPy or tinygrad) with llama files' rotary pairs regrouped."""
        heads = self._rope_heads_of(name)
        return unpermute_rope_rows(rows, *heads) if heads else rows

    def _float(self, name: str) -> Tensor:
        return self._regrouped(name, self.tinygrad_tensor(name))

    def _device_parts(self, names: tuple[str, ...]) -> list[tuple[Tensor, int, int]] | None:
        """The matrices' blocks on the device, by rows (rotary rows regrouped), consecutive ones of a type
        as one part, on tinygrad's path where each type's dequantization fuses into a product; else None.
        Read once a tuple of names: a tied head shares the embedding's."""
        if names not in self._device_blocks:
            self._device_blocks[names] = self._read_device_parts(names)
        return self._device_blocks[names]

    def _read_device_parts(self, names: tuple[str, ...]) -> list[tuple[Tensor, int, int]] | None:
        if self.kernels is not None or any(self._table[n].ggml_type not in DEVICE_BLOCK_TYPES for n in names):
            return None
        if self._file is None:
            self._file = Tensor(pathlib.Path(self.path))
        raws = [self._table[n] for n in names]
        rows = [self._file_bytes(raw).reshape(raw.rows, row_bytes(raw.ggml_type, raw.cols)) for raw in raws]
        runs = _runs_of_one_type([self._regrouped(name, r) for name, r in zip(names, rows)], raws)
        return [(Tensor.cat(*blocks).contiguous(), t, sum(b.shape[0] for b in blocks)) for blocks, t in runs]

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
        runs = _runs_of_one_type([self._regrouped(name, raw.data) for name, raw in zip(names, raws)], raws)
        stacked = [(np.concatenate(rows) if len(rows) > 1 else rows[0], t) for rows, t in runs]
        if len(stacked) == 1:
            return self.kernels.block_weight(*stacked[0], cols)
        return self.kernels.stacked_weight(stacked, cols)

    def linear(self, *names: str):
        block = self._block(names)
        if block is not None:
            if block.parts:  # stacked: each matrix under its own type
                for name in names:
                    self.forms[f"{stored_form(self._raw[name].ggml_type)} (stacked)"] += 1
            else:
                self.forms[block.form] += len(names)
            self.kept += len(names)
            return BlockLinear(self.kernels, block)
        parts = self._device_parts(names)
        if parts is not None:
            for name in names:
                self.forms[f"{stored_form(self._table[name].ggml_type)} on the device"] += 1
            return DeviceBlockLinear(parts, self._table[names[0]].cols)
        self.forms["float16"] += len(names)
        return FloatLinear(Tensor.cat(*(self._float(n) for n in names)) if len(names) > 1 else self._float(names[0]))

    def experts(self, name: str, count: int) -> BlockWeight | None:
        """A mixture of experts' 3-D tensor (count, rows, cols) in its blocks, on the kernels: every
        expert's matrix one after the other (QuantizedCPU.expert_weight); None where it cannot be."""
        raw = self._raw.get(name)
        if self.kernels is None or raw is None or raw.data is None:
            return None
        self.forms[stored_form(raw.ggml_type) + " (experts)"] += 1
        self.kept += 1
        return self.kernels.expert_weight(raw.data, raw.ggml_type, raw.cols, count)

    def float_experts(self, name: str, transposed: bool) -> Tensor:
        """A mixture of experts' 3-D tensor as float16 (count, rows, cols), or (count, cols, rows)
        `transposed` (the products' input axis first, as FloatLinear stores a matrix)."""
        self.forms["float16 (experts)"] += 1
        t = self.tinygrad_tensor(name).cast(WEIGHT_DTYPE)
        return (t.transpose(1, 2) if transposed else t).contiguous()

    def embedding(self):
        """token ids (...) -> (..., D) activations."""
        block = self._block(("token_embd.weight",))
        if block is not None:
            self.forms[block.form] += 1
            self.kept += 1
            return _BlockEmbedding(self.kernels, block, self.act_dtype)
        parts = self._device_parts(("token_embd.weight",))
        if parts is not None:
            blocks, ggml_type, _ = parts[0]
            self.forms[f"{stored_form(ggml_type)} on the device"] += 1
            return DeviceBlockEmbedding(blocks, ggml_type, self._table["token_embd.weight"].cols, self.act_dtype)
        self.forms["float16"] += 1
        return _FloatEmbedding(self.tinygrad_tensor("token_embd.weight").cast(WEIGHT_DTYPE).contiguous(), self.act_dtype)

    def head(self, vocab: int, int8: bool):
        """x (B, D) -> (B, vocab) float32 logits; the embedding's matrix when the file ties them."""
        name = "output.weight" if "output.weight" in self.names else "token_embd.weight"
        block = self._block((name,))
        if block is not None:
            self.forms[block.form] += 1
            self.kept += 1
            linear = BlockLinear(self.kernels, block)
            return _BlockHead(linear)
        parts = self._device_parts((name,))
        if parts is not None:
            self.forms[f"{stored_form(parts[0][1])} on the device"] += 1
            return _BlockHead(DeviceBlockLinear(parts, self._table[name].cols))
        self.forms["int8 head" if int8 else "float16"] += 1
        return FloatHead(self.tinygrad_tensor(name), vocab, int8)

    @property
    def uses_kernels(self) -> bool:
        return self.kept > 0

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
    """The output projection over the file's blocks, on the CPU kernels or on the device; `weight` is the
    BlockWeight the kernels' whole-model step reads (None on tinygrad's path)."""

    def __init__(self, linear: BlockLinear | DeviceBlockLinear):
        self.linear = linear
        self.weight = linear.weight if isinstance(linear, BlockLinear) else None

    def __call__(self, x: Tensor) -> Tensor:
        return self.linear(x).float()

    def tensors(self) -> list[Tensor]:
        return self.linear.tensors()


def _runs_of_one_type(rows: list, raws: list[RawTensor]) -> list[tuple[list, int]]:
    """Matrices' rows grouped into runs of consecutive matrices of one GGML type, each run (its rows, its
    type): q and k of a Q4_K_M layer are one run, its v in Q6_K another; all of them, mostly, one."""
    runs: list[tuple[list, int]] = []
    for matrix, raw in zip(rows, raws):
        if runs and runs[-1][1] == raw.ggml_type:
            runs[-1][0].append(matrix)
        else:
            runs.append(([matrix], raw.ggml_type))
    return runs
