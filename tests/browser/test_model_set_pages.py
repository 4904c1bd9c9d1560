"""The pages with LLM_MODELS_DIR, in a real (headless Debian) Chromium against a real Waitress server
over a model set of real engines on fake runners (support.fakes.FakeModelEngines): the dashboard's
Models table follows a load live, a model's name shows its panels, the chat page talks to the
first model; no console errors, no serious accessibility violations.

Skipped when Playwright or /usr/bin/chromium is missing.
"""

import os

import pytest
from support import CHROMIUM, axe_violations, post, running_server
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
    models = ModelSet(str(tmp_path), FakeModelEngines())
    try:
        with running_server(create_app({"TESTING": True}, engine=models)) as srv:
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
