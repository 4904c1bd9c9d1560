"""The headers every response carries, and the pages' Content-Security-Policy.

Contract: `install(app)` adds an app-level hook, so it holds for every blueprint: every response
gets `X-Content-Type-Options: nosniff`, `X-Frame-Options: DENY` and `Referrer-Policy: no-referrer`;
HTML responses also get a Content-Security-Policy that allows no inline script and no framing (a
view may set a stricter one of its own: `CHAT_CSP`). `COMMON_HEADERS` is also what the drain's
refusals (`webapp.ops.lifecycle`) carry, since those never reach Flask.
"""

from __future__ import annotations

from flask import Flask

# The pages' Content-Security-Policy: same-origin scripts, styles and fetches only, no inline code,
# no plugins, no framing. Every HTML response gets PAGE_CSP unless its view sets a stricter one.
_PAGE_DIRECTIVES = {
    "default-src": "'self'",
    "script-src": "'self'",
    "style-src": "'self'",
    "img-src": "'self' data:",
    "connect-src": "'self'",
    "object-src": "'none'",
    "base-uri": "'none'",
    "form-action": "'self'",
    "frame-ancestors": "'none'",
}


def _policy(directives: dict[str, str]) -> str:
    return "; ".join(f"{name} {value}" for name, value in directives.items())


PAGE_CSP = _policy(_PAGE_DIRECTIVES)
CHAT_CSP = _policy({**_PAGE_DIRECTIVES, "form-action": "'none'"})  # the chat page submits no form
# Every response, HTML or not, the API's and the drain's refusals included.
COMMON_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def install(app: Flask) -> None:
    app.after_request(_security_headers)


def _security_headers(response):
    for name, value in COMMON_HEADERS.items():
        response.headers.setdefault(name, value)
    if response.mimetype == "text/html":
        response.headers.setdefault("Content-Security-Policy", PAGE_CSP)
    return response
