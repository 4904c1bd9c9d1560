"""GGUF files are untrusted input: valid tiny files (seeds of several architectures and block formats:
Q8_0, K-quants, IQ4, 2- and 3-bit, float16 and bfloat16; gpt-oss's MXFP4 experts, Gemma 3's windows,
Phi-3's fused matrices, GLM-4.5's NextN blocks, a reranker's head), mutated thousands of ways in their headers,
metadata, tensor tables (types, shapes, offsets) and lengths, either load (model, tokenizer and
template, through the server's own loader) and run a step on the CPU kernels, or stop with one
`ModelLoadError` naming what is wrong. Never another exception, and never a crash in the C kernels,
which trust every size they are given (tests/integration/test_sanitizers.py runs this file again
under AddressSanitizer and UndefinedBehaviorSanitizer).
"""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from support.k_quants import QUANTIZERS as K_QUANTIZERS
from support.low_bit_quants import QUANTIZERS as LOW_BIT_QUANTIZERS
from support.tiny_models import smollm_tokenizer_fields_cut, write_tiny_gguf

from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.serving.loader import load_gguf_model

CASES = 2000
MORE_CASES = 250
VOCAB = 512
# (architecture, the layers' block type, cases): the first is the original seed; the others fewer cases
# each, their matrices 256 wide (a K-quant block's values)
SEEDS = [
    ("qwen3", "Q8_0", CASES),
    ("llama", "Q4_K", 400),
    ("llama", "Q6_K", 300),
    ("qwen3", "IQ4_XS", 300),
    ("llama", "Q3_K", 300),
    ("qwen3", "F16", 300),
    ("llama", "BF16", 300),
]
# struct formats of GGUF's scalar value types (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
EXTREMES = [0, 1, 2, 3, 7, 31, 32, 255, 256, 1000, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]


def _small_vocabulary() -> dict:
    """The default model's first 512 tokens, with the merges among them: a real byte-level BPE."""
    tok = smollm_tokenizer_fields_cut(VOCAB)
    return {
        "tokens": tok["tokenizer.ggml.tokens"],
        "types": tok["tokenizer.ggml.token_type"],
        "merges": tok["tokenizer.ggml.merges"],
        "template": tok["tokenizer.chat_template"],
    }


def write_fixture(path: str, arch: str = "qwen3", matrix_type: str = "Q8_0") -> None:
    rng = np.random.default_rng(0)
    vocab = _small_vocabulary()
    wide = matrix_type != "Q8_0"
    dim, hidden, heads, kv_heads, head_dim = (256, 256, 4, 2, 64) if wide else (64, 128, 4, 2, 16)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    quantizers = K_QUANTIZERS | LOW_BIT_QUANTIZERS
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab["tokens"])
    w.add_token_merges(vocab["merges"])
    w.add_token_types(vocab["types"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(vocab["template"])

    def matrix(name: str, rows: int, cols: int, q8: bool = True) -> None:
        values = (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32)
        if not q8:
            w.add_tensor(name, values.astype(np.float16))
        elif qtype in quantizers:
            w.add_tensor(name, quantizers[qtype](values), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", VOCAB, dim)
    norm("output_norm.weight", dim)
    matrix("output.weight", VOCAB, dim, q8=False)
    norm("blk.0.attn_norm.weight", dim)
    matrix("blk.0.attn_q.weight", heads * head_dim, dim)
    matrix("blk.0.attn_k.weight", kv_heads * head_dim, dim)
    matrix("blk.0.attn_v.weight", kv_heads * head_dim, dim, q8=False)
    if arch == "qwen3":
        norm("blk.0.attn_q_norm.weight", head_dim)
        norm("blk.0.attn_k_norm.weight", head_dim)
    matrix("blk.0.attn_output.weight", dim, heads * head_dim)
    norm("blk.0.ffn_norm.weight", dim)
    matrix("blk.0.ffn_gate.weight", hidden, dim)
    matrix("blk.0.ffn_up.weight", hidden, dim)
    matrix("blk.0.ffn_down.weight", dim, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def field_positions(data: bytes) -> dict[str, list]:
    """Where each mutable field of the file lies: (offset, struct format) for the header's counts, every
    metadata value's type and scalar value, every string length and array count, and each tensor's
    dimension count, dimensions, type and offset."""
    pos, fields = 24, {"header": [(4, "<I"), (8, "<Q"), (16, "<Q")], "meta": [], "lengths": [], "tensor": []}

    def skip_string() -> str:
        nonlocal pos
        fields["lengths"].append((pos, "<Q"))
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        return data[pos - n : pos].decode()

    def skip_value(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            skip_string()
        elif kind == 9:
            item, count = struct.unpack_from("<IQ", data, pos)
            fields["meta"].append((pos, "<I"))
            fields["lengths"].append((pos + 4, "<Q"))
            pos += 12
            for _ in range(count):
                skip_value(item)
        else:
            fields["meta"].append((pos, "<" + SCALARS[kind]))
            pos += struct.calcsize(SCALARS[kind])

    (n_tensors, n_kv) = struct.unpack_from("<QQ", data, 8)
    for _ in range(n_kv):
        skip_string()
        fields["meta"].append((pos, "<I"))
        (kind,) = struct.unpack_from("<I", data, pos)
        pos += 4
        skip_value(kind)
    for _ in range(n_tensors):
        skip_string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        fields["tensor"].append((pos, "<I"))
        pos += 4
        fields["tensor"] += [(pos + 8 * i, "<Q") for i in range(n_dims)]
        pos += 8 * n_dims
        fields["tensor"] += [(pos, "<I"), (pos + 4, "<Q")]
        pos += 12
    fields["end_of_table"] = pos
    return fields


def mutate(data: bytes, fields: dict, rng: np.random.Generator) -> bytes:
    out = bytearray(data)
    kind = rng.choice(["header", "meta", "lengths", "tensor", "tensor", "truncate", "flip"])
    if kind == "truncate":
        return bytes(out[: int(rng.integers(0, len(out)))])
    if kind == "flip":
        for _ in range(int(rng.integers(1, 8))):
            out[int(rng.integers(0, fields["end_of_table"]))] = int(rng.integers(0, 256))
        return bytes(out)
    offset, fmt = fields[kind][int(rng.integers(0, len(fields[kind])))]
    size = struct.calcsize(fmt)
    (old,) = struct.unpack_from(fmt, out, offset)
    if fmt[1] in "fd":
        new = float(rng.choice([0.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), old * 2]))
    elif fmt[1] == "?":
        new = not old
    else:
        choice = rng.integers(0, 4)
        if choice == 0:
            new = int(rng.choice(EXTREMES))
        elif choice == 1:
            new = int(old) + int(rng.integers(-40, 41))
        elif choice == 2:
            new = int(old) * 2 if rng.integers(0, 2) else int(old) // 2
        else:
            new = int(rng.integers(0, 42))  # a type id, a small count
        new %= 1 << (8 * size)
        if fmt[1] in "bhiq" and new >= 1 << (8 * size - 1):
            new -= 1 << (8 * size)
    struct.pack_into(fmt, out, offset, new)
    return bytes(out)


def run_mutations(data: bytes, cases: int, target, seed: int) -> tuple[dict, set]:
    """`cases` mutations of a model file's bytes, each loaded through the server's loader: refused in one
    ModelLoadError line, or loaded and run (a prompt and a decode step over whatever the mutation left
    in its tensors). The outcomes' counts, and the refusals' first words."""
    fields, rng = field_positions(data), np.random.default_rng(seed)
    outcomes, messages = {"loaded": 0, "refused": 0}, set()
    for _ in range(cases):
        target.write_bytes(mutate(data, fields, rng))
        try:
            loaded = load_gguf_model(str(target), slots=1, max_context=32, prefill_chunk=8)
        except ModelLoadError as e:
            outcomes["refused"] += 1
            messages.add(str(e).split(":")[0][:60])
            assert str(e) and "\n" not in str(e)
            continue
        outcomes["loaded"] += 1
        vocab = loaded.runner.steps.model.config.vocab_size
        assert loaded.runner.steps.prefill([1, 2, 3], 0, 0).shape == (vocab,)
        assert loaded.runner.steps.decode([4], [0], [3]).shape == (1, vocab)
    return outcomes, messages


@pytest.mark.parametrize("arch, matrix_type, cases", SEEDS)
def test_mutated_gguf_files_load_and_run_or_fail_with_a_model_load_error(tmp_path, arch, matrix_type, cases):
    use_tinygrad_from_this_thread()
    source = tmp_path / "valid.gguf"
    write_fixture(str(source), arch, matrix_type)
    data = source.read_bytes()
    valid = load_gguf_model(str(source), slots=1, max_context=32, prefill_chunk=8)
    assert valid.context == 32 and np.isfinite(valid.runner.steps.prefill([1, 2, 3, 4], 0, 0)).all()
    outcomes, messages = run_mutations(data, cases, tmp_path / "mutated.gguf", seed=2026)
    assert outcomes["refused"] > cases // 2, outcomes
    assert len(messages) > 20 * cases // CASES  # the refusals name many different faults


# more seeds, written by tests/support/tiny_models.py on a 512-token vocabulary: the architectures whose
# loaders read keys and tensors the seeds above lack (experts in MXFP4 with biases and sinks, sliding
# windows and post-norms, fused q/k/v, a dense lead layer and NextN blocks, a reranker's head)
MORE_SEEDS = {
    "gpt-oss MXFP4": dict(arch="gpt-oss", experts=(4, 2, 64), matrix_type="MXFP4_MOE", hidden=64),
    "gemma3": dict(arch="gemma3", matrix_type="Q8_0"),
    "phi3": dict(arch="phi3", matrix_type="Q8_0"),
    "glm4moe": dict(arch="glm4moe", experts=(4, 2, 64), matrix_type="Q8_0", n_layers=2, nextn_layers=1),
    "qwen3 reranker": dict(arch="qwen3", rank_labels=("on", "at"), quantize_embedding=False),  # two of the first 512 tokens
}


@pytest.mark.parametrize("seed", sorted(MORE_SEEDS))
def test_mutated_files_of_more_architectures_load_or_fail_with_a_model_load_error(tmp_path, seed):
    use_tinygrad_from_this_thread()
    source = write_tiny_gguf(str(tmp_path / "valid.gguf"), context=64, vocab_size=VOCAB, **MORE_SEEDS[seed])
    data = open(source, "rb").read()
    assert load_gguf_model(source, slots=1, max_context=32, prefill_chunk=8).context == 32
    outcomes, messages = run_mutations(data, MORE_CASES, tmp_path / "mutated.gguf", seed=2028)
    assert outcomes["refused"] > MORE_CASES // 2 and len(messages) > 10, (outcomes, messages)


@pytest.mark.parametrize("family, tensor_type", [("idefics3", "F16"), ("qwen2.5vl", "F16"), ("qwen2.5vl", "Q8_0")])
def test_mutated_projector_files_load_or_fail_with_a_model_load_error(tmp_path, family, tensor_type):
    """A projector file (images' GGUF, webapp/engine/vision) is untrusted too: mutated as above, it
    loads and encodes an image, or stops with one ModelLoadError line; a SigLIP family's and one with
    a tower of its own (Qwen2.5-VL); a Q8_0 one loaded as the server loads it, its blocks laid out for
    the CPU kernels and multiplied there (their C reads every byte of them)."""
    from support.tiny_projectors import write_tiny_projector, write_tiny_qwen2vl_projector

    from webapp.engine.kernels.cpu import QuantizedCPU
    from webapp.engine.kernels.vision_encoder import VisionEncoderKernels
    from webapp.engine.vision.projector import load_projector

    path = str(tmp_path / "valid.mmproj.gguf")
    source = (
        write_tiny_projector(path, family, tensor_type=tensor_type)
        if family == "idefics3"
        else write_tiny_qwen2vl_projector(path, tensor_type=tensor_type)
    )
    kernels = QuantizedCPU.load() if tensor_type != "F16" else None
    data = open(source, "rb").read()
    fields = field_positions(data)
    picture = np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    rng = np.random.default_rng(2027)
    target, outcomes, messages = tmp_path / "mutated.mmproj.gguf", {"loaded": 0, "refused": 0}, set()
    for _ in range(CASES):
        target.write_bytes(mutate(data, fields, rng))
        try:
            projector = load_projector(str(target), kernels.library if kernels else None)
        except ModelLoadError as e:
            outcomes["refused"] += 1
            messages.add(str(e)[:50])
            assert str(e) and "\n" not in str(e)
            continue
        outcomes["loaded"] += 1
        projector.encoder.kernels = VisionEncoderKernels(kernels.library) if kernels else None
        for _, pixels, _ in projector.pieces(picture):
            assert projector.encode(pixels).shape == (projector.tokens(pixels), projector.text_dim)
    assert outcomes["refused"] > CASES // 2, outcomes
    assert len(messages) > 20
