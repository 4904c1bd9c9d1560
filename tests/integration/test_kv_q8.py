"""The 8-bit KV cache (LLM_KV_TYPE=q8_0) against NumPy's reference of its rows (support/kv_quants.py):
the rows tinygrad's path and the kernels write, attention over them in the SIMD and the portable
build, a lane's numbers alone and among others; and a server on it through the openai client."""

import concurrent.futures
import ctypes
import re
import urllib.request

import numpy as np
import openai
import pytest
from support import get, tiny_engine_server
from support.kv_quants import q8_rows, q8_values
from support.tiny_models import write_tiny_gguf
from tinygrad import Tensor

from webapp.engine.kernels.abi import Attention, KvType
from webapp.engine.model.kv_types import KV_TYPES, kv_type_named
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model

NO_EXTRAS = np.zeros(1, np.float32)


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def _values(rng, shape) -> np.ndarray:
    """Keys or values with the spread real ones have: blocks of very different sizes, a zero block, ties."""
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 0.1, 1.0, 30.0], size=shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1, shape[-1])[0, :32] = 0.0  # a block of zeros: scale 0, every q 0
    x.reshape(-1, shape[-1])[1, :32] = np.arange(32) - 15.5  # 127 / 15.5 * (k - 15.5): many exact halves
    return x


def test_the_reference_rows_round_trip_within_half_a_step():
    x = _values(np.random.default_rng(0), (50, 128))
    rows = q8_rows(x)
    assert rows.shape == (50, 4 * 34) and rows.dtype == np.uint8
    back = q8_values(rows)
    # q is x / d to the nearest integer: off by half a step of d, plus what the float16 rounding of d
    # moves the largest q (127) by
    d = np.abs(x.reshape(50, 4, 32)).max(-1, keepdims=True) / 127
    kept = rows.reshape(50, 4, 34)[..., :2].copy().view(np.float16).astype(np.float64)
    assert np.all(np.abs(back.reshape(50, 4, 32) - x.reshape(50, 4, 32)) <= d * 0.5 * (1 + 1e-6) + 127 * np.abs(kept - d))
    assert np.all(back[0, :32] == 0)
    assert KV_TYPES["q8_0"].row_bytes(128) == 136 and KV_TYPES["f16"].row_bytes(128) == 256  # 34 / 64 of the memory


def test_tinygrads_rows_are_the_references_bytes():
    use_tinygrad_from_this_thread()
    x = _values(np.random.default_rng(1), (3, 5, 64))
    rows = KV_TYPES["q8_0"].store(Tensor(x)).numpy()
    np.testing.assert_array_equal(rows, q8_rows(x))
    np.testing.assert_array_equal(KV_TYPES["q8_0"].load(Tensor(rows)).numpy(), q8_values(rows))


def _attention(lanes_n, heads, kv_heads, slots, positions, head_dim):
    return Attention(lanes_n, heads, kv_heads, slots, positions, head_dim, 0, 0, head_dim**-0.5, head_dim, 1.0, kv_type=KvType.Q8_0)


@pytest.mark.parametrize(("head_dim", "positions"), [(64, 40), (128, 40), (64, 700)])  # one, four blocks a head; several key chunks
def test_attention_writes_q8_rows_then_attends_them_as_numpy(library, head_dim, positions):
    """Each lane writes its key and value at its position as the reference's bytes (unrotated: exactly;
    rotated: within float32 rounding of the rotation), then attends its slot's 8-bit keys and values."""
    rng = np.random.default_rng(5)
    lanes_n, heads, kv_heads, slots = 3, 6, 2, 4
    slot_of, pos_of = [2, 0, 3], [17, 0, positions - 1]
    lanes = np.array(slot_of + pos_of, np.int32)
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    cache = q8_rows(_values(rng, (2, slots, kv_heads, positions, head_dim)))
    got = np.empty((lanes_n, heads * head_dim), np.float32)
    shape = _attention(lanes_n, heads, kv_heads, slots, positions, head_dim)

    qkv = _values(rng, (lanes_n, (heads + 2 * kv_heads) * head_dim))
    library.tq_attend(
        _ptr(got),
        _ptr(qkv),
        _ptr(cache),
        _ptr(lanes),
        _ptr(np.zeros(head_dim // 2, np.float32)),
        _ptr(NO_EXTRAS),
        None,
        ctypes.byref(shape),
    )
    for b, (slot, pos) in enumerate(zip(slot_of, pos_of)):
        np.testing.assert_array_equal(cache[0, slot, :, pos], q8_rows(qkv[b, q_end:k_end].reshape(kv_heads, head_dim)))
        np.testing.assert_array_equal(cache[1, slot, :, pos], q8_rows(qkv[b, k_end:].reshape(kv_heads, head_dim)))

    inv_freq = (1.0 / 10000.0 ** (np.arange(head_dim // 2) * 2 / head_dim)).astype(np.float32)
    qkv = (rng.standard_normal((lanes_n, (heads + 2 * kv_heads) * head_dim)) * 3).astype(np.float32)
    library.tq_attend(_ptr(got), _ptr(qkv), _ptr(cache), _ptr(lanes), _ptr(inv_freq), _ptr(NO_EXTRAS), None, ctypes.byref(shape))
    values = q8_values(cache).astype(np.float64)
    for b, (slot, pos) in enumerate(zip(slot_of, pos_of)):
        k = _rotate(qkv[b, q_end:k_end].reshape(kv_heads, head_dim).astype(np.float64), pos, inv_freq)
        # the kernel rotates in float32: a value on a rounding boundary may land one step of d away
        d = np.abs(k.reshape(kv_heads, -1, 32)).max(-1, keepdims=True) / 127
        step_off = np.abs(values[0, slot, :, pos] - q8_values(q8_rows(k))).reshape(kv_heads, -1, 32)
        assert np.all(step_off <= d * 1.01) and np.mean(step_off == 0) > 0.9
        for h in range(heads):
            q = _rotate(qkv[b, h * head_dim : (h + 1) * head_dim].astype(np.float64), pos, inv_freq)
            keys, vals = (values[i, slot, h // (heads // kv_heads), : pos + 1] for i in (0, 1))
            scores = keys @ q / np.sqrt(head_dim)
            probs = np.exp(scores - scores.max())
            np.testing.assert_allclose(got[b, h * head_dim : (h + 1) * head_dim], probs / probs.sum() @ vals, rtol=1e-4, atol=1e-4)


def _rotate(x: np.ndarray, pos: int, inv_freq: np.ndarray) -> np.ndarray:
    angle = (np.float32(pos) * inv_freq).astype(np.float64)
    half = len(inv_freq)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)


def test_a_lanes_attention_over_q8_rows_is_the_same_bits_alone_and_among_seven_others(library):
    rng = np.random.default_rng(8)
    lanes_n, heads, kv_heads, head_dim, slots, positions = 8, 9, 3, 64, 8, 600  # the default model's heads
    qkv = rng.standard_normal((lanes_n, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(head_dim // 2) * 2 / head_dim)).astype(np.float32)
    slot_of, pos_of = list(range(lanes_n)), [int(p) for p in rng.integers(0, positions, lanes_n)]
    cache = q8_rows(rng.standard_normal((2, slots, kv_heads, positions, head_dim)))
    together = np.empty((lanes_n, heads * head_dim), np.float32)
    lanes = np.array(slot_of + pos_of, np.int32)
    shape = _attention(lanes_n, heads, kv_heads, slots, positions, head_dim)
    library.tq_attend(
        _ptr(together), _ptr(qkv), _ptr(cache.copy()), _ptr(lanes), _ptr(inv_freq), _ptr(NO_EXTRAS), None, ctypes.byref(shape)
    )
    one = _attention(1, heads, kv_heads, slots, positions, head_dim)
    for b in range(lanes_n):
        alone = np.empty((1, heads * head_dim), np.float32)
        lane = np.array([slot_of[b], pos_of[b]], np.int32)
        row = np.ascontiguousarray(qkv[b : b + 1])
        library.tq_attend(_ptr(alone), _ptr(row), _ptr(cache.copy()), _ptr(lane), _ptr(inv_freq), _ptr(NO_EXTRAS), None, ctypes.byref(one))
        np.testing.assert_array_equal(alone[0].view(np.uint32), together[b].view(np.uint32))


def test_a_head_size_outside_q8_0s_blocks_and_an_unknown_type_are_refused_in_one_line(tmp_path):
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "hd16.gguf"), "llama")  # heads of 16 values
    with pytest.raises(ModelLoadError, match="LLM_KV_TYPE=q8_0 stores heads in blocks of 32 values; this model's heads have 16"):
        load_model(path, slots=1, context=32, kv_type="q8_0")
    with pytest.raises(ValueError, match="LLM_KV_TYPE='q4': one of f16, q8_0 is expected"):
        kv_type_named("q4")


def test_a_server_on_the_8_bit_cache_answers_each_request_alike_alone_and_among_seven_others(tmp_path):
    """Eight chats at once on 8 slots give each one's own answer (greedy and seeded), a follow-up
    reuses its cached prefix, and /admin/stats.json names the cache's type and its bytes a token."""
    path = write_tiny_gguf(str(tmp_path / "q8kv.gguf"), "llama", matrix_type="Q4_1", n_heads=2, n_kv_heads=1)
    cases = [{"messages": [{"role": "user", "content": f"Count to {i}, please."}], "max_tokens": 16, "seed": i} for i in range(8)]
    cases = [case | {"temperature": 0.0 if i % 2 else 0.8} for i, case in enumerate(cases)]
    with tiny_engine_server(path, slots=8, queue_limit=16, kv_type="q8_0") as (engine, server):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        def answer(case):
            return client.chat.completions.create(model="tiny", **case).choices[0].message.content

        alone = [answer(case) for case in cases]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(answer, cases)) == alone
        follow_up = cases[1] | {
            "messages": cases[1]["messages"] + [{"role": "assistant", "content": alone[1]}, {"role": "user", "content": "Again."}]
        }
        reply = client.chat.completions.create(model="tiny", **follow_up)
        assert reply.usage.prompt_tokens_details.cached_tokens > 0
        status, _, stats = get(server, "/admin/stats.json")
        # 2 layers x (key + value) x 1 kv head x one 34-byte block of 32 values
        assert status == 200 and stats["kv_type"] == "q8_0" and stats["kv_bytes_per_token"] == 2 * 2 * 1 * 34
        with urllib.request.urlopen(f"{server.url}/admin", timeout=30) as page:
            text = " ".join(re.sub(r"<[^>]+>", "", page.read().decode()).split())
        assert "KV cache q8_0, 136 bytes a token" in text
