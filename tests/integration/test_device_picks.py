"""Greedy picks in tinygrad's steps (every device but the CPU kernels; here tinygrad's CPU backend): a
lane wanting TOKEN gets its last logits' argmax as an int32 array (1,), the argmax of the row the
same lane wanting LAST gets, alone, in a decode step of several lanes, beside lanes wanting rows,
and with a LoRA adapter. Where the steps do not pick (the CPU kernels), the runner picks from the
row. Through a real server and the `openai` client, a greedy request (picked in the step) answers
what the same request asking for logprobs (rows read back and sampled on the host) answers.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
from support import tiny_engine_server
from support.tiny_lora import write_lora_gguf
from support.tiny_models import load_steps, write_tiny_gguf

from webapp.engine.decoding.sampling import RequestSampler
from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.model.lanes import Lane, Want
from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
from webapp.engine.serving.loader import adapters_for
from webapp.engine.serving.request import Request
from webapp.engine.serving.runner import ModelRunner, Part

PROMPT = [1, 5, 9, 200, 33, 71, 12, 8, 90, 3]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_gguf(str(tmp_path_factory.mktemp("picks") / "model.gguf"), matrix_type="Q8_0", context=512)


@pytest.fixture(scope="module")
def steps(model):
    use_tinygrad_from_this_thread()
    steps = load_steps(model, slots=4, context=64, cpu_kernels=False)
    assert steps.picks
    return steps


def assert_picked(pick: np.ndarray, row: np.ndarray) -> None:
    assert pick.dtype == np.int32 and pick.shape == (1,)
    assert int(pick[0]) == int(np.argmax(row))


def test_a_prompts_pick_is_its_rows_argmax(steps):
    for slot in range(4):
        prompt = PROMPT[: 4 + slot]
        assert_picked(steps.run([Lane(slot, 0, prompt, Want.TOKEN)])[0], steps.run([Lane(slot, 0, prompt)])[0])


def test_a_decode_steps_picks_alone_beside_others_and_beside_rows(steps):
    prompts = [PROMPT[: 4 + i] for i in range(4)]
    for slot, prompt in enumerate(prompts):
        steps.run([Lane(slot, 0, prompt)])
    lanes = [Lane(slot, len(p), [11], decoding=True) for slot, p in enumerate(prompts)]
    rows = steps.run(lanes)
    picks = steps.run([Lane(x.slot, x.start, x.tokens, Want.TOKEN, decoding=True) for x in lanes])
    for pick, row in zip(picks, rows, strict=True):
        assert_picked(pick, row)
    mixed = steps.run([Lane(x.slot, x.start, x.tokens, Want.TOKEN if x.slot % 2 else Want.LAST, decoding=True) for x in lanes])
    for slot, (out, row) in enumerate(zip(mixed, rows, strict=True)):
        assert_picked(out, row) if slot % 2 else np.testing.assert_array_equal(out, row)
    assert_picked(steps.run([Lane(0, len(prompts[0]), [11], Want.TOKEN, decoding=True)])[0], steps.run(lanes[:1])[0])


def test_a_pick_with_an_adapter(model, steps, tmp_path):
    write_lora_gguf(str(tmp_path / "a.gguf"), model, rank=8, seed=1, size=0.3)
    lora = adapters_for(str(tmp_path), model, steps.model, steps).choose("a").lane
    row = steps.run([Lane(0, 0, PROMPT, lora=lora)])[0]
    assert_picked(steps.run([Lane(0, 0, PROMPT, Want.TOKEN, lora=lora)])[0], row)
    assert int(np.argmax(row)) != int(np.argmax(steps.run([Lane(0, 0, PROMPT)])[0]))  # the adapter's pick, not the model's


def test_the_runner_picks_from_the_row_where_the_steps_do_not(model):
    steps = load_steps(model, slots=2, context=64)  # the CPU kernels' one-call steps
    assert not steps.picks
    request = Request(PROMPT, SamplingParams(temperature=0.0))
    request.slot, request.sampler = 0, RequestSampler(request.params, PROMPT)
    part = Part.prompt(request, PROMPT, 0)
    assert part.want is Want.TOKEN
    assert_picked(ModelRunner(steps).run([part])[0], steps.run([Lane(0, 0, PROMPT)])[0])
    asks_logprobs = Request(PROMPT, SamplingParams(temperature=0.0, logprobs=True))
    asks_logprobs.sampler = RequestSampler(asks_logprobs.params, PROMPT)
    assert Part.prompt(asks_logprobs, PROMPT, 0).want is Want.LAST


def test_greedy_answers_through_a_real_server_are_the_rows_greedy_answers(model):
    with tiny_engine_server(model, slots=2, queue_limit=8, context=128, cpu_kernels=False) as (_, server):
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            ask = dict(model="model", prompt="The quick brown fox", max_tokens=12, temperature=0)
            picked = client.completions.create(**ask)
            from_rows = client.completions.create(**ask, logprobs=1)
    assert picked.usage.completion_tokens == from_rows.usage.completion_tokens == 12
    assert picked.choices[0].text == from_rows.choices[0].text
