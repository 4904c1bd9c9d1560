"""What an architecture is, as one record: the differences from the llama-family layer that a GGUF
file of it does not spell out in its tensors, and the defaults its metadata leaves to the reader.

Contract: `Architecture` is frozen data plus a few named rules (functions of the file's metadata);
`webapp.engine.model.config.ModelConfig.from_gguf` reads the file through it and keeps only
features, never the name. What a file does say (q/k/v biases, q/k norms, sinks, an output bias, a
fused q/k/v) is read from its tensors there, not declared here. This module imports nothing of the
engine: model/ reads records, records know nothing of how a layer runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class Mixer(Enum):
    """A layer's token mixer: how it reads the positions before it."""

    ATTENTION = "attention"  # q, k and v heads over a KV cache (a sliding window where the config says)
    LATENT = "latent"  # DeepSeek-V2's multi-head latent attention: one cached latent row a position
    HYBRID = "hybrid"  # Gated DeltaNet recurrent layers beside gated full-attention ones


class Experts(Enum):
    """Whether every layer's feed-forward is a mixture of experts."""

    NONE = "none"  # dense layers only
    ALWAYS = "always"  # a mixture: the file must carry expert_count
    OPTIONAL = "optional"  # a mixture where the file has expert_count, dense layers where it has none


class MRope(Enum):
    """Whether a file's M-RoPE sections (rope.dimension_sections) turn an image's rows by its time,
    row and column (model/rope.py), and how the rotary pairs fall in them."""

    NONE = "none"  # a file with sections is refused
    SECTIONS = "sections"  # pairs in runs: time, then row, then column (Qwen2-VL)
    INTERLEAVED = "interleaved"  # pairs take row, column and time in turn (Qwen3-VL, Qwen3.5)


def _never(kv: dict, n_layers: int) -> bool:
    return False


def _always(kv: dict, n_layers: int) -> bool:
    return True


def with_layers(count: int) -> Callable[[dict, int], bool]:
    """A named rule for a model its files tell apart only by its layer count: true for files of `count` layers."""

    def rule(kv: dict, n_layers: int) -> bool:
        return n_layers == count

    return rule


def _sigmoid_gating(kv: dict) -> int:
    return 2


@dataclass(frozen=True)
class Architecture:
    """One architecture's differences; the defaults are the llama-family layer's."""

    names: tuple[str, ...]  # the general.architecture values it serves (true aliases)
    mixer: Mixer = Mixer.ATTENTION
    experts: Experts = Experts.NONE
    # tensor names
    ffn_norm_name: str = "ffn_norm.weight"  # the feed-forward's input norm where a file names it otherwise
    fused_gate_up: bool = False  # gate and up stored as one matrix, ffn_up, gate first
    # attention
    interleaved_rope: bool = False  # each head's rotary pairs interleaved (llama.cpp's "norm" RoPE)
    no_rope_every: int = 0  # every n-th layer has no RoPE (llama.cpp's n_no_rope_layer_step; 0: none)
    qk_norm_whole: bool = False  # the q and k norms run over all of q and all of k, not a head at a time
    sliding_window_every: int = 0  # attention.sliding_window in every layer but every n-th (0: none)
    local_rope_base: float = 0.0  # the sliding-window layers' RoPE base (0: the model's)
    # whether a file's layers follow no_rope_every and sliding_window_every (a named rule: of EXAONE 4's
    # files, the 32B alone has them)
    layer_patterns: Callable[[dict, int], bool] = _always
    # M-RoPE sections: an image's rows turn by its time, row and column (a text token turns every
    # section by its one position, which is the plain rotation)
    mrope: MRope = MRope.NONE
    # attention's scale 1 / sqrt(dim / heads), not 1 / sqrt(head size), for these files (a named rule)
    score_scale_by_width: Callable[[dict, int], bool] = _never
    # feed-forward
    expert_weights_norm: bool = False  # the chosen experts' weights divided by their sum
    shared_expert: bool = False  # a shared expert beside the routed ones (ffn_*_shexp)
    # routing the file describes (llama.cpp's DeepSeek-V3 style, GLM-4.5): leading dense layers,
    # expert_gating_func, expert_weights_norm and _scale, a selection bias (exp_probs_b.bias), and
    # expert_shared_count ungated shared experts of the routed experts' width
    routing_from_file: bool = False
    selection_bias_optional: bool = False  # the selection bias only where the file has it
    # expert_gating_func where the file has none (llama.cpp's llama_expert_gating_func_type)
    default_gating: Callable[[dict], int] = _sigmoid_gating
    swiglu_clamped: bool = False  # gpt-oss's clamped SwiGLU for the experts
    # Gemma's layer
    scaled_embedding: bool = False  # the embedding times sqrt(dim)
    post_norms: bool = False  # each sublayer's output normed before it joins the residual stream
    # each sublayer's input normed (attn_norm, ffn_norm); False: its output's post-norm is its only one (OLMo 2)
    input_norms: bool = True
    geglu: bool = False  # gelu(gate) * up for the feed-forward, not silu(gate) * up

    def __post_init__(self):
        # the kernels' unnormed inputs (FORM_UNNORMED_INPUTS) are a dense attention layer's only
        if not self.input_norms and (self.mixer is not Mixer.ATTENTION or self.experts is not Experts.NONE):
            raise ValueError(f"{self.names[0]}: a layer without input norms is served for dense attention layers only")

    @property
    def name(self) -> str:
        return self.names[0]
