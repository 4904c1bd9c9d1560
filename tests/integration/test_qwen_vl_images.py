"""Qwen2.5-VL's, Qwen3-VL's and Qwen3.5's images through a real server and the real `openai`
client: an image's rows turn by M-RoPE (its time, row and column; in runs for Qwen2.5-VL,
interleaved for the others) and the text after it by positions that count the image as its grid's
longer side, though the image is longer than a prefill chunk; Qwen3-VL's first layers add its
rows' deepstack features. The answer's log probabilities are the float64 reference's given the
same prompt, rows and positions (written out here from the image's grid, apart from the server's
code), and not those of the image turned as text; a second request about the same image takes its
positions from the cache and answers alike, and the token decoded after it turns as the text
after the image does; on the CPU kernels and on tinygrad's path. A projector the model cannot take
is refused at load, saying why (the server's state says it, as its `/health` does)."""

import numpy as np
import openai
import pytest
from support import post, tiny_engine_server
from support.tiny_models import Reference, write_tiny_gguf
from support.tiny_projectors import write_tiny_qwen2vl_projector, write_tiny_qwen3vl_projector
from support.tiny_qwen35 import Qwen35Reference, write_tiny_qwen35

from tests.integration.test_gemma3_images import log_softmax
from tests.integration.test_images_api import png, user_turn

TOP = 5
SIZE = (96, 72)  # pixels: 12 x 9 merged tokens of 8 x 8 pixels, over several prefill chunks


SECTIONS = {"rope.dimension_sections": [2, 3, 3, 0]}


def qwen25vl(folder) -> tuple[str, str, type]:
    model = write_tiny_gguf(str(folder / "qwen2vl.gguf"), "qwen2vl", head_dim=16, metadata=SECTIONS)
    return model, write_tiny_qwen2vl_projector(str(folder / "qwen2vl.mmproj.gguf"), text_dim=64), Reference


def qwen3vl(folder) -> tuple[str, str, type]:
    model = write_tiny_gguf(str(folder / "qwen3vl.gguf"), "qwen3vl", head_dim=16, metadata=SECTIONS | {"n_deepstack_layers": 2})
    return model, write_tiny_qwen3vl_projector(str(folder / "qwen3vl.mmproj.gguf"), text_dim=64, deepstack=(1, 2)), Reference


def qwen35(folder) -> tuple[str, str, type]:
    model = write_tiny_qwen35(str(folder / "qwen35.gguf"))
    return model, write_tiny_qwen3vl_projector(str(folder / "qwen35.mmproj.gguf"), text_dim=64, deepstack=()), Qwen35Reference


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return qwen25vl(tmp_path_factory.mktemp("qwen2vl"))


@pytest.fixture(
    scope="module",
    params=[(qwen25vl, True), (qwen3vl, True), (qwen35, True), (qwen25vl, False), (qwen3vl, False)],
    ids=["qwen2.5-vl", "qwen3-vl", "qwen3.5", "qwen2.5-vl-tinygrad", "qwen3-vl-tinygrad"],
)
def served(tmp_path_factory, request):
    """On the CPU kernels, and on tinygrad's own (every other device's path; Qwen3.5 runs on the
    CPU kernels only)."""
    family, cpu_kernels = request.param
    model, projector, reference = family(tmp_path_factory.mktemp("qwen-vl"))
    with tiny_engine_server(model, slots=2, queue_limit=4, context=512, mmproj=projector, cpu_kernels=cpu_kernels) as (engine, server):
        yield engine, server, reference(model)


def turned(length: int, first: int, rows: int, cols: int) -> np.ndarray:
    """(3, length) positions of a prompt with one image of rows x cols tokens at `first`."""
    out = []
    for i in range(length):
        if i < first:
            out.append((i, i, i))
        elif i < first + rows * cols:
            row, col = divmod(i - first, cols)
            out.append((first, first + row, first + col))
        else:
            after = first + max(rows, cols) + (i - first - rows * cols)
            out.append((after, after, after))
    return np.array(out).T


def token_logprobs(server, messages, tokens: int = 1) -> tuple[list[np.ndarray], int]:
    """Each generated token's TOP log probabilities, highest first, and how many prompt tokens were cached."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=tokens, temperature=0, logprobs=True, top_logprobs=TOP
    )
    tops = [np.array(sorted((t.logprob for t in token.top_logprobs), reverse=True)) for token in reply.choices[0].logprobs.content]
    return tops, reply.usage.prompt_tokens_details.cached_tokens


def top(logits: np.ndarray) -> np.ndarray:
    return np.sort(log_softmax(logits))[::-1][:TOP]


def test_an_image_turns_by_its_grid_through_the_server(served):
    engine, server, reference = served
    image = png(31, size=SIZE)
    messages = user_turn(image)
    status, _, tokenized = post(server, "/tokenize", {"model": "tiny", "messages": messages, "with_pieces": True})
    assert status == 200
    ids = [t["id"] for t in tokenized["tokens"]]
    at = [i for i, t in enumerate(tokenized["tokens"]) if t["piece"] == "[image]"]
    (piece,) = engine.vision.prepare(image)
    assert piece.grid == (9, 12) and at == list(range(at[0], at[0] + 108)) and len(at) > engine.prefill_chunk
    (got, decoded), _ = token_logprobs(server, messages, tokens=2)
    inputs = {p: row.astype(np.float64) for p, row in zip(at, engine.vision.rows(piece), strict=True)}
    logits = reference.logits(ids, inputs, turned=turned(len(ids), at[0], 9, 12))[-1]
    first = int(np.argmax(logits))  # the greedy token, fed back: decoded at the image-shortened position
    assert np.sort(logits)[-1] - np.sort(logits)[-2] > 1e-2  # decided, so the server picked it too
    following = reference.logits([*ids, first], inputs, turned=turned(len(ids) + 1, at[0], 9, 12))[-1]
    as_text = top(reference.logits(ids, inputs)[-1])
    assert np.abs(got - top(logits)).max() < 1e-3  # tinygrad's path rounds more than the kernels (~1e-6 there)
    assert np.abs(decoded - top(following)).max() < 1e-3
    assert np.abs(as_text - top(logits)).max() > 1e-3  # the image's rows turned as text answer otherwise: the check can tell
    (again,), cached = token_logprobs(server, messages)
    assert cached >= 108 and np.abs(again - got).max() < 1e-4


def test_a_conversation_goes_on_after_the_image(files):
    """Generated text after an image decodes at the image-shortened positions: a greedy answer, fed
    back as the prompt's next turn, is the cache's continuation and answers as it did."""
    model, projector, _ = files
    with tiny_engine_server(model, slots=2, queue_limit=4, context=512, mmproj=projector) as (_, server):
        _converse(server)


def _converse(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = user_turn(png(32, size=SIZE))
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert first.choices[0].message.content == again.choices[0].message.content
    follow = [*messages, {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And?"}]
    reply = client.chat.completions.create(model="tiny", messages=follow, max_tokens=4, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens >= 108


def test_a_model_without_sections_refuses_the_projector(files, tmp_path):
    plain = write_tiny_gguf(str(tmp_path / "qwen2.gguf"), "qwen2")
    with pytest.raises(AssertionError, match="ModelLoadError: .*M-RoPE sections"):
        with tiny_engine_server(plain, slots=1, queue_limit=1, context=256, mmproj=files[1]):
            pass


def test_deepstack_features_the_model_does_not_take_are_refused(files, tmp_path):
    deep = write_tiny_qwen3vl_projector(str(tmp_path / "deep.mmproj.gguf"), text_dim=64, deepstack=(1,))
    with pytest.raises(AssertionError, match="ModelLoadError: .*1 deepstack features; the model's first layers take 0"):
        with tiny_engine_server(files[0], slots=1, queue_limit=1, context=256, mmproj=deep):
            pass
