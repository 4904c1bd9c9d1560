"""LoRA adapters on the CPU kernels' whole steps, against the float64 reference of the merged model.

A random adapter in llama.cpp's GGUF layout changes every product of a tiny model a great deal (the
adapted logits are far from the base ones), and the steps give the merged model's logits within
the quantization's error; a lane with an adapter beside lanes without one, or with another adapter,
gives each one's logits alone, bit for bit; a scale of 0 is the base model, bit for bit. Files that do
not fit the model are refused in one line.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.tiny_lora import merged_reference, write_lora_gguf
from support.tiny_models import Reference, load_steps, off_by, write_tiny_gguf
from support.tiny_qwen35 import write_tiny_qwen35

from bench.lora_file import matrix_shapes
from webapp.engine.model.lanes import Lane, Want
from webapp.engine.model.load_error import ModelLoadError
from webapp.engine.serving.adapters import UnknownAdapter
from webapp.engine.serving.loader import adapters_for, load_gguf_model

PROMPT = [1, 5, 9, 200, 33, 71, 12, 8, 90, 3]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    model = write_tiny_gguf(str(folder / "model.gguf"), matrix_type="Q8_0")
    loras = folder / "loras"
    loras.mkdir()
    write_lora_gguf(str(loras / "all.gguf"), model, rank=8, seed=1, size=0.3)
    # rank 40, not whole blocks of 32; q and v only, in float16, as PEFT's default targets are
    write_lora_gguf(str(loras / "qv.gguf"), model, rank=40, alpha=32, targets=("attn_q", "attn_v"), seed=2, size=0.3, dtype=np.float16)
    return model, str(loras)


@pytest.fixture(scope="module")
def steps_and_adapters(files):
    model, loras = files
    steps = load_steps(model, slots=4, context=64)
    return steps, adapters_for(loras, model, steps.model, steps)


@pytest.mark.parametrize("name, scale", [("all", 1.0), ("qv", 0.5)])
def test_an_adapter_gives_the_merged_models_logits(files, steps_and_adapters, name, scale):
    model, loras = files
    steps, adapters = steps_and_adapters
    want = merged_reference(model, os.path.join(loras, f"{name}.gguf"), scale).logits(PROMPT)
    base = Reference(model).logits(PROMPT)
    assert off_by(base, want) > 0.3  # the adapter matters
    got = steps.run([Lane(0, 0, PROMPT, Want.ALL, lora=adapters.choose(name, scale).lane)])[0]
    assert off_by(got, want) < 0.03
    decoded = steps.run([Lane(0, len(PROMPT), [7], lora=adapters.choose(name, scale).lane)])[0]
    assert off_by(decoded, merged_reference(model, os.path.join(loras, f"{name}.gguf"), scale).logits(PROMPT + [7])[-1]) < 0.03


def test_a_lane_is_its_own_beside_others_with_other_adapters(steps_and_adapters):
    steps, adapters = steps_and_adapters
    lanes = [None, adapters.choose("all").lane, adapters.choose("qv", 2.0).lane, adapters.choose("all", -0.5).lane]
    prompts = [PROMPT[: 4 + i] for i in range(4)]
    alone = [steps.run([Lane(s, 0, p, Want.ALL, lora=lora)])[0] for s, (p, lora) in enumerate(zip(prompts, lanes))]
    together = steps.run([Lane(s, 0, p, Want.ALL, lora=lora) for s, (p, lora) in enumerate(zip(prompts, lanes))])
    for one, both in zip(alone, together, strict=True):
        np.testing.assert_array_equal(both, one)
    decode = steps.run([Lane(s, len(p), [11], decoding=True, lora=lora) for s, (p, lora) in enumerate(zip(prompts, lanes))])
    for s, (p, lora) in enumerate(zip(prompts, lanes)):
        steps.run([Lane(s, 0, p, lora=lora)])
        np.testing.assert_array_equal(steps.run([Lane(s, len(p), [11], decoding=True, lora=lora)])[0], decode[s])


def test_a_scale_of_zero_is_the_model_itself(steps_and_adapters):
    steps, adapters = steps_and_adapters
    base = steps.run([Lane(0, 0, PROMPT, Want.ALL)])[0]
    np.testing.assert_array_equal(steps.run([Lane(0, 0, PROMPT, Want.ALL, lora=adapters.choose("all", 0.0).lane)])[0], base)


def test_adapters_are_listed_and_chosen_by_name(files, steps_and_adapters):
    _, adapters = steps_and_adapters
    assert adapters.names == ["all", "qv"]
    assert [(a["name"], a["rank"], a["alpha"]) for a in adapters.listing()] == [("all", 8, 16.0), ("qv", 40, 32.0)]
    # what a step reads: the float16 file's A's as float16, its B's transposed as float32
    _, shapes = matrix_shapes(files[0])
    layers = sum(name.endswith("attn_q.weight") for name in shapes)
    (q_rows, cols), (v_rows, _) = shapes["blk.0.attn_q.weight"], shapes["blk.0.attn_v.weight"]
    assert adapters.listing()[1]["bytes"] == layers * (2 * 2 * 40 * cols + 4 * 40 * (q_rows + v_rows))
    assert adapters.choose("all").lineage != adapters.choose("qv").lineage
    with pytest.raises(UnknownAdapter, match="no LoRA adapter named 'nope'"):
        adapters.choose("nope")


def test_files_that_do_not_fit_are_refused_in_one_line(files, tmp_path):
    model, _ = files
    steps = load_steps(model, slots=1, context=32)
    cases = {
        "other.gguf": dict(extra={"blk.0.attn_q.weight": (np.ones((4, 32), np.float32), np.ones((64, 4), np.float32))}, targets=()),
        "head.gguf": dict(extra={"output.weight": (np.ones((4, 64), np.float32), np.ones((32, 4), np.float32))}, targets=()),
    }
    for name, kwargs in cases.items():
        folder = tmp_path / name.removesuffix(".gguf")
        folder.mkdir()
        write_lora_gguf(str(folder / name), model, **kwargs)
        with pytest.raises(ModelLoadError) as refused:
            adapters_for(str(folder), model, steps.model, steps)
        assert "\n" not in str(refused.value) and name.removesuffix(".gguf") in str(refused.value)
    not_adapter = tmp_path / "plain"
    not_adapter.mkdir()
    os.symlink(model, not_adapter / "model.gguf")
    with pytest.raises(ModelLoadError, match="not a LoRA adapter"):
        adapters_for(str(not_adapter), model, steps.model, steps)


def test_a_model_with_recurrent_layers_takes_no_adapters(tmp_path):
    # its states would carry one adapter's work into another's request: no lineage files them
    path = write_tiny_qwen35(str(tmp_path / "q35.gguf"), matrix_type="Q8_0")
    assert load_gguf_model(path, 1, 64, 8).adapters is None
    with pytest.raises(ModelLoadError, match="LLM_LORA_DIR: .*this model has recurrent layers$"):
        load_gguf_model(path, 1, 64, 8, lora_dir=str(tmp_path))
