"""A llama.cpp projector ("mmproj") GGUF file: its vision hyperparameters and its tensors as float32 arrays.

Contract: `ProjectorFile.open(path)` checks that the file is a CLIP-style projector with a vision
encoder and reads `projector_type` and the SigLIP encoder's numbers (`VisionHparams`); a family's
own keys are read through `uint` / `floats`, and `tensor(name, shape)` dequantizes one tensor to a
float32 array of exactly that NumPy shape (a None in `shape` accepts any size, as the projection's
text width), or keeps a matrix as stored (float16, or quantized blocks laid out by `kept` for the
kernels a projector is opened for). Anything wrong raises `ModelLoadError` with one line naming the key or tensor: the file
is untrusted input, and the sizes read here decide the buffers the encoder allocates and the loops
it runs, so no size leaves this module unchecked.

The file is read with the language models' own reader (model/gguf.py: counts, lengths and offsets
checked against the file's size before anything is allocated). Tensors are dequantized on request,
not at open: a family reads only what it computes with, and nothing keeps the file's memory map
once the arrays are built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from webapp.engine.kernels.ggml_types import GGML_TYPES
from webapp.engine.kernels.host_blocks import HostBlocks
from webapp.engine.model.gguf import RawTensor, float_values, read_gguf
from webapp.engine.model.load_error import ModelLoadError

# far past any real projector: a file claiming more is corrupt, and would ask for absurd buffers
LIMITS = {"image_size": 8192, "patch_size": 1024, "embedding_length": 1 << 14, "feed_forward_length": 1 << 17}
LIMITS |= {"block_count": 256, "attention.head_count": 1024}
# one head's (patches x patches) float32 score matrix stays under a gigabyte
MAX_PATCHES = 1 << 14


@dataclass(frozen=True)
class VisionHparams:
    """The SigLIP encoder's numbers, checked against each other: whole patches, whole heads."""

    image_size: int  # the square side the image is resized to
    patch_size: int
    width: int  # clip.vision.embedding_length
    ffn: int  # clip.vision.feed_forward_length
    layers: int
    heads: int
    eps: float  # every LayerNorm's, and the projections' RMS norms'
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @property
    def grid_side(self) -> int:
        """Patches along each side of the image."""
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.grid_side**2

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


class ProjectorFile:
    """One projector GGUF, open for reading: metadata checked at open, tensors read on request."""

    def __init__(self, path: str, metadata: dict, tensors: dict[str, RawTensor], library=None):
        self.path, self.library = path, library  # library: the CPU kernels' build that will multiply the matrices, if any
        self._metadata, self._tensors = metadata, tensors
        if (arch := self.string("general.architecture")) != "clip":
            raise ModelLoadError(f"general.architecture is {arch!r}, not 'clip': not a projector file")
        if not self.flag("clip.has_vision_encoder"):
            raise ModelLoadError("clip.has_vision_encoder is false: the projector has no vision encoder")
        self.projector_type = self.string("clip.projector_type")
        self.hparams = self._vision_hparams()

    @classmethod
    def open(cls, path: str, library=None) -> ProjectorFile:
        try:
            metadata, tensors = read_gguf(path)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"{path} is not a readable GGUF file: {err}") from err
        return cls(path, metadata, tensors, library)

    def kept(self, arrays: dict) -> dict:
        """A layer's arrays as its encoder keeps them: quantized blocks laid out for the kernels that
        will multiply them (`library`), once, at load."""
        if self.library is None:
            return arrays
        return {name: a.packed(self.library) if isinstance(a, HostBlocks) else a for name, a in arrays.items()}

    def _value(self, key: str):
        if key not in self._metadata:
            raise ModelLoadError(f"{key} is missing")
        return self._metadata[key]

    def string(self, key: str) -> str:
        value = self._value(key)
        if not isinstance(value, str):
            raise ModelLoadError(f"{key} is not a string")
        return value

    def flag(self, key: str) -> bool:
        value = self._value(key)
        if not isinstance(value, bool):
            raise ModelLoadError(f"{key} is not a bool")
        return value

    def has(self, key: str) -> bool:
        return key in self._metadata

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def uint(self, key: str, low: int = 1, high: int = 1 << 31) -> int:
        """An integer key, which must lie in [low, high]."""
        value = self._value(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelLoadError(f"{key} is not an integer")
        if not low <= value <= high:
            raise ModelLoadError(f"{key} is {value}, outside [{low}, {high}]")
        return value

    def floats(self, key: str, count: int | None = None) -> tuple[float, ...]:
        """A number (count None: a tuple of one) or an array of exactly `count` numbers, all finite."""
        value = self._value(key)
        values = (value,) if count is None else tuple(value) if isinstance(value, list) else ()
        if (count is not None and not isinstance(value, list)) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            raise ModelLoadError(f"{key} is not {'a number' if count is None else f'an array of {count} numbers'}")
        if count is not None and len(values) != count:
            raise ModelLoadError(f"{key} has {len(values)} values, not {count}")
        if not all(math.isfinite(v) for v in values):
            raise ModelLoadError(f"{key} is not finite")
        return tuple(float(v) for v in values)

    def _vision_hparams(self) -> VisionHparams:
        size = {name: self.uint(f"clip.vision.{name}", 1, limit) for name, limit in LIMITS.items()}
        image_size, patch_size, width, heads = (
            size["image_size"],
            size["patch_size"],
            size["embedding_length"],
            size["attention.head_count"],
        )
        if image_size < patch_size:
            raise ModelLoadError(f"clip.vision.image_size {image_size} is less than clip.vision.patch_size {patch_size}")
        if (image_size // patch_size) ** 2 > MAX_PATCHES:
            raise ModelLoadError(f"clip.vision.image_size {image_size} over patch_size {patch_size} makes more than {MAX_PATCHES} patches")
        if width % heads:
            raise ModelLoadError(f"clip.vision.attention.head_count {heads} does not divide clip.vision.embedding_length {width}")
        (eps,) = self.floats("clip.vision.attention.layer_norm_epsilon")
        if not 0 < eps < 1:
            raise ModelLoadError(f"clip.vision.attention.layer_norm_epsilon is {eps}, outside (0, 1)")
        std = self.floats("clip.vision.image_std", 3)
        if not all(s > 0 for s in std):
            raise ModelLoadError(f"clip.vision.image_std {std} is not positive")
        return VisionHparams(
            image_size=image_size,
            patch_size=patch_size,
            width=width,
            ffn=size["feed_forward_length"],
            layers=size["block_count"],
            heads=heads,
            eps=eps,
            image_mean=self.floats("clip.vision.image_mean", 3),
            image_std=std,
        )

    def tensor(self, name: str, shape: tuple[int | None, ...], as_stored: bool = False) -> np.ndarray | HostBlocks:
        """The tensor as a float32 array of NumPy shape `shape` (the file's dimensions, last first);
        a None there takes the file's size, which must lie in [1, 1 << 20]. `as_stored`: an F16
        matrix stays float16 and a quantized one in its blocks (`HostBlocks`) where the CPU kernels
        multiply its type: the same values in a fraction of the memory."""
        stored = self._tensors.get(name)
        if stored is None:
            raise ModelLoadError(f"tensor {name} is missing")
        actual = tuple(int(d) for d in stored.shape)  # read_gguf's: the file's dimensions, last first
        if len(actual) != len(shape) or any(want is not None and want != got for want, got in zip(shape, actual)):
            raise ModelLoadError(f"tensor {name} has shape {actual}, expected {tuple('any' if d is None else d for d in shape)}")
        if any(not 1 <= got <= 1 << 20 for want, got in zip(shape, actual) if want is None):
            raise ModelLoadError(f"tensor {name} has shape {actual}, a size outside [1, {1 << 20}]")
        try:
            values = float_values(self.path, name, stored)  # every value checked finite, whatever is kept
        except ValueError as err:
            raise ModelLoadError(str(err)) from err
        type_name, block_values, _ = GGML_TYPES[stored.ggml_type]
        if as_stored and type_name == "F16":
            return values.astype(np.float16)
        if as_stored and len(actual) == 2 and block_values > 1 and stored.data is not None:  # read_gguf's rows of a kernel's blocks
            return HostBlocks(np.array(stored.data), stored.ggml_type, stored.cols)
        return values
