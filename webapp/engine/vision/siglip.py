"""The SigLIP vision transformer of llama.cpp's projector files, in float32 NumPy.

Contract: `SiglipEncoder.from_file(file)` reads the encoder's tensors (names as llama.cpp's mtmd
writes them: `v.patch_embd`, `v.position_embd`, `v.blk.{i}.*`, `v.post_ln`) checked against the
file's hyperparameters; `forward(pixels)` maps one normalized (3, S, S) image to its patches'
(n_patches, width) features, patches in row-major order over the grid. `normalized_pixels` is the
encoder's input convention (resize to S x S, scale to [0, 1], subtract the mean, divide by the
std), the resampling filter left to the family, as each model was trained with its own.

The layers are pre-norm: x + attention(ln1(x)), then x + ffn_down(gelu(ffn_up(ln2(x)))), the
attention bidirectional over every patch, gelu the tanh approximation ggml's gelu computes. Where
`kernels` is set (the served model runs on the CPU kernels), everything heavy runs on their cores:
the products read each matrix in the file's type (`product`), attention runs a head, and a block of
its queries, at a time in one pass over the keys, and the gelu too. Else all is NumPy: the products
BLAS's on a layer's matrices widened to float32 as the encode reaches it, the attention no more
than one block of (queries x patches) scores alive at once.
`forward_slices` yields between such blocks of work: how the model thread interleaves an encode
with other requests' steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from webapp.engine.kernels.host_blocks import HostBlocks
from webapp.engine.vision.projector_file import ProjectorFile, VisionHparams

# the work of one slice of a sliced encode (`forward_slices`): tens of milliseconds on a small CPU,
# about one decode step of a small model
SLICE_FLOPS = 2e9
GELU_CUBIC = 0.044715
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def normalized_pixels(rgb: np.ndarray, resample: Image.Resampling, hparams: VisionHparams) -> np.ndarray:
    """An RGB uint8 (H, W, 3) image resized to S x S (S = image_size, aspect ratio not kept) with
    `resample`, scaled to [0, 1] and normalized with the file's mean and std: (3, S, S) float32."""
    if not isinstance(rgb, np.ndarray) or rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or 0 in rgb.shape:
        raise ValueError(
            f"an image must be an RGB uint8 (H, W, 3) array, not {getattr(rgb, 'dtype', type(rgb))} {getattr(rgb, 'shape', '')}"
        )
    size = hparams.image_size
    return scaled_pixels(np.asarray(Image.fromarray(np.ascontiguousarray(rgb)).resize((size, size), resample=resample)), hparams)


def scaled_pixels(rgb: np.ndarray, hparams: VisionHparams) -> np.ndarray:
    """A resized RGB uint8 (H, W, 3) image scaled to [0, 1] and normalized with the file's mean and
    std: (3, H, W) float32."""
    pixels = np.asarray(rgb, dtype=np.float32) / np.float32(255.0)
    pixels -= np.asarray(hparams.image_mean, dtype=np.float32)
    pixels /= np.asarray(hparams.image_std, dtype=np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    centered = x - x.mean(axis=-1, keepdims=True)
    variance = np.mean(centered * centered, axis=-1, keepdims=True)
    centered *= 1.0 / np.sqrt(variance + np.float32(eps))
    centered *= weight
    centered += bias
    return centered


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), overwriting x: the feed-forward's widest buffer."""
    inner = x * x
    inner *= np.float32(GELU_CUBIC)
    inner += 1.0
    inner *= x
    inner *= np.float32(SQRT_2_OVER_PI)
    np.tanh(inner, out=inner)
    inner += 1.0
    inner *= 0.5
    x *= inner
    return x


def product(
    kernels, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None = None, add: bool = False
) -> np.ndarray:
    """x @ weight.T + bias, into `out` (added to what it holds where `add`) or a new array: on the
    CPU kernels' cores where `kernels` is set, the weight read as it is stored (float16, float32 or
    quantized blocks, kernels/vision_encoder.py), else NumPy's BLAS (the weight widened first: `widened`)."""
    if kernels is not None:
        return kernels.linear(x, weight, bias, out, add)
    y = x @ weight.T  # weight (out, in) as the file stores it: BLAS reads the transpose in place
    if bias is not None:
        y += bias
    if out is None:
        return y
    if add:
        out += y
    else:
        out[...] = y
    return out


@dataclass(frozen=True)
class EncoderLayer:
    """One pre-norm transformer block's tensors; matrices (out, in), float16 where the file's are,
    biases and norms (out,) float32."""

    ln1_weight: np.ndarray
    ln1_bias: np.ndarray
    q_weight: np.ndarray
    q_bias: np.ndarray
    k_weight: np.ndarray
    k_bias: np.ndarray
    v_weight: np.ndarray
    v_bias: np.ndarray
    out_weight: np.ndarray
    out_bias: np.ndarray
    ln2_weight: np.ndarray
    ln2_bias: np.ndarray
    up_weight: np.ndarray
    up_bias: np.ndarray
    down_weight: np.ndarray
    down_bias: np.ndarray

    @classmethod
    def from_file(cls, file: ProjectorFile, index: int) -> EncoderLayer:
        width, ffn = file.hparams.width, file.hparams.ffn
        prefix = f"v.blk.{index}."
        # the file's name -> (this class's field, the weight's shape); every bias is as long as its weight's first axis
        parts = {"ln1": ("ln1", (width,)), "attn_q": ("q", (width, width)), "attn_k": ("k", (width, width))}
        parts |= {"attn_v": ("v", (width, width)), "attn_out": ("out", (width, width)), "ln2": ("ln2", (width,))}
        parts |= {"ffn_up": ("up", (ffn, width)), "ffn_down": ("down", (width, ffn))}
        arrays = {}
        for name, (field, shape) in parts.items():
            arrays[f"{field}_weight"] = file.tensor(f"{prefix}{name}.weight", shape, as_stored=len(shape) == 2)
            arrays[f"{field}_bias"] = file.tensor(f"{prefix}{name}.bias", shape[:1])
        return cls(**file.kept(arrays))

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in vars(self).values())

    def widened(self, kernels=None) -> EncoderLayer:
        return widened(self, kernels)


def widened(layer, kernels=None):
    """A layer's dataclass as `product` multiplies by it: where `kernels` is given, as it is (they
    read float16 and quantized blocks); else with those matrices (an F16 or quantized file's, kept
    so) as float32, what BLAS multiplies, made as an encode reaches the layer, so one layer's float32
    copy lives at a time."""
    if kernels is not None:
        return layer
    kept = {
        name: array for name, array in vars(layer).items() if isinstance(array, HostBlocks) or getattr(array, "dtype", None) == np.float16
    }
    wide = {name: array.floats() if isinstance(array, HostBlocks) else array.astype(np.float32) for name, array in kept.items()}
    return dataclasses.replace(layer, **wide) if wide else layer


class SiglipEncoder:
    """Patch embedding, learned positions, `layers` pre-norm blocks and a final LayerNorm."""

    def __init__(
        self,
        hparams: VisionHparams,
        patch_weight: np.ndarray,
        patch_bias: np.ndarray,
        position: np.ndarray,
        layers: list[EncoderLayer],
        post_weight: np.ndarray,
        post_bias: np.ndarray,
    ):
        self.hparams = hparams
        self.patch_weight = patch_weight  # (width, 3 * patch * patch): the conv's kernel, one row per output channel
        self.patch_bias = patch_bias  # (width,)
        self.position = position  # (n_patches, width)
        self.layers = layers
        self.post_weight = post_weight  # (width,)
        self.post_bias = post_bias  # (width,)
        self.slice_flops = SLICE_FLOPS  # a slice's work, which the model thread raises while no step waits on it
        # attention and gelu on the CPU kernels' cores (kernels/vision_encoder.py), set where the
        # served model runs on them; None: in NumPy (attention a head and a block of queries at a time)
        self.kernels = None

    @classmethod
    def from_file(cls, file: ProjectorFile) -> SiglipEncoder:
        h = file.hparams
        kernel = file.tensor("v.patch_embd.weight", (h.width, 3, h.patch_size, h.patch_size))
        return cls(
            hparams=h,
            patch_weight=kernel.reshape(h.width, 3 * h.patch_size * h.patch_size),
            patch_bias=file.tensor("v.patch_embd.bias", (h.width,)),
            position=file.tensor("v.position_embd.weight", (h.n_patches, h.width)),
            layers=[EncoderLayer.from_file(file, i) for i in range(h.layers)],
            post_weight=file.tensor("v.post_ln.weight", (h.width,)),
            post_bias=file.tensor("v.post_ln.bias", (h.width,)),
        )

    @property
    def nbytes(self) -> int:
        arrays = (self.patch_weight, self.patch_bias, self.position, self.post_weight, self.post_bias)
        return sum(a.nbytes for a in arrays) + sum(layer.nbytes for layer in self.layers)

    def forward(self, pixels: np.ndarray) -> np.ndarray:
        """(3, S, S) float32 normalized pixels -> (n_patches, width) float32 features."""
        return run_to_end(self.forward_slices(pixels))

    def forward_slices(self, pixels: np.ndarray, slice_flops: float | None = None) -> Generator[None, None, np.ndarray]:
        """`forward` as a generator that yields after each slice of about `slice_flops` (None: the
        encoder's `slice_flops` as each slice is cut) of work (rows
        of a product, queries of a head) and returns the features: the model thread runs a slice
        between other requests' steps, so a long encode never holds them up for longer than that."""
        h = self.hparams

        def budget() -> float:  # read as each block of work is cut: the model thread may change it meanwhile
            return self.slice_flops if slice_flops is None else slice_flops

        side, patch = h.grid_side, h.patch_size
        pixels = np.asarray(pixels, dtype=np.float32)
        if pixels.shape != (3, h.image_size, h.image_size):
            raise ValueError(f"pixels must have shape (3, {h.image_size}, {h.image_size}), not {pixels.shape}")
        # a stride-`patch` convolution is one product over the flattened patches; pixels past the last
        # whole patch are no patch's (SmolVLM's 384-pixel input in 14-pixel patches)
        cropped = side * patch
        patches = pixels[:, :cropped, :cropped].reshape(3, side, patch, side, patch).transpose(1, 3, 0, 2, 4)  # (row, col, channel, dy, dx)
        patches = patches.reshape(side * side, 3 * patch * patch)  # (n_patches, 3 * patch * patch)
        x = product(self.kernels, patches, self.patch_weight, self.patch_bias)  # (n_patches, width)
        x += self.position
        yield
        n, width, heads, head_dim = x.shape[0], h.width, h.heads, h.head_dim
        for stored in self.layers:
            layer = stored.widened(self.kernels)
            normed = layer_norm(x, layer.ln1_weight, layer.ln1_bias, h.eps)
            q, k, v = (np.empty((n, width), dtype=np.float32) for _ in range(3))
            for rows in row_blocks(n, 6 * width * width, budget()):
                for out, weight, bias in (
                    (q, layer.q_weight, layer.q_bias),
                    (k, layer.k_weight, layer.k_bias),
                    (v, layer.v_weight, layer.v_bias),
                ):
                    product(self.kernels, normed[rows], weight, bias, out[rows])
                yield
            q *= np.float32(1.0 / math.sqrt(head_dim))
            q, k, v = (np.ascontiguousarray(y.reshape(n, heads, head_dim).transpose(1, 0, 2)) for y in (q, k, v))  # (heads, n, head_dim)
            mixed = np.empty((n, heads, head_dim), dtype=np.float32)
            on_kernels = self.kernels is not None and self.kernels.runs_attention(head_dim)
            for head in range(heads):
                kt = np.ascontiguousarray(k[head].T) if on_kernels else None  # (head_dim, n): what the kernel reads
                for rows in row_blocks(n, 4 * n * head_dim, budget()):
                    if on_kernels:
                        self.kernels.attention(q[head, rows], kt, v[head], mixed[rows, head])
                    else:
                        mixed[rows, head] = attention_rows(q[head, rows], k[head], v[head])
                    yield
            mixed = mixed.reshape(n, width)
            for rows in row_blocks(n, 2 * width * width, budget()):
                product(self.kernels, mixed[rows], layer.out_weight, layer.out_bias, x[rows], add=True)
                yield
            normed = layer_norm(x, layer.ln2_weight, layer.ln2_bias, h.eps)
            gelu = gelu_tanh if self.kernels is None else self.kernels.gelu_tanh
            for rows in row_blocks(n, 4 * width * h.ffn, budget()):
                hidden = gelu(product(self.kernels, normed[rows], layer.up_weight, layer.up_bias))  # (rows, ffn)
                product(self.kernels, hidden, layer.down_weight, layer.down_bias, x[rows], add=True)
                yield
        return layer_norm(x, self.post_weight, self.post_bias, h.eps)


def attention_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q . k^T) . v for one head's (queries, head_dim) q over its (n, head_dim) k and v."""
    scores = q @ k.T  # (queries, n)
    scores -= scores.max(axis=1, keepdims=True)
    np.exp(scores, out=scores)
    scores *= 1.0 / scores.sum(axis=1, keepdims=True)
    return scores @ v


def row_blocks(n: int, flops_a_row: float, slice_flops: float) -> list[slice]:
    """Rows 0..n-1 in blocks of about `slice_flops` of work each."""
    step = max(1, int(slice_flops // max(flops_a_row, 1)))
    return [slice(start, min(n, start + step)) for start in range(0, n, step)]


def run_to_end(slices: Generator[None, None, np.ndarray]) -> np.ndarray:
    """A sliced computation run through: what it returns."""
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value
