"""Images on the chat page, in a real (headless Debian) Chromium against the real engine on a tiny
model with a tiny projector: an image attached with the picker shows as a thumbnail, goes out with
the message, shows in the conversation, reaches the model (usage counts its positions) and is still
there after a reload; a second turn about it finds it in the KV cache. Screenshots in test-output/."""

import os

import numpy as np
import pytest
from PIL import Image
from support import CHROMIUM, SHOTS, get, send_message, tiny_engine_server
from support.tiny_models import write_tiny_gguf
from support.tiny_projectors import write_tiny_projector

pytest.importorskip("playwright.sync_api")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)

LAST_META = "document.querySelector('.msg.assistant:last-of-type .meta').textContent"


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-page")
    model = write_tiny_gguf(str(folder / "tiny-vision.gguf"), matrix_type="Q8_0")
    projector = write_tiny_projector(str(folder / "tiny-vision.mmproj.gguf"), "idefics3", text_dim=64)
    picture = folder / "picture.png"
    gradient = np.linspace(0, 255, 120 * 160 * 3).reshape(120, 160, 3).astype(np.uint8)
    Image.fromarray(gradient).save(picture)
    with tiny_engine_server(model, slots=2, queue_limit=4, context=256, mmproj=projector) as (engine, server):
        yield engine, server, str(picture)


def test_an_attached_image_goes_out_shows_and_stays(pages, vision_server):
    engine, srv, picture = vision_server
    page = pages(srv.url + "/")
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny-vision'")
    page.click("#settings summary")
    page.fill("#max-tokens", "6")
    page.fill("#temperature", "0")
    page.click("#settings summary")

    page.set_input_files("#attach-file", picture)
    page.wait_for_selector("#attached img")
    assert page.is_visible("#attached") and page.locator("#attached img").count() == 1
    send_message(page, "What is in this picture?")
    # a finished reply's figures: its token count (a rate shows only where its tokens arrived apart,
    # which a tiny model's six need not)
    page.wait_for_function(f"() => {LAST_META}.includes('6 tokens')", timeout=20_000)
    assert page.locator(".msg.user .images img").count() == 1 and not page.is_visible("#attached")
    recent = get(srv, "/admin/stats.json", timeout=5)[2]["recent_requests"][0]
    assert recent["prompt_tokens"] >= 16 and engine.vision.encodes == 1
    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / "chat-image.png"))

    # saved with the conversation: a reload shows it, and the next turn sends it again, cached
    page.reload()
    page.wait_for_selector(".msg.user .images img")
    send_message(page, "And the colours?")
    page.wait_for_function(
        "() => document.querySelectorAll('.msg.assistant .meta').length === 2 && "
        "[...document.querySelectorAll('.msg.assistant .meta')].every(m => m.textContent.includes('6 tokens'))",
        timeout=20_000,
    )
    assert "prompt tokens cached" in page.eval_on_selector_all(".msg.assistant .meta", "ms => ms[1].textContent")
    assert engine.vision.encodes == 1  # the image's positions came from the cache

    dashboard = pages(srv.url + "/admin")
    assert dashboard.inner_text("#images [data-stat='images.encodes']") == "1"
    dashboard.screenshot(path=str(SHOTS / "dashboard-images.png"), full_page=True)
