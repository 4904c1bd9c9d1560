"""Fixtures of the integration tests: the real `openai` client of the fake engine's server."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture
def openai_client(fake_server):
    """The real `openai` client pointed at `fake_server`."""
    client = openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="test-key", max_retries=0, timeout=10)
    yield client
    client.close()
