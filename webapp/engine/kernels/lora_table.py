"""The CPU kernels' LoRA table for one model (tq.h's MODEL_LORA, read by kernels/c/lora.c).

Contract: `LoraTable(layers)` holds up to abi.LORA_MAX_ADAPTERS adapters, each at an index;
`add(fitted)` takes one adapter's model/lora.FittedProduct by layer and product (model/lora.py's
`fit`; None where a product is unchanged) and gives its index, `remove(index)` frees it (the model thread's: never during a step).
`address(adapters, scales)` is what a step's table entry holds: 0 where no lane has an adapter,
else the table's address with the step's lanes (an index or -1 each, and a scale each) written in;
the arrays stay alive until the next step's.
"""

from __future__ import annotations

import numpy as np

from webapp.engine.kernels import abi

TYPES = {np.dtype(np.float32): abi.BlockType.F32, np.dtype(np.float16): abi.BlockType.F16}  # the kernels' F32 and F16


class LoraTable:
    def __init__(self, layers: int):
        self.layers = layers
        per_adapter = layers * abi.LORA_MATRICES * abi.LORA_ENTRY
        self.table = np.zeros(abi.LORA_WEIGHTS + abi.LORA_MAX_ADAPTERS * per_adapter, np.uint64)
        self._held: dict[int, list[np.ndarray]] = {}  # index -> the arrays its entries name
        self._lanes: tuple[np.ndarray, np.ndarray] | None = None

    def add(self, fitted: list[list]) -> int:
        if len(fitted) != self.layers:
            raise ValueError(f"an adapter for {len(fitted)} layers, not this model's {self.layers}")
        index = next((i for i in range(abi.LORA_MAX_ADAPTERS) if i not in self._held), None)
        if index is None:
            raise ValueError(f"{abi.LORA_MAX_ADAPTERS} adapters are loaded already: unload one first")
        held = []
        for layer, products in enumerate(fitted):
            for product, fitted_product in enumerate(products):
                if fitted_product is not None:
                    held += self._write(self._entry(index, layer, product), fitted_product)
        self._held[index] = held
        return index

    def _write(self, entry: int, fitted) -> list[np.ndarray]:
        a = np.ascontiguousarray(fitted.a)
        assert a.dtype in TYPES and len(fitted.parts) <= abi.LORA_PARTS and a.shape[0] == sum(p.rank for p in fitted.parts)
        self.table[entry + abi.LORA_A], self.table[entry + abi.LORA_TYPE] = a.ctypes.data, TYPES[a.dtype]
        self.table[entry + abi.LORA_RANK] = a.shape[0]
        held = [a]
        for p, part in enumerate(fitted.parts):
            at = entry + abi.LORA_PART + p * abi.LORA_PART_SIZE
            self.table[at + abi.LORA_PART_ROWS], self.table[at + abi.LORA_PART_RANK] = part.rows, part.rank
            if part.bt is not None:
                bt = np.ascontiguousarray(part.bt, np.float32)
                assert bt.shape == (part.rank, part.rows), "model/lora.py gives each B transposed"
                self.table[at + abi.LORA_PART_B] = bt.ctypes.data
                self.table[at + abi.LORA_PART_SCALE] = int(np.float32(part.scale).view(np.uint32))
                held.append(bt)
        return held

    def remove(self, index: int) -> None:
        self._held.pop(index)
        start = self._entry(index, 0, 0)
        self.table[start : start + self.layers * abi.LORA_MATRICES * abi.LORA_ENTRY] = 0

    def address(self, adapters: np.ndarray, scales: np.ndarray) -> int:
        if not (adapters >= 0).any():
            return 0
        assert all(int(i) in self._held for i in np.unique(adapters[adapters >= 0])), "a lane names an adapter not loaded"
        self._lanes = (np.ascontiguousarray(adapters, np.int32), np.ascontiguousarray(scales, np.float32))
        self.table[abi.LORA_LANE_ADAPTERS] = self._lanes[0].ctypes.data
        self.table[abi.LORA_LANE_SCALES] = self._lanes[1].ctypes.data
        return self.table.ctypes.data

    def _entry(self, index: int, layer: int, product: int) -> int:
        return abi.LORA_WEIGHTS + ((index * self.layers + layer) * abi.LORA_MATRICES + product) * abi.LORA_ENTRY
