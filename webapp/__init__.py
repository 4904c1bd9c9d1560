"""The Flask application factory.

`create_app(config=None, engine=None)` builds the app: defaults, then `LLM_*` environment variables
(`app.config.from_prefixed_env("LLM")`, values parsed as JSON so `LLM_SLOTS=4` is an int), then
`config`. The engine lives in `app.extensions["engine"]`; when none is passed, the real one is
built by `webapp.engine.serving.loader.build_engine(app.config)`, imported only then so that tests with a
fake engine never load the model code. The engine's settings and their defaults are
`webapp.engine.serving.settings.ENGINE_DEFAULTS`; the web layer's own are below.

Secrets (`LLM_API_KEY`, `LLM_ADMIN_TOKEN`) are taken from the environment verbatim, never parsed as
JSON (a key like `1e3` must stay that string). Each API family is a blueprint that declares its
error shape, its guard (the API key, the admin token, or none) and whether shutdown drains it
(`webapp.http.families`); the root registers them and enforces nothing by path.
`webapp.http.headers` sets security headers on every response; `webapp.ops.lifecycle` counts the
requests of drained families and drains them on shutdown (`app.extensions["lifecycle"]`).

Every error leaves as JSON in the shape of the family the request belongs to (OpenAI's,
`{"error": {"message", "type", "param", "code"}}`, unless the family declares another, as
Anthropic's does): unknown routes (404), wrong methods (405), oversized bodies (413), refused
requests (`ApiError`), a prompt too long for the context (400), a full queue (429 with
`Retry-After`), an engine still loading (503) and unexpected failures (500).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

from webapp.engine.serving.errors import RETRY_AFTER_S, EngineNotReady, ModelLoadFailed, PromptTooLong, QueueFull
from webapp.engine.serving.settings import ENGINE_DEFAULTS
from webapp.http import (
    admin,
    anthropic_api,
    api,
    chat,
    embeddings,
    families,
    headers,
    health,
    login,
    lora_api,
    metrics,
    ollama_api,
    openapi,
    rerank,
    responses_api,
    tokens,
)
from webapp.openai.errors import ApiError
from webapp.openai.image_fetch import ImageFetcher
from webapp.ops.lifecycle import Lifecycle

ROOT = Path(__file__).resolve().parent.parent

DEFAULTS = {
    **ENGINE_DEFAULTS,
    "API_KEY": None,  # when set, the API families require "Authorization: Bearer <API_KEY>"
    "ADMIN_TOKEN": None,  # when set, /admin and /metrics require it (header or login cookie)
    "HOST": None,  # where the server listens, when not started by waitress-serve (warnings only)
    "MAX_CONTENT_LENGTH": 4 * 1024 * 1024,  # request bodies beyond this get a 413
    "MAX_MESSAGES": 1000,  # messages per chat request
    "MAX_PROMPT_TOKENS": None,  # prompt tokens per request; None: whatever the context allows
    "REASONING_BUDGET": None,  # thinking tokens before the end-of-thinking marker is forced; None: no limit
    "DRAIN_SECONDS": 30,  # on SIGTERM/SIGINT, how long running requests may take to finish
    "METRICS_COMPAT": None,  # "vllm": /metrics also exports vLLM's metric names (webapp.ops.vllm_metrics)
    "IMAGE_FETCH": None,  # hosts http(s) image URLs are fetched from ("*": any public one); None: none (openai/image_fetch.py)
    "IMAGE_FETCH_BYTES": 20 * 1024 * 1024,  # the most one fetched image may take (the image decoder's own limit)
    "IMAGE_FETCH_SECONDS": 10,  # the longest one fetch may take, all of it
}
SECRETS = ("API_KEY", "ADMIN_TOKEN")

log = logging.getLogger(__name__)


def create_app(config: dict | None = None, engine=None) -> Flask:
    """Build the app around `engine` (or the real engine, built from the final config)."""
    app = Flask(__name__, template_folder=str(ROOT / "templates"), static_folder=str(ROOT / "static"))
    app.config.from_mapping(DEFAULTS)
    app.config.from_prefixed_env("LLM")
    for name in SECRETS:
        if f"LLM_{name}" in os.environ:
            app.config[name] = os.environ[f"LLM_{name}"]
    app.config.from_mapping(config or {})
    app.json.sort_keys = False  # keep OpenAI's field order; it reads better in logs and curl

    if engine is None:
        from webapp.engine.serving.loader import build_engine

        engine = build_engine(app.config).start()  # loads and warms up on the model thread
    app.extensions["engine"] = engine
    app.extensions["image_fetcher"] = ImageFetcher.from_setting(
        app.config["IMAGE_FETCH"], app.config["IMAGE_FETCH_BYTES"], app.config["IMAGE_FETCH_SECONDS"]
    )
    lifecycle = Lifecycle(engine, drain_seconds=app.config["DRAIN_SECONDS"])
    app.extensions["lifecycle"] = lifecycle
    app.wsgi_app = lifecycle.wrap(app.wsgi_app, lambda environ: families.drains(app, environ))

    families.install(app, app_routes=families.Policy(guard=families.PUBLIC, drained=False))  # the static files
    headers.install(app)
    blueprints = (
        api.bp,
        anthropic_api.bp,
        ollama_api.bp,
        responses_api.bp,
        embeddings.bp,
        rerank.bp,
        lora_api.bp,
        lora_api.listing_bp,
        tokens.bp,
        openapi.bp,
        health.bp,
        chat.bp,
        admin.bp,
        metrics.bp,
        login.bp,
    )
    for blueprint in blueprints:
        app.register_blueprint(blueprint)
    _register_error_handlers(app)
    return app


def _error(status: int, message: str, param=None, code=None, type=None, headers=None):
    e = ApiError(status, message, param, code, type, headers)
    response = jsonify(families.current().errors(e))  # the family's own shape
    response.status_code = status
    response.headers.update(e.headers)
    return response


def _register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def api_error(e: ApiError):
        return _error(e.status, e.message, e.param, e.code, e.type, e.headers)

    @app.errorhandler(QueueFull)
    def queue_full(e: QueueFull):
        return _error(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)})

    @app.errorhandler(PromptTooLong)  # the engine's own guard; the API refuses these before submit
    def prompt_too_long(e: PromptTooLong):
        return _error(400, str(e), code="context_length_exceeded")

    @app.errorhandler(ModelLoadFailed)  # an EngineNotReady Flask hands here: no Retry-After, waiting will not mend a file
    def model_load_failed(e: ModelLoadFailed):
        return _error(503, str(e), code="model_load_failed")

    @app.errorhandler(EngineNotReady)
    def engine_not_ready(e: EngineNotReady):
        message = str(e) or "The model is not ready yet."
        return _error(503, message, code="engine_not_ready", headers={"Retry-After": str(RETRY_AFTER_S)})

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
        return _error(e.code or 500, message, code=e.name.lower().replace(" ", "_"), headers=headers)

    @app.errorhandler(Exception)
    def unexpected(e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, "Internal server error.", code="internal_error")
