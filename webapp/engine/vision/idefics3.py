"""SmolVLM / Idefics3's projector (`clip.projector_type` "idefics3"): a pixel shuffle, then one linear map.

Contract: `Idefics3Projection.from_file(file)` reads the shuffle's scale factor s
(`clip.vision.projector.scale_factor`) and `mm.model.fc.weight`, stored (text_dim, width * s * s),
and refuses a patch grid whose side s does not divide; `project(patches)` maps the encoder's
(side * side, width) features to (side * side / s^2, text_dim) rows. The shuffle is Idefics3's
connector's: each token gathers an s x s block of neighbouring patches into one row of
width * s * s values, in the order its reshapes and transposes of the (side, side, width) grid give.

`pieces(rgb, hparams)` is SmolVLM's image splitting, as its processor and llama.cpp do it where the
file gives `clip.vision.preproc_image_size` (the longest edge, 2048 in SmolVLM's files): the image
resized (Lanczos, aspect ratio kept) so that its longer side is that edge, then to whole tiles of
the encoder's square, cut into those tiles, row by row, each after
"<fake_token_around_image><row_R_col_C>" and each row but the last followed by a newline; then the
whole image squeezed into one square (the overview) between
"\n\n<fake_token_around_image><global-img>" and "<fake_token_around_image>". A file without that
key gets the overview alone, between "<fake_token_around_image><global-img>" and
"<fake_token_around_image>".
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.vision.projector_file import ProjectorFile, VisionHparams
from webapp.engine.vision.siglip import normalized_pixels

SCALE_FACTOR_KEY = "clip.vision.projector.scale_factor"
LONGEST_EDGE_KEY = "clip.vision.preproc_image_size"
MAX_TILES = 64  # a longest edge of 8 tiles: 4 is SmolVLM's own


class Idefics3Projection:
    """Pixel shuffle and a bias-free linear map; see the module's docstring."""

    family = "idefics3"
    resample = Image.Resampling.LANCZOS
    before = "<fake_token_around_image><global-img>"
    after = "<fake_token_around_image>"
    both_ways = False  # causal over its rows, as over text

    def __init__(self, grid_side: int, scale_factor: int, fc_weight: np.ndarray, longest_edge: int = 0):
        self.grid_side = grid_side
        self.scale_factor = scale_factor
        self.fc_weight = fc_weight  # (text_dim, width * s * s)
        self.longest_edge = longest_edge  # 0: the overview alone

    @classmethod
    def from_file(cls, file: ProjectorFile) -> Idefics3Projection:
        h = file.hparams
        scale = file.uint(SCALE_FACTOR_KEY, 1, h.grid_side)
        if h.grid_side % scale:
            raise ModelLoadError(f"{SCALE_FACTOR_KEY} {scale} does not divide the patch grid's side {h.grid_side}")
        fc_weight = file.tensor("mm.model.fc.weight", (None, h.width * scale * scale))
        edge = file.uint(LONGEST_EDGE_KEY, h.image_size, h.image_size * int(MAX_TILES**0.5)) if file.has(LONGEST_EDGE_KEY) else 0
        return cls(h.grid_side, scale, fc_weight, edge)

    def pieces(self, rgb: np.ndarray, hparams: VisionHparams) -> list[tuple[str, np.ndarray, str]]:
        """The tiles and the overview of an RGB uint8 image, each (text before, pixels, text after)."""
        overview = (self.before, normalized_pixels(rgb, self.resample, hparams), self.after)
        if not self.longest_edge:
            return [overview]
        height, width, tile = rgb.shape[0], rgb.shape[1], hparams.image_size
        if width >= height:  # the longer side to the edge, the other as its ratio keeps it, made even
            size = (self.longest_edge, int(self.longest_edge / (width / height)))
        else:
            size = (int(self.longest_edge * (width / height)), self.longest_edge)
        size = tuple(max(2, side + side % 2) for side in size)
        columns, rows = (-(-side // tile) for side in size)
        picture = Image.fromarray(np.ascontiguousarray(rgb)).resize(size, self.resample)
        picture = picture.resize((columns * tile, rows * tile), self.resample)
        out = []
        for row in range(rows):
            for column in range(columns):
                cut = np.asarray(picture.crop((column * tile, row * tile, (column + 1) * tile, (row + 1) * tile)))
                after = "\n" if column == columns - 1 and row < rows - 1 else ""
                out.append(
                    (f"<fake_token_around_image><row_{row + 1}_col_{column + 1}>", normalized_pixels(cut, self.resample, hparams), after)
                )
        whole = normalized_pixels(np.asarray(picture), self.resample, hparams)  # the tiles' picture, squeezed
        return [*out, ("\n\n" + self.before, whole, self.after)]

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
