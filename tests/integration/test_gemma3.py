"""Gemma 3's layers (sliding-window attention with its own RoPE base on five of six layers, post-norms,
GeGLU, the sqrt(dim) embedding scale) against the float64 reference, on every way of running a step,
and the local layers' ring caches: past the window and past the ring, batched == alone, a copied or
cached prefix == a fresh one, and what a ring can no longer serve prefilled again."""

import numpy as np
import openai
import pytest
from support import tiny_engine_server
from support.tiny_models import (
    Reference,
    assert_chunked_prefill_matches,
    assert_tinygrad_path_matches,
    load_steps,
    logits_without_windows,
    off_by,
    write_tiny_gguf,
)

from webapp.engine.kernels.abi import AttendFlag
from webapp.engine.model.steps import KernelJitSteps, OneCallSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

WINDOW = 5
RNG = np.random.default_rng(3)
PROMPT = [int(t) for t in RNG.integers(2, 4000, 24)]  # several windows long
LONG = [int(t) for t in RNG.integers(2, 4000, 600)]  # more than twice a local layer's ring (256 positions)


@pytest.fixture(autouse=True)
def _tinygrad_here():
    use_tinygrad_from_this_thread()


def _file(tmp_path, name="gemma3.gguf", **kwargs) -> str:
    # seven layers: the sixth is the one global layer, the seventh local again
    return write_tiny_gguf(str(tmp_path / name), "gemma3", n_layers=7, n_kv_heads=1, sliding_window=WINDOW, context=4096, **kwargs)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = _file(tmp_path_factory.mktemp("gemma3"), matrix_type="Q8_0")
    return path, Reference(path)


def test_in_one_call_the_model_matches_the_reference_and_the_window_matters(gemma):
    path, ref = gemma
    steps = load_steps(path, slots=2, context=1024)
    assert isinstance(steps, OneCallSteps)
    blocks = steps.model.blocks
    assert [b.window for b in blocks] == [WINDOW] * 5 + [0, WINDOW]
    assert [bool(b.attend_flags & AttendFlag.LOCAL_ROPE) for b in blocks] == [True] * 5 + [False, True]
    # the local layers' caches are rings of whole key chunks; the global layer's holds the context
    assert [b.positions for b in blocks] == [256] * 5 + [1024 + 64, 256]  # 64: load_model's largest chunk
    got = steps.score(PROMPT, slot=0, start=0)
    assert off_by(got, ref.logits(PROMPT)) < 0.03
    assert off_by(got, logits_without_windows(path, PROMPT)) > 0.2  # every layer global: another model


def test_a_long_prompt_in_chunks_wraps_the_rings_and_still_matches(gemma):
    """600 positions through 256-position rings, 16 at a time: each chunk's last logits as the reference's."""
    path, ref = gemma
    assert_chunked_prefill_matches(load_steps(path, slots=2, context=1024), ref.logits(LONG), LONG, 16, 0.03)


def test_tinygrad_masks_the_window_of_a_whole_context(gemma):
    path, ref = gemma
    assert_tinygrad_path_matches(path, ref.logits(PROMPT + [42]), PROMPT, 42)


@pytest.mark.parametrize("float_matrix", ["ffn_down.weight", "attn_output.weight"])
def test_five_kernels_around_a_float_product_match_the_reference(tmp_path, float_matrix):
    """A matrix without a kernel: the layer's kernels around tinygrad's product, post-norms and GeGLU in tinygrad."""
    path = _file(tmp_path, matrix_type="Q8_0", float_matrices=(float_matrix,))
    steps = load_steps(path, slots=2, context=512)
    assert isinstance(steps, KernelJitSteps)
    assert off_by(steps.prefill(PROMPT, slot=0, start=0), Reference(path).logits(PROMPT)[-1]) < 0.03


def test_a_lane_is_the_same_alone_among_others_and_after_a_copied_prefix(gemma):
    """Bit for bit, past the rings' wrap: decoded alone, among three other lanes, and in a slot whose
    first 580 positions were copied from another slot (every row of each ring)."""
    path, _ = gemma
    steps = load_steps(path, slots=4, context=1024)
    prefix = LONG[:580]
    for start in range(0, len(prefix), 32):
        steps.prefill(prefix[start : start + 32], slot=0, start=start)
    for slot in (1, 2):
        steps.prefill(PROMPT[: 3 + slot], slot=slot, start=0)
    alone = steps.decode([42], slots=[0], positions=[580])[0]
    together = steps.decode([42, 7, 8], slots=[0, 1, 2], positions=[580, 4, 5])
    np.testing.assert_array_equal(together[0], alone)
    steps.copy_prefix(0, 3, 580)
    np.testing.assert_array_equal(steps.decode([42], slots=[3], positions=[580])[0], alone)


def test_the_server_reuses_what_a_ring_still_holds_and_prefills_the_rest_again(tmp_path):
    """End to end with the openai client: a repeated long prompt is served from the cache, a prompt
    that parts from the cached one further back than the ring keeps is prefilled from the start, and
    every answer is the one a fresh cache gives."""
    path = _file(tmp_path, matrix_type="Q8_0")
    words = " ".join(["alpha", "beta", "gamma", "delta", "epsilon"] * 70)  # ~350 tokens: past a ring's 256
    first = [{"role": "user", "content": words}]
    parted = [{"role": "user", "content": "x " + words}]
    with tiny_engine_server(path, slots=1, queue_limit=4, context=1024) as (engine, srv):
        assert engine.scheduler.slots.ring is not None
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(messages):
            reply = client.chat.completions.create(model="g", messages=messages, max_tokens=6, temperature=0)
            return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens

        fresh, cached = ask(first)
        assert cached == 0
        again, cached = ask(first)
        assert again == fresh and cached > 300  # the slot went only a few positions past the prompt
        other, cached = ask(parted)
        assert cached == 0  # parts at its first words: the rings hold only the last positions
        back, cached = ask(first)
        assert back == fresh and cached == 0
        client.close()
    with tiny_engine_server(path, slots=1, queue_limit=4, context=1024) as (engine, srv):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert ask(parted)[0] == other
        client.close()
