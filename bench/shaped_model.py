"""Random-weight GGUFs with real models' shapes, for the benches: speed depends on shapes, not numbers.

Usage: .venv/bin/python bench/shaped_model.py SHAPE OUT.gguf [--type Q4_K_M] [--llama-quantize PATH] [--layers N]
       .venv/bin/python bench/shaped_model.py SHAPE OUT.gguf --direct Q4_K_M|Q5_K_M|MXFP4_MOE|F16 [--layers N]
       .venv/bin/python bench/shaped_model.py --list

Writes OUT as float16 matrices (float32 norms) with SHAPE's widths, depth, heads, QK-norm and tied
embedding (Llama 3.2 shapes with their rope_freqs.weight), and the default model's tokenizer (its 49,152-token vocabulary stands in for the real
one, as the issue's repro did; for Qwen2.5-VL and Qwen3-VL three of its control tokens spelled as Qwen's image tokens, for SmolVLM eleven as its image and tile markers). With --type, llama.cpp's own `llama-quantize` then turns it into that
block mix (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, IQ4_XS, ...), as users' downloads are made, and the
float16 file is removed. Random weights give flat logits, so the final norm is scaled (x6) to make
greedy choices decided rather than coin flips. With --predictable, the embedding is large and the
head (untied) sends each token to a fixed successor, the same map for every shape: any two such files
agree on every greedy token, which makes a draft/target pair whose drafts are all confirmed (the
upper bound in bench/speculative.py). With --direct Q4_K_M (or Q5_K_M, MXFP4_MOE), no float16 file is written:
each matrix goes to OUT in the type llama-quantize's mix gives it, its rows drawn from a pool of
random quantized rows (bench/block_files.py), for shapes whose float16 file would not fit on disk
(a 48-layer Qwen3-30B-A3B: ~60 GB as float16, ~17 GB as Q4_K_M).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import gguf
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from support.tiny_models import RERANK_PROMPT, add_smollm_tokenizer, smollm_tokenizer_fields  # noqa: E402

from bench.block_files import MIXES, Random, write_blocks  # noqa: E402

RANK_LABELS = ("yes", "no")
# (arch, layers, dim, FFN, heads, KV heads, head dim, tied, rope theta): the published configs
SHAPES = {
    "qwen3-0.6b": ("qwen3", 28, 1024, 3072, 16, 8, 128, True, 1e6),
    "qwen3-1.7b": ("qwen3", 28, 2048, 6144, 16, 8, 128, True, 1e6),
    "qwen3-4b": ("qwen3", 36, 2560, 9728, 32, 8, 128, True, 1e6),
    "llama3.2-1b": ("llama", 16, 2048, 8192, 32, 8, 64, True, 5e5),
    "llama3.2-3b": ("llama", 28, 3072, 8192, 24, 8, 128, True, 5e5),
    "llama3.1-8b": ("llama", 32, 4096, 14336, 32, 8, 128, False, 5e5),
    "smollm2-135m": ("llama", 30, 576, 1536, 9, 3, 64, True, 1e5),
    "exaone3.5-2.4b": ("exaone", 30, 2560, 7168, 32, 8, 80, True, 1e6),
    "olmo2-1b": ("olmo2", 16, 2048, 8192, 16, 16, 128, False, 5e5),
    "exaone4-1.2b": ("exaone4", 30, 2048, 4096, 32, 8, 64, True, 1e6),
    "qwen3-30b-a3b": ("qwen3moe", 48, 2048, 6144, 32, 4, 128, False, 1e6),
    "smollm3-3b": ("smollm3", 36, 2048, 11008, 16, 4, 128, True, 5e6),
    "phi4-mini": ("phi3", 32, 3072, 8192, 24, 8, 128, True, 1e4),
    "gemma3-1b": ("gemma3", 26, 1152, 6912, 4, 1, 256, True, 1e6),
    "gemma3-4b": ("gemma3", 34, 2560, 10240, 8, 4, 256, True, 1e6),
    "gpt-oss-20b": ("gpt-oss", 24, 2880, 2880, 64, 8, 64, False, 150000.0),
    "olmoe-1b-7b": ("olmoe", 16, 2048, 1024, 16, 16, 128, False, 10000.0),
    "qwen1.5-moe-a2.7b": ("qwen2moe", 24, 2048, 5632, 16, 16, 128, False, 1e6),
    # DeepSeek-V2-Lite (its head size here: the latent row cached, kv_lora + rope; its FFN the dense
    # first layer's), and its attention with every layer dense (a deepseek2 file without experts)
    "deepseek-v2-lite": ("deepseek2", 27, 2048, 10944, 16, 1, 576, False, 10000.0),
    "deepseek-v2-lite-dense": ("deepseek2", 27, 2048, 10944, 16, 1, 576, False, 10000.0),
    "moonlight-16b-a3b": ("deepseek2", 27, 2048, 11264, 16, 1, 576, False, 50000.0),  # DeepSeek-V3's routing
    "glm4.5-air": ("glm4moe", 46, 4096, 10944, 96, 8, 128, False, 1e6),
    # Qwen3.5's hybrids: three Gated DeltaNet layers to one gated attention layer (RECURRENT)
    "qwen3.5-0.8b": ("qwen35", 24, 1024, 3584, 8, 2, 256, True, 1e7),
    "qwen3.5-2b": ("qwen35", 24, 2048, 6144, 8, 2, 256, True, 1e7),
    "qwen3.5-4b": ("qwen35", 32, 2560, 9216, 16, 4, 256, True, 1e7),
    "qwen3.5-35b-a3b": ("qwen35moe", 40, 2048, 512, 16, 2, 256, False, 1e7),
    # Qwen2.5-VL-3B's language model: Qwen2.5-3B's shapes with M-RoPE (MROPE_SECTIONS)
    "qwen2.5-vl-3b": ("qwen2vl", 36, 2048, 11008, 16, 2, 128, True, 1e6),
    # Qwen3-VL-4B's: Qwen3-4B's shapes with interleaved M-RoPE and deepstack (DEEPSTACK)
    "qwen3-vl-4b": ("qwen3vl", 36, 2560, 9728, 32, 8, 128, True, 5e6),
    # SmolVLM-256M's language model: SmolLM2-135M's shapes (its image tokens: VISION_TOKENS)
    "smolvlm-256m": ("llama", 30, 576, 1536, 9, 3, 64, True, 1e5),
}
# Gated DeltaNet's sizes: (conv kernel, a head's state, key heads, value heads, every n-th layer full attention)
RECURRENT = {"qwen3.5-0.8b": (4, 128, 16, 16, 4), "qwen3.5-2b": (4, 128, 16, 16, 4), "qwen3.5-4b": (4, 128, 16, 32, 4)}
RECURRENT["qwen3.5-35b-a3b"] = (4, 128, 16, 32, 4)
# multi-head latent attention's sizes: (q_lora, kv_lora, nope, rope, v_dim), as the published config
LATENT = dict.fromkeys(("deepseek-v2-lite", "deepseek-v2-lite-dense", "moonlight-16b-a3b"), (0, 512, 128, 64, 128))
# partial rotary: the values of a head that RoPE turns (Phi-4-mini: 96 of 128), with LongRoPE's
# original context and attention factor (sqrt(1 + ln(131072 / 4096) / ln(4096)), as its converter writes it)
PARTIAL_ROTARY = {"phi4-mini": (96, 4096, 1.190238), "glm4.5-air": (64, None, None)}
PARTIAL_ROTARY |= dict.fromkeys(("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-35b-a3b"), (64, None, None))
# M-RoPE's sections (rope.dimension_sections), in pairs of a head's values: the first turned by a
# token's time, the next by its row, the next by its column (an image's tokens; text's all alike);
# qwen3vl's interleaved (pair k by time, row, column as k % 3 is 0, 1, 2, while its section lasts)
MROPE_SECTIONS = {"qwen2.5-vl-3b": [16, 24, 24, 0], "qwen3-vl-4b": [24, 20, 20, 0]}
# Qwen3-VL: its first n layers each add one more part of an image row (the vision tower's deepstack features)
DEEPSTACK = {"qwen3-vl-4b": 3}
# the tokens llama.cpp's mtmd and our loader look up around an image (Qwen2-VL's), spelled over
# control tokens of the default model's vocabulary that no prompt here uses
VISION_TOKENS = dict.fromkeys(("qwen2.5-vl-3b", "qwen3-vl-4b"), {3: "<|vision_start|>", 4: "<|vision_end|>", 5: "<|image_pad|>"})
# SmolVLM's (Idefics3's): the fourteen spare control tokens (3 .. 16) hold its two markers and the
# row/column markers of tile grids up to SMOLVLM_TILES a side (its own 2,048-pixel longest edge cuts
# up to 4 x 4 tiles, which would need 18); a projector for this shape caps its longest edge to match
SMOLVLM_TILES = 3
VISION_TOKENS["smolvlm-256m"] = dict(
    enumerate(
        ["<fake_token_around_image>", "<global-img>"]
        + [f"<row_{row}_col_{col}>" for row in range(1, SMOLVLM_TILES + 1) for col in range(1, SMOLVLM_TILES + 1)],
        start=3,
    )
)
# mixture-of-experts shapes: (experts, used a token, each one's FFN)
EXPERTS = {"qwen3-30b-a3b": (128, 8, 768), "gpt-oss-20b": (32, 4, 2880), "olmoe-1b-7b": (64, 8, 1024), "qwen1.5-moe-a2.7b": (60, 4, 1408)}
EXPERTS |= {"glm4.5-air": (128, 8, 1408), "deepseek-v2-lite": (64, 6, 1408), "moonlight-16b-a3b": (64, 6, 1408)}
EXPERTS["qwen3.5-35b-a3b"] = (256, 8, 512)
# a shared expert's FFN beside the routed ones (qwen2moe), gated by one F32 row a layer
SHARED_EXPERT = {"qwen1.5-moe-a2.7b": 5632, "qwen3.5-35b-a3b": 512}
# routing the file describes (glm4moe, deepseek2): (leading dense layers, shared experts of the
# experts' FFN, expert_weights_scale, expert_weights_norm, sigmoid gating with a selection bias
# (exp_probs_b) a layer, else softmax without one); no NextN block (nextn_predict_layers 0: the
# trunk alone, which is all this server runs)
ROUTING = {"glm4.5-air": (1, 1, 1.0, True, True), "deepseek-v2-lite": (1, 2, 1.0, False, False)}
ROUTING |= {"moonlight-16b-a3b": (1, 2, 2.446, True, True)}
# sliding-window shapes: a local layer's window (Gemma 3: all but every sixth layer)
SLIDING_WINDOW = {"gemma3-1b": 512, "gemma3-4b": 1024, "gpt-oss-20b": 128}
# YaRN: (factor, original context), as gpt-oss's files carry it
YARN = {"gpt-oss-20b": (32.0, 4096), "deepseek-v2-lite": (40.0, 4096), "deepseek-v2-lite-dense": (40.0, 4096)}
# DeepSeek-V2's YaRN: its rope.scaling.yarn_log_multiplier (0.1 x mscale_all_dim 0.707)
YARN_LOG_MULTIPLIER = {"deepseek-v2-lite": 0.0707, "deepseek-v2-lite-dense": 0.0707}
FINAL_NORM_SCALE = 6.0
# Named random initialisations (--init; bench/conformance.py's and float64_triangle.py's file specs take
# one as SHAPE:LAYERS:TYPE:INIT): the seed, every matrix's std (None: 1 / sqrt(its columns), so each
# layer keeps its input's scale) and the final norm's scale. Judging rounding on one draw of random
# weights can mistake that draw's quirks for a kernel's; "std02" is the kind of draw a precision gap
# against llama.cpp was once found on (every matrix at 0.02, the final norm twice the default's).
INITS = {"default": (0, None, FINAL_NORM_SCALE), "seed1": (1, None, FINAL_NORM_SCALE), "seed2": (2, None, FINAL_NORM_SCALE)}
INITS["std02"] = (3, 0.02, 2 * FINAL_NORM_SCALE)
EMBEDDING_STD = 0.02
# --predictable: an embedding ~10x larger than 28 random layers add to the residual, so the head sees
# mostly the token's own row; the successor map's seed is shared by every shape
PREDICTABLE_STD, SUCCESSOR_SEED = 10.0, 1234


def llama3_rope_factors(head_dim: int, theta: float, factor=32.0, low=1.0, high=4.0, original_context=8192) -> np.ndarray:
    """rope_freqs.weight as Llama 3.2's converter computes it (its published rope_scaling): wavelengths
    beyond the original context divided by `factor`, those under a quarter of it kept, a ramp between."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelength = 2 * np.pi / inv
    smooth = np.clip((original_context / wavelength - low) / (high - low), 0.0, 1.0)
    return (1.0 / ((1 - smooth) / factor + smooth)).astype(np.float32)


def write_shaped(
    shape: str,
    path: str,
    layers: int | None = None,
    seed: int | None = None,
    predictable: bool = False,
    direct: str | None = None,
    reranker: bool = False,
    init: str = "default",
    deepstack: int | None = None,
) -> str:
    """Write SHAPE's random model to `path`: float16 matrices, or with `direct` (a mix of MIXES) each matrix
    straight in its type of that mix (bench/block_files.py). `reranker` makes it a reranker's file
    as llama.cpp's converter writes Qwen3-Reranker (tests/support/tiny_models.py's `rank_labels`).
    `init` names one of INITS (`seed`, where given, replaces its seed). `deepstack`: a Qwen3-VL
    shape's deepstack layers, where not DEEPSTACK's (to match a shorter vision tower's)."""
    arch, n_layers, dim, ffn, heads, kv_heads, head_dim, tied, theta = SHAPES[shape]
    if reranker and (direct or predictable or not tied):
        raise SystemExit("--reranker copies the tied float16 embedding's rows: not with --direct, --predictable or an untied shape")
    if direct and (predictable or arch == "phi3"):
        raise SystemExit("--direct writes unfused matrices of random rows: not with --predictable or phi3's fused ones")
    n_layers = layers or n_layers
    init_seed, matrix_std, final_norm_scale = INITS[init]
    seed = init_seed if seed is None else seed
    rng = np.random.default_rng(seed)
    tok = smollm_tokenizer_fields()
    vocab = len(tok["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(n_layers)
    w.add_context_length(32768)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    latent = LATENT.get(shape)
    w.add_key_length(head_dim)
    w.add_value_length(latent[1] if latent else head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    if latent:
        q_lora, kv_lora, nope, rope_dims, v_dim = latent
        numbers = {"attention.kv_lora_rank": kv_lora, "attention.key_length_mla": nope + rope_dims, "attention.value_length_mla": v_dim}
        if shape not in EXPERTS:  # every layer dense (with experts: ROUTING's keys below)
            numbers |= {"leading_dense_block_count": n_layers, "expert_feed_forward_length": ffn, "expert_shared_count": 0}
        # q_lora_rank 0 for a Lite model: llama.cpp reads it unless the depth is Lite's own 27 layers
        for key, value in (numbers | {"attention.q_lora_rank": q_lora}).items():
            w.add_uint32(f"{arch}.{key}", value)
        if shape in YARN_LOG_MULTIPLIER:
            w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", YARN_LOG_MULTIPLIER[shape])
    w.add_rope_freq_base(theta)
    rotary, original, attn_factor = PARTIAL_ROTARY.get(shape, (latent[3] if latent else head_dim, None, None))
    w.add_rope_dimension_count(rotary)
    if original:
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
        w.add_float32(f"{arch}.rope.scaling.attn_factor", attn_factor)
    if shape in MROPE_SECTIONS:
        w.add_array(f"{arch}.rope.dimension_sections", MROPE_SECTIONS[shape])
    if shape in DEEPSTACK:
        w.add_uint32(f"{arch}.n_deepstack_layers", DEEPSTACK[shape] if deepstack is None else deepstack)
    if shape in SLIDING_WINDOW:
        w.add_sliding_window(SLIDING_WINDOW[shape])
    if shape in YARN:
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", YARN[shape][0])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", YARN[shape][1])
    if shape in EXPERTS:
        count, used, expert_ffn = EXPERTS[shape]
        w.add_expert_count(count)
        w.add_expert_used_count(used)
        w.add_expert_feed_forward_length(expert_ffn)
    if shape in SHARED_EXPERT:
        w.add_expert_shared_feed_forward_length(SHARED_EXPERT[shape])
    dense_lead, shared_count, weights_scale, weights_norm, sigmoid = ROUTING.get(shape, (0, 0, 1.0, False, False))
    if shape in ROUTING:
        w.add_leading_dense_block_count(dense_lead)
        w.add_expert_shared_count(shared_count)
        w.add_expert_weights_scale(weights_scale)
        w.add_expert_weights_norm(weights_norm)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_nextn_predict_layers(0)
    if shape in RECURRENT:
        kernel, state, k_heads, v_heads, every = RECURRENT[shape]
        for key, value in (("conv_kernel", kernel), ("state_size", state), ("group_count", k_heads), ("time_step_rank", v_heads)):
            w.add_uint32(f"{arch}.ssm.{key}", value)
        w.add_uint32(f"{arch}.ssm.inner_size", v_heads * state)
        w.add_uint32(f"{arch}.full_attention_interval", every)
        # M-RoPE's sections (a text token turns them all by its position), as llama.cpp requires them
        w.add_array(f"{arch}.rope.dimension_sections", [11 * rotary // 64, 11 * rotary // 64, rotary // 2 - 22 * rotary // 64, 0])
    w.add_file_type(MIXES[direct] if direct else 1)  # llama_ftype: mostly F16, or the mix
    add_smollm_tokenizer(w, renamed=VISION_TOKENS.get(shape))
    w.add_chat_template(tok["tokenizer.chat_template"])
    if reranker:
        w.add_uint32(f"{arch}.pooling_type", 4)  # rank
        w.add_array(f"{arch}.classifier.output_labels", list(RANK_LABELS))
        w.add_string("tokenizer.chat_template.rerank", RERANK_PROMPT)

    def matrix(rows: int, cols: int, scale: float | None = None) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (scale or matrix_std or cols**-0.5)).astype(np.float16)

    def weight(rows: int, cols: int, scale: float | None = None, count: int = 0):
        """A matrix (`count` of them stacked, for experts) to quantize: made now, or with `direct` when written."""
        if direct:
            return Random((count, rows, cols) if count else (rows, cols), scale or matrix_std or cols**-0.5)
        return np.stack([matrix(rows, cols, scale) for _ in range(count)]) if count else matrix(rows, cols, scale)

    tensors: list[tuple[str, object]] = []

    def add(name: str, value) -> None:
        if direct:
            tensors.append((name, value))
        else:
            w.add_tensor(name, value)

    def bias(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    def norm(n: int, scale: float = 1.0) -> np.ndarray:
        return (scale * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)

    # real embeddings are small beside what the layers add (std ~0.02): a large random one, tied to the
    # head, makes every greedy choice an echo of the last token
    # (Gemma scales its embedding by sqrt(dim) as it reads it: stored that much smaller, it is as small)
    embedding_std = EMBEDDING_STD / (np.sqrt(dim) if arch == "gemma3" else 1.0)
    embedding = weight(vocab, dim, scale=PREDICTABLE_STD if predictable else embedding_std)
    add("token_embd.weight", embedding)
    if reranker:  # the head's rows of "yes" and "no"
        add("cls.output.weight", embedding[[tok["tokenizer.ggml.tokens"].index(label) for label in RANK_LABELS]])
    if predictable:  # head row successor[t] is token t's embedding: the greedy token after t is successor[t]
        head = np.empty_like(embedding)
        head[np.random.default_rng(SUCCESSOR_SEED).permutation(vocab)] = embedding
        add("output.weight", head)
    add("output_norm.weight", norm(dim, final_norm_scale))
    if shape.startswith("llama3"):
        add("rope_freqs.weight", llama3_rope_factors(head_dim, theta))
    if original:  # LongRoPE's per-frequency factors: near 1 for short contexts, up to ~32 for long ones
        add("rope_factors_short.weight", np.linspace(1.0, 1.3, rotary // 2, dtype=np.float32))
        add("rope_factors_long.weight", np.geomspace(1.0, 32.0, rotary // 2).astype(np.float32))
    if not tied and not predictable:
        add("output.weight", weight(vocab, dim))

    def feed_forward(p: str, i: int) -> None:
        """Layer i's feed-forward: dense, or a mixture of experts past the leading dense layers."""
        if shape in EXPERTS and i >= dense_lead:  # the router stays float32, as llama-quantize keeps it
            add(p + "ffn_gate_inp.weight", matrix(count, dim, scale=2 * dim**-0.5).astype(np.float32))
            add(p + "ffn_gate_exps.weight", weight(expert_ffn, dim, count=count))
            add(p + "ffn_up_exps.weight", weight(expert_ffn, dim, count=count))
            add(p + "ffn_down_exps.weight", weight(dim, expert_ffn, count=count))
            if shape in SHARED_EXPERT:  # the converter keeps its gate float32, as the router
                shared = SHARED_EXPERT[shape]
                add(p + "ffn_gate_inp_shexp.weight", matrix(1, dim, scale=2 * dim**-0.5).astype(np.float32))
                add(p + "ffn_gate_shexp.weight", weight(shared, dim))
                add(p + "ffn_up_shexp.weight", weight(shared, dim))
                add(p + "ffn_down_shexp.weight", weight(dim, shared))
            if shape in ROUTING:  # the selection bias (float32), and ungated shared experts of the experts' width
                if sigmoid:
                    add(p + "exp_probs_b.bias", (0.05 * rng.standard_normal(count)).astype(np.float32))
                shared = shared_count * expert_ffn
                add(p + "ffn_gate_shexp.weight", weight(shared, dim))
                add(p + "ffn_up_shexp.weight", weight(shared, dim))
                add(p + "ffn_down_shexp.weight", weight(dim, shared))
            return
        if arch == "phi3":  # gate over up as one matrix
            add(p + "ffn_up.weight", np.concatenate([matrix(ffn, dim), matrix(ffn, dim)]))
        else:
            add(p + "ffn_gate.weight", weight(ffn, dim))
            add(p + "ffn_up.weight", weight(ffn, dim))
        add(p + "ffn_down.weight", weight(dim, ffn))

    def hybrid_layer(p: str, i: int) -> None:
        """A Qwen3.5 layer: Gated DeltaNet (its conv's weights, dt bias and a float32), or gated attention."""
        add(p + "post_attention_norm.weight", norm(dim))
        if (i + 1) % every:
            conv, value = (2 * k_heads + v_heads) * state, v_heads * state
            add(p + "attn_qkv.weight", weight(conv, dim))
            add(p + "attn_gate.weight", weight(value, dim))
            add(p + "ssm_conv1d.weight", (0.5 * rng.standard_normal((conv, kernel))).astype(np.float32))
            add(p + "ssm_dt.bias", bias(v_heads))
            add(p + "ssm_a", -np.exp(rng.uniform(-1.0, 1.0, v_heads)).astype(np.float32))
            add(p + "ssm_beta.weight", weight(v_heads, dim))
            add(p + "ssm_alpha.weight", weight(v_heads, dim))
            add(p + "ssm_norm.weight", norm(state))
            add(p + "ssm_out.weight", weight(dim, value))
        else:  # each head's query rows, then its gate's
            add(p + "attn_q.weight", weight(2 * heads * head_dim, dim))
            add(p + "attn_k.weight", weight(kv_heads * head_dim, dim))
            add(p + "attn_v.weight", weight(kv_heads * head_dim, dim))
            add(p + "attn_q_norm.weight", norm(head_dim))
            add(p + "attn_k_norm.weight", norm(head_dim))
            add(p + "attn_output.weight", weight(dim, heads * head_dim))
        feed_forward(p, i)

    for i in range(n_layers):
        p = f"blk.{i}."
        if arch not in ("olmo2", "exaone4"):  # their sublayers' inputs are not normed
            add(p + "attn_norm.weight", norm(dim))
        if shape in RECURRENT:
            hybrid_layer(p, i)
            continue
        if latent:  # MLA's products and norms (k_b and v_b a head's matrix after another's)
            if q_lora:
                add(p + "attn_q_a.weight", weight(q_lora, dim))
                add(p + "attn_q_a_norm.weight", norm(q_lora))
                add(p + "attn_q_b.weight", weight(heads * (nope + rope_dims), q_lora))
            else:
                add(p + "attn_q.weight", weight(heads * (nope + rope_dims), dim))
            add(p + "attn_kv_a_mqa.weight", weight(kv_lora + rope_dims, dim))
            add(p + "attn_kv_a_norm.weight", norm(kv_lora))
            add(p + "attn_k_b.weight", weight(kv_lora, nope, count=heads))
            add(p + "attn_v_b.weight", weight(v_dim, kv_lora, count=heads))
            add(p + "attn_output.weight", weight(dim, heads * v_dim))
            add(p + "ffn_norm.weight", norm(dim))
            feed_forward(p, i)
            continue
        q, k, v = weight(heads * head_dim, dim), weight(kv_heads * head_dim, dim), weight(kv_heads * head_dim, dim)
        if arch == "phi3":  # q, k and v as one matrix, as Phi files store them
            add(p + "attn_qkv.weight", np.concatenate([q, k, v]))
        else:
            add(p + "attn_q.weight", q)
            add(p + "attn_k.weight", k)
            add(p + "attn_v.weight", v)
        if arch in ("qwen3", "qwen3vl", "qwen3moe", "gemma3", "exaone4"):
            add(p + "attn_q_norm.weight", norm(head_dim))
            add(p + "attn_k_norm.weight", norm(head_dim))
        if arch in ("olmoe", "olmo2"):  # over all of q and all of k
            add(p + "attn_q_norm.weight", norm(heads * head_dim))
            add(p + "attn_k_norm.weight", norm(kv_heads * head_dim))
        if arch in ("qwen2moe", "glm4moe", "qwen2vl"):  # qwen2's q/k/v biases
            for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)):
                add(p + name + ".bias", bias(rows))
        add(p + "attn_output.weight", weight(dim, heads * head_dim))
        oss = arch == "gpt-oss"  # biases everywhere, a sink a head, its feed-forward norm named post_attention_norm
        if arch not in ("olmo2", "exaone4"):
            add(p + ("post_attention_norm.weight" if oss or arch == "glm4moe" else "ffn_norm.weight"), norm(dim))
        if oss:
            for name, rows in (
                ("attn_q", heads * head_dim),
                ("attn_k", kv_heads * head_dim),
                ("attn_v", kv_heads * head_dim),
                ("attn_output", dim),
            ):
                add(p + name + ".bias", bias(rows))
            add(p + "attn_sinks.weight", rng.standard_normal(heads).astype(np.float32))
            add(p + "ffn_gate_inp.bias", bias(count))
            for name, rows in (("gate", expert_ffn), ("up", expert_ffn), ("down", dim)):
                add(p + f"ffn_{name}_exps.bias", np.stack([bias(rows) for _ in range(count)]))
        if arch in ("gemma3", "olmo2", "exaone4"):  # each sublayer's output normed before it is added
            add(p + "post_attention_norm.weight", norm(dim))
            add(p + "post_ffw_norm.weight", norm(dim))
        feed_forward(p, i)
    if direct:
        write_blocks(w, tensors, n_layers, tied, direct, seed)
        return path
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("out", nargs="?")
    parser.add_argument("--type", help="a llama-quantize type (Q4_K_M, Q8_0, ...); default: keep float16")
    parser.add_argument("--llama-quantize", default="llama-quantize", help="path of llama.cpp's llama-quantize")
    parser.add_argument("--layers", type=int, help="fewer layers than the real model (same widths)")
    parser.add_argument("--predictable", action="store_true", help="each greedy token a fixed successor of the last (see above)")
    parser.add_argument(
        "--direct", choices=sorted(MIXES), help="write this mix block by block, with no float16 file (bench/block_files.py)"
    )
    parser.add_argument("--reranker", action="store_true", help="a reranker's file (Qwen3-Reranker's layout; tied shapes)")
    parser.add_argument("--init", choices=sorted(INITS), default="default", help="the random initialisation (INITS)")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list or not (args.shape and args.out):
        for name, (arch, layers, dim, ffn, heads, kv, hd, tied, _) in SHAPES.items():
            experts = ", {} experts ({} a token) of FFN {}".format(*EXPERTS[name]) if name in EXPERTS else ""
            experts += f", a shared expert of FFN {SHARED_EXPERT[name]}" if name in SHARED_EXPERT else ""
            if name in ROUTING:
                dense, shared, _, _, sigmoid = ROUTING[name]
                experts += f", {dense} dense first, {shared} shared, {'sigmoid + selection bias' if sigmoid else 'softmax'}"
            print(
                f"{name:17} {arch:8} {layers} layers, dim {dim}, FFN {ffn}, {heads}/{kv} heads of {hd}{', tied' if tied else ''}{experts}"
            )
        return
    if args.direct or not args.type:
        write_shaped(
            args.shape, args.out, args.layers, predictable=args.predictable, direct=args.direct, reranker=args.reranker, init=args.init
        )
        print(f"{args.out}: {os.path.getsize(args.out) / 2**20:.0f} MiB")
        return
    f16 = args.out + ".f16.tmp"
    write_shaped(args.shape, f16, args.layers, predictable=args.predictable, reranker=args.reranker, init=args.init)
    try:
        subprocess.run([args.llama_quantize, f16, args.out, args.type], check=True, capture_output=True, text=True)
    finally:
        os.unlink(f16)
    print(f"{args.out}: {os.path.getsize(args.out) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
