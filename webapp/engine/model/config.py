"""What a GGUF file says the transformer is, checked before any weight is read.

Contract: `ModelConfig.from_gguf(kv, table)` returns the architecture's numbers or raises
`ModelLoadError` naming the key at fault; `check_tensors(config, table)` raises it for the first
tensor the model reads that is missing, of a type this server cannot read, or of another shape than
the config implies. GGUF files are untrusted input: the CPU kernels trust every size they are given
(a q matrix of fewer rows than heads x head size would be read past its end), so a file that passes
here is one whose every read stays inside its tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from webapp.engine.archs import architecture, supported
from webapp.engine.archs.record import Architecture, Experts, Mixer
from webapp.engine.kernels.ggml_types import GGML_TYPES, UNREADABLE_TYPES
from webapp.engine.model.latent_config import Latent, latent_rope_rows, latent_sizes, latent_tensor_shapes
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.recurrent_config import Recurrent, recurrent_sizes, recurrent_tensor_shapes
from webapp.engine.model.rope import attention_factor, mrope_sections

# expert_gating_func's values (llama.cpp's llama_expert_gating_func_type) this server computes
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}

# far past any real model: a file claiming more is corrupt, and would ask for absurd buffers
LIMITS = {"block_count": 1024, "embedding_length": 1 << 17, "feed_forward_length": 1 << 20, "attention.head_count": 1024}
LIMITS |= {"expert_count": 512, "expert_used_count": 32, "expert_feed_forward_length": 1 << 20}  # tq.h's MAX_EXPERTS, MAX_EXPERTS_USED
LIMITS |= {"expert_shared_feed_forward_length": 1 << 20, "expert_shared_count": 64, "nextn_predict_layers": 16}


@dataclass(frozen=True)
class ModelConfig:
    """The model's numbers and features; `arch` (general.architecture) only prefixes its metadata keys
    and names it in logs: what differs between architectures is a feature here (archs/)."""

    arch: str
    n_layers: int
    dim: int
    hidden_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    vocab_size: int
    rope_theta: float
    trained_context: int
    qkv_bias: bool
    qk_norm: bool
    qk_norm_whole: bool = False  # the q/k norms over all of q and of k, not each head
    rope_attention_factor: float = 1.0  # YaRN's or LongRoPE's factor on RoPE's cos and sin (rope.attention_factor)
    experts: int = 0  # a mixture of experts' count a layer (0: dense layers)...
    experts_used: int = 0  # ...how many a token uses...
    expert_hidden_dim: int = 0  # ...each one's feed-forward width...
    expert_weights_norm: bool = False  # ...and whether the chosen ones' weights are divided by their sum...
    expert_sigmoid: bool = False  # ...the router's probabilities sigmoid(logits), not their softmax...
    expert_weights_scale: float = 1.0  # ...the weights times this after any division...
    selection_bias: bool = False  # ...and the experts chosen by probs + exp_probs_b.bias, weighted by probs alone
    dense_layers: int = 0  # the first layers of a mixture of experts are dense (leading_dense_block_count)
    shared_expert_hidden_dim: int = 0  # a shared expert's feed-forward width (0: none)...
    shared_expert_gated: bool = True  # ...scaled by sigmoid(ffn_gate_inp_shexp . n), or added as it is
    no_rope_every: int = 0  # every n-th layer attends without RoPE (0: none)
    rotary_dim: int = 0  # RoPE turns each head's first rotary_dim values (rope.dimension_count; 0: the head size)
    # M-RoPE (Qwen2-VL): the section (0 time, 1 row, 2 column) each rotary pair turns by, for an
    # image's rows; a text token turns every section by its one position. Empty: plain RoPE
    rope_sections: tuple[int, ...] = ()
    deepstack_layers: int = 0  # Qwen3-VL: an image row's deepstack features, added to the first layers' outputs
    fused_qkv: bool = False  # q, k and v stored as one matrix, attn_qkv (phi3)
    fused_gate_up: bool = False  # gate and up stored as one matrix, ffn_up (phi3)
    interleaved_rope: bool = False  # q and k rows hold each head's rotary pairs interleaved (regrouped at load)
    sliding_window: int = 0  # local layers attend their last sliding_window positions (0: no local layers)...
    global_every: int = 0  # ...all but every global_every-th layer (gemma3: 6)...
    local_rope_theta: float = 0.0  # ...rotated with this base (0: the model's)
    scaled_embedding: bool = False  # the embedding times sqrt(dim) (gemma3)
    post_norms: bool = False  # each sublayer's output normed before it joins the residual stream (gemma3)
    input_norms: bool = True  # each sublayer's input normed first (False: post-norms alone, olmo2)
    geglu: bool = False  # the feed-forward's gelu(gate) * up, not silu(gate) * up (gemma3)
    score_by_width: bool = False  # attention's scale 1 / sqrt(dim / heads), not the head size's
    sinks: bool = False  # a sink logit a query head beside its keys' (attn_sinks, gpt-oss)
    output_bias: bool = False  # a bias on the attention's output product (attn_output.bias)
    expert_biases: bool = False  # biases on the router and every expert's products (gpt-oss)
    swiglu_clamped: bool = False  # the experts' activation: gpt-oss's clamped SwiGLU
    ffn_norm_name: str = "ffn_norm.weight"  # the feed-forward's input norm as the file names it
    # multi-head latent attention's sizes (None: q, k and v heads): head_dim is then a cache row's
    # values, n_kv_heads 1
    latent: Latent | None = None
    # a hybrid's recurrent layers (None: attention in every layer)
    recurrent: Recurrent | None = None

    @property
    def cache_rows(self) -> int:
        """Rows a position takes a kv head in the KV cache: a key's and a value's, or one where the
        key's row is its value too (multi-head latent attention)."""
        return 1 if self.latent else 2

    def qkv_names(self, p: str) -> tuple[str, ...]:
        """A layer's q, k and v matrices as the file stores them (one fused matrix, or three)."""
        return (p + "attn_qkv.weight",) if self.fused_qkv else tuple(p + f"attn_{n}.weight" for n in "qkv")

    def gate_up_names(self, p: str) -> tuple[str, ...]:
        """A dense layer's gate and up matrices as the file stores them (gate over up in one, or two)."""
        return (p + "ffn_up.weight",) if self.fused_gate_up else (p + "ffn_gate.weight", p + "ffn_up.weight")

    def __post_init__(self):
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)

    def rope_rows(self) -> dict[str, tuple[int, int]]:
        """The matrices whose rows hold rotary pairs interleaved (`interleaved_rope`), by name suffix:
        (groups, rotated rows at the end of each group), as weights.WeightSource takes them."""
        if not self.interleaved_rope:
            return {}
        if self.latent:
            return latent_rope_rows(self)
        return {"attn_q.weight": (self.n_heads, self.head_dim), "attn_k.weight": (self.n_kv_heads, self.head_dim)}

    def routed(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) is a mixture of experts (not one of the leading dense layers)."""
        return bool(self.experts) and layer >= self.dense_layers

    def recurrent_layer(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) is a recurrent (Gated DeltaNet) layer of a hybrid."""
        return self.recurrent is not None and self.recurrent.layer(layer)

    def rotates(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) rotates q and k by RoPE."""
        return not self.no_rope_every or (layer + 1) % self.no_rope_every != 0

    def window(self, layer: int) -> int:
        """The positions a query of layer `layer` sees back to itself included (0: all of them)."""
        return self.sliding_window if self.sliding_window and (layer + 1) % self.global_every else 0

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.dim) if self.scaled_embedding else 1.0

    @property
    def score_scale(self) -> float:
        """Attention's scale on q . k: 1 / sqrt(head size). (YaRN's and LongRoPE's factor scales the
        rotated values, in RoPE's cos and sin: a partial rotary's other values keep their size.) A
        model `score_by_width` takes its width per head instead (archs/gemma3.py); latent attention its
        own (latent_config.py)."""
        if self.latent:
            return self.latent.score_scale
        if self.score_by_width:
            return 1.0 / math.sqrt(self.dim / self.n_heads)
        return 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_gguf(cls, kv: dict, weights: dict) -> ModelConfig:
        arch = kv.get("general.architecture")
        record = architecture(arch)
        if record is None:
            raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(supported())}")

        def need(key: str):
            if key not in kv:
                raise ModelLoadError(f"GGUF metadata is missing {key!r}")
            return kv[key]

        def count(key: str, default=None, low: int = 1):
            value = need(f"{arch}.{key}") if default is None else kv.get(f"{arch}.{key}", default)
            high = LIMITS.get(key, 1 << 31)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ModelLoadError(f"GGUF metadata {arch}.{key} = {value!r}: expected a whole number from {low} to {high}")
            return value

        dim, n_heads = count("embedding_length"), count("attention.head_count")
        n_kv_heads = count("attention.head_count_kv", n_heads)
        if n_heads % n_kv_heads:
            raise ModelLoadError(f"{n_heads} attention heads cannot share {n_kv_heads} KV heads evenly")
        head_dim = count("attention.key_length", dim // n_heads if dim >= n_heads else 0)
        if head_dim % 2:
            raise ModelLoadError(f"head size {head_dim} is odd: RoPE rotates pairs")
        eps = need(f"{arch}.attention.layer_norm_rms_epsilon")
        if not isinstance(eps, float) or not 0 < eps < 1:
            raise ModelLoadError(f"GGUF metadata {arch}.attention.layer_norm_rms_epsilon = {eps!r}: expected a small positive number")
        theta = kv.get(f"{arch}.rope.freq_base", 10000.0)
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not (math.isfinite(theta) and theta > 1):
            raise ModelLoadError(f"GGUF metadata {arch}.rope.freq_base = {theta!r}: expected a number above 1")
        experts = experts_used = expert_hidden = 0
        if record.experts is Experts.ALWAYS or (record.experts is Experts.OPTIONAL and f"{arch}.expert_count" in kv):
            experts, experts_used = count("expert_count"), count("expert_used_count")
            expert_hidden = count("expert_feed_forward_length")
            if experts_used > experts:
                raise ModelLoadError(f"GGUF metadata {arch}.expert_used_count = {experts_used}: more than the {experts} experts")
        routing = _routing_from_file(kv, arch, record, count) if record.routing_from_file and experts else {}
        # as llama.cpp reads it: the shared expert's own width, else the file's feed-forward width
        shared_hidden = count("expert_shared_feed_forward_length", kv.get(f"{arch}.feed_forward_length")) if record.shared_expert else 0
        shared_hidden = shared_hidden if experts else 0
        if record.routing_from_file and experts:  # expert_shared_count experts of the routed ones' width, as one
            shared_hidden = count("expert_shared_count", low=0) * expert_hidden
        dense_lead = routing.get("dense_layers", 0)
        rotary = count("rope.dimension_count", head_dim)
        if rotary % 2 or rotary > head_dim:
            raise ModelLoadError(
                f"GGUF metadata {arch}.rope.dimension_count = {rotary}: expected an even number up to the head size {head_dim}"
            )
        if rotary < head_dim and record.interleaved_rope and record.mixer is not Mixer.LATENT:
            raise ModelLoadError(f"partial rotary ({rotary} of {head_dim} values) with {arch}'s interleaved pairs is not supported")
        latent = latent_sizes(kv, arch, head_dim, n_kv_heads, rotary, n_heads, count) if record.mixer is Mixer.LATENT else None
        tokens = need("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ModelLoadError("GGUF metadata tokenizer.ggml.tokens is not a list of tokens")
        sections = mrope_sections(kv, arch, record, rotary)
        # llama.cpp's converter counts NextN/MTP layers in block_count, after the trunk's: they predict
        # further tokens for speculation, and the trunk alone makes the logits
        blocks = count("block_count")
        nextn = count("nextn_predict_layers", 0, low=0)
        deepstack = count("n_deepstack_layers", 0, low=0) if sections else 0
        if deepstack > blocks:
            raise ModelLoadError(f"GGUF metadata {arch}.n_deepstack_layers = {deepstack}: more than the {blocks} layers")
        if nextn >= blocks:
            raise ModelLoadError(f"GGUF metadata {arch}.nextn_predict_layers = {nextn}: not fewer than the {blocks} blocks")
        if dense_lead > blocks - nextn:
            raise ModelLoadError(f"GGUF metadata {arch}.leading_dense_block_count = {dense_lead}: more than the {blocks - nextn} layers")
        dense_ffn = not experts or dense_lead > 0
        patterned = record.layer_patterns(kv, blocks - nextn)
        window = count("attention.sliding_window") if record.sliding_window_every and patterned else 0
        recurrent = recurrent_sizes(kv, arch, blocks - nextn, count) if record.mixer is Mixer.HYBRID else None
        a = f"blk.{recurrent.first_attention if recurrent else 0}."  # an attention layer's tensors say what they all have
        return cls(
            arch=arch,
            n_layers=blocks - nextn,
            dim=dim,
            hidden_dim=count("feed_forward_length", None if dense_ffn else 0, low=1 if dense_ffn else 0),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            norm_eps=eps,
            vocab_size=len(tokens),
            rope_theta=float(theta),
            trained_context=count("context_length"),
            qkv_bias=a + "attn_q.bias" in weights,
            fused_qkv=a + "attn_qkv.weight" in weights,
            fused_gate_up=record.fused_gate_up,
            interleaved_rope=record.interleaved_rope,
            qk_norm=a + "attn_q_norm.weight" in weights,
            qk_norm_whole=record.qk_norm_whole,
            rope_attention_factor=1.0 if latent else attention_factor(kv, arch),  # latent: in the score scale instead
            experts=experts,
            experts_used=experts_used,
            expert_hidden_dim=expert_hidden,
            expert_weights_norm=routing.get("norm", record.expert_weights_norm),
            expert_sigmoid=routing.get("sigmoid", False),
            expert_weights_scale=routing.get("scale", 1.0),
            selection_bias=bool(routing) and (not record.selection_bias_optional or f"blk.{dense_lead}.exp_probs_b.bias" in weights),
            dense_layers=dense_lead,
            shared_expert_hidden_dim=shared_hidden,
            shared_expert_gated=not record.routing_from_file,
            no_rope_every=record.no_rope_every if patterned else 0,
            rotary_dim=rotary,
            rope_sections=sections,
            deepstack_layers=deepstack,
            sliding_window=window,
            global_every=record.sliding_window_every if patterned else 0,
            local_rope_theta=record.local_rope_base,
            scaled_embedding=record.scaled_embedding,
            post_norms=record.post_norms,
            input_norms=record.input_norms,
            geglu=record.geglu,
            score_by_width=record.score_scale_by_width(kv, blocks - nextn),
            sinks=a + "attn_sinks.weight" in weights,
            output_bias=a + "attn_output.bias" in weights,
            expert_biases=bool(experts) and f"blk.{dense_lead}.ffn_gate_exps.bias" in weights,
            swiglu_clamped=record.swiglu_clamped,
            ffn_norm_name=record.ffn_norm_name,
            latent=latent,
            recurrent=recurrent,
        )

    def _feed_forward_shapes(self, p: str, layer: int) -> dict[str, tuple[int, int]]:
        """A layer's feed-forward matrices: SwiGLU's three, or a router and every expert's three (a
        3-D tensor of experts x rows x cols, as (experts * rows, cols))."""
        if not self.routed(layer):
            gate_up = dict.fromkeys(self.gate_up_names(p), (self.hidden_dim * (2 if self.fused_gate_up else 1), self.dim))
            return gate_up | {p + "ffn_down.weight": (self.dim, self.hidden_dim)}
        E, F = self.experts, self.expert_hidden_dim
        shapes = {p + "ffn_gate_inp.weight": (E, self.dim), p + "ffn_gate_exps.weight": (E * F, self.dim)} | {
            p + "ffn_up_exps.weight": (E * F, self.dim),
            p + "ffn_down_exps.weight": (E * self.dim, F),
        }
        if self.expert_biases:  # a vector the router, a row an expert for the experts' products
            shapes |= {p + "ffn_gate_inp.bias": (1, E), p + "ffn_gate_exps.bias": (E, F), p + "ffn_up_exps.bias": (E, F)}
            shapes |= {p + "ffn_down_exps.bias": (E, self.dim)}
        if self.selection_bias:  # a number an expert
            shapes[p + "exp_probs_b.bias"] = (1, E)
        if self.shared_expert_hidden_dim:  # its gate a vector, its matrices a dense layer's
            S = self.shared_expert_hidden_dim
            if self.shared_expert_gated:
                shapes[p + "ffn_gate_inp_shexp.weight"] = (1, self.dim)
            shapes |= {p + "ffn_gate_shexp.weight": (S, self.dim)}
            shapes |= {p + "ffn_up_shexp.weight": (S, self.dim), p + "ffn_down_shexp.weight": (self.dim, S)}
        return shapes

    def tensor_shapes(self) -> dict[str, tuple[int, int]]:
        """Every tensor the model reads, as (rows, cols) the way weights.read_gguf gives them (a vector
        is one row)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        shapes = {"token_embd.weight": (self.vocab_size, self.dim), "output_norm.weight": (1, self.dim)}
        for i in range(self.n_layers):
            p = f"blk.{i}."
            if self.latent or self.recurrent:
                layer = latent_tensor_shapes(self, p) if self.latent else recurrent_tensor_shapes(self, p, i)
                shapes |= layer | self._feed_forward_shapes(p, i)
                continue
            if self.fused_qkv:
                shapes[p + "attn_qkv.weight"] = (q + 2 * kv, self.dim)
            else:
                shapes |= {p + "attn_q.weight": (q, self.dim), p + "attn_k.weight": (kv, self.dim), p + "attn_v.weight": (kv, self.dim)}
            shapes[p + "attn_output.weight"] = (self.dim, q)
            if self.input_norms:
                shapes |= {p + "attn_norm.weight": (1, self.dim), p + self.ffn_norm_name: (1, self.dim)}
            shapes |= self._feed_forward_shapes(p, i)
            if self.qk_norm:
                q_norm, k_norm = (q, kv) if self.qk_norm_whole else (self.head_dim, self.head_dim)
                shapes |= {p + "attn_q_norm.weight": (1, q_norm), p + "attn_k_norm.weight": (1, k_norm)}
            if self.qkv_bias:
                shapes |= {p + "attn_q.bias": (1, q), p + "attn_k.bias": (1, kv), p + "attn_v.bias": (1, kv)}
            if self.post_norms:
                shapes |= {p + "post_attention_norm.weight": (1, self.dim), p + "post_ffw_norm.weight": (1, self.dim)}
            if self.sinks:
                shapes[p + "attn_sinks.weight"] = (1, self.n_heads)
            if self.output_bias:
                shapes[p + "attn_output.bias"] = (1, self.dim)
        return shapes


def _routing_from_file(kv: dict, arch: str, record: Architecture, count) -> dict:
    """The routing keys of an architecture whose file describes its routing, as llama.cpp reads them
    (the record's default gating where expert_gating_func is absent or 0, no division or scale where
    the norm and scale are), or ModelLoadError naming the key at fault."""
    gating = count("expert_gating_func", 0, low=0) or record.default_gating(kv)
    if gating not in GATING_FUNCS:
        raise ModelLoadError(f"GGUF metadata {arch}.expert_gating_func = {gating}: only {GATING_FUNCS} are supported")
    norm = kv.get(f"{arch}.expert_weights_norm", False)
    if not isinstance(norm, bool):
        raise ModelLoadError(f"GGUF metadata {arch}.expert_weights_norm = {norm!r}: expected true or false")
    scale = kv.get(f"{arch}.expert_weights_scale", 0.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not (math.isfinite(scale) and 0 <= scale <= 1000):
        raise ModelLoadError(f"GGUF metadata {arch}.expert_weights_scale = {scale!r}: expected a finite number from 0 to 1000")
    groups, groups_used = count("expert_group_count", 1, low=0), count("expert_group_used_count", 0, low=0)
    # llama.cpp keeps only the best groups' experts: the same choice as none when every group is kept
    if groups > 1 and groups_used != groups:
        raise ModelLoadError(
            f"GGUF metadata {arch}.expert_group_count = {groups} with expert_group_used_count = {groups_used}: "
            "group-limited expert routing is not supported"
        )
    dense = count("leading_dense_block_count", 0, low=0)
    # llama.cpp: a scale of 0 is none
    return {"sigmoid": GATING_FUNCS[gating] == "sigmoid", "norm": norm, "scale": float(scale) or 1.0, "dense_layers": dense}


def used_tensors(config: ModelConfig, table: dict) -> dict[str, tuple[int, int]]:
    """Every tensor the model reads from this file with the shape it must have: the config's, and the
    output head when the file has one of its own (else the embedding is the head)."""
    shapes = config.tensor_shapes()
    if "output.weight" in table:
        shapes["output.weight"] = (config.vocab_size, config.dim)
    return shapes


def check_tensors(config: ModelConfig, table: dict) -> None:
    """`table` as weights.read_gguf gives it (name -> RawTensor with ggml_type, rows, cols)."""
    shapes = used_tensors(config, table)
    missing = [n for n in shapes if n not in table]
    if missing:
        raise ModelLoadError(f"GGUF file lacks tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for name, expected in shapes.items():
        raw = table[name]
        if raw.ggml_type not in GGML_TYPES:
            known = UNREADABLE_TYPES.get(raw.ggml_type, f"unknown type {raw.ggml_type}")
            raise ModelLoadError(f"tensor {name!r} is stored as {known}, which this server cannot read yet")
        if name.endswith("_exps.weight") and (len(raw.shape) != 3 or raw.shape[0] != config.experts):
            raise ModelLoadError(f"tensor {name!r} has dimensions {raw.shape}; expected {config.experts} experts' matrices")
        if (raw.rows, raw.cols) != expected:
            raise ModelLoadError(
                f"tensor {name!r} has shape {raw.rows} x {raw.cols}; the file's metadata implies {expected[0]} x {expected[1]}"
            )
        type_name, values, _ = GGML_TYPES[raw.ggml_type]
        if raw.cols % values:
            raise ModelLoadError(f"tensor {name!r}: rows of {raw.cols} values are not whole {type_name} blocks of {values}")
