"""Mixture-of-experts files (qwen3moe) against the float64 reference: the router on its own, the whole
model on the CPU kernels (one call, and the five-kernel path around a matrix without a kernel) and on
tinygrad's path, batch invariance, and clear errors for malformed expert tensors."""

import dataclasses

import numpy as np
import openai
import pytest
import requests
from support import tiny_engine_server
from support.tiny_models import (
    Reference,
    assert_a_lane_does_not_depend_on_the_others,
    assert_top1_where_float64_decides,
    load_steps,
    write_tiny_gguf,
)

from webapp.engine.model.config import ModelConfig, check_tensors
from webapp.engine.model.gguf import read_gguf
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.routed import RoutedFeedForward
from webapp.engine.model.steps import KernelJitSteps, OneCallSteps, TinygradJitSteps, steps_for
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 77, 88, 99, 1234, 5]
EXPERTS = (8, 2, 32)  # count, used a token, each one's width
K_EXPERTS = (8, 2, 256)  # K-quants need rows of 256 values


@pytest.fixture(autouse=True)
def _tinygrad_here():
    use_tinygrad_from_this_thread()


def _file(tmp_path, matrix_type=None, experts=EXPERTS, **kwargs) -> str:
    widths = {"dim": 256} if experts is K_EXPERTS else {}
    return write_tiny_gguf(str(tmp_path / "moe.gguf"), "qwen3moe", experts=experts, matrix_type=matrix_type, seed=1, **widths, **kwargs)


def test_the_router_sends_each_token_to_the_experts_the_reference_chooses(tmp_path):
    """The kernels' per-expert token counts after scoring a prompt are the reference's routing, layer by layer."""
    path = _file(tmp_path)
    steps, ref = load_steps(path, slots=2, context=64), Reference(path)
    assert isinstance(steps, OneCallSteps)
    steps.score(PROMPT, slot=0, start=0)
    ref.hidden(PROMPT)
    for i, block in enumerate(steps.model.blocks):
        chosen, weights = ref.routing(ref.ffn_inputs[i], f"blk.{i}.")
        np.testing.assert_array_equal(block.routed_tokens(), np.bincount(chosen.ravel(), minlength=EXPERTS[0]))
        np.testing.assert_allclose(weights.sum(-1), 1.0)  # qwen3moe divides by the chosen ones' sum
        assert len(set(chosen.ravel())) > EXPERTS[1]  # the tokens do not all pick the same experts


@pytest.mark.parametrize("matrix_type, experts, tolerance", [(None, EXPERTS, 1e-4), ("Q8_0", EXPERTS, 0.05), ("Q4_K_M", K_EXPERTS, 0.05)])
def test_on_the_kernels_in_one_call_the_model_matches_the_reference(tmp_path, matrix_type, experts, tolerance):
    path = _file(tmp_path, matrix_type, experts)
    steps, ref = load_steps(path, slots=2, context=64), Reference(path)
    assert isinstance(steps, OneCallSteps)
    assert all(isinstance(b.ffn, RoutedFeedForward) and b.ffn.expert_blocks is not None for b in steps.model.blocks)
    want, got = ref.logits(PROMPT), steps.score(PROMPT, slot=0, start=0)
    assert np.abs(got - want).max() <= tolerance * np.abs(want).max()
    assert_top1_where_float64_decides(got, want)


def test_a_matrix_without_a_kernel_runs_the_experts_on_tinygrad_beside_the_kernels(tmp_path):
    path = _file(tmp_path, "Q8_0", float_matrices=("attn_q.weight",))  # F64: no kernel, a float16 copy
    steps, ref = load_steps(path, slots=2, context=64), Reference(path)
    assert isinstance(steps, KernelJitSteps)
    assert all(b.ffn.expert_blocks is None for b in steps.model.blocks)
    want = ref.logits(PROMPT)
    got = np.stack([steps.prefill(PROMPT[: n + 1], slot=0, start=0) for n in range(len(PROMPT))])
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    assert_top1_where_float64_decides(got, want)


def test_on_tinygrad_every_expert_runs_under_the_routers_mask(tmp_path):
    path = _file(tmp_path)
    model, _ = load_model(path, slots=2, context=64, cpu_kernels=False)
    steps, ref = steps_for(model, 16), Reference(path)
    assert isinstance(steps, TinygradJitSteps)
    want = ref.logits(PROMPT)
    whole = steps.prefill(PROMPT, slot=0, start=0)
    np.testing.assert_allclose(whole, want[-1], atol=2e-3 * np.abs(want).max())
    decoded = steps.decode([42], slots=[0], positions=[len(PROMPT)])[0]
    np.testing.assert_allclose(decoded, ref.logits(PROMPT + [42])[-1], atol=2e-3 * np.abs(want).max())


def test_a_tokens_experts_and_numbers_do_not_depend_on_the_other_lanes(tmp_path):
    """Bit for bit: a sequence decoded alone, and among seven others that share its experts or not."""
    assert_a_lane_does_not_depend_on_the_others(load_steps(_file(tmp_path, "Q4_K_M", K_EXPERTS), slots=8, context=64), PROMPT, 8)


def _with_uint32(path: str, key: str, value: int) -> str:
    """The file with metadata `key` (a uint32) set to `value`, in place: a file whose keys and tensors disagree."""
    data = bytearray(open(path, "rb").read())
    name = key.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    assert data[at : at + 4] == (4).to_bytes(4, "little")  # GGUF's uint32
    data[at + 4 : at + 8] = value.to_bytes(4, "little")
    open(path, "wb").write(bytes(data))
    return path


@pytest.mark.parametrize(
    "patches, message",
    [
        ({"expert_used_count": 9}, "more than the 8 experts"),
        ({"expert_count": 4000}, "expert_count = 4000: expected a whole number from 1 to 512"),
        ({"expert_count": 4}, "ffn_gate_inp.weight' has shape 8 x 64; the file's metadata implies 4 x 64"),
        ({"expert_feed_forward_length": 64}, "ffn_gate_exps.weight' has shape 256 x 64; the file's metadata implies 512 x 64"),
        # as many rows in all, cut into other experts: the 3-D tensor's own dimensions say so
        ({"expert_count": 4, "expert_feed_forward_length": 64}, "ffn_gate_inp.weight' has shape 8 x 64"),
    ],
)
def test_expert_metadata_that_disagrees_with_the_tensors_is_refused_at_load(tmp_path, patches, message):
    path = _file(tmp_path)
    for key, value in patches.items():
        _with_uint32(path, f"qwen3moe.{key}", value)
    with pytest.raises(ModelLoadError, match=message):
        load_model(path, slots=1, context=32)


def test_expert_tensors_cut_into_another_count_of_experts_are_refused(tmp_path):
    """As many rows in all, another split: a 3-D tensor's own dimensions must name the file's experts."""
    kv, table = read_gguf(_file(tmp_path))
    config = ModelConfig.from_gguf(kv, table)
    name = "blk.1.ffn_up_exps.weight"
    table[name] = dataclasses.replace(table[name], shape=(4, 64, 64))
    with pytest.raises(ModelLoadError, match=r"'blk.1.ffn_up_exps.weight' has dimensions \(4, 64, 64\); expected 8 experts"):
        check_tensors(config, table)


def test_a_server_answers_the_openai_client_and_shows_each_experts_load(tmp_path):
    """End to end: the openai client's chats on a qwen3moe file, then /metrics and /admin/stats.json
    count the lanes every expert took (each generated or prefilled token: `used` experts a layer)."""
    with tiny_engine_server(_file(tmp_path, "Q8_0"), slots=2, queue_limit=2) as (engine, srv):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="moe", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
        client.close()
        stats = requests.get(f"{srv.url}/admin/stats.json", timeout=30).json()
        experts = stats["experts"]
        # every token through the model went to `used` experts in each of 2 layers (warm-up's tokens too)
        assert experts["count"] == EXPERTS[0] and sum(experts["tokens_total"]) % (EXPERTS[1] * 2) == 0
        assert sum(experts["tokens_total"]) >= (reply.usage.prompt_tokens + 4) * EXPERTS[1] * 2
        assert experts["busiest_per_step"] >= experts["mean_per_step"] > 0 and experts["imbalance"] >= 1
        metrics = requests.get(f"{srv.url}/metrics", timeout=30).text
        lines = [line for line in metrics.splitlines() if line.startswith("llm_expert_tokens_total{")]
        assert len(lines) == EXPERTS[0] and sum(float(line.split()[-1]) for line in lines) == sum(experts["tokens_total"])
        assert "llm_expert_load_imbalance " in metrics
        page = requests.get(f"{srv.url}/admin", timeout=30).text
        bars = page[page.index('id="expert-bars"') :]
        assert bars[: bars.index("</svg>")].count("<rect ") == EXPERTS[0] and "Busiest / mean" in page


def test_on_tinygrads_path_a_few_tokens_read_only_their_chosen_experts(tmp_path):
    """A decode step's lanes (tokens x experts used < experts) read their chosen experts through an
    indexed load, not every expert; both ways give the reference's outputs (the tinygrad tests)."""
    from tinygrad import GlobalCounters, Tensor

    model, _ = load_model(_file(tmp_path), slots=1, context=64, cpu_kernels=False)
    ffn = next(b.ffn for b in model.blocks if isinstance(b.ffn, RoutedFeedForward))
    experts = sum(t.nbytes() for t in (ffn.gate_exps, ffn.up_exps, ffn.down_exps))
    n = Tensor(np.random.default_rng(3).standard_normal((1, 1, model.config.dim), dtype=np.float32)).realize()
    GlobalCounters.reset()
    one = ffn(n).realize()
    assert GlobalCounters.global_mem < 0.5 * experts  # two of eight experts, and the router
    many = ffn(n.expand(1, 8, model.config.dim).contiguous()).realize()  # 8 tokens x 2 >= 8 experts: the mask
    np.testing.assert_allclose(many.numpy()[0, 3], one.numpy()[0, 0], rtol=1e-5, atol=1e-5)
