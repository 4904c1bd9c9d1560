"""Images through every API, with the real clients, to a real tiny model and a tiny projector of its
width behind a real Waitress server: the image reaches the model (another image, another answer),
usage counts its positions, a second turn about it reuses its cached positions, and everything
wrong with an image is a 400 in the API's own shape while the server goes on serving."""

import base64
import io
import struct
import zlib

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image
from support import assert_error_shape, get, post, tiny_engine_server
from support.tiny_models import write_tiny_gguf
from support.tiny_projectors import write_tiny_projector

from webapp.engine.kernels.host_blocks import HostBlocks

TOKENS_PER_IMAGE = 16  # the tiny idefics3 projector's 8 x 8 patches shuffled in 2 x 2 blocks


def png(seed: int, size=(40, 30)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def user_turn(data: bytes, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(data)}}]}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision")
    model = write_tiny_gguf(str(folder / "tiny.gguf"), matrix_type="Q8_0")
    # Q8_0, as llama.cpp's quantized projector files: its matrices laid out for the CPU kernels at load, multiplied there
    projector = write_tiny_projector(str(folder / "tiny.mmproj.gguf"), "idefics3", text_dim=64, tensor_type="Q8_0")
    with tiny_engine_server(model, slots=2, queue_limit=8, context=256, mmproj=projector) as (engine, server):
        yield engine, server


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served[1].url}/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client, messages, **extra):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, **extra)


def test_an_image_reaches_the_model_and_its_positions_are_counted(client, served):
    up = served[0].vision.projector.encoder.layers[0].up_weight
    assert isinstance(up, HostBlocks) and up.library is served[0].vision.projector.encoder.kernels.library
    text_only = ask(client, [{"role": "user", "content": "What is in this picture?"}])
    first, other = ask(client, user_turn(png(1))), ask(client, user_turn(png(2)))
    assert first.usage.prompt_tokens >= text_only.usage.prompt_tokens + TOKENS_PER_IMAGE
    # the image's rows change what the model sees: another image, other first-token logprobs
    assert first.choices[0].logprobs.content[0].logprob != other.choices[0].logprobs.content[0].logprob


def test_a_second_request_with_the_same_image_reuses_its_positions_and_answers_alike(client, served):
    engine, _ = served
    encodes = engine.vision.encodes
    first = ask(client, user_turn(png(3)))
    again = ask(client, user_turn(png(3)))
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= TOKENS_PER_IMAGE
    assert engine.vision.encodes == encodes + 1  # the second found every image position cached


def test_the_same_pixels_in_another_format_are_the_same_image(client, served):
    engine, _ = served
    pixels = np.asarray(Image.open(io.BytesIO(png(4))))
    bmp = io.BytesIO()
    Image.fromarray(pixels).save(bmp, format="BMP")
    first = ask(client, user_turn(png(4)))
    again = ask(
        client,
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": data_url(bmp.getvalue(), "image/bmp")}},
                ],
            }
        ],
    )
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= TOKENS_PER_IMAGE


def test_anthropics_image_blocks(served):
    claude = anthropic.Anthropic(base_url=served[1].url, api_key="k", max_retries=0, timeout=60)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(5)).decode()}}
    reply = claude.messages.create(
        model="tiny", max_tokens=5, messages=[{"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]}]
    )
    assert reply.content and reply.usage.input_tokens >= TOKENS_PER_IMAGE
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model="tiny",
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:1/x.png"}}]}],
        )
    assert refused.value.body["type"] == "error" and "fetches no URL" in refused.value.body["error"]["message"]


def test_the_responses_apis_input_image(client):
    reply = client.responses.create(
        model="tiny",
        max_output_tokens=5,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": data_url(png(6))}],
            }
        ],
    )
    assert reply.usage.input_tokens >= TOKENS_PER_IMAGE


def bomb() -> bytes:
    """A PNG whose header claims 100000 x 100000 pixels, with almost no data after it."""
    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    chunk = lambda kind, body: struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))  # noqa: E731
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    "url, says",
    [
        (data_url(b"just some text, not a picture"), "not an image"),
        (data_url(png(7)[:60]), "truncated or corrupt"),
        (data_url(bomb()), "pixels"),
        (data_url(b""), "empty"),
        ("data:image/png;base64,@@@", "does not decode"),
        ("https://127.0.0.1:1/cat.png", "fetches no URL"),
        ("data:image/png,rawbytes", "data URL of the form"),
    ],
)
def test_a_bad_image_is_a_400_naming_what_is_wrong_and_the_server_goes_on(served, client, url, says):
    body = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    status, _, error = post(served[1], "/v1/chat/completions", body)
    assert status == 400 and says in error["error"]["message"], error
    assert_error_shape(error)
    assert ask(client, [{"role": "user", "content": "still there?"}]).choices[0].message.content is not None


def test_too_many_images_and_a_marker_in_text_are_refused(served):
    many = [{"type": "image_url", "image_url": {"url": data_url(png(8))}}] * 9
    status, _, error = post(served[1], "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": many}]})
    assert status == 400 and "at most 8 images" in error["error"]["message"]
    sneaky = [{"type": "text", "text": "look: <__image__>"}]
    status, _, error = post(served[1], "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": sneaky}]})
    assert status == 400 and "stands for an image" in error["error"]["message"]


def test_a_model_without_a_projector_refuses_images(openai_client):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model="tiny", messages=user_turn(png(9)), max_tokens=3)
    assert refused.value.code == "images_not_supported" and "LLM_MMPROJ" in refused.value.message


def test_ollamas_images(served):
    import ollama

    client = ollama.Client(host=served[1].url, timeout=60)
    assert "vision" in client.show("tiny").capabilities
    reply = client.chat(
        model="tiny", messages=[{"role": "user", "content": "What is this?", "images": [png(10)]}], options={"num_predict": 4}
    )
    assert reply.prompt_eval_count >= TOKENS_PER_IMAGE
    generated = client.generate(model="tiny", prompt="Describe it.", images=[png(10)], options={"num_predict": 4})
    assert generated.prompt_eval_count >= TOKENS_PER_IMAGE
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model="tiny", prompt="x", raw=True, images=[png(10)])
    assert refused.value.status_code == 400 and "raw" in refused.value.error


def test_the_api_document_offers_images_in_every_shape(served):
    _, _, document = get(served[1], "/openapi.json")
    schemas = document["components"]["schemas"]
    for name, image_type in (("ContentPart", "image_url"), ("ResponseContentPart", "input_image"), ("AnthropicContentBlock", "image")):
        assert image_type in [part["properties"]["type"].get("const") for part in schemas[name]["oneOf"]], name


def test_tokenize_counts_an_images_positions(served):
    messages = user_turn(png(11))
    status, _, counted = post(served[1], "/tokenize", {"model": "tiny", "messages": messages, "with_pieces": True})
    assert status == 200 and [t["piece"] for t in counted["tokens"]].count("[image]") == TOKENS_PER_IMAGE
    status, _, text_only = post(
        served[1], "/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "What is in this picture?"}]}
    )
    assert counted["count"] >= text_only["count"] + TOKENS_PER_IMAGE


def test_a_long_encode_lets_other_requests_run_meanwhile(served, client, monkeypatch):
    """The model thread encodes a slice a pass between steps: a text request sent while an image
    is still encoding is answered first, not after the encode."""
    import threading
    import time

    from support import wait_until

    from webapp.engine.vision import vision as vision_module
    from webapp.engine.vision.vision import Vision

    engine, _ = served
    monkeypatch.setattr(vision_module, "SLICE_FLOPS", 1e4)  # the tiny encoder in hundreds of slices,
    one_slice = Vision.encode_slice

    def slow_slice(vision, images, alone=False):  # each of them as slow as a real encoder's
        time.sleep(0.005)
        one_slice(vision, images, alone)

    monkeypatch.setattr(Vision, "encode_slice", slow_slice)
    finished = {}

    def ask_about_an_image():
        ask(client, user_turn(png(13)))
        finished["image"] = time.monotonic()

    asking = threading.Thread(target=ask_about_an_image)
    asking.start()
    assert wait_until(lambda: len(engine.scheduler.waiting) == 1, timeout=10)  # held back while it encodes
    ask(client, [{"role": "user", "content": "And meanwhile?"}])
    finished["text"] = time.monotonic()
    asking.join(60)
    assert finished["text"] < finished["image"]


def test_a_projector_that_does_not_fit_the_model_is_refused_at_load(tmp_path):
    from webapp.engine.model.load_error import ModelLoadError
    from webapp.engine.model.tinygrad_setup import use_tinygrad_from_this_thread
    from webapp.engine.serving.loader import load_gguf_model

    use_tinygrad_from_this_thread()
    model = write_tiny_gguf(str(tmp_path / "tiny.gguf"), matrix_type="Q8_0")
    narrow = write_tiny_projector(str(tmp_path / "narrow.mmproj.gguf"), "idefics3", text_dim=48)
    with pytest.raises(ModelLoadError, match="narrow.mmproj.gguf: its rows have 48 values; the model's embeddings have 64"):
        load_gguf_model(model, 1, 64, 8, mmproj=narrow)
    with pytest.raises(ModelLoadError, match="clip"):
        load_gguf_model(model, 1, 64, 8, mmproj=model)  # a language model given as the projector
