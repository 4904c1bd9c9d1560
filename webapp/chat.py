"""The chat page at `/`.

The page is a static shell: `static/chat.js` keeps the conversation in the browser and talks to
/v1/chat/completions like any other API client, so the page needs nothing from the server beyond
the API itself. All user and model text is rendered as text, never as HTML, and the page is served
with `webapp.security.CHAT_CSP`: same-origin scripts, styles and requests only, and no forms.
"""

from __future__ import annotations

from flask import Blueprint, current_app, make_response, render_template

from webapp.security import CHAT_CSP

bp = Blueprint("chat", __name__)


@bp.get("/")
def index():
    """The chat page; it asks for an API key only when the server requires one."""
    html = render_template("chat.html", needs_key=bool(current_app.config.get("API_KEY")))
    response = make_response(html)
    response.headers["Content-Security-Policy"] = CHAT_CSP
    return response
