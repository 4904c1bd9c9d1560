"""LoRA adapters in llama.cpp's GGUF form (`convert_lora_to_gguf`'s output), fitted to a model's products.

Contract: `read_adapter(path)` reads and checks one adapter file: `general.type` "adapter",
`adapter.type` "lora", `adapter.lora.alpha`, and for each matrix it changes a pair of tensors,
`<matrix>.lora_a` (rank, cols) and `<matrix>.lora_b` (rows, rank), in any float or block type (read
as float32). `product_targets(config, layers)` names what a model's layers multiply: for each layer
its four products (qkv, o, gate_up, down) as the file's matrices stacked in them, None where a
layer's product takes no adapter (multi-head latent, recurrent and gated attention, a mixture's
experts). `fit(adapter, targets, regroup)` lays the pairs out as the CPU kernels read them
(kernels/c/lora.c): for each layer and product a `FittedProduct`, its matrices' A's one under another
(float16 where every value is one, an adapter file's usual type: half the bytes a step reads, else
float32) and each matrix's B apart, transposed, as float32, in the rows the model stores, with its
scale, alpha / rank, llama.cpp's on the pair. A file that does not fit the model says why in one ValueError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from webapp.engine.model.gguf import float_values, read_gguf

MAX_RANK = 1024  # larger is no longer low-rank: refused rather than multiplied
INPUT_BLOCK = 32  # the float products' block: A's product takes its input in whole blocks of it
ALL_TARGETS = ("qkv", "o", "gate_up", "down")  # kernels/abi.py's LORA_MATRICES, in the table's order


@dataclass(frozen=True)
class AdapterFile:
    """An adapter as its file holds it: alpha, and (A, B) float32 pairs by the base matrix's name."""

    name: str
    path: str
    alpha: float
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.pairs.values())


@dataclass(frozen=True)
class ProductTarget:
    """One product of a layer: the file's matrices stacked in it (by rows) and their rows, and its input's width."""

    names: tuple[str, ...]
    rows: tuple[int, ...]
    cols: int


@dataclass(frozen=True)
class FittedPart:
    """One matrix of a product: its B transposed (rank, rows), or None where the adapter leaves it;
    its rows, its rank, and the scale on its pair."""

    bt: np.ndarray | None
    rows: int
    rank: int
    scale: float


@dataclass(frozen=True)
class FittedProduct:
    """A product's adapter as the kernels read it: A (the parts' ranks, cols) and the parts."""

    a: np.ndarray
    parts: tuple[FittedPart, ...]

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + sum(p.bt.nbytes for p in self.parts if p.bt is not None)


def read_adapter(path: str, name: str | None = None) -> AdapterFile:
    """The adapter file at `path` (named `name`, else its file name less `.gguf`), or ValueError saying why not."""
    name = name or os.path.basename(path).removesuffix(".gguf")
    try:
        kv, table = read_gguf(path)
    except (OSError, ValueError, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"{name}: not a readable GGUF file ({e})") from e
    if kv.get("general.type") != "adapter" or kv.get("adapter.type") != "lora":
        raise ValueError(f"{name}: not a LoRA adapter (general.type {kv.get('general.type')!r}, adapter.type {kv.get('adapter.type')!r})")
    alpha = kv.get("adapter.lora.alpha", 0.0)
    if not isinstance(alpha, int | float) or not np.isfinite(alpha) or alpha < 0:
        raise ValueError(f"{name}: adapter.lora.alpha is {alpha!r}, not a number of 0 or more")
    pairs = {}
    for tensor in table:
        if tensor.endswith(".lora_b") and tensor.removesuffix(".lora_b") + ".lora_a" in table:
            continue
        base, _, part = tensor.rpartition(".")
        if part != "lora_a" or base + ".lora_b" not in table:
            raise ValueError(f"{name}: tensor {tensor!r} is not one of a pair of .lora_a and .lora_b tensors")
        a, b = (float_values(path, f"{base}.{p}", table[f"{base}.{p}"]) for p in ("lora_a", "lora_b"))
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or not 0 < a.shape[0] <= MAX_RANK:
            raise ValueError(
                f"{name}: {base}'s lora_a {a.shape} and lora_b {b.shape} are not (rank, cols) and (rows, rank) of a rank up to {MAX_RANK}"
            )
        pairs[base] = (a, b)
    if not pairs:
        raise ValueError(f"{name}: the adapter holds no lora_a / lora_b pairs")
    return AdapterFile(name, path, float(alpha), pairs)


def product_targets(config, layers) -> list[list[ProductTarget | None]]:
    """Each layer's four products as `fit` takes them; `layers`: each layer's (plain attention, dense
    feed-forward, the file's matrices' (rows, cols) by name), as `model_targets` gives them."""
    out = []
    for index, (attention, dense, shapes) in enumerate(layers):
        p = f"blk.{index}."
        names = [config.qkv_names(p), (p + "attn_output.weight",), config.gate_up_names(p), (p + "ffn_down.weight",)]
        kept = [attention, attention, dense, dense]
        out.append([_target(n, shapes) if keep and all(x in shapes for x in n) else None for n, keep in zip(names, kept, strict=True)])
    return out


def _target(names: tuple[str, ...], shapes: dict[str, tuple[int, int]]) -> ProductTarget:
    return ProductTarget(names, tuple(shapes[n][0] for n in names), shapes[names[0]][1])


def fit(adapter: AdapterFile, targets: list[list[ProductTarget | None]], regroup) -> list[list[FittedProduct | None]]:
    """The adapter's (A, B) for each layer and product (None: unchanged), as the module's docstring
    says; `regroup(name, rows)` reorders a matrix's rows as the model stores them (llama files' q and
    k, whose rotary pairs the loader regroups)."""
    by_name = {
        n: (layer, product, target)
        for layer, row in enumerate(targets)
        for product, target in enumerate(row)
        if target
        for n in target.names
    }
    unknown = sorted(set(adapter.pairs) - set(by_name))
    if unknown:
        raise ValueError(
            f"{adapter.name}: changes {', '.join(unknown[:3])}, which this model does not run through a product adapters change"
        )
    fitted: list[list] = [[None] * len(ALL_TARGETS) for _ in targets]
    for layer, row in enumerate(targets):
        for product, target in enumerate(row):
            if target is not None and any(n in adapter.pairs for n in target.names):
                fitted[layer][product] = _stacked(adapter, target, regroup)
    return fitted


def _stacked(adapter: AdapterFile, target: ProductTarget, regroup) -> FittedProduct:
    if target.cols % INPUT_BLOCK:
        raise ValueError(f"{adapter.name}: {target.names[0]}'s input of {target.cols} values is not whole blocks of {INPUT_BLOCK}")
    a_parts, parts = [], []
    for name, rows in zip(target.names, target.rows, strict=True):
        if name not in adapter.pairs:
            parts.append(FittedPart(None, rows, 0, 0.0))
            continue
        a, b = adapter.pairs[name]
        if a.shape[1] != target.cols or b.shape[0] != rows:
            raise ValueError(
                f"{adapter.name}: {name} is ({rows}, {target.cols}) in the model, its lora_a {a.shape} and lora_b {b.shape} do not fit it"
            )
        rank = a.shape[0]
        a_parts.append(a)
        bt = np.ascontiguousarray(np.asarray(regroup(name, b), np.float32).T)
        parts.append(FittedPart(bt, rows, rank, adapter.alpha / rank if adapter.alpha else 1.0))
    a_all = np.concatenate(a_parts).astype(np.float32)
    return FittedProduct(np.ascontiguousarray(a_all, np.float16 if _is_half(a_all) else np.float32), tuple(parts))


def _is_half(values: np.ndarray) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


def model_targets(model, shapes: dict[str, tuple[int, int]]) -> list[list[ProductTarget | None]]:
    """`product_targets` for a loaded model (its blocks' mixers and the config's routed layers),
    `shapes` the file's matrices' (rows, cols) by name."""
    from webapp.engine.kernels.abi import LayerForm

    other_attention = LayerForm.LATENT | LayerForm.RECURRENT | LayerForm.GATED_ATTENTION
    layers = [(not block.mixer.form & other_attention, not model.config.routed(i), shapes) for i, block in enumerate(model.blocks)]
    return product_targets(model.config, layers)
