"""The memory plan said before loading: weights as the file stores them (block formats kept) or as
float16, the KV cache when full, and a model whose weights cannot fit refused in one line."""

import os

import numpy as np
import pytest
from support.tiny_models import write_tiny_gguf

from webapp.engine.model import memory
from webapp.engine.model.config import ModelConfig
from webapp.engine.model.gguf import read_gguf
from webapp.engine.model.kv_types import KV_TYPES
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.model.transformer import load_model


def test_weights_count_the_files_bytes_or_float16_and_the_cache_every_position(tmp_path):
    path = write_tiny_gguf(str(tmp_path / "q.gguf"), "qwen3", matrix_type="Q8_0")
    kv, table = read_gguf(path)
    config = ModelConfig.from_gguf(kv, table)
    kept = memory.plan(config, table, slots=4, positions=100, kept_types={8})
    tensor_bytes = sum(t.nbytes for t in table.values())
    assert kept.weights == tensor_bytes  # every tensor the model reads, in the file's bytes
    as_float16 = memory.plan(config, table, slots=4, positions=100, kept_types=set())
    matrices = [t for t in table.values() if t.rows > 1]
    assert as_float16.weights == tensor_bytes - sum(t.nbytes for t in matrices) + sum(2 * t.rows * t.cols for t in matrices)
    per_position = config.n_layers * 2 * config.n_kv_heads * config.head_dim * 2
    assert kept.kv_cache == 5 * 100 * per_position  # the scratch slot too
    assert "4 slots x 100 positions" in kept.describe()


def test_a_model_that_cannot_fit_is_refused_before_loading(tmp_path, monkeypatch):
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "q.gguf"), "llama", matrix_type="Q4_1")
    monkeypatch.setattr(memory, "available_bytes", lambda: 100_000)
    with pytest.raises(ModelLoadError, match=r"needs 0\.\d GiB for its weights and 0\.0 GiB is available"):
        load_model(path, slots=1, context=32)


def test_available_memory_is_this_machines():
    available = memory.available_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert np.isfinite(available)


def test_auto_context_fills_half_the_memory_the_weights_leave_within_the_trained_context(tmp_path, monkeypatch):
    path = write_tiny_gguf(str(tmp_path / "q.gguf"), "qwen3", matrix_type="Q8_0", context=8192)
    kv, table = read_gguf(path)
    config = ModelConfig.from_gguf(kv, table)
    weights, per_position = memory.weight_bytes(config, table, {8}), 5 * memory.kv_bytes_per_position(config)
    monkeypatch.setattr(memory, "available_bytes", lambda: weights + 2 * 3000 * per_position)
    positions, why = memory.auto_context(config, table, 4, {8}, "CPU")
    assert positions == 2816 and "hold 2816 positions each" in why  # 3000 in steps of 256
    monkeypatch.setattr(memory, "available_bytes", lambda: weights + 2 * 100_000 * per_position)
    assert memory.auto_context(config, table, 4, {8}, "CPU") == (8192, memory.auto_context(config, table, 4, {8}, "CPU")[1])
    assert "capped at 8192 (the trained context)" in memory.auto_context(config, table, 4, {8}, "CPU")[1]
    monkeypatch.setattr(memory, "available_bytes", lambda: weights)  # nothing left: the floor, and the plan warns
    assert memory.auto_context(config, table, 4, {8}, "CPU")[0] == memory.AUTO_CONTEXT_FLOOR
    assert memory.auto_context(config, table, 4, {8}, "CUDA") == (memory.FIXED_CONTEXT, "CUDA's free memory is not known")


def test_a_model_whose_every_layer_is_windowed_gets_its_whole_trained_context(tmp_path, caplog):
    """Its caches are rings, whatever the context: nothing to divide the free memory by."""
    import logging

    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "g.gguf"), "gemma3", n_layers=2, matrix_type="Q8_0", context=512)  # both layers local
    with caplog.at_level(logging.INFO, logger="webapp.engine.model"):
        model, _ = load_model(path, slots=1, context=None)
    assert model.context == 512 and "capped at 512 (the trained context)" in caplog.text


def test_a_model_loaded_without_a_context_says_what_it_chose(tmp_path, caplog):
    import logging

    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "q.gguf"), "llama", matrix_type="Q4_1", context=1024)
    with caplog.at_level(logging.INFO, logger="webapp.engine.model"):
        model, _ = load_model(path, slots=1, context=None)
    assert model.context == 1024  # a tiny model: its trained context fits many times over
    assert "context: 1024 positions a slot (" in caplog.text and "LLM_MAX_CONTEXT sets it" in caplog.text


def test_the_8_bit_cache_counts_its_rows_bytes_and_auto_context_gives_it_the_positions_they_free(tmp_path, monkeypatch):
    """q8_0 rows hold 32 values in 34 bytes against float16's 64: the plan, its log line and the auto
    context all use that, so the same memory holds 1.88x the positions."""
    path = write_tiny_gguf(str(tmp_path / "q.gguf"), "qwen3", matrix_type="Q8_0", context=32768, n_heads=2, n_kv_heads=1)
    kv, table = read_gguf(path)
    config = ModelConfig.from_gguf(kv, table)
    f16, q8 = KV_TYPES["f16"], KV_TYPES["q8_0"]
    assert memory.kv_bytes_per_position(config, q8) * 64 == memory.kv_bytes_per_position(config, f16) * 34
    plan = memory.plan(config, table, slots=4, positions=100, kept_types={8}, kv_type=q8)
    assert plan.kv_cache == 5 * 100 * memory.kv_bytes_per_position(config, q8)
    assert f"KV cache (q8_0, {memory.kv_bytes_per_position(config, q8) / 1024:.1f} KiB a token) 4 slots x 100 positions" in plan.describe()
    weights = memory.weight_bytes(config, table, {8})
    monkeypatch.setattr(memory, "available_bytes", lambda: weights + 2 * 5 * 4000 * memory.kv_bytes_per_position(config, f16))
    as_f16, _ = memory.auto_context(config, table, 4, {8}, "CPU", f16)
    as_q8, why = memory.auto_context(config, table, 4, {8}, "CPU", q8)
    assert (as_f16, as_q8) == (3840, 7424) and "4 slots' q8_0 caches" in why  # 4000 and 4000 * 64 / 34 in steps of 256


def test_a_sliding_window_models_plan_counts_its_rings_as_the_loaded_caches_are(tmp_path):
    """gemma3 on the CPU kernels: six of seven layers hold a 256-position ring whatever the context,
    and the plan's bytes are the caches' the model allocates."""
    use_tinygrad_from_this_thread()
    path = write_tiny_gguf(str(tmp_path / "g.gguf"), "gemma3", n_layers=7, matrix_type="Q8_0", sliding_window=5, context=4096)
    kv, table = read_gguf(path)
    config = ModelConfig.from_gguf(kv, table)
    row = 2 * config.n_kv_heads * config.head_dim * 2  # a position's key and value, float16
    assert memory.layer_positions(config, 2048 + 64, step_writes=64) == [256] * 5 + [2112, 256]
    planned = memory.plan(config, table, slots=2, positions=2048 + 64, kept_types={8}, step_writes=64)
    assert planned.kv_cache == 3 * (6 * 256 + 2112) * row and planned.kv_bytes_per_token == row  # one global layer grows
    model, _ = load_model(path, slots=2, context=2048)
    assert sum(b.cache.nbytes() for b in model.blocks) == planned.kv_cache
    tinygrad_path = memory.plan(config, table, slots=2, positions=2048 + 64, kept_types=set())
    assert tinygrad_path.kv_cache == 3 * 7 * 2112 * row  # masks a whole context in every layer


def test_a_gpus_auto_context_comes_from_its_own_free_memory(tmp_path, monkeypatch):
    """nvidia-smi's memory.free for an NVIDIA device (the index through CUDA_VISIBLE_DEVICES), the
    amdgpu driver's VRAM counters for an AMD one; the host's RAM is not asked."""
    from webapp.engine.device.free_memory import device_free_bytes

    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text('#!/bin/sh\ncase "$1" in --id=3) echo 2048 ;; --id=0) echo " 81920" ;; *) exit 6 ;; esac\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_free_bytes("CUDA") == 81920 * 2**20 and device_free_bytes("NV:1") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0")
    assert device_free_bytes("CUDA:0") == 2048 * 2**20 and device_free_bytes("CUDA:1") == 81920 * 2**20
    for card, total, used in (("card1", 64 * 2**30, 2**30), ("card0", 32 * 2**30, 0)):
        (tmp_path / "drm" / card / "device").mkdir(parents=True)
        (tmp_path / "drm" / card / "device" / "mem_info_vram_total").write_text(f"{total}\n")
        (tmp_path / "drm" / card / "device" / "mem_info_vram_used").write_text(f"{used}\n")
    (tmp_path / "drm" / "card0-DP-1").mkdir()  # a connector, not a card
    drm = str(tmp_path / "drm")
    assert [device_free_bytes(f"AMD:{i}", drm) for i in range(3)] == [32 * 2**30, 63 * 2**30, None]
    assert device_free_bytes("METAL") is None and device_free_bytes("CPU") is None

    path = write_tiny_gguf(str(tmp_path / "q.gguf"), "qwen3", matrix_type="Q8_0", context=8192)
    kv, table = read_gguf(path)
    config = ModelConfig.from_gguf(kv, table)
    monkeypatch.setattr(memory, "available_bytes", lambda: 0)  # the host's RAM: never asked for a GPU
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: 80 * 2**30)
    positions, why = memory.auto_context(config, table, 4, {8}, "CUDA")
    assert positions == 8192 and "capped at 8192" in why
