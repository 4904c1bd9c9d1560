"""Gemma 3's image through a real server and the real `openai` client, on the CPU kernels and on
tinygrad's path: its positions attend each other both ways, as the model was trained and llama.cpp decodes it, though the image is longer than
a prefill chunk. The answer's log probabilities are the float64 reference's given the same prompt
and rows, attending the image both ways, and not the causal reference's; a second request about the
same image takes its positions from the cache and answers alike."""

import numpy as np
import openai
import pytest
from support import post, tiny_engine_server
from support.tiny_models import Reference, write_tiny_gguf
from support.tiny_projectors import write_tiny_projector

from tests.integration.test_images_api import png, user_turn

TOP = 5


@pytest.fixture(scope="module", params=[True, False], ids=["cpu-kernels", "tinygrad"])
def served(tmp_path_factory, request):
    """On the CPU kernels, and on tinygrad's own (every other device's path)."""
    folder = tmp_path_factory.mktemp("gemma3-vision")
    model = write_tiny_gguf(str(folder / "gemma3.gguf"), "gemma3", sliding_window=64)
    projector = write_tiny_projector(str(folder / "gemma3.mmproj.gguf"), "gemma3", text_dim=64)
    with tiny_engine_server(model, slots=2, queue_limit=4, context=512, mmproj=projector, cpu_kernels=request.param) as (engine, server):
        yield engine, server, Reference(model)


def first_token_logprobs(server, messages) -> tuple[np.ndarray, int]:
    """The first token's TOP log probabilities, highest first (by value: a random model's tokens
    may decode to the same text), and how many prompt tokens were cached."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0, logprobs=True, top_logprobs=TOP)
    top = sorted((t.logprob for t in reply.choices[0].logprobs.content[0].top_logprobs), reverse=True)
    return np.array(top), reply.usage.prompt_tokens_details.cached_tokens


def log_softmax(x: np.ndarray) -> np.ndarray:
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_an_image_is_attended_both_ways_through_the_server(served):
    engine, server, reference = served
    image = png(21, size=(48, 40))
    messages = user_turn(image)
    status, _, tokenized = post(server, "/tokenize", {"model": "tiny", "messages": messages, "with_pieces": True})
    assert status == 200
    ids = [t["id"] for t in tokenized["tokens"]]
    at = [i for i, t in enumerate(tokenized["tokens"]) if t["piece"] == "[image]"]
    assert len(at) == 256 > engine.prefill_chunk and at == list(range(at[0], at[0] + 256))  # one image, over many chunks' worth
    got, _ = first_token_logprobs(server, messages)
    (piece,) = engine.vision.prepare(image)
    inputs = {p: row.astype(np.float64) for p, row in zip(at, engine.vision.rows(piece), strict=True)}
    both_ways = np.sort(log_softmax(reference.logits(ids, inputs, both_ways=((at[0], at[-1] + 1),))[-1]))[::-1][:TOP]
    causal = np.sort(log_softmax(reference.logits(ids, inputs)[-1]))[::-1][:TOP]
    assert np.abs(got - both_ways).max() < 1e-3  # tinygrad's path rounds more than the kernels (~1e-6 there)
    assert np.abs(causal - both_ways).max() > 3e-3  # the causal mask's answer is another: the check can tell
    again, cached = first_token_logprobs(server, messages)
    assert cached >= 256 and np.abs(again - got).max() < 1e-4
