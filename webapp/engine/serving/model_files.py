"""A folder's model files as the model set lists them (serving/model_set.py).

Contract: `model_file(path)` is a GGUF's `ModelFile` (its name without `.gguf`, its size with the
projector found beside it, whose memory counts too, and its modification time, which tells a file
replaced since it failed); `projector_beside(path)` finds that projector by name
(NAME.mmproj.gguf or mmproj-NAME.gguf); `is_projector(name)` says a file is one, never listed as a
model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SUFFIX = ".gguf"


@dataclass(frozen=True)
class ModelFile:
    name: str
    path: str
    size: int
    mtime: float


def model_file(path: str) -> ModelFile:
    """The file at `path` as the listing shows it: its size counts the projector loaded beside it."""
    stat = os.stat(path)
    projector = projector_beside(path)  # loaded with it: its memory counts too
    size = stat.st_size + (os.path.getsize(projector) if projector else 0)
    return ModelFile(os.path.basename(path).removesuffix(SUFFIX), path, size, stat.st_mtime)


def projector_beside(path: str) -> str | None:
    """A model's projector file, found beside it by name: NAME.mmproj.gguf or mmproj-NAME.gguf."""
    folder, name = os.path.split(path)
    stem = name.removesuffix(SUFFIX)
    found = (os.path.join(folder, c) for c in (f"{stem}.mmproj{SUFFIX}", f"mmproj-{stem}{SUFFIX}"))
    return next((c for c in found if os.path.isfile(c)), None)


def is_projector(name: str) -> bool:
    return name.endswith(f".mmproj{SUFFIX}") or name.startswith("mmproj-")
