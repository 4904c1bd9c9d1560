"""Fixtures for more than one folder: the app around a real engine over a scripted runner and a real
Waitress server for it, and the real engine on a tiny random-weight llama behind Waitress. Each folder's own
fixtures are in its conftest.py; helpers live in `support`, not here.

Every test is marked with its folder's name (unit, integration, browser, e2e; registered in
pytest.ini), so `-m "not browser"` and the like select by kind across the tree."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import TINY_CONTEXT, TINY_QUEUE_LIMIT, TINY_SLOTS, running_server, tiny_engine_server
from support.fakes import start_scripted_engine
from support.tiny_models import write_tiny_gguf

from webapp import create_app

TESTS = Path(__file__).parent
KINDS = ("unit", "integration", "browser", "e2e")


def pytest_configure(config):
    # tinygrad reads HCQ2 at import, and some test modules import it before the engine loads a model
    from webapp.engine.model.tinygrad_setup import prepare_tinygrad

    prepare_tinygrad()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.is_relative_to(TESTS) and (kind := item.path.relative_to(TESTS).parts[0]) in KINDS:
            item.add_marker(kind)


@pytest.fixture
def fake_engine(request):
    """A real `Engine` over a `ScriptedRunner` (`fake_engine.loaded.runner`), loaded; an indirect
    parameter gives `start_scripted_engine` its settings (say {"queue_limit": 0})."""
    engine = start_scripted_engine(**getattr(request, "param", {}))
    yield engine
    engine.loaded.runner.gate.set()  # a test that held the model thread lets it stop
    engine.stop(5)


@pytest.fixture
def fake_runner(fake_engine):
    """`fake_engine`'s `ScriptedRunner`: its `replies` script the requests, `requests` are those it ran."""
    return fake_engine.loaded.runner


@pytest.fixture
def fake_app(fake_engine):
    return create_app({"TESTING": True}, engine=fake_engine)


@pytest.fixture
def fake_server(fake_app, fake_engine):
    """A real Waitress server for the app over `fake_engine`."""
    with running_server(fake_app) as srv:
        yield srv
        # as a shutdown does: the requests a handler thread is still reading end, cancelled
        fake_engine.loaded.runner.gate.set()
        fake_app.extensions["lifecycle"].drain(0)


@pytest.fixture(scope="module")
def tiny_llama_server(tmp_path_factory):
    """The real engine on a tiny random-weight llama ("tiny-llama"; TINY_SLOTS, TINY_QUEUE_LIMIT and
    TINY_CONTEXT from support) behind a real Waitress server: (engine, server)."""
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("m") / "tiny-llama.gguf"), "llama", context=TINY_CONTEXT)
    with tiny_engine_server(path, TINY_SLOTS, TINY_QUEUE_LIMIT, TINY_CONTEXT) as (engine, srv):
        yield engine, srv
