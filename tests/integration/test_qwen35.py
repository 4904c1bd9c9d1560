"""Qwen3.5's hybrid (qwen35): Gated DeltaNet recurrent layers beside gated attention layers, on the
CPU kernels' one-call step, against a float64 reference that runs the delta rule a token at a time;
the recurrent state's reuse rule; and end to end through the engine and the openai client."""

import contextlib
import urllib.request

import numpy as np
import openai
import pytest
from support import drain_outputs, tiny_engine_server, wait_until
from support.tiny_models import assert_chunked_prefill_matches, load_steps, off_by
from support.tiny_qwen35 import SIZES, Qwen35Reference, write_tiny_qwen35

from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.kernels import abi
from webapp.engine.model.gated_delta import GatedAttention, GatedDeltaNet
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.memory import kv_bytes_per_position, spare_state_bytes, state_bytes
from webapp.engine.model.recurrent_config import DRAFT_STATE_ROWS, snapshot_rows, spare_state_rows
from webapp.engine.model.routed import RoutedFeedForward
from webapp.engine.model.steps import OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.loader import load_gguf_model
from webapp.engine.serving.request import Request

RNG = np.random.default_rng(7)
PROMPT = [int(t) for t in RNG.integers(2, 4000, 20)]
LONG = [int(t) for t in RNG.integers(2, 4000, 70)]


@pytest.fixture(autouse=True)
def _tinygrad_here():
    use_tinygrad_from_this_thread()


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    path = write_tiny_qwen35(str(tmp_path_factory.mktemp("qwen35") / "q35.gguf"))
    return path, Qwen35Reference(path)


def test_in_one_call_the_model_matches_the_reference(qwen35):
    path, ref = qwen35
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, OneCallSteps) and steps.speculates and steps.drafted_limit == DRAFT_STATE_ROWS
    kinds = [type(b.mixer) for b in steps.model.blocks]
    assert kinds == [GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, GatedAttention]
    assert steps.model.blocks[0].layer_tensors.form == abi.LayerForm.RECURRENT
    assert steps.model.blocks[3].layer_tensors.form == abi.LayerForm.GATED_ATTENTION
    assert off_by(steps.score(PROMPT, slot=0, start=0), ref.logits(PROMPT)) < 1e-4


def test_a_recurrent_layer_keeps_a_state_a_slot_whatever_the_context(qwen35):
    path, _ = qwen35
    model, _ = load_model(path, slots=2, context=64)
    s = SIZES
    conv = (2 * s["k_heads"] + s["v_heads"]) * s["state"]
    floats = (s["conv_kernel"] - 1) * conv + s["v_heads"] * s["state"] ** 2
    rows = 3 + snapshot_rows(2) + DRAFT_STATE_ROWS  # every slot, the scratch one, the snapshots, the drafted tokens'
    assert model.blocks[0].cache.shape == (1, rows, 1, 1, floats)
    assert kv_bytes_per_position(model.config) == 2 * s["kv_heads"] * s["head_dim"] * 2  # the one attention layer's keys and values
    assert state_bytes(model.config) == 3 * 4 * floats
    assert spare_state_bytes(model.config, 2) == spare_state_rows(2) * state_bytes(model.config)


def test_a_long_prompt_in_chunks_matches(qwen35):
    path, ref = qwen35
    assert_chunked_prefill_matches(load_steps(path, slots=2, context=256), ref.logits(LONG), LONG, 16, 1e-4)


def test_an_8_bit_cache_matches_the_reference_rounding_alike(qwen35):
    """LLM_KV_TYPE=q8_0 rounds the attention layer's keys and values; the recurrent state stays float32."""
    path, _ = qwen35
    steps = load_steps(path, slots=2, context=256, kv_type="q8_0")
    assert off_by(steps.score(PROMPT, slot=0, start=0), Qwen35Reference(path, kv_type="q8_0").logits(PROMPT)) < 1e-4


def test_position_zero_starts_a_sequence_afresh_and_a_copied_state_goes_on(qwen35):
    path, ref = qwen35
    steps = load_steps(path, slots=3, context=256)
    steps.prefill(LONG[:30], slot=0, start=0)  # another sequence first: its state must not leak
    want = ref.logits(PROMPT + [42])
    assert off_by(steps.prefill(PROMPT, slot=0, start=0), want[-2]) < 1e-4
    steps.copy_prefix(0, 2, len(PROMPT))  # the whole sequence's state, as state_snapshots.RecurrentSlots allows
    assert off_by(steps.decode([42], slots=[2], positions=[len(PROMPT)])[0], want[-1]) < 1e-4


def test_a_snapshot_of_the_state_serves_its_prefix_in_another_slot(qwen35):
    """The state copied aside where a chunk ended, the sequence run on past it, then that prefix's
    keys and values and the snapshot's state in another slot: a prompt that parts there goes on as
    if prefilled afresh."""
    path, ref = qwen35
    steps = load_steps(path, slots=2, context=256)
    snapshot = 2 + 1  # the first row after both slots' and the scratch one
    steps.prefill(LONG[:40], slot=0, start=0)
    steps.copy_state(0, snapshot)
    steps.prefill(LONG[40:60], slot=0, start=40)  # the state moves on; the snapshot stays at 40
    steps.prefill(LONG[:10], slot=1, start=0)  # whatever slot 1 held before
    steps.copy_prefix(0, 1, 40)
    steps.copy_state(snapshot, 1)
    other = LONG[:40] + PROMPT[:10]
    assert off_by(steps.prefill(PROMPT[:10], slot=1, start=40), ref.logits(other)[-1]) < 1e-4


def _decoded_alone(steps, slot, prompt, fed):
    """Plain decoding: `prompt` prefilled from position 0, then each of `fed` a step; every fed token's logits."""
    steps.prefill(prompt, slot=slot, start=0)
    return np.stack([steps.decode([t], [slot], [len(prompt) + i])[0] for i, t in enumerate(fed)])


def test_drafted_tokens_leave_the_state_of_the_last_one_kept(qwen35):
    """Speculation on a recurrent model: each drafted token runs in a row of state of its own, so
    whether a verification keeps all, some or none of a lane's drafts, the next token decodes as if
    only the kept ones had been fed; and every drafted position's logits are a lone decode's, bit for bit."""
    path, ref = qwen35
    steps = load_steps(path, slots=2, context=256)
    fed = [42, 7, 99, 5]  # the last output token, then three drafts
    for kept in (1, 2, 4):
        steps.prefill(PROMPT, slot=0, start=0)
        rows = steps.verify([fed], [0], [len(PROMPT)])[0]
        steps.kept(0, kept)
        after = steps.decode([77], [0], [len(PROMPT) + kept])[0]
        want = _decoded_alone(steps, 1, PROMPT, fed[:kept] + [77])
        np.testing.assert_array_equal(rows[:kept], want[:kept])
        np.testing.assert_array_equal(after, want[kept])
    np.testing.assert_array_equal(rows, _decoded_alone(steps, 1, PROMPT, fed))
    assert off_by(after, ref.logits(PROMPT + fed + [77])[-1]) < 1e-4


def test_drafted_lanes_of_two_sequences_beside_a_prompt_chunk_each_keep_their_own(qwen35):
    """One call: a prompt chunk in slot 2, and drafted lanes of slots 0 and 1 whose drafts share the
    draft rows; slot 0 keeps one draft of three, slot 1 all of its two. Each goes on as alone."""
    path, _ = qwen35
    steps = load_steps(path, slots=4, context=256)
    a, b = PROMPT, LONG[:25]
    steps.prefill(a, slot=0, start=0)
    steps.prefill(b, slot=1, start=0)
    steps.prefill(LONG[:30], slot=2, start=0)
    lanes = [[42, 7, 99, 5], [11, 12, 13]]
    firsts, rows = steps.prefill_and_verify([(LONG[30:40], 2, 30)], lanes, [0, 1], [len(a), len(b)])
    steps.kept(0, 2)
    steps.kept(1, 3)
    after = steps.decode([77, 78, LONG[40]], [0, 1, 2], [len(a) + 2, len(b) + 3, 40])
    want_a = _decoded_alone(steps, 3, a, [42, 7, 77])
    want_b = _decoded_alone(steps, 3, b, [11, 12, 13, 78])
    np.testing.assert_array_equal(rows[0], _decoded_alone(steps, 3, a, lanes[0]))
    np.testing.assert_array_equal(rows[1], want_b[:3])
    np.testing.assert_array_equal(after[0], want_a[2])
    np.testing.assert_array_equal(after[1], want_b[3])
    np.testing.assert_array_equal(firsts[0], steps.prefill(LONG[:40], slot=3, start=0))
    np.testing.assert_array_equal(after[2], steps.decode([LONG[40]], [3], [40])[0])


@pytest.mark.parametrize("matrix_type", ["Q8_0", "Q4_0"])
def test_quantized_files_and_a_lane_alone_or_among_others(tmp_path, matrix_type):
    """Bit for bit: a lane decoded alone, among three others, and as a prompt's last token (each
    sequence prefilled again first: a recurrent state takes in every token it is fed)."""
    path = write_tiny_qwen35(str(tmp_path / "q35.gguf"), matrix_type=matrix_type)
    steps = load_steps(path, slots=4, context=256)
    assert isinstance(steps, OneCallSteps)
    # activations are rounded to int8 before every product, as llama.cpp rounds them, and the state
    # carries each token's rounding into every later one: 0.03-0.12 off here, 1e-6 with float matrices
    assert off_by(steps.score(PROMPT, slot=0, start=0), Qwen35Reference(path).logits(PROMPT)) < 0.2
    prompts = [PROMPT[: 3 + i] for i in range(4)]

    def prefilled():
        for slot, sequence in enumerate(prompts):
            steps.prefill(sequence, slot=slot, start=0)

    prefilled()
    alone = steps.decode([42], slots=[0], positions=[len(prompts[0])])[0]
    prefilled()
    together = steps.decode([42, 100, 101, 102], slots=[0, 1, 2, 3], positions=[len(p) for p in prompts])
    np.testing.assert_array_equal(together[0], alone)
    np.testing.assert_array_equal(steps.prefill(prompts[0] + [42], slot=0, start=0), alone)


def test_refused_in_one_line_where_it_cannot_run(tmp_path, qwen35):
    path, _ = qwen35
    with pytest.raises(ModelLoadError, match="only on the CPU kernels"):
        load_model(path, slots=1, context=32, cpu_kernels=False)
    bad = {"ssm.inner_size": 96}
    with pytest.raises(ModelLoadError, match="ssm.inner_size"):
        load_model(write_tiny_qwen35(str(tmp_path / "inner.gguf"), metadata=bad), slots=1, context=32)
    with pytest.raises(ModelLoadError, match="every layer is recurrent"):
        load_model(write_tiny_qwen35(str(tmp_path / "all.gguf"), interval=8), slots=1, context=32)


@contextlib.contextmanager
def _serving(path, paging=None, slots=2):
    """A started engine on the tiny file, stopped at the end."""
    use_tinygrad_from_this_thread()  # the last engine's model thread had it
    engine = Engine(lambda: load_gguf_model(path, slots, 256, 16, paging=paging), slots=slots, prefill_chunk=16).start()
    try:
        assert wait_until(lambda: engine.state != "loading", timeout=120) and engine.state == "ok", engine.error
        yield engine
    finally:
        engine.stop(5)


def _greedy(engine, prompt, max_tokens=6, message_ends=()):
    request = Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), message_ends=message_ends)
    engine.submit(request)
    return drain_outputs(request, timeout=120)[0], request


def test_a_follow_up_turn_reuses_the_conversations_state_and_gets_the_fresh_tokens(tmp_path):
    path = write_tiny_qwen35(str(tmp_path / "q35.gguf"), matrix_type="Q8_0")
    with _serving(path, paging=(2, None)) as engine:  # a pool asked for: slots instead, the state has no blocks
        assert engine.loaded.kv_pool is None
        first, _ = _greedy(engine, PROMPT)
        follow_up = PROMPT + first + [5, 6, 7]
        tokens, request = _greedy(engine, follow_up)
        assert request.cached_tokens == len(PROMPT) + len(first) - 1  # all it ran: the last output was never fed
    with _serving(path) as engine:
        assert _greedy(engine, follow_up)[0] == tokens


def test_prompts_that_part_after_a_snapshot_start_from_it_and_get_the_fresh_tokens(tmp_path):
    """A chat's system prompt and its first turn, snapshotted where each ends; then another user with
    that system prompt (two choices of one prompt among them), the same prompt again, and the next
    turn, which parts from the first where its generation prompt began."""
    path = write_tiny_qwen35(str(tmp_path / "q35.gguf"), matrix_type="Q8_0")
    system, question = LONG[:40], LONG[40:52]
    generation = [7, 8]  # the generation prompt: the next turn's history has the answer in its place
    with _serving(path, slots=3) as engine:
        first, request = _greedy(engine, system + question + generation, message_ends=(40, 52))
        assert request.cached_tokens == 0 and engine.scheduler.slots.describe_snapshots()["taken_total"] == 2
        others = [Request(system + PROMPT, SamplingParams(max_tokens=4, temperature=0.0), message_ends=(40,)) for _ in range(2)]
        for other in others:
            engine.submit(other)
        other_tokens = [drain_outputs(other, timeout=120)[0] for other in others]
        # the second from the snapshot too, or from the first's state further on, between its chunks
        assert others[0].cached_tokens == 40 and others[1].cached_tokens >= 40
        again, request = _greedy(engine, system + question + generation, message_ends=(40, 52))
        assert again == first and request.cached_tokens == 52
        turn = system + question + first + [9, 10, 11] + generation
        tokens, request = _greedy(engine, turn, message_ends=(40, len(turn) - 2))
        assert request.cached_tokens == 52
    with _serving(path) as engine:
        assert _greedy(engine, turn)[0] == tokens
        assert _greedy(engine, system + PROMPT, max_tokens=4)[0] == other_tokens[0] == other_tokens[1]


def test_many_prompts_at_once_sharing_prefixes_get_the_tokens_of_each_alone(tmp_path):
    """Twelve greedy requests on three slots, submitted together: three system prompts, questions
    after them, repeats, and next turns, so prompts start from snapshots, other slots' states and
    their own; each gets the tokens of the model run on it alone from position 0."""
    path = write_tiny_qwen35(str(tmp_path / "q35.gguf"), matrix_type="Q8_0")
    rng = np.random.default_rng(3)
    systems = [[int(t) for t in rng.integers(2, 4000, 40)] for _ in range(3)]
    prompts = []
    for i in range(12):
        system = systems[i % 3]
        prompts.append(prompts[i - 3] if i in (7, 10) else system + [int(t) for t in rng.integers(2, 4000, int(rng.integers(3, 20)))])
    prompts[11] = prompts[4] + [5, 6, 7]  # a next turn of sorts
    steps = load_steps(path, slots=1, context=256)

    def alone(prompt, tokens=4):
        out, logits = [], steps.prefill(prompt, slot=0, start=0)
        for _ in range(tokens):
            out.append(int(np.argmax(logits)))
            logits = steps.decode([out[-1]], slots=[0], positions=[len(prompt) + len(out) - 1])[0]
        return out

    want = [alone(p) for p in prompts]
    with _serving(path, slots=3) as engine:
        requests = [Request(p, SamplingParams(max_tokens=4, temperature=0.0), message_ends=(40,)) for p in prompts]
        for request in requests:
            engine.submit(request)
        got = [drain_outputs(request, timeout=120)[0] for request in requests]
        assert engine.stats()["state_snapshots"]["restored_total"] > 0
    assert got == want
    assert sum(r.cached_tokens for r in requests) > 0


def test_the_server_answers_the_openai_client(tmp_path):
    path = write_tiny_qwen35(str(tmp_path / "q35.gguf"), matrix_type="Q8_0")
    with tiny_engine_server(path, slots=2, queue_limit=2) as (engine, srv):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        ask = {"model": "qwen35", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
        reply, again = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
        assert again.choices[0].message.content == reply.choices[0].message.content
        stream = client.chat.completions.create(**ask, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == reply.choices[0].message.content
        client.close()


def test_a_chats_next_turn_and_another_users_chat_start_from_snapshots_through_the_openai_client(tmp_path):
    """The web layer says where the system prompt ends and where the generation prompt starts; the
    next turn reuses all its history but the generation prompt, another user the system prompt."""
    path = write_tiny_qwen35(str(tmp_path / "q35.gguf"), matrix_type="Q8_0")
    system = {"role": "system", "content": "You answer in one short sentence, politely, and never make up facts. " * 3}
    with tiny_engine_server(path, slots=3, queue_limit=2) as (engine, srv):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(*messages):
            reply = client.chat.completions.create(model="qwen35", messages=list(messages), max_tokens=6, temperature=0)
            return reply, reply.usage.prompt_tokens_details.cached_tokens

        question = {"role": "user", "content": "What does a recurrent layer keep?"}
        first, cached = ask(system, question)
        assert cached == 0
        answer = {"role": "assistant", "content": first.choices[0].message.content}
        _, cached = ask(system, question, answer, {"role": "user", "content": "And why?"})
        assert first.usage.prompt_tokens - 4 <= cached < first.usage.prompt_tokens  # all but "<|im_start|>assistant\n"
        other, cached = ask(system, {"role": "user", "content": "Name a prime number."})
        system_tokens = len(engine.tokenizer.encode(system["content"]))
        assert system_tokens < cached < first.usage.prompt_tokens - 4  # the system prompt and its message's header
        client.close()
        assert wait_until(lambda: engine.stats()["state_snapshots"]["restored_total"] == 2, timeout=10)
        with urllib.request.urlopen(f"{srv.url}/metrics", timeout=10) as response:
            assert "llm_state_snapshots_restored_total 2.0" in response.read().decode()
        with urllib.request.urlopen(f"{srv.url}/admin", timeout=10) as response:
            assert "State snapshots" in response.read().decode()


def test_a_mixture_of_experts_with_a_gated_shared_expert_matches_the_reference(tmp_path):
    """qwen35moe (Qwen3.5-35B-A3B's kind): every layer's feed-forward 2 of 8 experts, softmax and
    divided by their sum, beside a shared expert behind its sigmoid gate; the kernels count each
    expert's lanes."""
    path = write_tiny_qwen35(str(tmp_path / "moe.gguf"), experts=(8, 2, 64), shared=96)
    steps = load_steps(path, slots=2, context=256)
    assert isinstance(steps, OneCallSteps)
    assert [type(b.mixer) for b in steps.model.blocks][-2:] == [GatedDeltaNet, GatedAttention]
    assert all(isinstance(b.ffn, RoutedFeedForward) and b.ffn.shared is not None for b in steps.model.blocks)
    assert off_by(steps.score(PROMPT, slot=0, start=0), Qwen35Reference(path).logits(PROMPT)) < 1e-4
    assert steps.model.routed_tokens().sum() == 4 * 2 * len(PROMPT)  # every layer, two experts a token
