"""A paged KV cache (tq_attention.block_positions > 0) against the unpaged cache holding the same rows,
in the SIMD and the portable build, for float16 and Q8_0 rows: attention over a pool of shuffled blocks
gives the unpaged output bit for bit (an item walks its chunk as a run per block, every sum in the
unpaged order), each lane's new key and value land in its table's block and row, and sequences whose
tables share a block (a common prefix) read the same keys and give what each gives alone; and the same
through QuantizedCPU.attend and a whole step (QuantizedCPU.step) on a model built with block tables."""

import ctypes
import dataclasses

import numpy as np
import pytest
from support.kv_quants import q8_rows
from support.tiny_models import write_tiny_gguf
from tinygrad import Tensor

from webapp.engine.device.buffers import device_array, host_values
from webapp.engine.kernels.abi import KEY_CHUNK, Attention, KvType
from webapp.engine.kernels.cpu import QuantizedCPU
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model

HEADS, KV_HEADS = 6, 2  # three query heads a kv head: items share their kv head's keys
CASES = [(KvType.F16, 64), (KvType.F16, 12), (KvType.Q8_0, 64)]  # 12: the float16 item's scalar path
CASE_IDS = ["f16", "f16-head12", "q8_0"]


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def _inverse_frequencies(head_dim: int) -> np.ndarray:
    return (1.0 / 10000.0 ** (np.arange(head_dim // 2) * 2 / head_dim)).astype(np.float32)


def _cache(rng, kv_type, slots, positions, head_dim) -> np.ndarray:
    """An unpaged cache (2, slots, kv heads, positions, a row) of float16 values or Q8_0 bytes."""
    values = rng.standard_normal((2, slots, KV_HEADS, positions, head_dim))
    return q8_rows(values) if kv_type == KvType.Q8_0 else values.astype(np.float16)


def _paged(cache: np.ndarray, block_positions: int, rng, spare: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """The same rows as a pool of blocks (2, blocks, kv heads, block_positions, a row) in shuffled order,
    with `spare` blocks no table names, and each slot's row of the block table."""
    _, slots, kv_heads, positions, width = cache.shape
    per_slot = positions // block_positions
    order = rng.permutation(slots * per_slot + spare).astype(np.int32)
    tables = order[: slots * per_slot].reshape(slots, per_slot)
    pool = _random_like(rng, cache, (2, len(order), kv_heads, block_positions, width))
    for s in range(slots):
        for i, block in enumerate(tables[s]):
            pool[:, block] = cache[:, s, :, i * block_positions : (i + 1) * block_positions]
    return pool, np.ascontiguousarray(tables)


def _random_like(rng, cache: np.ndarray, shape) -> np.ndarray:
    if cache.dtype == np.uint8:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    return rng.standard_normal(shape).astype(np.float16)


def _unpaged_view(pool: np.ndarray, tables: np.ndarray) -> np.ndarray:
    """The pool's rows remapped through the table: (2, slots, kv heads, positions, a row)."""
    gathered = pool[:, tables]  # (2, slots, per_slot, kv heads, block_positions, a row)
    two, slots, per_slot, kv_heads, block_positions, width = gathered.shape
    return gathered.transpose(0, 1, 3, 2, 4, 5).reshape(two, slots, kv_heads, per_slot * block_positions, width)


def _attention(kv_type, lanes_n, slots, positions, head_dim, block_positions=0, table_width=0) -> Attention:
    shape = Attention(lanes_n, HEADS, KV_HEADS, slots, positions, head_dim, 0, 0, head_dim**-0.5, head_dim, 1.0, kv_type)
    shape.block_positions, shape.table_width = block_positions, table_width
    return shape


def _attend(library, shape, qkv, cache, lanes, tables=None) -> np.ndarray:
    out = np.empty((shape.lanes, HEADS * shape.head_dim), np.float32)
    inv_freq = _inverse_frequencies(shape.head_dim)
    table = None if tables is None else _ptr(tables)
    library.tq_attend(
        _ptr(out), _ptr(qkv), _ptr(cache), _ptr(lanes), _ptr(inv_freq), _ptr(np.zeros(1, np.float32)), table, ctypes.byref(shape)
    )
    return out


LANES = {
    # slot, position: below one block, across blocks, at and past a chunk's edge, far past KEY_CHUNK
    "sequences": ([2, 0, 3, 1, 0], [5, 40, KEY_CHUNK - 1, KEY_CHUNK, 600]),
    # a prefill piece: consecutive positions of one sequence, across a chunk's edge
    "prefill": ([1] * 12, list(range(KEY_CHUNK - 6, KEY_CHUNK + 6))),
}


@pytest.mark.parametrize(("kv_type", "head_dim"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("block_positions", [16, 64])
@pytest.mark.parametrize("lanes_case", list(LANES))
def test_a_paged_cache_gives_the_unpaged_bits_and_writes_its_tables_rows(library, kv_type, head_dim, block_positions, lanes_case):
    rng = np.random.default_rng(block_positions + head_dim)
    slots, positions = 4, 640
    slot_of, pos_of = LANES[lanes_case]
    lanes = np.array(slot_of + pos_of, np.int32)
    cache = _cache(rng, kv_type, slots, positions, head_dim)
    pool, tables = _paged(cache, block_positions, rng)
    spare = np.setdiff1d(np.arange(pool.shape[1]), tables)
    untouched = pool[:, spare].copy()
    qkv = rng.standard_normal((len(slot_of), (HEADS + 2 * KV_HEADS) * head_dim)).astype(np.float32)

    unpaged = _attend(library, _attention(kv_type, len(slot_of), slots, positions, head_dim), qkv, cache, lanes)
    paged_shape = _attention(kv_type, len(slot_of), pool.shape[1], positions, head_dim, block_positions, tables.shape[1])
    paged = _attend(library, paged_shape, qkv, pool, lanes, tables)

    assert np.array_equal(paged.view(np.uint32), unpaged.view(np.uint32))
    # every lane's key and value went to its block and row, and nothing else moved
    assert np.array_equal(_unpaged_view(pool, tables).view(np.uint8), cache.view(np.uint8))
    assert np.array_equal(pool[:, spare].view(np.uint8), untouched.view(np.uint8))


@pytest.mark.parametrize(("kv_type", "head_dim"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("block_positions", [16, 64])
def test_sequences_sharing_a_prefix_block_read_its_keys_alike_together_and_alone(library, kv_type, head_dim, block_positions):
    """Two tables name the same first block; each sequence's own blocks follow. Each lane's output is
    that of an unpaged cache with the prefix copied into both slots, and the same alone as together."""
    rng = np.random.default_rng(7 + block_positions)
    positions = 5 * block_positions
    cache = _cache(rng, kv_type, 2, positions, head_dim)
    cache[:, 1, :, :block_positions] = cache[:, 0, :, :block_positions]  # the shared prefix
    pool, tables = _paged(cache, block_positions, rng)
    tables[1, 0] = tables[0, 0]  # slot 1's own copy of the prefix block is no longer read
    pool[:, np.setdiff1d(np.arange(pool.shape[1]), tables)] = 0
    pos_of = [block_positions + 3, 4 * block_positions + 1]  # both past the prefix: writes land in their own blocks
    lanes = np.array([0, 1] + pos_of, np.int32)
    qkv = rng.standard_normal((2, (HEADS + 2 * KV_HEADS) * head_dim)).astype(np.float32)
    width = tables.shape[1]

    unpaged = _attend(library, _attention(kv_type, 2, 2, positions, head_dim), qkv, cache.copy(), lanes)
    together = _attend(
        library, _attention(kv_type, 2, pool.shape[1], positions, head_dim, block_positions, width), qkv, pool.copy(), lanes, tables
    )
    assert np.array_equal(together.view(np.uint32), unpaged.view(np.uint32))
    for b in range(2):
        lane = np.array([b, pos_of[b]], np.int32)
        one = _attention(kv_type, 1, pool.shape[1], positions, head_dim, block_positions, width)
        alone = _attend(library, one, np.ascontiguousarray(qkv[b : b + 1]), pool.copy(), lane, tables)
        assert np.array_equal(alone[0].view(np.uint32), together[b].view(np.uint32))


# lanes of one sequence share an item (attend_lanes): a prefill piece of 20 (items of 8, 8 and 4 lanes)
# across a chunk's edge, a verification of 9 lanes far past KEY_CHUNK, and a lone lane between them
SEQUENCE_LANES = ([1] * 20 + [3] * 9 + [0], list(range(KEY_CHUNK - 10, KEY_CHUNK + 10)) + list(range(600, 609)) + [5])


@pytest.mark.parametrize(("kv_type", "head_dim"), CASES + [(KvType.F16, 168)], ids=CASE_IDS + ["f16-head168"])  # 168: 8-wide value columns
@pytest.mark.parametrize("block_positions", [0, 16])
def test_lanes_of_one_sequence_give_each_lanes_bits_alone(library, kv_type, head_dim, block_positions):
    """Consecutive lanes of one slot read their keys once for all of them; each lane's output is bit
    for bit what it gives alone, over the keys the lanes before it wrote in the same call."""
    rng = np.random.default_rng(head_dim + block_positions)
    slots, positions = 4, 640
    slot_of, pos_of = SEQUENCE_LANES
    cache = _cache(rng, kv_type, slots, positions, head_dim)
    tables, width = None, 0
    if block_positions:
        cache, tables = _paged(cache, block_positions, rng)
        width = tables.shape[1]
    qkv = rng.standard_normal((len(slot_of), (HEADS + 2 * KV_HEADS) * head_dim)).astype(np.float32)
    shape = _attention(kv_type, len(slot_of), cache.shape[1], positions, head_dim, block_positions, width)
    together = _attend(library, shape, qkv, cache, np.array(slot_of + pos_of, np.int32), tables)  # writes every lane's key
    one = _attention(kv_type, 1, cache.shape[1], positions, head_dim, block_positions, width)
    for b, (slot, pos) in enumerate(zip(slot_of, pos_of, strict=True)):
        alone = _attend(library, one, np.ascontiguousarray(qkv[b : b + 1]), cache.copy(), np.array([slot, pos], np.int32), tables)
        assert np.array_equal(alone[0].view(np.uint32), together[b].view(np.uint32)), f"lane {b} at {pos}"


def test_quantized_cpus_attend_on_a_paged_cache_gives_the_unpaged_bits():
    use_tinygrad_from_this_thread()
    kernels = QuantizedCPU.load()
    rng = np.random.default_rng(2)
    head_dim, block_positions = 64, 16
    cache = _cache(rng, KvType.Q8_0, 2, 320, head_dim)
    pool, tables = _paged(cache, block_positions, rng)
    slot_of, pos_of = [1, 0, 1], [3, 300, 17]
    lanes = device_array(np.array(slot_of + pos_of, np.int32))
    qkv = Tensor(rng.standard_normal((3, (HEADS + 2 * KV_HEADS) * head_dim)).astype(np.float32)).realize()
    inv_freq, extras = device_array(_inverse_frequencies(head_dim)), device_array(np.zeros(1, np.float32))
    cache_tensor, pool_tensor = device_array(cache), device_array(pool)
    args = (HEADS, 0, 0.0, head_dim**-0.5)
    with pytest.raises(ValueError, match="does not hold F16 rows"):  # told the rows' type, never guessing it from bytes
        kernels.attend(qkv, cache_tensor, lanes, inv_freq, extras, *args)
    unpaged = kernels.attend(qkv, cache_tensor, lanes, inv_freq, extras, *args, kv_type=KvType.Q8_0).numpy()
    paged = kernels.attend(
        qkv, pool_tensor, lanes, inv_freq, extras, *args, tables=device_array(tables), block_positions=block_positions, kv_type=KvType.Q8_0
    )
    assert np.array_equal(paged.numpy().view(np.uint32), unpaged.view(np.uint32))
    written = _unpaged_view(host_values(pool_tensor, np.uint8).reshape(pool.shape), tables)
    assert np.array_equal(written, host_values(cache_tensor, np.uint8).reshape(cache.shape))
    with pytest.raises(ValueError, match="a block holds a power of two"):
        kernels.attend(qkv, pool_tensor, lanes, inv_freq, extras, *args, tables=tables, block_positions=24, kv_type=KvType.Q8_0)


def test_a_whole_step_on_block_tables_gives_the_unpaged_steps_logits(tmp_path):
    """A prefill across blocks, then a decode step of two sequences, on a model whose layers' caches
    are pools of shuffled blocks: the same logits, bit for bit, as on the model's own caches."""
    use_tinygrad_from_this_thread()
    model, _ = load_model(write_tiny_gguf(str(tmp_path / "paged.gguf"), "llama"), slots=2, context=128)
    kernels, layers, eps = model.kernels, [block.layer_tensors for block in model.blocks], model.config.norm_eps
    tensors = (model.embed.weight, model.output_norm, model.head.weight, model.inv_freq)
    options = {"inv_freq_local": model.inv_freq_local, "embed_scale": model.config.embed_scale}
    unpaged = kernels.whole_model(*tensors, layers, eps, **options)
    block_positions = 16
    _, slots, kv_heads, positions, width = layers[0].cache.shape
    blocks = slots * positions // block_positions + 2
    tables = np.random.default_rng(4).permutation(blocks)[: blocks - 2].astype(np.int32).reshape(slots, -1)
    pools = [Tensor.zeros(2, blocks, kv_heads, block_positions, width, dtype=layer.cache.dtype).contiguous().realize() for layer in layers]
    paged_layers = [dataclasses.replace(layer, cache=pool) for layer, pool in zip(layers, pools, strict=True)]
    paged = kernels.whole_model(*tensors, paged_layers, eps, **options, block_tables=tables, block_positions=block_positions)
    assert paged.dims.attention.positions == positions and paged.block_tables is tables

    for slot, prompt in enumerate([list(range(3, 43)), list(range(50, 70))]):  # 40 and 20 tokens: three and two blocks
        lanes = [slot] * len(prompt) + list(range(len(prompt)))
        expected = kernels.step(unpaged, prompt, lanes, [len(prompt) - 1])
        assert np.array_equal(kernels.step(paged, prompt, lanes, [len(prompt) - 1]).view(np.uint32), expected.view(np.uint32))
    lanes = [0, 1, 40, 20]
    expected = kernels.step(unpaged, [7, 9], lanes, [0, 1])
    assert np.array_equal(kernels.step(paged, [7, 9], lanes, [0, 1]).view(np.uint32), expected.view(np.uint32))
    rows = host_values(pools[0], np.float16).reshape(pools[0].shape)
    assert rows[:, tables[0, :3]].any() and not rows[:, np.setdiff1d(np.arange(blocks), tables)].any()  # spare blocks untouched
