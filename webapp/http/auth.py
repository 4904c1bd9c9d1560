"""The two guards a family can declare (`webapp.http.families`): the API key and the admin token.

Contract:
- `require_api_key()`: with `API_KEY` set, the request needs `Authorization: Bearer <API_KEY>` (or
  `x-api-key: <API_KEY>`, as Anthropic's clients send it); otherwise an `ApiError` 401
  (`invalid_api_key`), which the app renders in the family's error shape.
- `require_admin()`: with `ADMIN_TOKEN` set, the request needs `Authorization: Bearer <ADMIN_TOKEN>`
  (or HTTP Basic with the token as password), or the session cookie (`COOKIE`) that
  `POST /admin/login` sets (`webapp.http.login`). The cookie holds `session_value(token)`, an HMAC
  of the token, not the token. A browser that asks for a page without either is sent to the login
  form; anything else gets a 401 with `WWW-Authenticate: Bearer`. A request it lets through has
  `g.admin_authenticated` set.

Which routes need which guard is not decided here: each family declares it. Secrets are compared
with `hmac.compare_digest`. Pure Flask; no engine, no tinygrad.
"""

from __future__ import annotations

import hashlib
import hmac

from flask import current_app, g, redirect, request, url_for

from webapp.openai.errors import ApiError

COOKIE = "llm_admin"


def require_api_key():
    key = current_app.config.get("API_KEY")
    if key and not (_bearer_matches(str(key)) or _header_matches("X-Api-Key", str(key))):
        raise ApiError(
            401,
            "Invalid or missing API key. Send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return None


def require_admin():
    if is_admin():
        g.admin_authenticated = True
        return None
    if request.method == "GET" and _wants_html():
        return redirect(url_for("auth.login", next=request.full_path.rstrip("?")), 303)
    raise ApiError(
        401,
        "This page needs the admin token: 'Authorization: Bearer <token>' or a login at /admin/login.",
        code="invalid_admin_token",
        headers={"WWW-Authenticate": "Bearer"},
    )


def is_admin() -> bool:
    """Whether the request carries the admin token (or its session cookie); true when none is set."""
    token = current_app.config.get("ADMIN_TOKEN")
    if not token:
        return True
    token = str(token)
    if _bearer_matches(token) or _basic_password_matches(token):
        return True
    cookie = request.cookies.get(COOKIE, "")
    return hmac.compare_digest(cookie.encode(), session_value(token).encode())


def session_value(token: str) -> str:
    """What the admin cookie holds: a MAC of the token, so the cookie never carries the token."""
    return hmac.new(token.encode(), b"llm-admin-session", hashlib.sha256).hexdigest()


def _bearer_matches(secret: str) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    valid = hmac.compare_digest(token.strip().encode(), secret.encode())
    return scheme.lower() == "bearer" and valid


def _header_matches(name: str, secret: str) -> bool:
    """The Anthropic SDK sends its key as `x-api-key`, not as a bearer token."""
    return hmac.compare_digest(request.headers.get(name, "").strip().encode(), secret.encode())


def _basic_password_matches(secret: str) -> bool:
    auth = request.authorization  # werkzeug parses Basic; any user name will do
    password = auth.password if auth is not None and auth.type == "basic" else None
    return password is not None and hmac.compare_digest(password.encode(), secret.encode())


def _wants_html() -> bool:
    best = request.accept_mimetypes.best_match(["application/json", "text/html"])
    return best == "text/html"
