"""The pages with LLM_MODELS_DIR, in a real (headless Debian) Chromium against a real Waitress server
over a model set of real engines on fake runners (support.fakes.FakeModelEngines): the dashboard's
Models table follows a load live, a model's name shows its panels; the chat page's model picker
sends each conversation to its own model (checked on the server: which engine served it), across a
reload and a new chat, waits for a model's first load, and tells of a model that failed to load or is
gone from the folder;
no console errors, no serious accessibility violations. A screenshot of the header lands in test-output/.

Skipped when Playwright or /usr/bin/chromium is missing.
"""

import os
import threading

import pytest
from support import CHROMIUM, DESKTOP, PHONE, SHOTS, axe_violations, post, running_server, send_message
from support.fakes import FakeModelEngines

from webapp import create_app
from webapp.engine.serving.model_set import ModelSet

pytest.importorskip("playwright.sync_api")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)


@pytest.fixture
def model_set_server(tmp_path):
    for name in ("alpha", "beta"):
        (tmp_path / f"{name}.gguf").write_bytes(b"x" * 1000)
    engines = FakeModelEngines(context=512)  # room for a few turns of bytes
    models = ModelSet(str(tmp_path), engines)
    try:
        with running_server(create_app({"TESTING": True}, engine=models)) as srv:
            srv.models, srv.engines, srv.folder = models, engines, tmp_path
            yield srv
    finally:
        models.stop(5)


def test_the_dashboard_lists_the_models_live_and_shows_one(pages, model_set_server):
    srv = model_set_server
    admin = pages(srv.url + "/admin")
    admin.wait_for_selector("#live.ok")
    rows = "() => [...document.querySelectorAll('#model-rows tr')].map(r => r.innerText.replace(/\\s+/g, ' ').trim())"
    assert admin.evaluate(rows) == ["alpha unloaded 0.0 MiB – –", "beta unloaded 0.0 MiB – –"]

    body = {"model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(srv, "/v1/chat/completions", body)[0] == 200
    admin.wait_for_function("() => document.querySelector('#model-rows tr:nth-child(2) .badge').textContent === 'loaded'")
    assert admin.evaluate(rows)[1].startswith("beta loaded 0.0 MiB 0.0 MiB 0")
    assert admin.text_content("h1") == "beta"  # the most recently used model's panels

    admin.click("text=alpha")  # not loaded: its panels are the most recently used model's, until it is
    admin.wait_for_selector("#live.ok")
    assert admin.url.endswith("/admin?model=alpha") and admin.text_content("h1") == "beta"
    assert axe_violations(admin) == []

    chat = pages(srv.url + "/")
    chat.wait_for_function("() => document.getElementById('model-name').textContent === 'alpha'")  # the first listed


REPLY_DONE = "() => document.querySelector('.msg.assistant:last-of-type:not(.pending) .meta')?.textContent"
OPTIONS = "() => [...document.querySelectorAll('#model-picker option')].map(o => o.textContent)"


def served(srv) -> dict[str, int]:
    """Requests each loaded model's engine has finished: the server's own account of who answered."""
    return {name: sum(stats["requests_total"].values()) for name, stats in srv.models.model_stats().items()}


def open_chat(pages, srv):
    page = pages(srv.url + "/")
    page.wait_for_function("() => document.querySelectorAll('#model-picker option').length > 1")
    page.click("#settings summary")
    page.fill("#max-tokens", "3")  # kept in the browser from its change on, across reloads
    page.click("#settings summary")
    return page


def send_and_wait(page, text):
    send_message(page, text)
    page.wait_for_function(REPLY_DONE, timeout=15_000)


def test_each_conversation_talks_to_the_model_picked_for_it(pages, model_set_server):
    srv = model_set_server
    page = open_chat(pages, srv)
    assert page.is_visible("#model-picker") and "sr-only" in page.get_attribute("#model-name", "class")
    assert page.evaluate(OPTIONS) == ["alpha · not loaded", "beta · not loaded"]
    assert page.input_value("#model-picker") == "alpha" and page.title() == "alpha · Chat"

    page.focus("#model-picker")  # the keyboard alone picks
    page.keyboard.press("ArrowDown")
    assert page.input_value("#model-picker") == "beta" and page.title() == "beta · Chat"
    assert page.text_content("#model-name") == "beta"  # the heading screen readers read
    send_and_wait(page, "hi")
    assert served(srv) == {"beta": 1}  # alpha was never even loaded
    page.wait_for_function(f"() => ({OPTIONS})()[1] === 'beta · loaded'")
    SHOTS.mkdir(exist_ok=True)
    page.locator(".bar").screenshot(path=str(SHOTS / "chat-model-picker.png"))
    assert axe_violations(page) == []
    page.emulate_media(color_scheme="dark")
    page.set_viewport_size(PHONE)
    page.locator(".bar").screenshot(path=str(SHOTS / "chat-model-picker-phone-dark.png"))
    assert axe_violations(page) == []
    page.emulate_media(color_scheme="light")
    page.set_viewport_size(DESKTOP)

    page.reload()  # the conversation remembers its model
    page.wait_for_selector(".msg.assistant")
    page.wait_for_function("() => document.getElementById('model-picker').value === 'beta'")
    send_and_wait(page, "again")
    assert served(srv) == {"beta": 2}

    page.click("#new-chat")  # starts on the last pick
    assert page.input_value("#model-picker") == "beta"
    page.select_option("#model-picker", "alpha")
    send_and_wait(page, "hello alpha")
    assert served(srv) == {"beta": 2, "alpha": 1}

    page.click("#conversations li:nth-child(2) .open")  # the first chat: still beta's
    assert page.input_value("#model-picker") == "beta" and page.title() == "beta · Chat"
    send_and_wait(page, "and once more")
    assert served(srv) == {"beta": 3, "alpha": 1}
    page.click("#new-chat")
    assert page.input_value("#model-picker") == "alpha"  # the last one a person picked


def test_a_first_load_is_waited_for_and_a_failed_or_vanished_model_is_told(pages, model_set_server):
    srv = model_set_server
    for name in ("delta", "gamma"):
        (srv.folder / f"{name}.gguf").write_bytes(b"x" * 1000)
    srv.engines.broken.add(str(srv.folder / "delta.gguf"))
    held = srv.engines.held[str(srv.folder / "beta.gguf")] = threading.Event()
    page = open_chat(pages, srv)
    page.select_option("#model-picker", "beta")
    send_message(page, "hi")
    page.wait_for_function("() => document.getElementById('notice').textContent.includes('Loading beta')")
    assert page.is_visible(".msg.assistant.pending")
    held.set()  # the load ends: the reply comes, the notice goes
    page.wait_for_function(REPLY_DONE, timeout=15_000)
    assert page.is_hidden("#notice") and served(srv) == {"beta": 1}

    page.click("#new-chat")  # a file that fails to load: told at once, not retried while it is unchanged
    page.select_option("#model-picker", "delta")
    pages.expected.append("status of 503")
    send_message(page, "hi")
    page.wait_for_function("() => document.getElementById('error').textContent.includes('failed to load')")
    told = "The model delta failed to load: ValueError: not a GGUF. Pick another model at the top, or fix its file and send again."
    assert page.inner_text("#error") == told
    assert page.evaluate(OPTIONS)[2] == "delta · failed to load" and page.is_hidden("#notice")

    page.click("#new-chat")
    page.select_option("#model-picker", "gamma")
    (srv.folder / "gamma.gguf").unlink()
    pages.expected.append("status of 404")
    send_message(page, "are you there?")
    page.wait_for_function("() => document.getElementById('error').textContent.includes('no longer offers “gamma”')")
    assert "now talks to “alpha”" in page.inner_text("#error")  # the first listed: the last pick was gamma
    assert page.evaluate(OPTIONS) == ["alpha · not loaded", "beta · loaded", "delta · failed to load"]  # read again
    assert page.input_value("#input") == "are you there?"  # given back to send again
    assert page.locator(".msg").count() == 0
