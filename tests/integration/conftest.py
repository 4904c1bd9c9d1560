"""Fixtures of the integration tests: the real `openai` client of the fake engine's server, and the
kernels' library built both ways (AVX2 and portable C)."""

from __future__ import annotations

import ctypes

import openai
import pytest

from webapp.engine.kernels.build import compile_library, simd_flags


@pytest.fixture
def openai_client(fake_server):
    """The real `openai` client pointed at `fake_server`."""
    client = openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="test-key", max_retries=0, timeout=10)
    yield client
    client.close()


@pytest.fixture(scope="module", params=["simd", "portable"])
def library(request):
    """The C kernels as a ctypes library, the AVX2 build and the portable one (skipped without AVX2)."""
    flags = simd_flags() if request.param == "simd" else []
    if request.param == "simd" and not flags:
        pytest.skip("this CPU has no AVX2")
    lib = ctypes.CDLL(str(compile_library(flags)))
    lib.tq_start(ctypes.c_long(3), ctypes.c_long(50))  # more threads than cores: chunks still all land
    assert lib.tq_simd() == (request.param == "simd")
    return lib
