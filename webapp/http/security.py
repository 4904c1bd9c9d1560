"""Who may use what, and the headers every response carries.

Contract:
- `install(app)` adds app-level hooks, so they hold for every blueprint, present or future:
  - With `API_KEY` set, every `/v1/*` request needs `Authorization: Bearer <API_KEY>`; otherwise
    a 401 OpenAI error (`invalid_api_key`). `/health` and the pages stay open.
  - With `ADMIN_TOKEN` set, `/admin*` and `/metrics*` need `Authorization: Bearer <ADMIN_TOKEN>`
    (or HTTP Basic with the token as password), or the session cookie that `POST /admin/login`
    sets (HttpOnly, SameSite=Strict, Secure over HTTPS). The cookie holds an HMAC of the token,
    not the token. A browser that asks for a page without either is sent to the login form;
    anything else gets a 401 with `WWW-Authenticate: Bearer`. The guard looks at the path and at
    the matched route, so it protects whatever gets registered under those prefixes without
    knowing their code; a request it lets through has `g.admin_authenticated` set.
  - Every response gets `X-Content-Type-Options: nosniff`, `X-Frame-Options: DENY` and
    `Referrer-Policy: no-referrer`; HTML responses also get a Content-Security-Policy that allows
    no inline script and no framing (a view may set a stricter one of its own).
- `bp` holds the login form and logout: `GET|POST /admin/login`, `POST /admin/logout`.
- `listen_hosts(argv)` and `warn_if_exposed(config, hosts)` let `wsgi.py` log a loud warning at
  start-up when the server listens beyond loopback without an admin token (or an API key).

Secrets are compared with `hmac.compare_digest`. Pure Flask; no engine, no tinygrad.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

from flask import Blueprint, Flask, current_app, g, redirect, render_template, request, url_for

from webapp.openai.requests import ApiError
from webapp.ops.waitress_settings import waitress_adjustments

log = logging.getLogger(__name__)

bp = Blueprint("security", __name__)

API_PREFIX = "/v1/"  # the OpenAI API: guarded by API_KEY here, counted and drained by webapp.ops.lifecycle
ADMIN_PREFIXES = ("/admin", "/metrics")
COOKIE = "llm_admin"
PUBLIC_ADMIN_ENDPOINTS = frozenset({"security.login", "security.logout"})

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
    app.before_request(_guard)
    app.after_request(_security_headers)
    app.register_blueprint(bp)


# --- the guard ------------------------------------------------------------------------------------


def _guard():
    path = _normalised(request.path)
    rule = request.url_rule.rule if request.url_rule is not None else ""
    if path.startswith(API_PREFIX) or rule.startswith(API_PREFIX):
        key = current_app.config.get("API_KEY")
        if key and not _bearer_matches(str(key)):
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
        return redirect(url_for("security.login", next=request.full_path.rstrip("?")), 303)
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
    response = redirect(url_for("security.login"), 303)
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


# --- headers --------------------------------------------------------------------------------------


def _security_headers(response):
    for name, value in COMMON_HEADERS.items():
        response.headers.setdefault(name, value)
    if response.mimetype == "text/html":
        response.headers.setdefault("Content-Security-Policy", PAGE_CSP)
    return response


# --- start-up warning -----------------------------------------------------------------------------


def listen_hosts(argv: list[str]) -> list[str] | None:
    """The addresses `waitress-serve` will listen on, or None when `argv` is not waitress's.

    Parsed with waitress's own option parser, so defaults match: without --listen or --host it
    listens on 0.0.0.0 (and ::). A --unix-socket counts as "unix", which is local.
    """
    adj = waitress_adjustments(argv)
    if adj is None:  # not waitress-serve, or arguments waitress will reject itself
        return None
    if adj.unix_socket:
        return ["unix"]
    return sorted({sockaddr[0] for _, _, _, sockaddr in adj.listen})


def is_loopback(host: str) -> bool:
    if host in ("localhost", "unix"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to anything


def warn_if_exposed(config, hosts: Iterable[str] | None) -> bool:
    """Log loudly when the server may be reachable beyond this machine without an admin token.

    `hosts` None means the listen address is unknown (not started by `waitress-serve`); then the
    `HOST` setting (`LLM_HOST`) decides, and without it the server is assumed to be exposed.
    Returns True when it warned about the admin token.
    """
    if hosts is None:
        hosts = [config["HOST"]] if config.get("HOST") else None
    exposed = hosts is None or not all(is_loopback(h) for h in hosts)
    if not exposed:
        return False
    where = ", ".join(hosts) if hosts else "an unknown address"
    if not config.get("API_KEY"):
        log.warning("listening on %s without LLM_API_KEY: anyone who can reach it may use the API", where)
    if config.get("ADMIN_TOKEN"):
        return False
    banner = "!" * 78
    log.warning(
        "\n%s\n!! LLM_ADMIN_TOKEN is not set and the server listens on %s.\n"
        "!! /admin and /metrics are open to anyone who can reach this port.\n"
        "!! Set LLM_ADMIN_TOKEN, or listen on 127.0.0.1 only.\n%s",
        banner,
        where,
        banner,
    )
    return True
