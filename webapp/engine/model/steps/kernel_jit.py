"""Steps as captured tinygrad jits of the CPU kernels' layers (`Transformer.forward_on_kernels`).

Chosen on the CPU kernels when some matrix (the embedding, the head, or a layer's product) has no
kernel, so a step cannot be one call: a layer is then one kernel, or five around tinygrad's float16
product. Lanes are plain int32 values the kernels read (each lane's slot, then its position), so a
prefill piece and a decode step compute a position identically.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor, dtypes

from webapp.engine.model.steps.base import capturing_jit, prompt_lanes
from webapp.engine.model.steps.jitted import JittedSteps


class KernelJitSteps(JittedSteps):
    how = "jitted, on the CPU kernels"

    def _jit(self, jits: dict, size: int):
        jit = jits.get(size)
        if jit is None:
            jit = jits[size] = capturing_jit(self.model.forward_on_kernels)
        return jit

    def _prefill_piece(self, tokens: list[int], slot: int, start: int, piece: int, lora=None, pick: bool = False) -> np.ndarray:
        n, b = len(tokens), self.buffers
        assert 0 < n <= piece
        padded = b.fill("prefill tokens", tokens + [0] * (piece - n), dtypes.int32)
        lanes = b.fill("prefill lanes", prompt_lanes(slot, start, piece), dtypes.int32)
        picks = b.fill("prefill picks", [n - 1], dtypes.int32)
        return b.read(self._jit(self._prefill_jits, piece)(padded, lanes, picks), 1)[0]

    def _hidden_piece(self, tokens: list[int], slot: int, start: int, piece: int, lora=None) -> np.ndarray:
        n = len(tokens)
        padded = Tensor(np.array(tokens + [0] * (piece - n), dtype=np.int32))
        lanes = Tensor(np.array(prompt_lanes(slot, start, piece), dtype=np.int32))
        return self.model.hidden_on_kernels(padded, lanes).numpy()[:n]

    def _decode_width(
        self, tokens: list[int], slots: list[int], positions: list[int], width: int, lora=None, pick: bool = False
    ) -> np.ndarray:
        n, b = len(tokens), self.buffers
        assert 0 < n <= width
        pad = width - n
        tokens_in = b.fill("decode tokens", tokens + [0] * pad, dtypes.int32)
        lanes = b.fill("decode lanes", slots + [self.model.slots] * pad + positions + [0] * pad, dtypes.int32)
        picks = b.fill("decode picks", list(range(width)), dtypes.int32)
        return b.read(self._jit(self._decode_jits, width)(tokens_in, lanes, picks), n)
