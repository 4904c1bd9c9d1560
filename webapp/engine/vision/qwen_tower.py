"""The vision tower Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 share, in float32 NumPy: images at
their own resolution, 2-D rotary positions, window attention where a family has it.

Contract: a `QwenVisionTower` is made by a family's projector (qwen2vl.py, qwen3vl.py) from its
file's tensors; `forward_slices(pixels, place, positions)` maps (3, H, W) pixels to the patches'
(patches, width) features after the final norm, in `place`'s order (`layout`), and each deepstack
layer's merged features, yielding between slices of about SLICE_FLOPS as the SigLIP encoder does.

Each patch's embedding is the sum of the Conv3D's two temporal halves (a still image is both
frames) plus the family's bias and learned positions (Qwen3-VL); the patches are grouped so that
each 2 x 2 block of them (one merged token) is four rows in a row, and those groups by window
(`window` merged tokens a side, the windows row-major, their tokens row-major inside). The layers
are pre-norm (RMS norms where a layer's norms have no bias, LayerNorms otherwise): attention with
biased q, k and v, q and k turned by the 2-D rotary (a head's first quarter of pairs by the patch's
row, the second by its column, each quarter's frequencies from the start, halves paired as in
NeoX); every `full_every`-th layer attends over every patch, the others within their window
(0: every layer everything); then the feed-forward: SwiGLU where a layer has a gate, else
`activation` (gelu_quick or gelu) between up and down. After a deepstack layer its output, each
merged token's four rows side by side, goes through that layer's `Merger`. Products and attention
(a head and a window, or a block of queries, at a time) run on the CPU kernels' cores where the
model runs on them, else in NumPy, as SigLIP's do (siglip.py).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np

from webapp.engine.kernels.host_blocks import stacked
from webapp.engine.vision.projector_file import ProjectorFile, VisionHparams
from webapp.engine.vision.siglip import SLICE_FLOPS, attention_rows, gelu_tanh, layer_norm, product, row_blocks, widened

MERGE = 2  # a merged token is MERGE x MERGE patches
ROPE_BASE = 10000.0
GELU_QUICK = 1.702


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    out = x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)))
    out *= weight
    return out


def norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float) -> np.ndarray:
    """RMS norm where there is no bias, LayerNorm where there is one."""
    return rms_norm(x, weight, eps) if bias is None else layer_norm(x, weight, bias, eps)


@dataclass(frozen=True)
class TowerLayer:
    """One block's tensors: matrices (out, in), float16 where the file's are, q, k and v as one
    product (their rows one under another) and a SwiGLU's gate over its up, one product each (one
    BLAS call a slice rather than three or two: a slice's few hundred rows multiply faster so);
    norms' biases None where the family has none."""

    ln1_weight: np.ndarray
    ln1_bias: np.ndarray | None
    qkv_weight: np.ndarray
    qkv_bias: np.ndarray
    out_weight: np.ndarray
    out_bias: np.ndarray
    ln2_weight: np.ndarray
    ln2_bias: np.ndarray | None
    up_weight: np.ndarray  # (2 ffn, width), the gate's rows first, where the layer is gated; else (ffn, width)
    up_bias: np.ndarray
    down_weight: np.ndarray
    down_bias: np.ndarray

    @classmethod
    def from_file(cls, file: ProjectorFile, index: int, *, rms: bool, gated: bool, fused_qkv: bool) -> TowerLayer:
        """Layer `index`: RMS norms (no biases) or LayerNorms, a SwiGLU gate or none, q/k/v as one
        `attn_qkv` (q, k, v in that order) or apart."""
        width, ffn, p = file.hparams.width, file.hparams.ffn, f"v.blk.{index}."

        def product(names: tuple[str, ...], rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
            weights = [file.tensor(f"{p}{name}.weight", (rows, cols), as_stored=True) for name in names]
            biases = [file.tensor(f"{p}{name}.bias", (rows,)) for name in names]
            return (weights[0], biases[0]) if len(names) == 1 else (stacked(weights), np.concatenate(biases))

        arrays = {}
        for name in ("ln1", "ln2"):
            arrays[f"{name}_weight"] = file.tensor(f"{p}{name}.weight", (width,))
            arrays[f"{name}_bias"] = None if rms else file.tensor(f"{p}{name}.bias", (width,))
        qkv = product(("attn_qkv",), 3 * width, width) if fused_qkv else product(("attn_q", "attn_k", "attn_v"), width, width)
        arrays["qkv_weight"], arrays["qkv_bias"] = qkv
        arrays["out_weight"], arrays["out_bias"] = product(("attn_out",), width, width)
        arrays["up_weight"], arrays["up_bias"] = product(("ffn_gate", "ffn_up") if gated else ("ffn_up",), ffn, width)
        arrays["down_weight"], arrays["down_bias"] = product(("ffn_down",), width, ffn)
        return cls(**file.kept(arrays))

    @property
    def gated(self) -> bool:
        return self.up_weight.shape[0] == 2 * self.down_weight.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if a is not None)

    def widened(self, kernels=None) -> TowerLayer:
        return widened(self, kernels)


@dataclass(frozen=True)
class Merger:
    """A merged token's four patch rows side by side -> fc2(gelu(fc1(norm(row)))), the norm a
    LayerNorm over the four rows' values where the merger has one (Qwen3-VL's deepstack)."""

    fc1_weight: np.ndarray
    fc1_bias: np.ndarray
    fc2_weight: np.ndarray
    fc2_bias: np.ndarray
    norm_weight: np.ndarray | None = None
    norm_bias: np.ndarray | None = None

    @classmethod
    def from_file(cls, file: ProjectorFile, fc1: str, fc2: str, norm_name: str | None = None) -> Merger:
        width4 = file.hparams.width * MERGE * MERGE
        fc1_weight, fc2_weight = (
            file.tensor(f"{fc1}.weight", (width4, width4), as_stored=True),
            file.tensor(f"{fc2}.weight", (None, width4), as_stored=True),
        )
        arrays = {"fc1_weight": fc1_weight, "fc1_bias": file.tensor(f"{fc1}.bias", (width4,)), "fc2_weight": fc2_weight}
        arrays["fc2_bias"] = file.tensor(f"{fc2}.bias", (fc2_weight.shape[0],))
        if norm_name:
            arrays |= {
                "norm_weight": file.tensor(f"{norm_name}.weight", (width4,)),
                "norm_bias": file.tensor(f"{norm_name}.bias", (width4,)),
            }
        return cls(**file.kept(arrays))

    @property
    def out_dim(self) -> int:
        return self.fc2_weight.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if a is not None)

    def project(self, merged: np.ndarray, eps: float, kernels=None) -> np.ndarray:
        """(tokens, 4 width) -> (tokens, out_dim)."""
        if self.norm_weight is not None:
            merged = layer_norm(merged, self.norm_weight, self.norm_bias, eps)
        layer = widened(self, kernels)
        gelu = gelu_tanh if kernels is None else kernels.gelu_tanh
        hidden = gelu(np.ascontiguousarray(product(kernels, merged, layer.fc1_weight, layer.fc1_bias)))
        return product(kernels, hidden, layer.fc2_weight, layer.fc2_bias)


@dataclass(frozen=True)
class Layout:
    """Where an image's patches go: the merged tokens' order in the tower (windows grouped), each
    patch's (row, col) in that order, and the windows as runs of patches."""

    order: np.ndarray  # (tokens,) the row-major merged token at each place in the tower
    rows: np.ndarray  # (patches,) each patch's row, in the tower's order
    cols: np.ndarray
    windows: tuple[tuple[int, int], ...]  # (first patch, end) runs a windowed layer attends within


def layout(grid_rows: int, grid_cols: int, window: int) -> Layout:
    """The tower's order for a (grid_rows, grid_cols) merged grid, windows of `window` tokens a side
    (0: one window, the whole image)."""
    side = window or max(grid_rows, grid_cols)
    order, windows = [], []
    for top in range(0, grid_rows, side):
        for left in range(0, grid_cols, side):
            first = len(order) * MERGE * MERGE
            order += [r * grid_cols + c for r in range(top, min(top + side, grid_rows)) for c in range(left, min(left + side, grid_cols))]
            windows.append((first, len(order) * MERGE * MERGE))
    order = np.asarray(order, dtype=np.int64)
    dy, dx = np.divmod(np.arange(MERGE * MERGE), MERGE)  # a merged token's patches, row-major
    rows = ((order // grid_cols)[:, None] * MERGE + dy).reshape(-1)
    cols = ((order % grid_cols)[:, None] * MERGE + dx).reshape(-1)
    return Layout(order, rows, cols, tuple(windows))


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """(n, heads, d) turned in halves: value k with value k + d/2 by angle k ((n, 1, d/2) cos and sin)."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


class QwenVisionTower:
    """The patch embedding, the layers, the final norm and the deepstack mergers; `kernels` as
    SiglipEncoder's."""

    def __init__(self, hparams: VisionHparams, patch_weights, layers: list[TowerLayer], post_norm, *, window: int = 0, full_every: int = 0):
        self.hparams = hparams
        self.patch_weight = patch_weights[0] + patch_weights[1]  # (width, 3 * p * p): both frames see one picture
        self.patch_bias: np.ndarray | None = None  # (width,), Qwen3-VL's
        self.layers, (self.post_weight, self.post_bias) = layers, post_norm
        self.window, self.full_every = window, full_every  # merged tokens a window side, and every n-th layer full (0: all full)
        self.activation = "gelu_quick"  # between up and down where a layer has no gate: "gelu_quick" or "gelu"
        self.deepstack: dict[int, Merger] = {}  # layer index -> its merger (Qwen3-VL)
        self.slice_flops = SLICE_FLOPS  # as SiglipEncoder's
        self.kernels = None

    @property
    def nbytes(self) -> int:
        own = [self.patch_weight, self.patch_bias, self.post_weight, self.post_bias]
        return sum(a.nbytes for a in own if a is not None) + sum(m.nbytes for m in [*self.layers, *self.deepstack.values()])

    def forward_slices(
        self, pixels: np.ndarray, place: Layout, positions: np.ndarray | None = None, slice_flops: float | None = None
    ) -> Generator[None, None, tuple[np.ndarray, list[np.ndarray]]]:
        """(3, H, W) pixels -> (patches, width) features in `place`'s order, and each deepstack
        layer's (tokens, its merger's out_dim) in that order too; `positions` (H/p * W/p, width): the
        learned position embedding at each patch, row-major, or None."""
        h, p, eps = self.hparams, self.hparams.patch_size, self.hparams.eps

        def budget() -> float:  # SiglipEncoder.forward_slices' budget
            return self.slice_flops if slice_flops is None else slice_flops

        grid_h, grid_w = pixels.shape[1] // p, pixels.shape[2] // p
        patches = pixels.reshape(3, grid_h, p, grid_w, p).transpose(1, 3, 0, 2, 4).reshape(grid_h * grid_w, 3 * p * p)
        at = place.rows * grid_w + place.cols  # each of the tower's patches, row-major
        x = product(self.kernels, patches[at], self.patch_weight, None)  # (n, width)
        if self.patch_bias is not None:
            x += self.patch_bias
        if positions is not None:
            x += positions[at]
        n, heads, head_dim = x.shape[0], h.heads, h.head_dim
        frequencies = ROPE_BASE ** (-4.0 * np.arange(head_dim // 4) / head_dim)
        angles = np.concatenate([place.rows[:, None] * frequencies, place.cols[:, None] * frequencies], axis=1)
        cos, sin = (f(angles).astype(np.float32)[:, None, :] for f in (np.cos, np.sin))
        everything, deep = ((0, n),), []
        yield
        for index, stored in enumerate(self.layers):
            layer = stored.widened(self.kernels)
            full = not self.full_every or (index + 1) % self.full_every == 0
            normed = norm(x, layer.ln1_weight, layer.ln1_bias, eps)
            qkv = np.empty((n, 3 * h.width), dtype=np.float32)
            for rows in row_blocks(n, 6 * h.width * h.width, budget()):
                product(self.kernels, normed[rows], layer.qkv_weight, layer.qkv_bias, qkv[rows])
                yield
            q, k, v = np.split(qkv, 3, axis=1)
            q, k = (rotate(y.reshape(n, heads, head_dim), cos, sin) for y in (q, k))
            q *= np.float32(1.0 / math.sqrt(head_dim))
            q, k, v = (np.ascontiguousarray(y.reshape(n, heads, head_dim).transpose(1, 0, 2)) for y in (q, k, v))
            mixed = np.empty((n, heads, head_dim), dtype=np.float32)
            yield from self._attend(q, k, v, mixed, everything if full else place.windows, budget)
            mixed = mixed.reshape(n, h.width)
            for rows in row_blocks(n, 2 * h.width * h.width, budget()):
                product(self.kernels, mixed[rows], layer.out_weight, layer.out_bias, x[rows], add=True)
                yield
            normed = norm(x, layer.ln2_weight, layer.ln2_bias, eps)
            for rows in row_blocks(n, 2 * (h.width * layer.up_weight.shape[0] + h.width * h.ffn), budget()):
                product(self.kernels, self._activated(normed[rows], layer), layer.down_weight, layer.down_bias, x[rows], add=True)
                yield
            if index in self.deepstack:
                deep.append(self.deepstack[index].project(x.reshape(n // (MERGE * MERGE), -1), eps, self.kernels))
                yield
        return norm(x, self.post_weight, self.post_bias, eps), deep

    def _activated(self, rows: np.ndarray, layer: TowerLayer) -> np.ndarray:
        up = product(self.kernels, rows, layer.up_weight, layer.up_bias)
        if layer.gated:
            gate, up = np.split(up, 2, axis=1)
            up *= gate / (1.0 + np.exp(-gate))  # silu(gate) * up
            return up
        if self.activation == "gelu":
            return gelu_tanh(np.ascontiguousarray(up)) if self.kernels is None else self.kernels.gelu_tanh(np.ascontiguousarray(up))
        up *= 1.0 / (1.0 + np.exp(np.float32(-GELU_QUICK) * up))  # gelu_quick
        return up

    def _attend(self, q, k, v, mixed, windows, budget) -> Generator[None, None, None]:
        """Each head's attention within each of `windows` (runs of patches), a slice's work at a time."""
        on_kernels = self.kernels is not None and self.kernels.runs_attention(q.shape[2])
        work = 0.0
        for head in range(q.shape[0]):
            for first, end in windows:
                keys = end - first
                kt = np.ascontiguousarray(k[head, first:end].T) if on_kernels else None
                for rows in row_blocks(keys, 4 * keys * q.shape[2], budget()):
                    block = slice(first + rows.start, first + rows.stop)
                    if on_kernels:
                        self.kernels.attention(q[head, block], kt, v[head, first:end], mixed[block, head])
                    else:
                        mixed[block, head] = attention_rows(q[head, block], k[head, first:end], v[head, first:end])
                    work += 4.0 * (rows.stop - rows.start) * keys * q.shape[2]
                    if work >= budget():
                        work = 0.0
                        yield
