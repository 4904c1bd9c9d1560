"""The chat page at `/`.

The page is a static shell: `static/chat/main.js` keeps conversations in the browser
(localStorage) and talks to /v1/chat/completions like any other API client, so the page needs
nothing from the server beyond the API itself. User text is rendered as text; model text as
markdown that DOMPurify sanitizes (libraries vendored under static/vendor/, served from here). The
page is served with `webapp.http.headers.CHAT_CSP`: same-origin scripts, styles and requests only, no
inline script, no eval, no other origin.
"""

from __future__ import annotations

from flask import current_app, make_response, render_template

from webapp.http.families import PUBLIC, Family
from webapp.http.headers import CHAT_CSP

bp = Family("chat", __name__, guard=PUBLIC, drained=False)  # the page asks for the key itself


@bp.get("/")
def index():
    """The chat page; it asks for an API key only when the server requires one."""
    html = render_template("chat.html", needs_key=bool(current_app.config.get("API_KEY")))
    response = make_response(html)
    response.headers["Content-Security-Policy"] = CHAT_CSP
    return response
