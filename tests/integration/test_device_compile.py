"""tinygrad's path compiled for an H100/H200 (sm_90) on tinygrad's NULL device, which renders and
compiles every kernel and runs none: a Llama-3.1-8B-shaped Q4_K_M file cut to two layers, in a
process of its own (the device is chosen before tinygrad is imported). Its weights take the file's
bytes on the device, a prefill piece's and a wide decode's products run on tensor cores while a
one-lane decode reads the blocks in its products, a decode step's kernels are as many at 64 lanes as
at 32 and at 8 as at 1, and no step keeps float32 activations; the same with a LoRA adapter on every
lane (its low-rank products a few kernels a layer more, the base products still on tensor cores);
with every lane greedy, a step reads back an id a lane, not its logits. What a GPU
computes in float16 is run here too, on tinygrad's CPU backend told it has float16 arithmetic,
against the float64 reference."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.tiny_models import Reference, assert_tinygrad_path_matches, write_tiny_gguf
from tinygrad import dtypes

from webapp.engine.device.capabilities import device_capabilities
from webapp.engine.model import transformer
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (1, 8, 32, 64)
LAYERS = 2


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("null")
    path = tmp / "llama8b.gguf"
    subprocess.run(
        [sys.executable, "bench/shaped_model.py", "llama3.1-8b", str(path), "--direct", "Q4_K_M", "--layers", str(LAYERS)],
        cwd=ROOT, check=True, capture_output=True, env=os.environ | {"DEV": "CPU"},
    )  # fmt: skip
    # tinygrad 0.14's MOCK interface imports a module its wheel does not ship: a stub stands in
    stub = tmp / "stub" / "test" / "mockgpu"
    stub.mkdir(parents=True)
    (stub.parent / "__init__.py").write_text("")
    (stub / "__init__.py").write_text("")
    (stub / "mockgpu.py").write_text("class MockFileIOInterface: pass\n")
    env = os.environ | {"DEV": "MOCK+NULL:PTX:sm_90", "NULL_ALLOW_COPYOUT": "1", "PYTHONPATH": str(tmp / "stub")}
    run = subprocess.run(
        [sys.executable, "tests/support/device_compile.py", str(path), "--widths", ",".join(map(str, WIDTHS)), "--lora", "16"],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    path.unlink()
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_weights_take_the_files_bytes_on_the_device(compiled):
    assert compiled["weight_bytes"] <= 1.05 * compiled["file_bytes"]


def test_prefill_and_wide_decode_products_run_on_tensor_cores(compiled):
    assert compiled["prefill"]["tensor_core_kernels"] >= 2 * 4  # each layer's q/k/v, output, gate/up and down
    assert compiled["decode"]["32"]["tensor_core_kernels"] >= 2 * 4
    assert compiled["decode"]["1"]["tensor_core_kernels"] == 0  # one lane: the blocks read in the product


def test_a_decode_steps_kernels_do_not_grow_with_its_lanes(compiled):
    """Lanes' slots and positions are device tensors (lane_rows.py); from 16 lanes the products'
    tensor-core path adds one kernel each, at every width above it alike."""
    kernels = {int(width): step["kernels"] for width, step in compiled["decode"].items()}
    assert kernels[1] == kernels[8] and kernels[32] == kernels[64]
    # the issue's aim is 10 a layer + 10: the scores' maximum and each norm's sum of squares are
    # kernels of their own, as is the keys' and values' rotation before their rows are written
    assert kernels[8] <= 11 * LAYERS + 10


def test_a_greedy_decode_step_reads_back_an_id_a_lane(compiled):
    """Every lane greedy: each lane's argmax picked in the step, 4 bytes a lane read back, not its row."""
    for width, step in compiled["decode_picks"].items():
        assert step["read_back_bytes"] == 4 * int(width)
        assert compiled["decode"][width]["read_back_bytes"] >= 1000 * step["read_back_bytes"]
    kernels = {int(width): step["kernels"] for width, step in compiled["decode_picks"].items()}
    assert kernels[1] == kernels[8] and kernels[32] == kernels[64]
    assert kernels[8] <= compiled["decode"]["8"]["kernels"] + 5  # the argmax's few kernels, once a step


def test_steps_with_an_adapter_keep_the_tensor_cores_and_the_kernels_flat(compiled):
    lora = compiled["lora"]
    assert lora["prefill"]["tensor_core_kernels"] >= compiled["prefill"]["tensor_core_kernels"]
    assert lora["decode"]["32"]["tensor_core_kernels"] >= compiled["decode"]["32"]["tensor_core_kernels"]
    kernels = {int(width): step["kernels"] for width, step in lora["decode"].items()}
    assert kernels[1] == kernels[8] and kernels[32] == kernels[64]
    assert kernels[8] <= compiled["decode"]["8"]["kernels"] + 4 * LAYERS  # a kernel a product more: its A product; B fused in


def test_no_step_keeps_float32_activations(compiled):
    steps = [compiled["prefill"], *compiled["decode"].values(), compiled["lora"]["prefill"], *compiled["lora"]["decode"].values()]
    assert [step["float32_activations"] for step in steps] == [0] * len(steps)


@pytest.mark.parametrize("arch, options", [("qwen3", {"qk_norm": True}), ("gemma3", {"n_layers": 7, "n_kv_heads": 1})])
def test_float16_activations_match_the_reference(tmp_path, monkeypatch, arch, options):
    use_tinygrad_from_this_thread()
    float16 = lambda name=None: dataclasses.replace(device_capabilities(name), float16_compute=True)  # noqa: E731
    monkeypatch.setattr(transformer, "device_capabilities", float16)
    path = write_tiny_gguf(str(tmp_path / f"{arch}.gguf"), arch, matrix_type="Q8_0", **options)
    model, _ = transformer.load_model(path, slots=1, context=64, cpu_kernels=False)
    assert model.act_dtype == dtypes.float16
    prompt = [int(t) for t in np.random.default_rng(7).integers(2, 4000, 16)]
    assert_tinygrad_path_matches(path, Reference(path).logits(prompt + [42]), prompt, 42, tolerance=0.005)
