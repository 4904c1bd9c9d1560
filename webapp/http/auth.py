"""Who may use what: the API key on /v1, the admin token on /admin and /metrics.

Contract:
- `install(app)` adds an app-level hook, so it holds for every blueprint, present or future:
  - With `API_KEY` set, every `/v1/*` request needs `Authorization: Bearer <API_KEY>` (or
    `x-api-key: <API_KEY>`, as Anthropic's clients send it); otherwise
    a 401 OpenAI error (`invalid_api_key`). `/health` and the pages stay open.
  - With `ADMIN_TOKEN` set, `/admin*` and `/metrics*` need `Authorization: Bearer <ADMIN_TOKEN>`
    (or HTTP Basic with the token as password), or the session cookie that `POST /admin/login`
    sets (HttpOnly, SameSite=Strict, Secure over HTTPS). The cookie holds an HMAC of the token,
    not the token. A browser that asks for a page without either is sent to the login form;
    anything else gets a 401 with `WWW-Authenticate: Bearer`. The guard looks at the path and at
    the matched route, so it protects whatever gets registered under those prefixes without
    knowing their code; a request it lets through has `g.admin_authenticated` set.
- `bp` holds the login form and logout: `GET|POST /admin/login`, `POST /admin/logout`.

Secrets are compared with `hmac.compare_digest`. Pure Flask; no engine, no tinygrad.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from urllib.parse import urlsplit

from flask import Blueprint, Flask, current_app, g, redirect, render_template, request, url_for

from webapp.openai.errors import ApiError

log = logging.getLogger(__name__)

bp = Blueprint("auth", __name__)

API_PREFIX = "/v1/"  # the OpenAI API: guarded by API_KEY here, counted and drained by webapp.ops.lifecycle
TOKEN_PATHS = ("/tokenize", "/detokenize")  # outside /v1, as llama-server and vLLM serve them; guarded alike
ADMIN_PREFIXES = ("/admin", "/metrics")
COOKIE = "llm_admin"
PUBLIC_ADMIN_ENDPOINTS = frozenset({"auth.login", "auth.logout"})


def install(app: Flask) -> None:
    app.before_request(_guard)
    app.register_blueprint(bp)


# --- the guard ------------------------------------------------------------------------------------


def _guard():
    path = _normalised(request.path)
    rule = request.url_rule.rule if request.url_rule is not None else ""
    if path.startswith(API_PREFIX) or rule.startswith(API_PREFIX) or path in TOKEN_PATHS:
        key = current_app.config.get("API_KEY")
        if key and not (_bearer_matches(str(key)) or _header_matches("X-Api-Key", str(key))):
            raise ApiError(
                401,
                "Invalid or missing API key. Send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return None
    if not any(_under(p, prefix) for p in (path, rule) for prefix in ADMIN_PREFIXES):
        return None
    token = current_app.config.get("ADMIN_TOKEN")
    if not token or _is_admin(str(token)):
        g.admin_authenticated = True
        return None
    if request.endpoint in PUBLIC_ADMIN_ENDPOINTS:
        return None
    if request.method == "GET" and _wants_html():
        return redirect(url_for("auth.login", next=request.full_path.rstrip("?")), 303)
    raise ApiError(
        401,
        "This page needs the admin token: 'Authorization: Bearer <token>' or a login at /admin/login.",
        code="invalid_admin_token",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _normalised(path: str) -> str:
    # Routing would redirect "//admin" to "/admin"; judge the path the way routing will.
    while "//" in path:
        path = path.replace("//", "/")
    return path


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


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


def _session_value(token: str) -> str:
    """What the admin cookie holds: a MAC of the token, so the cookie never carries the token."""
    return hmac.new(token.encode(), b"llm-admin-session", hashlib.sha256).hexdigest()


def _is_admin(token: str) -> bool:
    if _bearer_matches(token) or _basic_password_matches(token):
        return True
    cookie = request.cookies.get(COOKIE, "")
    return hmac.compare_digest(cookie.encode(), _session_value(token).encode())


def _wants_html() -> bool:
    best = request.accept_mimetypes.best_match(["application/json", "text/html"])
    return best == "text/html"


# --- login and logout -----------------------------------------------------------------------------


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
        _session_value(str(token)),
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
