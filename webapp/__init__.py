"""The Flask application factory.

`create_app(config=None, engine=None)` builds the app: defaults, then `LLM_*` environment variables
(`app.config.from_prefixed_env("LLM")`, values parsed as JSON so `LLM_SLOTS=4` is an int), then
`config`. The engine lives in `app.extensions["engine"]`; when none is passed, the real one is
built by `webapp.engine.engine.build_engine(app.config)`, imported only then so that tests with a
fake engine never load the model code.

Every error leaves as OpenAI-shaped JSON, `{"error": {"message", "type", "param", "code"}}`:
unknown routes (404), wrong methods (405), oversized bodies (413), refused requests (`ApiError`),
a full queue (429 with `Retry-After`), an engine still loading (503) and unexpected failures (500).
"""

from __future__ import annotations

import logging
from pathlib import Path

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

from webapp import api, chat
from webapp.engine.errors import EngineNotReady, QueueFull
from webapp.openai_format import ApiError, error_body, error_type

ROOT = Path(__file__).resolve().parent.parent

DEFAULTS = {
    "MODEL": None,  # model file or name; build_engine decides what it accepts
    "MAX_CONTEXT": 4096,  # tokens per request, prompt and completion together
    "SLOTS": 8,  # requests decoded together
    "QUEUE_LIMIT": 64,  # requests waiting for a slot before submit raises QueueFull
    "PREFILL_CHUNK": 32,  # prompt tokens per prefill step
    "API_KEY": None,  # when set, /v1/* requires "Authorization: Bearer <API_KEY>"
    "ADMIN_TOKEN": None,
    "MAX_CONTENT_LENGTH": 4 * 1024 * 1024,  # request bodies beyond this get a 413
}

log = logging.getLogger(__name__)


def create_app(config: dict | None = None, engine=None) -> Flask:
    """Build the app around `engine` (or the real engine, built from the final config)."""
    app = Flask(
        __name__, template_folder=str(ROOT / "templates"), static_folder=str(ROOT / "static")
    )
    app.config.from_mapping(DEFAULTS)
    app.config.from_prefixed_env("LLM")
    app.config.from_mapping(config or {})
    app.json.sort_keys = False  # keep OpenAI's field order; it reads better in logs and curl

    if engine is None:
        from webapp.engine.engine import build_engine

        engine = build_engine(app.config).start()  # loads and warms up on the model thread
    app.extensions["engine"] = engine

    # Later pages (/admin, /metrics) are blueprints registered here too.
    for blueprint in (api.bp, chat.bp):
        app.register_blueprint(blueprint)
    _register_error_handlers(app)
    return app


def _error(status: int, message: str, param=None, code=None, type=None, headers=None):
    response = jsonify(error_body(message, type or error_type(status), param, code))
    response.status_code = status
    response.headers.update(headers or {})
    return response


def _register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def api_error(e: ApiError):
        return _error(e.status, e.message, e.param, e.code, e.type)

    @app.errorhandler(QueueFull)
    def queue_full(e: QueueFull):
        return _error(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)})

    @app.errorhandler(EngineNotReady)
    def engine_not_ready(e: EngineNotReady):
        message = str(e) or "The model is not ready yet."
        return _error(503, message, code="engine_not_ready", headers={"Retry-After": "5"})

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        if e.code == 404:
            message = f"Unknown route: {request.method} {request.path}"
        elif e.code == 405:
            message = f"Method {request.method} is not allowed for {request.path}."
        else:
            message = e.description or e.name
        # Keep headers such as Allow (405); drop the HTML content type.
        headers = {k: v for k, v in e.get_headers() if k.lower() != "content-type"}
        return _error(
            e.code or 500, message, code=e.name.lower().replace(" ", "_"), headers=headers
        )

    @app.errorhandler(Exception)
    def unexpected(e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, "Internal server error.", code="internal_error")
