"""Qwen2-VL's and Qwen2.5-VL's vision tower and merger (`clip.projector_type` "qwen2vl_merger",
"qwen2.5vl_merger"): images at their own resolution, 2-D rotary positions, window attention.

Contract: `QwenVLProjector.from_file(file)` reads the tower (names as llama.cpp's converter writes
them: the Conv3D patch kernel split in its two temporal halves `v.patch_embd.weight` and
`.weight.1`, `v.blk.{i}.*` with q, k and v apart, `v.post_ln`, the merger's `mm.0` and `mm.2`) and
refuses what does not fit, naming it. It is a projector as projector.py's `Projector` is one:
`pieces(rgb)` is the image between "<|vision_start|>" and "<|vision_end|>", resized so that each
side is whole merged tokens (2 x 2 patches) and the area lies between the file's least and most
tokens (`target_size`, the "smart resize" Qwen's processor and llama.cpp share, bicubic);
`tokens(pixels)` and `grid(pixels)` say how many rows it becomes and in what (rows, cols) grid,
which the language model's M-RoPE positions follow; `encode(pixels)` gives those rows, row-major.

The tower is qwen_tower.py's: Qwen2.5-VL's with RMS norms, SwiGLU and window attention in all
but every `clip.vision.n_wa_pattern`-th layer (windows of `clip.vision.window_size` pixels,
112 where the file does not say), Qwen2-VL's with LayerNorms, gelu_quick and no windows. After the
final norm each merged token's four patch rows are one row, projected by mm.2(gelu(mm.0(row))) and
put back in row-major order; `encode_slices` yields between slices of the encode.
"""

from __future__ import annotations

import math
from collections.abc import Generator

import numpy as np
from PIL import Image

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.vision.images import ImageError
from webapp.engine.vision.projector_file import MAX_PATCHES, ProjectorFile
from webapp.engine.vision.qwen_tower import MERGE, Merger, QwenVisionTower, TowerLayer, layout
from webapp.engine.vision.siglip import run_to_end, scaled_pixels

DEFAULT_WINDOW_PIXELS = 112  # Qwen2.5-VL's window, where a file does not say
TOKEN_RANGE = (8, 4096)  # the least and most merged tokens an image becomes, where a file does not say (llama.cpp's)


def target_size(height: int, width: int, align: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to whole `align`s, scaled down or up, aspect kept, where its area is
    past `max_pixels` or short of `min_pixels` (float32 arithmetic, as llama.cpp's)."""
    f32 = np.float32
    h_bar = max(align, int(math.floor(f32(height) / f32(align) + f32(0.5))) * align)
    w_bar = max(align, int(math.floor(f32(width) / f32(align) + f32(0.5))) * align)
    if h_bar * w_bar > max_pixels:
        beta = np.sqrt(f32(height) * f32(width) / f32(max_pixels), dtype=f32)
        h_bar = max(align, int(math.floor(f32(height) / beta / f32(align))) * align)
        w_bar = max(align, int(math.floor(f32(width) / beta / f32(align))) * align)
    elif h_bar * w_bar < min_pixels:
        beta = np.sqrt(f32(min_pixels) / (f32(height) * f32(width)), dtype=f32)
        h_bar = int(math.ceil(f32(height) * beta / f32(align))) * align
        w_bar = int(math.ceil(f32(width) * beta / f32(align))) * align
    return h_bar, w_bar


class QwenVLProjector:
    """The tower and the merger; see the module's docstring. A family with more (qwen3vl.py) reads
    its file its own way and hands the tower the learned positions an image's grid takes."""

    both_ways = False  # the language model reads an image's rows causally, as text
    deepstack = 0  # rows of deepstack features after each token's own (qwen3vl.py's)
    before, after = "<|vision_start|>", "<|vision_end|>"

    def __init__(self, family: str, encoder: QwenVisionTower, merger: Merger, token_range: tuple[int, int]):
        self.family, self.encoder, self.merger, self.token_range = family, encoder, merger, token_range

    @classmethod
    def from_file(cls, file: ProjectorFile) -> QwenVLProjector:
        h, family = file.hparams, file.projector_type
        windowed = family == "qwen2.5vl_merger"
        window = full_every = 0
        if windowed:
            full_every = file.uint("clip.vision.n_wa_pattern", 0, 1 << 16)  # 0: every layer attends everything; past the layers: none
            pixels = (
                file.uint("clip.vision.window_size", MERGE * h.patch_size) if file.has("clip.vision.window_size") else DEFAULT_WINDOW_PIXELS
            )
            window = pixels // (MERGE * h.patch_size) if full_every else 0
        layers = [TowerLayer.from_file(file, i, rms=windowed, gated=windowed, fused_qkv=False) for i in range(h.layers)]
        post = (file.tensor("v.post_ln.weight", (h.width,)), None if windowed else file.tensor("v.post_ln.bias", (h.width,)))
        tower = QwenVisionTower(h, patch_kernels(file), layers, post, window=window, full_every=full_every)
        return cls(family, tower, Merger.from_file(file, "mm.0", "mm.2"), token_range(file))

    def limit_tokens(self, least: int | None, most: int | None) -> tuple[int, int]:
        """The least and most positions an image becomes, from now on (None: as they are), within
        what the tower takes (MAX_PATCHES' patches): the range kept."""
        cap = MAX_PATCHES // (MERGE * MERGE)
        most = min(cap, most or self.token_range[1])
        least = min(most, least or self.token_range[0])
        self.token_range = (least, most)
        return self.token_range

    @property
    def text_dim(self) -> int:
        return self.merger.out_dim

    @property
    def nbytes(self) -> int:
        return self.encoder.nbytes + self.merger.nbytes

    def preprocess(self, rgb: np.ndarray) -> np.ndarray:
        """RGB uint8 (H, W, 3) -> (3, H', W') float32, both sides whole merged tokens."""
        h = self.encoder.hparams
        align = MERGE * h.patch_size
        least, most = (tokens * align * align for tokens in self.token_range)
        height, width = target_size(rgb.shape[0], rgb.shape[1], align, least, most)
        # a strip holds one side at a token while the other scales: past the most, as llama.cpp lets
        # it, but not past what the tower takes
        tokens, cap = height * width // (align * align), MAX_PATCHES // (MERGE * MERGE)
        if tokens > cap:
            size = f"{rgb.shape[1]}x{rgb.shape[0]}"
            raise ImageError(f"the image is {size} pixels: so narrow a strip takes {tokens} positions, more than the {cap} an image may")
        resized = Image.fromarray(np.ascontiguousarray(rgb)).resize((width, height), resample=Image.Resampling.BICUBIC)
        return scaled_pixels(np.asarray(resized), h)

    def pieces(self, rgb: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        return [(self.before, self.preprocess(rgb), self.after)]

    def grid(self, pixels: np.ndarray) -> tuple[int, int]:
        """The image's merged tokens as (rows, cols): the rows `encode` gives, row-major."""
        side = MERGE * self.encoder.hparams.patch_size
        return pixels.shape[1] // side, pixels.shape[2] // side

    def tokens(self, pixels: np.ndarray) -> int:
        rows, cols = self.grid(pixels)
        return rows * cols

    def positions(self, grid_rows: int, grid_cols: int) -> np.ndarray | None:
        """The learned position embedding at each patch of the grid (row-major), where the family has one."""
        return None

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        return run_to_end(self.encode_slices(pixels))

    def encode_slices(self, pixels: np.ndarray) -> Generator[None, None, np.ndarray]:
        """(3, H, W) -> (tokens, text_dim) rows, row-major (Qwen3-VL: each deepstack layer's after them, side by side)."""
        pixels = np.asarray(pixels, dtype=np.float32)
        side, eps = MERGE * self.encoder.hparams.patch_size, self.encoder.hparams.eps
        if pixels.ndim != 3 or pixels.shape[0] != 3 or pixels.shape[1] % side or pixels.shape[2] % side or 0 in pixels.shape:
            raise ValueError(f"pixels must be (3, H, W) with H and W multiples of {side}, not {pixels.shape}")
        rows, cols = self.grid(pixels)
        place = layout(rows, cols, self.encoder.window)
        features, deep = yield from self.encoder.forward_slices(pixels, place, self.positions(rows * MERGE, cols * MERGE))
        main = self.merger.project(features.reshape(rows * cols, -1), eps, self.encoder.kernels)  # a token's four patches side by side
        projected = np.concatenate([main, *deep], axis=1) if deep else main
        out = np.empty_like(projected)
        out[place.order] = projected  # back to row-major
        return out


def patch_kernels(file: ProjectorFile) -> tuple[np.ndarray, np.ndarray]:
    """The Conv3D's two temporal halves, each (width, 3 * p * p)."""
    h = file.hparams
    if h.head_dim % 4:
        raise ModelLoadError(f"clip.vision heads of {h.head_dim} values: the 2-D rotary needs a multiple of 4")
    if file.has("clip.vision.spatial_merge_size") and file.uint("clip.vision.spatial_merge_size") != MERGE:
        raise ModelLoadError(f"clip.vision.spatial_merge_size is not {MERGE}: only 2 x 2 merges are supported")
    names = ("v.patch_embd.weight", "v.patch_embd.weight.1")
    return tuple(file.tensor(name, (h.width, 3, h.patch_size, h.patch_size)).reshape(h.width, -1) for name in names)


def token_range(file: ProjectorFile) -> tuple[int, int]:
    """The least and most merged tokens an image becomes: the file's pixels where it says, else
    TOKEN_RANGE, never past MAX_PATCHES' patches."""
    h = file.hparams
    most, area = MAX_PATCHES // (MERGE * MERGE), (MERGE * h.patch_size) ** 2
    bounds = [
        file.uint(f"clip.vision.image_{k}_pixels") // area if file.has(f"clip.vision.image_{k}_pixels") else d
        for k, d in zip(("min", "max"), TOKEN_RANGE, strict=True)
    ]
    least, most = max(1, min(bounds[0], most)), max(1, min(bounds[1], most))
    if least > most:
        raise ModelLoadError(f"clip.vision.image_min_pixels is more than image_max_pixels ({least} > {most} tokens)")
    return least, most
