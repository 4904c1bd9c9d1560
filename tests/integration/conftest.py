"""Fixtures of the integration tests: the real `openai` client of the fake engine's server, and the
kernels' library built both ways (the highest ISA rung this CPU runs, and portable C)."""

from __future__ import annotations

import ctypes

import openai
import pytest

from webapp.engine.kernels.abi import Isa
from webapp.engine.kernels.build import load_library, rung_for


@pytest.fixture
def openai_client(fake_server):
    """The real `openai` client pointed at `fake_server`."""
    client = openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="test-key", max_retries=0, timeout=10)
    yield client
    client.close()


@pytest.fixture(scope="module", params=["best", "generic"])
def library(request):
    """The C kernels as a ctypes library: the highest rung of the ISA ladder this CPU runs (the server's
    build without LLM_CPU_ISA; skipped where that is the generic one) and the generic one.
    tests/integration/test_isa_ladder.py takes every rung."""
    rung, flags = rung_for(None if request.param == "best" else request.param)
    if request.param == "best" and rung.isa == Isa.GENERIC:
        pytest.skip("this CPU runs no SIMD rung")
    lib = load_library(rung, flags)
    lib.tq_start(ctypes.c_long(3), ctypes.c_long(50))  # more threads than cores: chunks still all land
    return lib
