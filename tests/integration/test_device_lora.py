"""LoRA adapters on tinygrad's path (every device but the CPU kernels; here tinygrad's CPU backend),
against the float64 reference of the merged model, as tests/integration/test_lora.py checks the CPU
kernels: prompt scoring, a prompt's last logits, a decode step and the final norm's rows give the
merged model's; lanes
with different adapters, and without one, in one step give what they give in any order (bit for
bit: the same width runs the same kernels) and alone (within float32's rounding: another width is
other kernels); loading an adapter past the stacks' rank or products lays them out again and the
adapters loaded before still give theirs; an unloaded adapter's index adds nothing. Through a real
server and the `openai` client, an adapter chosen by name scores as the merged model.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
from support import tiny_engine_server
from support.tiny_lora import merged_reference, write_lora_gguf
from support.tiny_models import Reference, load_steps, off_by, write_tiny_gguf

from webapp.engine.model.lanes import Lane, Want
from webapp.engine.model.lora import read_adapter
from webapp.engine.model.steps import TinygradJitSteps
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.serving.loader import adapters_for

PROMPT = [1, 5, 9, 200, 33, 71, 12, 8, 90, 3]
CLOSE = 2e-3  # of the largest logit: float32 against float64 on the same Q8_0 values, more where a large scale amplifies rounding


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("device_lora")
    model = write_tiny_gguf(str(folder / "model.gguf"), matrix_type="Q8_0", context=512)
    loras = folder / "loras"
    loras.mkdir()
    write_lora_gguf(str(loras / "all.gguf"), model, rank=8, seed=1, size=0.3)
    write_lora_gguf(str(loras / "qv.gguf"), model, rank=12, alpha=32, targets=("attn_q", "attn_v"), seed=2, size=0.3, dtype=np.float16)
    write_lora_gguf(str(folder / "wide.gguf"), model, rank=40, seed=3, size=0.3, targets=("attn_k", "ffn_down"))
    return model, str(loras), str(folder / "wide.gguf")


@pytest.fixture(scope="module")
def steps_and_adapters(files):
    use_tinygrad_from_this_thread()
    model, loras, _ = files
    steps = load_steps(model, slots=4, context=64, cpu_kernels=False)
    assert isinstance(steps, TinygradJitSteps)
    return steps, adapters_for(loras, model, steps.model, steps)


def merged(files, name: str, scale: float, tokens: list[int]) -> np.ndarray:
    model, loras, wide = files
    return merged_reference(model, wide if name == "wide" else f"{loras}/{name}.gguf", scale).logits(tokens)


@pytest.mark.parametrize("name, scale", [("all", 1.0), ("qv", 0.5)])
def test_an_adapter_gives_the_merged_models_logits(files, steps_and_adapters, name, scale):
    steps, adapters = steps_and_adapters
    lora = adapters.choose(name, scale).lane
    want = merged(files, name, scale, PROMPT + [7])
    assert off_by(Reference(files[0]).logits(PROMPT), want[:-1]) > 0.3  # the adapter matters
    assert off_by(steps.run([Lane(0, 0, PROMPT, Want.ALL, lora=lora)])[0], want[:-1]) < CLOSE
    assert off_by(steps.run([Lane(0, 0, PROMPT, lora=lora)])[0], want[-2]) < CLOSE
    assert off_by(steps.run([Lane(0, len(PROMPT), [7], decoding=True, lora=lora)])[0], want[-1]) < CLOSE
    hidden = merged_reference(files[0], f"{files[1]}/{name}.gguf", scale).hidden(PROMPT)  # what embeddings pool
    assert off_by(steps.run([Lane(0, 0, PROMPT, Want.HIDDEN, lora=lora)])[0], hidden) < CLOSE


def test_lanes_with_other_adapters_in_one_step(steps_and_adapters):
    steps, adapters = steps_and_adapters
    lanes = [None, adapters.choose("all").lane, adapters.choose("qv", 2.0).lane, adapters.choose("all", -0.5).lane]
    prompts = [PROMPT[: 4 + i] for i in range(4)]
    for slot, (prompt, lora) in enumerate(zip(prompts, lanes)):
        steps.run([Lane(slot, 0, prompt, lora=lora)])
    step = [Lane(slot, len(p), [11], decoding=True, lora=lora) for slot, (p, lora) in enumerate(zip(prompts, lanes))]
    together, reversed_ = steps.run(step), steps.run(step[::-1])[::-1]
    for slot, lane in enumerate(step):
        np.testing.assert_array_equal(reversed_[slot], together[slot])
        assert off_by(steps.run([lane])[0], together[slot]) < CLOSE
    plain = steps.run([Lane(slot, len(p), [11], decoding=True) for slot, p in enumerate(prompts)])
    assert off_by(together[0], plain[0]) < CLOSE and off_by(together[1], plain[1]) > 0.1


def test_a_wider_adapter_lays_the_stacks_out_again_and_unloading_zeroes_its_index(files, steps_and_adapters, monkeypatch):
    steps, adapters = steps_and_adapters
    monkeypatch.setattr("webapp.engine.serving.adapters.QUIET_S", 0.0)
    table = steps.lora_table
    before = table.generation
    adapters.add(read_adapter(files[2]))  # rank 40 > the stacks' 16, and k and down, which none changed
    assert table.generation == before + 1 and {s.rank for s in table.stacks.values()} == {64}
    held = sum(a["bytes"] for a in adapters.listing())
    assert adapters.nbytes == held + table.device_bytes and table.device_bytes > held  # 4 adapters of rank 64 a product
    for name, scale in [("wide", 1.0), ("qv", 0.5), ("all", 2.0)]:
        got = steps.run([Lane(0, 0, PROMPT, Want.ALL, lora=adapters.choose(name, scale).lane)])[0]
        assert off_by(got, merged(files, name, scale, PROMPT)) < CLOSE, name
    index = adapters.choose("wide").index
    adapters.retire("wide")
    assert adapters.free_if_unused("wide", set()) and "wide" not in adapters.names
    freed = steps.run([Lane(0, 0, PROMPT, Want.ALL, lora=(index, 1.0))])[0]  # what an index no adapter holds adds
    assert off_by(freed, Reference(files[0]).logits(PROMPT)) < CLOSE


def test_an_adapter_through_a_real_server_and_client(files):
    model, loras, _ = files
    with tiny_engine_server(model, slots=2, queue_limit=8, context=128, lora_dir=loras, cpu_kernels=False) as (engine, server):
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            prompt = "The quick brown fox"
            ids = engine.tokenizer.encode(prompt, special=True)
            ids = [engine.tokenizer.bos_id, *ids] if engine.tokenizer.add_bos and ids[:1] != [engine.tokenizer.bos_id] else ids
            answers = {
                name: client.completions.create(model=name, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=0)
                for name in ("model", "all", "qv")
            }
    for name, answer in answers.items():
        logits = (Reference(model) if name == "model" else merged_reference(model, f"{loras}/{name}.gguf")).logits(ids)[:-1]
        top = logits.max(-1, keepdims=True)
        want = (logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True)))[np.arange(len(ids) - 1), ids[1:]]
        np.testing.assert_allclose(answer.choices[0].logprobs.token_logprobs[1 : len(ids)], want, atol=1e-3, err_msg=name)
