"""A projector file turned into the two steps image input needs: pixels from an image, rows from pixels.

Contract: `load_projector(path, library)` reads a llama.cpp projector ("mmproj") GGUF and returns a
`Projector` (or a family's own, the same methods: qwen2vl.py's), or raises `ModelLoadError` naming
the key or tensor at fault. A projector's `pieces(rgb)` is what an RGB uint8 (H, W, 3) image is in
a prompt: its encoder inputs (float32 pixels), each between the family's strings before and after
its rows (the caller tokenizes those); `tokens(pixels)` how many rows an input becomes, and
`grid(pixels)` their (rows, cols) where the language model turns them by a 2-D position (M-RoPE),
else None; `encode(pixels)` runs the encoder and the family's projection and returns (tokens,
text_dim) float32 rows. All are pure functions of their input: the same pixels give the same rows.

What differs between SigLIP families (resampling filter, wrap strings, the projection after the
encoder) is one class per family, named in `FAMILIES` by its `family` (`clip.projector_type`); the
encoder is shared. A new family is a module beside gemma3.py and one entry there; a family with a
tower of its own (`OWN_TOWERS`) is a whole projector in its module.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from PIL import Image

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.vision.gemma3 import Gemma3Projection
from webapp.engine.vision.idefics3 import Idefics3Projection
from webapp.engine.vision.projector_file import ProjectorFile, VisionHparams
from webapp.engine.vision.qwen2vl import QwenVLProjector
from webapp.engine.vision.qwen3vl import Qwen3VLProjector
from webapp.engine.vision.siglip import SiglipEncoder, normalized_pixels, run_to_end


class Projection(Protocol):
    """What a family adds to the shared encoder: its preprocessing filter, its prompt wrap and the
    map from the encoder's (n_patches, width) features to (tokens_per_image, text_dim) rows."""

    family: str
    resample: Image.Resampling
    before: str
    after: str
    both_ways: bool  # each of an image's positions attends all of its rows, not only those before it

    @property
    def tokens_per_image(self) -> int: ...

    @property
    def text_dim(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def project(self, patches: np.ndarray) -> np.ndarray: ...

    def pieces(self, rgb: np.ndarray, hparams: VisionHparams) -> list[tuple[str, np.ndarray, str]]: ...


# clip.projector_type -> the family's reader; each checks its own keys and tensors
FAMILIES: dict[str, Callable[[ProjectorFile], Projection]] = {
    family.family: family.from_file for family in (Gemma3Projection, Idefics3Projection)
}
# families with a tower of their own (qwen2vl.py), each a whole projector
OWN_TOWERS = {"qwen2vl_merger": QwenVLProjector.from_file, "qwen2.5vl_merger": QwenVLProjector.from_file}
OWN_TOWERS["qwen3vl_merger"] = Qwen3VLProjector.from_file


@dataclass(frozen=True)
class Projector:
    """A loaded projector: the shared SigLIP encoder and its family's projection."""

    encoder: SiglipEncoder
    projection: Projection

    @property
    def family(self) -> str:
        return self.projection.family

    @property
    def text_dim(self) -> int:
        """The width of the rows `encode` returns: the language model's embedding width."""
        return self.projection.text_dim

    @property
    def both_ways(self) -> bool:
        """The language model attends an image's rows both ways, so its rows run in one chunk."""
        return self.projection.both_ways

    @property
    def tokens_per_image(self) -> int:
        return self.projection.tokens_per_image

    @property
    def image_size(self) -> int:
        """The side of the square every image is resized to."""
        return self.encoder.hparams.image_size

    @property
    def nbytes(self) -> int:
        """The weights' bytes in memory: as the file stores its matrices (float16, quantized blocks), float32 else."""
        return self.encoder.nbytes + self.projection.nbytes

    def pieces(self, rgb: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        """What an image is in a prompt: its encoder inputs (a family's tiles, then its overview; most
        families one whole image), each with the text before and after its rows."""
        return self.projection.pieces(rgb, self.encoder.hparams)

    @property
    def deepstack(self) -> int:
        """Rows of text_dim each encoded row carries after its own (Qwen3-VL's deepstack): none here."""
        return 0

    def limit_tokens(self, least: int | None, most: int | None) -> None:
        """A SigLIP family's images take one number of positions whatever their size: nothing to limit."""
        return None

    def tokens(self, pixels: np.ndarray) -> int:
        """How many rows `encode` gives for these pixels: the family's one number."""
        return self.projection.tokens_per_image

    def grid(self, pixels: np.ndarray) -> None:
        """The rows' 2-D grid where the language model turns them by it (M-RoPE); none here."""
        return None

    def preprocess(self, rgb: np.ndarray) -> np.ndarray:
        """RGB uint8 (H, W, 3) -> (3, image_size, image_size) float32, resized and normalized as the family was trained."""
        return normalized_pixels(rgb, self.projection.resample, self.encoder.hparams)

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """(3, image_size, image_size) float32 -> (tokens_per_image, text_dim) float32 rows."""
        return run_to_end(self.encode_slices(pixels))

    def encode_slices(self, pixels: np.ndarray) -> Generator[None, None, np.ndarray]:
        """`encode` a slice of work at a time (SiglipEncoder.forward_slices), returning the rows."""
        features = yield from self.encoder.forward_slices(pixels)
        return self.projection.project(features)


def load_projector(path: str, library=None) -> Projector | QwenVLProjector:
    """The projector in the GGUF file at `path`, its quantized matrices laid out for `library` (the
    CPU kernels' build that will run its encoder, if any); `ModelLoadError` names what is wrong with it."""
    file = ProjectorFile.open(path, library)
    if file.projector_type in OWN_TOWERS:
        return OWN_TOWERS[file.projector_type](file)
    read_projection = FAMILIES.get(file.projector_type)
    if read_projection is None:
        known = ", ".join(sorted([*FAMILIES, *OWN_TOWERS]))
        raise ModelLoadError(f"clip.projector_type {file.projector_type!r} is not supported (supported: {known})")
    projection = read_projection(file)  # the family's checks first: they read far less than the encoder's tensors
    return Projector(SiglipEncoder.from_file(file), projection)
