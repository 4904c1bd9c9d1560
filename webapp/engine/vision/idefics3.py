"""SmolVLM / Idefics3's projector (`clip.projector_type` "idefics3"): a pixel shuffle, then one linear map.

Contract: `Idefics3Projection.from_file(file)` reads the shuffle's scale factor s
(`clip.vision.projector.scale_factor`) and `mm.model.fc.weight`, stored (text_dim, width * s * s),
and refuses a patch grid whose side s does not divide; `project(patches)` maps the encoder's
(side * side, width) features to (side * side / s^2, text_dim) rows. The shuffle is Idefics3's
connector's: each token gathers an s x s block of neighbouring patches into one row of
width * s * s values, in the order its reshapes and transposes of the (side, side, width) grid give.

Images are resized to the encoder's square with a bicubic filter, aspect ratio not kept: the single
"global" image of SmolVLM's preprocessing (the tiles it also cuts a large image into are not made
here). The rows sit between "<fake_token_around_image><global-img>" and "<fake_token_around_image>".
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.vision.projector_file import ProjectorFile

SCALE_FACTOR_KEY = "clip.vision.projector.scale_factor"


class Idefics3Projection:
    """Pixel shuffle and a bias-free linear map; see the module's docstring."""

    family = "idefics3"
    resample = Image.Resampling.BICUBIC
    before = "<fake_token_around_image><global-img>"
    after = "<fake_token_around_image>"

    def __init__(self, grid_side: int, scale_factor: int, fc_weight: np.ndarray):
        self.grid_side = grid_side
        self.scale_factor = scale_factor
        self.fc_weight = fc_weight  # (text_dim, width * s * s)

    @classmethod
    def from_file(cls, file: ProjectorFile) -> Idefics3Projection:
        h = file.hparams
        scale = file.uint(SCALE_FACTOR_KEY, 1, h.grid_side)
        if h.grid_side % scale:
            raise ModelLoadError(f"{SCALE_FACTOR_KEY} {scale} does not divide the patch grid's side {h.grid_side}")
        fc_weight = file.tensor("mm.model.fc.weight", (None, h.width * scale * scale))
        return cls(h.grid_side, scale, fc_weight)

    @property
    def tokens_per_image(self) -> int:
        return (self.grid_side // self.scale_factor) ** 2

    @property
    def text_dim(self) -> int:
        return self.fc_weight.shape[0]

    @property
    def nbytes(self) -> int:
        return self.fc_weight.nbytes

    def project(self, patches: np.ndarray) -> np.ndarray:
        """(grid_side * grid_side, width) encoder features -> (tokens_per_image, text_dim) rows."""
        side, s, width = self.grid_side, self.scale_factor, patches.shape[1]
        x = patches.reshape(side, side // s, width * s)  # each row's patches in runs of s
        x = x.transpose(1, 0, 2).reshape(side // s, side // s, width * s * s)  # (col block, row block, s rows of runs)
        x = x.transpose(1, 0, 2).reshape(self.tokens_per_image, width * s * s)  # row blocks first
        return x @ self.fc_weight.T  # (tokens, text_dim)
