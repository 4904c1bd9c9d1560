"""Fixtures of the browser tests: Debian's Chromium driven by Playwright (skipped without either;
`playwright install` is never needed), and pages that fail a test on an unexpected console error."""

from __future__ import annotations

import os

import pytest
from support import CHROMIUM, CHROMIUM_ARGS, DESKTOP


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
