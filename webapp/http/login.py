"""The admin login form and logout: `GET|POST /admin/login`, `POST /admin/logout`.

A public family (`webapp.http.families`): the form must be reachable without the token it asks
for, and it is not drained. A right token sets the session cookie (`webapp.http.auth.COOKIE`,
HttpOnly, SameSite=Strict, Secure over HTTPS) and goes on to `next`, which must be a path on
this site.
"""

from __future__ import annotations

import hmac
import logging
from urllib.parse import urlsplit

from flask import current_app, redirect, render_template, request, url_for

from webapp.http.auth import COOKIE, session_value
from webapp.http.families import PUBLIC, Family

log = logging.getLogger(__name__)

# Named "auth" so that url_for("auth.login") (templates, the admin guard) reads as what it is.
bp = Family("auth", __name__, guard=PUBLIC, drained=False)


@bp.route("/admin/login", methods=["GET", "POST"])
def login():
    """The admin login form; a right token sets the session cookie and goes on to `next`."""
    token = current_app.config.get("ADMIN_TOKEN")
    target = _safe_next(request.values.get("next"))
    if not token:
        return redirect(target, 303)
    if request.method == "GET":
        return _login_page(target)
    given = request.form.get("token", "")
    if not hmac.compare_digest(given.encode(), str(token).encode()):
        log.warning("failed admin login from %s", request.remote_addr)
        return _login_page(target, error="That token is not right.", status=401)
    response = redirect(target, 303)
    response.set_cookie(
        COOKIE,
        session_value(str(token)),
        httponly=True,
        samesite="Strict",
        secure=request.is_secure,
        path="/",
    )
    return response


@bp.post("/admin/logout")
def logout():
    """Forget the admin session cookie."""
    response = redirect(url_for("auth.login"), 303)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="Strict")
    return response


def _login_page(target: str, error: str | None = None, status: int = 200):
    html = render_template("login.html", next=target, error=error)
    return html, status, {"Cache-Control": "no-store"}


def _safe_next(value: str | None) -> str:
    """Only same-site paths: a login must not bounce the browser to another site."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/admin"
    parts = urlsplit(value)
    if parts.scheme or parts.netloc:
        return "/admin"
    return value
