"""DeepSeek-V2's multi-head latent attention (deepseek2): the latent row cached once for every head,
W_k_b absorbed into the query, against a float64 reference that decompresses full keys and values
instead, on every way of running a step, and end to end through the openai client."""

import numpy as np
import openai
import pytest
from support import drain_outputs, tiny_engine_server, wait_until
from support.tiny_deepseek2 import SIZES, LatentReference, write_tiny_deepseek2
from support.tiny_models import (
    assert_a_lane_does_not_depend_on_the_others,
    assert_chunked_prefill_matches,
    assert_tinygrad_path_matches,
    load_steps,
    off_by,
)

from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.kernels import abi
from webapp.engine.model.feed_forward import DenseFeedForward
from webapp.engine.model.kv_types import KvPool
from webapp.engine.model.latent_attention import LatentAttention
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.memory import kv_bytes_per_position
from webapp.engine.model.routed import RoutedFeedForward
from webapp.engine.model.steps import KernelJitSteps, OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.loader import load_gguf_model
from webapp.engine.serving.request import Request

RNG = np.random.default_rng(5)
PROMPT = [int(t) for t in RNG.integers(2, 4000, 16)]
LONG = [int(t) for t in RNG.integers(2, 4000, 70)]


@pytest.fixture(autouse=True)
def _tinygrad_here():
    use_tinygrad_from_this_thread()


@pytest.fixture(scope="module", params=[0, 64], ids=["lite", "q_lora"])
def deepseek2(tmp_path_factory, request):
    path = write_tiny_deepseek2(str(tmp_path_factory.mktemp("deepseek2") / "ds.gguf"), q_lora=request.param)
    return path, LatentReference(path)


def test_in_one_call_the_model_matches_the_decompressed_reference(deepseek2):
    path, ref = deepseek2
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, OneCallSteps)
    blocks = steps.model.blocks
    assert all(isinstance(b.mixer, LatentAttention) and b.layer_tensors.form & abi.LayerForm.LATENT for b in blocks)
    assert off_by(steps.score(PROMPT, slot=0, start=0), ref.logits(PROMPT)) < 1e-4


def test_the_cache_holds_one_latent_row_a_position(deepseek2):
    path, _ = deepseek2
    model, _ = load_model(path, slots=2, context=64)
    row = SIZES["rope"] + SIZES["kv_lora"]
    # (rows, slots + 1, kv heads, positions, a row): no value rows, a key's row is its value
    assert all((b.cache.shape[:3], b.cache.shape[4]) == ((1, 3, 1), row) for b in model.blocks)
    assert kv_bytes_per_position(model.config) == 2 * row * 2  # two layers, float16: full heads would take 4 x (64 + 32) x 2


def test_a_long_prompt_in_chunks_matches(deepseek2):
    path, ref = deepseek2
    assert_chunked_prefill_matches(load_steps(path, slots=2, context=256), ref.logits(LONG), LONG, 16, 1e-4)


def test_tinygrad_path_matches(deepseek2):
    path, ref = deepseek2
    assert_tinygrad_path_matches(path, ref.logits(PROMPT + [42]), PROMPT, 42)


@pytest.mark.parametrize("outside", ["output.weight", "attn_output.weight"])
def test_the_kernels_attention_among_tinygrad_products_matches(tmp_path, outside):
    """A matrix without a kernel: the head (every layer's matrices in blocks, a head's k_b and v_b read
    from them), or each layer's W_o (the per-head matrices then float16)."""
    path = write_tiny_deepseek2(str(tmp_path / "ds.gguf"), q_lora=64, float_matrices=(outside,))
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, KernelJitSteps)
    want = LatentReference(path).logits(PROMPT + [42])
    assert off_by(steps.prefill(PROMPT, slot=0, start=0), want[-2]) < 0.02
    assert off_by(steps.decode([42], slots=[0], positions=[len(PROMPT)])[0], want[-1]) < 0.02


def test_an_8_bit_cache_matches_the_reference_rounding_alike(tmp_path):
    path = write_tiny_deepseek2(str(tmp_path / "ds.gguf"))
    steps = load_steps(path, slots=2, context=256, kv_type="q8_0")
    assert off_by(steps.score(PROMPT, slot=0, start=0), LatentReference(path, kv_type="q8_0").logits(PROMPT)) < 1e-4


@pytest.mark.parametrize("matrix_type", ["Q8_0", "Q4_0"])
def test_quantized_files_and_a_lane_alone_or_among_others(tmp_path, matrix_type):
    path = write_tiny_deepseek2(str(tmp_path / "ds.gguf"), q_lora=64, matrix_type=matrix_type)
    steps = load_steps(path, slots=4, context=256)
    assert isinstance(steps, OneCallSteps)
    assert off_by(steps.score(PROMPT, slot=0, start=0), LatentReference(path).logits(PROMPT)) < 0.1
    assert_a_lane_does_not_depend_on_the_others(steps, PROMPT, 4)


def test_yarn_scales_the_scores_as_llama_cpp_does(tmp_path):
    """DeepSeek-V2's YaRN: q . k times mscale squared, mscale = 1 + 0.1 * mscale_all_dim * ln(factor)."""
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 40.0, "rope.scaling.original_context_length": 64}
    path = write_tiny_deepseek2(str(tmp_path / "ds.gguf"), metadata=yarn | {"rope.scaling.yarn_log_multiplier": 0.0707})
    model, _ = load_model(path, slots=1, context=32)
    mscale = 1 + 0.1 * 0.707 * np.log(40.0)
    assert model.config.score_scale == pytest.approx(mscale**2 / np.sqrt(SIZES["nope"] + SIZES["rope"]))
    assert model.config.rope_attention_factor == 1.0
    steps = load_steps(path, slots=1, context=64)  # YaRN's frequencies too, against the reference's
    assert off_by(steps.score(PROMPT, slot=0, start=0), LatentReference(path).logits(PROMPT)) < 1e-4
    with pytest.raises(ModelLoadError, match="yarn_log_multiplier"):
        load_model(write_tiny_deepseek2(str(tmp_path / "no-mul.gguf"), metadata=yarn), slots=1, context=32)


def test_a_file_written_before_mla_was_split_is_refused_in_one_line(tmp_path):
    path = write_tiny_deepseek2(str(tmp_path / "ds.gguf"))
    data = open(path, "rb").read()
    name = b"deepseek2.attention.key_length_mla"
    open(path, "wb").write(data.replace(name, name.replace(b"mla", b"xyz")))  # the key renamed away
    with pytest.raises(ModelLoadError, match="convert the model again"):
        load_model(path, slots=1, context=32)


# DeepSeek-V2(-Lite)'s mixture: softmax, the chosen probabilities as they are, two shared experts;
# DeepSeek-V3's (Moonlight): sigmoid, chosen with a selection bias, divided by their sum, scaled
MIXTURES = {
    "v2": ({}, False, 2),
    "v3": ({"expert_gating_func": 2, "expert_weights_norm": True, "expert_weights_scale": 2.5}, True, 1),
}


@pytest.mark.parametrize("kind", sorted(MIXTURES))
def test_mixtures_of_experts_after_a_dense_layer_match_the_reference(tmp_path, kind):
    routing, bias, shared = MIXTURES[kind]
    path = write_tiny_deepseek2(
        str(tmp_path / "ds.gguf"), n_layers=3, q_lora=64, experts=(8, 2, 64), shared=shared, selection_bias=bias, metadata=routing
    )
    steps = load_steps(path, slots=4, context=256)
    assert isinstance(steps, OneCallSteps)
    blocks = steps.model.blocks
    assert all(type(b.mixer) is LatentAttention for b in blocks) and type(blocks[0].ffn) is DenseFeedForward
    assert all(isinstance(b.ffn, RoutedFeedForward) and b.ffn.shared is not None for b in blocks[1:])
    assert steps.model.config.selection_bias is bias and steps.model.config.shared_expert_hidden_dim == shared * 64
    ref = LatentReference(path)
    assert off_by(steps.score(PROMPT, slot=0, start=0), ref.logits(PROMPT)) < 1e-4
    assert_a_lane_does_not_depend_on_the_others(steps, PROMPT, 4)
    assert_tinygrad_path_matches(path, ref.logits(PROMPT + [42]), PROMPT, 42)


def test_the_server_answers_the_openai_client(tmp_path):
    path = write_tiny_deepseek2(str(tmp_path / "ds.gguf"), q_lora=64, matrix_type="Q8_0")
    with tiny_engine_server(path, slots=2, queue_limit=2) as (engine, srv):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        ask = {"model": "deepseek2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
        reply, again = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
        assert again.choices[0].message.content == reply.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        client.close()


def test_a_paged_pool_of_latent_rows_gives_the_slot_caches_tokens_with_shared_blocks_and_preemption(tmp_path):
    """Four requests sharing a 40-token prefix: in slots, then in a pool too small for all at once
    (the newest preempted and computed again), every token the same."""
    path = write_tiny_deepseek2(str(tmp_path / "ds.gguf"), q_lora=64, matrix_type="Q8_0")
    prefix = [int(t) for t in RNG.integers(2, 4000, 40)]
    prompts = [prefix + [int(t) for t in RNG.integers(2, 4000, 5 + 3 * i)] for i in range(4)]

    def tokens(paging):
        use_tinygrad_from_this_thread()  # the last engine's model thread had it
        engine = Engine(lambda: load_gguf_model(path, 4, 256, 16, paging=paging), slots=4, prefill_chunk=16).start()
        try:
            assert wait_until(lambda: engine.state != "loading", timeout=120) and engine.state == "ok", engine.error
            assert isinstance(engine.loaded.kv_pool, KvPool) == (paging is not None)
            requests = [Request(p, SamplingParams(max_tokens=48, temperature=0.0)) for p in prompts]
            for r in requests:
                engine.submit(r)
            return [drain_outputs(r, timeout=120)[0] for r in requests], sum(r.preemptions for r in requests)
        finally:
            engine.stop(5)

    in_slots, _ = tokens(None)
    paged, preemptions = tokens((4, ("positions", 272)))
    assert paged == in_slots and preemptions > 0
