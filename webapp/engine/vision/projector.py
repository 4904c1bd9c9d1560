"""A projector file turned into the two steps image input needs: pixels from an image, rows from pixels.

Contract: `load_projector(path)` reads a llama.cpp projector ("mmproj") GGUF and returns a
`Projector`, or raises `ModelLoadError` naming the key or tensor at fault. A `Projector`'s
`preprocess(rgb)` maps an RGB uint8 (H, W, 3) image to the encoder's (3, S, S) float32 input;
`encode(pixels)` runs the SigLIP encoder and the family's projection and returns
(tokens_per_image, text_dim) float32 rows; `pieces(rgb)` is what an image is in a prompt: its
encoder inputs, each between the family's strings before and after its rows (the caller tokenizes
those). Both are pure functions of their input:
the same pixels give the same rows.

What differs between families (resampling filter, wrap strings, the projection after the encoder) is
one class per family, named in `FAMILIES` by its `family` (`clip.projector_type`); the encoder is
shared. A new family is a module beside gemma3.py and one entry there.
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
        """The weights' bytes in memory (float32, whatever the file's types)."""
        return self.encoder.nbytes + self.projection.nbytes

    def pieces(self, rgb: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        """What an image is in a prompt: its encoder inputs (a family's tiles, then its overview; most
        families one whole image), each with the text before and after its rows."""
        return self.projection.pieces(rgb, self.encoder.hparams)

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


def load_projector(path: str) -> Projector:
    """The projector in the GGUF file at `path`; `ModelLoadError` names what is wrong with it."""
    file = ProjectorFile.open(path)
    read_projection = FAMILIES.get(file.projector_type)
    if read_projection is None:
        raise ModelLoadError(f"clip.projector_type {file.projector_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    projection = read_projection(file)  # the family's checks first: they read far less than the encoder's tensors
    return Projector(SiglipEncoder.from_file(file), projection)
