"""API families: each blueprint says how its routes meet the world, and nothing else decides it.

Contract:
- A `Family` is a `flask.Blueprint` that declares a `Policy`: the shape its errors take
  (`errors`, an `ApiError` -> JSON body), who may call it (`guard`: `API_KEY`, `ADMIN_TOKEN` or
  `PUBLIC`), whether shutdown drains it (`drained`: counted while running, refused with a 503 once
  draining begins) and the URL space it answers for beyond its routes (`owns`: an unknown route
  under it gets this family's 404, guard and drain).
- Closed by default: a route of a plain `Blueprint`, or of a `Family` that declares nothing, needs
  the API key, is drained and errs in OpenAI's shape. A new family is guarded and drained without
  an edit here, in the app root, in `webapp.http.auth` or in `webapp.ops.lifecycle`.
- `policy_for(app, path, method)` names the policy of a request: the policy of the blueprint of
  the route it matches (a wrong method or a redirect to a cleaner path counts as the route it
  would reach); for a route of no blueprint, or none at all, the family with the longest `owns`
  prefix over the path; else, for the app's own routes (its static files), the policy `install`
  is given, and for no route `UNROUTED` (a public 404).
- `install(app, app_routes)` adds the one app-level hook that enforces all of it before any view:
  a request the lifecycle refused (`webapp.ops.lifecycle.REFUSED`) becomes its family's 503, then
  the family's guard runs. `current()` is the policy of the request being handled; the app's error
  handlers shape every error with `current().errors`.

Pure Flask and Werkzeug; no engine, no tinygrad.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from flask import Blueprint, Flask, current_app, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from werkzeug.routing import RequestRedirect
from werkzeug.wsgi import get_path_info

from webapp.engine.serving.errors import RETRY_AFTER_S
from webapp.http import auth
from webapp.openai.errors import ApiError
from webapp.ops.lifecycle import REFUSED

Guard = Callable[[], object]  # returns None to let the request through, or a response (a redirect)

API_KEY: Guard = auth.require_api_key
ADMIN_TOKEN: Guard = auth.require_admin
PUBLIC: Guard | None = None


def openai_error(e: ApiError) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`."""
    return e.body()


@dataclass(frozen=True)
class Policy:
    errors: Callable[[ApiError], dict] = openai_error
    guard: Guard | None = API_KEY
    drained: bool = True
    owns: tuple[str, ...] = ()


DEFAULT = Policy()  # what a family that declares nothing gets: closed
UNROUTED = Policy(guard=PUBLIC, drained=False)  # a path no family answers for: a public 404


class Family(Blueprint):
    """A blueprint with a `Policy`; keyword arguments other than the policy's go to `Blueprint`."""

    def __init__(
        self,
        name: str,
        import_name: str,
        *,
        errors: Callable[[ApiError], dict] = openai_error,
        guard: Guard | None = API_KEY,
        drained: bool = True,
        owns: tuple[str, ...] = (),
        **kwargs,
    ) -> None:
        super().__init__(name, import_name, **kwargs)
        self.policy = Policy(errors, guard, drained, owns)


def install(app: Flask, app_routes: Policy) -> None:
    """Enforce each request's policy before its view; `app_routes` is the policy of the app's own routes."""
    app.extensions["app_routes_policy"] = app_routes
    app.before_request(_enforce)


def current() -> Policy:
    """The policy of the request being handled."""
    return policy_for(current_app, request.path, request.method)


def drains(app: Flask, environ: dict) -> bool:
    """Whether shutdown drains this WSGI request (asked before Flask sees it)."""
    return policy_for(app, get_path_info(environ), environ.get("REQUEST_METHOD", "GET")).drained


def policy_for(app: Flask, path: str, method: str) -> Policy:
    endpoint = _endpoint(app, path, method)
    name, dot, _ = (endpoint or "").rpartition(".")
    if dot:
        blueprint = app.blueprints.get(name)
        return blueprint.policy if isinstance(blueprint, Family) else DEFAULT
    owner = _owner(app, path)
    if owner is not None:
        return owner
    return UNROUTED if endpoint is None else app.extensions.get("app_routes_policy", DEFAULT)


def _enforce():
    policy = current()
    if request.environ.get(REFUSED):
        raise ApiError(
            503,
            "The server is shutting down and accepts no new requests.",
            code="server_shutting_down",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    return policy.guard() if policy.guard is not None else None


def _endpoint(app: Flask, path: str, method: str, redirects: int = 2) -> str | None:
    """The endpoint routing sends `path` to; a wrong method's route, or a redirect's target, too."""
    adapter = app.url_map.bind("localhost")  # this app routes by path and method only
    try:
        return adapter.match(path, method)[0]
    except RequestRedirect as e:
        # "//admin" is redirected to "/admin": judge it as the route it reaches
        target = urlsplit(e.new_url).path
        return _endpoint(app, target, method, redirects - 1) if redirects and target != path else None
    except MethodNotAllowed as e:
        for allowed in e.valid_methods or ():
            try:
                return adapter.match(path, allowed)[0]
            except HTTPException:
                continue
        return None
    except HTTPException:
        return None


def _owner(app: Flask, path: str) -> Policy | None:
    while "//" in path:  # as routing would merge them, so "//admin/x" is judged as "/admin/x"
        path = path.replace("//", "/")
    owners = [
        (len(prefix), blueprint.policy)
        for blueprint in app.blueprints.values()
        if isinstance(blueprint, Family)
        for prefix in blueprint.policy.owns
        if path == prefix or path.startswith(prefix.rstrip("/") + "/")
    ]
    return max(owners, key=lambda owner: owner[0])[1] if owners else None
