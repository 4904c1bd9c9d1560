"""Qwen3-VL's vision tower, which Qwen3.5 shares (`clip.projector_type` "qwen3vl_merger"): Qwen2-VL's
at heart, with learned positions resized to each image and deepstack features.

Contract: `Qwen3VLProjector.from_file(file)` reads the tower (names as llama.cpp's converter writes
them: the Conv3D's halves and `v.patch_embd.bias`, `v.position_embd.weight` a square grid of
learned positions, `v.blk.{i}.attn_qkv` one product for q, k and v, LayerNorms, `v.post_ln`, the
merger's `mm.0` and `mm.2`, and for each deepstack layer `v.deepstack.{i}.norm`, `.fc1` and `.fc2`)
and refuses what does not fit, naming it. It is qwen2vl.py's projector otherwise (preprocessing,
`pieces`, `tokens`, `grid`); `encode` gives each token's text_dim values of its merger, then
`deepstack` more rows of text_dim side by side, one per deepstack layer in layer order, which the
language model adds to its first layers' outputs (Qwen3-VL's; Qwen3.5's files have none).

The learned grid is resized to the image's patch grid bilinearly with aligned corners (sample
i of n at i (side - 1) / (n - 1)), as llama.cpp's ggml_interpolate and Qwen's processor do; the
layers run gelu (tanh form, `clip.use_gelu`) between up and down, without a gate or windows.
"""

from __future__ import annotations

import numpy as np

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.vision.projector_file import ProjectorFile
from webapp.engine.vision.qwen2vl import QwenVLProjector, patch_kernels, token_range
from webapp.engine.vision.qwen_tower import Merger, QwenVisionTower, TowerLayer


class Qwen3VLProjector(QwenVLProjector):
    """The tower, the merger and the deepstack mergers; see the module's docstring."""

    learned: np.ndarray  # (side, side, width): the learned positions' grid

    @classmethod
    def from_file(cls, file: ProjectorFile) -> Qwen3VLProjector:
        h = file.hparams
        layers = [TowerLayer.from_file(file, i, rms=False, gated=False, fused_qkv=True) for i in range(h.layers)]
        post = (file.tensor("v.post_ln.weight", (h.width,)), file.tensor("v.post_ln.bias", (h.width,)))
        tower = QwenVisionTower(h, patch_kernels(file), layers, post)
        tower.patch_bias = file.tensor("v.patch_embd.bias", (h.width,))
        tower.activation = "gelu" if file.has("clip.use_gelu") and file.flag("clip.use_gelu") else "gelu_quick"
        merger = Merger.from_file(file, "mm.0", "mm.2")
        for i in range(h.layers):
            p = f"v.deepstack.{i}"
            if file.has_tensor(f"{p}.fc1.weight"):
                tower.deepstack[i] = Merger.from_file(file, f"{p}.fc1", f"{p}.fc2", f"{p}.norm")
                if tower.deepstack[i].out_dim != merger.out_dim:
                    raise ModelLoadError(f"tensor {p}.fc2.weight gives {tower.deepstack[i].out_dim} values, the merger {merger.out_dim}")
        projector = cls(file.projector_type, tower, merger, token_range(file))
        projector.deepstack = len(tower.deepstack)  # rows of deepstack features after each token's own
        side = h.grid_side
        projector.learned = file.tensor("v.position_embd.weight", (side * side, h.width)).reshape(side, side, h.width)
        return projector

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.learned.nbytes

    def positions(self, grid_rows: int, grid_cols: int) -> np.ndarray:
        """The learned grid resized to (grid_rows, grid_cols) patches, (rows * cols, width) row-major."""
        grid = self.learned
        if grid.shape[:2] != (grid_rows, grid_cols):
            grid = _resized(_resized(grid, grid_rows, axis=0), grid_cols, axis=1)
        return np.ascontiguousarray(grid.reshape(grid_rows * grid_cols, -1), dtype=np.float32)


def _resized(grid: np.ndarray, size: int, axis: int) -> np.ndarray:
    """`grid` bilinearly resized along `axis` to `size` samples, corners aligned."""
    side = grid.shape[axis]
    at = np.arange(size, dtype=np.float32) * np.float32((side - 1) / (size - 1)) if size > 1 and side > 1 else np.zeros(size, np.float32)
    low = np.clip(np.floor(at).astype(np.int64), 0, side - 1)
    high = np.minimum(low + 1, side - 1)
    weight = np.clip(at - low, 0.0, 1.0).astype(np.float32)
    shape = [1] * grid.ndim
    shape[axis] = size
    weight = weight.reshape(shape)
    return np.take(grid, low, axis=axis) * (1 - weight) + np.take(grid, high, axis=axis) * weight
