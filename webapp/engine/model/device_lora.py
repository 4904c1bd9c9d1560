"""LoRA adapters on tinygrad's path: every adapter's A and B's stacked on the device, product by
product, and each lane of a step adding its own adapter's low-rank product to the base one's.

Contract: `DeviceLoraTable(model)` is the tinygrad steps' `lora_table`, with kernels/lora_table.py's
`add(fitted)` (model/lora.fit's layout: each layer's products' FittedProduct or None) -> index and
`remove(index)`, run on the model thread between steps. `lanes(adapters, scales)` is a context in
which the model's forward passes add, to each adapted product's output, scale * B (A x) with lane
l's adapter `adapters[l]` and scale `scales[l]` ((L,) int32 and float32 device tensors; the
products' inputs are (L, T, cols): a decode step's lanes, or one prompt piece's). A lane without an
adapter names index 0 with a scale of 0: it adds zeros. `generation` counts the stacks' layouts: a
jit captured over one reads buffers that a later layout no longer uses, so the steps key their
adapted jits by it.

The stacks hold `capacity` adapters of up to `rank` a matrix (powers of two): a product's A's as
(capacity, parts x rank, cols), part j's rows at j x rank, and each part's B transposed as
(capacity, rank, rows) with its alpha / rank folded in. Loading within that capacity rewrites the
buffers in place; past it, the stacks are laid out again (every loaded adapter written anew) and the
generation moves on. A product is wrapped (`AdaptedProduct`) the first time an adapter changes it:
a jit captured before then runs the product as it was, which is what a step without adapters needs.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from tinygrad import Tensor

from webapp.engine.device.buffers import device_array, overwrite
from webapp.engine.kernels.abi import LORA_MAX_ADAPTERS
from webapp.engine.model.device_blocks import on_tensor_cores
from webapp.engine.model.lora import ALL_TARGETS, FittedProduct

SMALLEST_RANK = 8  # stacks' rank at least this: adapters of ranks 1..8 share one layout


def _power_of_two(n: int, smallest: int) -> int:
    return max(smallest, 1 << (n - 1).bit_length())


class ProductStack:
    """One product's adapters on the device (the module's layout)."""

    def __init__(self, rows: tuple[int, ...], cols: int, capacity: int, rank: int, a_dtype):
        self.capacity, self.rank = capacity, rank
        self.a = device_array(np.zeros((capacity, len(rows) * rank, cols), a_dtype))
        self.bt = [device_array(np.zeros((capacity, rank, r), np.float32)) for r in rows]

    def upload(self, adapters: dict[int, FittedProduct | None]) -> None:
        """Write every index's matrices (zeros where `adapters` has none for it) into the buffers."""
        a = np.zeros(self.a.shape, self.a.dtype.fmt)
        bts = [np.zeros(bt.shape, np.float32) for bt in self.bt]
        for index, fitted in adapters.items():
            row = 0
            for j, part in enumerate(() if fitted is None else fitted.parts):
                if part.bt is not None:
                    a[index, j * self.rank : j * self.rank + part.rank] = fitted.a[row : row + part.rank]
                    bts[j][index, : part.rank] = part.bt * np.float32(part.scale)
                    row += part.rank
        overwrite(self.a, a)
        for tensor, values in zip(self.bt, bts, strict=True):
            overwrite(tensor, values)

    def delta(self, x: Tensor, adapters: Tensor, scales: Tensor) -> Tensor:
        """x (L, T, cols) -> (L, T, rows): lane l's scales[l] * B (A x) with adapter adapters[l]."""
        low = x @ self.a[adapters].cast(x.dtype).transpose(-1, -2)  # (L, T, parts x rank)
        low = low * scales.cast(x.dtype).reshape(-1, 1, 1)
        r = self.rank
        parts = [low[..., j * r : (j + 1) * r] @ bt[adapters].cast(x.dtype) for j, bt in enumerate(self.bt)]
        return parts[0] if len(parts) == 1 else Tensor.cat(*parts, dim=-1)


class AdaptedProduct:
    """A product whose output takes the current step's lanes' low-rank products where a step has them."""

    def __init__(self, base, table: DeviceLoraTable, key: tuple[int, int]):
        self.base, self.table, self.key = base, table, key

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        y = self.base(x, bias)
        lanes = self.table.current
        if lanes is None:
            return y
        if on_tensor_cores(x):
            y = y.contiguous()  # the product alone in its kernel, on tensor cores: the low-rank one's reduce fused in keeps it off them
        return y + self.table.stacks[self.key].delta(x, *lanes).cast(y.dtype)

    def __getattr__(self, name: str):  # what else the model reads of a product (its tensors, its rows)
        return getattr(self.base, name)


# where each of fit's products lives in a layer: (component, attribute)
_HOLDERS = {"qkv": ("mixer", "qkv"), "o": ("mixer", "attn_output"), "gate_up": ("ffn", "gate_up"), "down": ("ffn", "down")}


class DeviceLoraTable:
    def __init__(self, model):
        self.model = model
        self.stacks: dict[tuple[int, int], ProductStack] = {}
        self.generation = 0
        self.current: tuple[Tensor, Tensor] | None = None
        self._fitted: dict[int, list[list[FittedProduct | None]]] = {}
        self._shapes: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}  # a product's parts' rows, its cols

    @property
    def loaded(self) -> bool:
        return bool(self._fitted)

    @property
    def device_bytes(self) -> int:
        """The stacks' bytes on the device (the fitted matrices they were written from stay on the host)."""
        return sum(stack.a.nbytes() + sum(bt.nbytes() for bt in stack.bt) for stack in self.stacks.values())

    def add(self, fitted: list[list[FittedProduct | None]]) -> int:
        if len(fitted) != len(self.model.blocks):
            raise ValueError(f"an adapter for {len(fitted)} layers, not this model's {len(self.model.blocks)}")
        index = next((i for i in range(LORA_MAX_ADAPTERS) if i not in self._fitted), None)
        if index is None:
            raise ValueError(f"{LORA_MAX_ADAPTERS} adapters are loaded already: unload one first")
        self._fitted[index] = fitted
        for layer, product, fp in _products(fitted):
            self._shapes.setdefault((layer, product), (tuple(p.rows for p in fp.parts), fp.a.shape[1]))
        self._lay_out()
        return index

    def remove(self, index: int) -> None:
        del self._fitted[index]
        self._upload()

    @contextmanager
    def lanes(self, adapters: Tensor, scales: Tensor):
        """The model's forward passes inside this add each lane's adapter (the module's contract)."""
        self.current = (adapters, scales)
        try:
            yield
        finally:
            self.current = None

    def _lay_out(self) -> None:
        """Every loaded adapter written into stacks of the capacity they need: the same buffers where
        the capacity holds, new ones (and the next generation) where it does not."""
        capacity = _power_of_two(max(self._fitted) + 1, 1)
        rank = _power_of_two(max(p.rank for f in self._fitted.values() for p in _parts(f)), SMALLEST_RANK)
        halves = all(fp.a.dtype == np.float16 for f in self._fitted.values() for *_, fp in _products(f))
        a_dtype = np.dtype(np.float16 if halves else np.float32)
        old = next(iter(self.stacks.values()), None)
        fits = old is not None and capacity <= old.capacity and rank <= old.rank and a_dtype == old.a.dtype.fmt
        if not fits or set(self._shapes) != set(self.stacks):
            if old is not None:
                capacity, rank = max(capacity, old.capacity), max(rank, old.rank)
            self.stacks = {key: ProductStack(rows, cols, capacity, rank, a_dtype) for key, (rows, cols) in self._shapes.items()}
            self.generation += 1
        self._upload()
        for key in self.stacks:
            self._wrap(key)

    def _upload(self) -> None:
        for (layer, product), stack in self.stacks.items():
            stack.upload({index: fitted[layer][product] for index, fitted in self._fitted.items()})

    def _wrap(self, key: tuple[int, int]) -> None:
        layer, product = key
        component, attribute = _HOLDERS[ALL_TARGETS[product]]
        holder = getattr(self.model.blocks[layer], component)
        if not isinstance(getattr(holder, attribute), AdaptedProduct):
            setattr(holder, attribute, AdaptedProduct(getattr(holder, attribute), self, key))


def _products(fitted):
    return [(layer, product, fp) for layer, row in enumerate(fitted) for product, fp in enumerate(row) if fp is not None]


def _parts(fitted):
    return [part for *_, fp in _products(fitted) for part in fp.parts if part.bt is not None]
