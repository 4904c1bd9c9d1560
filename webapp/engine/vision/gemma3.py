"""Gemma 3's projector (`clip.projector_type` "gemma3"): SigLIP features pooled to a 16 x 16 grid, RMS-normed, projected.

Contract: `Gemma3Projection.from_file(file)` reads the projection's tensors and refuses a patch grid
that does not pool evenly; `project(patches)` maps the encoder's (side * side, width) features to
(tokens_per_image, text_dim) rows for the language model. The grid is average-pooled in square
blocks so that 16 x 16 cells remain (a grid smaller than 16 stays as it is, as tiny test files
have), each cell RMS-normed, scaled by `mm.soft_emb_norm.weight` (the converter already stored it
as 1 + w) and multiplied by `mm.input_projection.weight`, stored (width, text_dim).

Images are resized to the encoder's square with a bilinear filter, aspect ratio not kept: Gemma 3's
own preprocessing (without pan-and-scan crops). The rows sit between "<start_of_image>" and
"<end_of_image>" in the prompt, and the language model attends them both ways: each of an image's
positions sees all of them, as Gemma 3 was trained.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.vision.projector_file import ProjectorFile, VisionHparams
from webapp.engine.vision.siglip import normalized_pixels

# the pooled grid's side: 256 tokens per image, what Gemma 3 was trained on
POOLED_SIDE = 16


class Gemma3Projection:
    """Average pool, RMS norm, projection; see the module's docstring."""

    family = "gemma3"
    resample = Image.Resampling.BILINEAR
    before = "<start_of_image>"
    after = "<end_of_image>"
    both_ways = True  # the model attends an image's rows both ways (llama.cpp's mtmd: one non-causal batch)

    def __init__(self, grid_side: int, pooled_side: int, eps: float, norm_weight: np.ndarray, projection: np.ndarray):
        self.grid_side = grid_side
        self.pooled_side = pooled_side
        self.kernel = grid_side // pooled_side
        self.eps = eps
        self.norm_weight = norm_weight  # (width,)
        self.projection = projection  # (width, text_dim)

    @classmethod
    def from_file(cls, file: ProjectorFile) -> Gemma3Projection:
        h = file.hparams
        pooled = min(POOLED_SIDE, h.grid_side)
        if h.grid_side % pooled:
            raise ModelLoadError(
                f"clip.vision.image_size / clip.vision.patch_size makes a {h.grid_side}-patch grid side, which does not pool to {pooled}"
            )
        norm_weight = file.tensor("mm.soft_emb_norm.weight", (h.width,))
        projection = file.tensor("mm.input_projection.weight", (h.width, None))
        return cls(h.grid_side, pooled, h.eps, norm_weight, projection)

    def pieces(self, rgb: np.ndarray, hparams: VisionHparams) -> list[tuple[str, np.ndarray, str]]:
        """One piece: the whole image in the encoder's square (no pan-and-scan crops)."""
        return [(self.before, normalized_pixels(rgb, self.resample, hparams), self.after)]

    @property
    def tokens_per_image(self) -> int:
        return self.pooled_side**2

    @property
    def text_dim(self) -> int:
        return self.projection.shape[1]

    @property
    def nbytes(self) -> int:
        return self.norm_weight.nbytes + self.projection.nbytes

    def project(self, patches: np.ndarray) -> np.ndarray:
        """(grid_side * grid_side, width) encoder features -> (tokens_per_image, text_dim) rows."""
        pooled, kernel, width = self.pooled_side, self.kernel, patches.shape[1]
        blocks = patches.reshape(pooled, kernel, pooled, kernel, width)  # (row, dy, col, dx, width)
        cells = blocks.mean(axis=(1, 3), dtype=np.float32).reshape(pooled * pooled, width)  # row-major over the pooled grid
        cells *= 1.0 / np.sqrt(np.mean(cells * cells, axis=1, keepdims=True) + np.float32(self.eps))
        cells *= self.norm_weight
        return cells @ self.projection  # (tokens, text_dim)
