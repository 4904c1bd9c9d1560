"""The app through Flask's test client over a real engine on a scripted runner: /health, the chat page and its
assets, the settings from defaults, the environment and the argument, and the error a request
gets for an oversized body or an unexpected exception."""

from __future__ import annotations

import re

import pytest
from support import HELLO, assert_error_shape

from webapp import create_app
from webapp.engine.serving.settings import ENGINE_DEFAULTS, engine_settings


def test_body_over_the_size_limit_is_413(fake_engine):
    client = create_app({"TESTING": True, "MAX_CONTENT_LENGTH": 1000}, engine=fake_engine).test_client()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 2000}]})
    assert r.status_code == 413
    assert_error_shape(r.get_json())


def test_unexpected_exception_is_500_json(fake_client, fake_engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("bug")

    monkeypatch.setattr(fake_engine.chat_template, "render", broken)
    r = fake_client.post("/v1/chat/completions", json={"messages": HELLO})
    assert r.status_code == 500
    assert_error_shape(r.get_json(), "server_error")
    assert "bug" not in r.get_json()["error"]["message"]  # internals stay in the log


def test_health_ok(fake_client):
    r = fake_client.get("/health")
    assert r.status_code == 200 and r.get_json()["status"] == "ok"


def test_chat_page_loads_only_external_scripts(fake_client):
    r = fake_client.get("/")
    assert r.status_code == 200 and r.mimetype == "text/html"
    html = r.get_data(as_text=True)
    scripts = re.findall(r"<script\b[^>]*>", html)
    assert scripts and all('src="/static/' in s for s in scripts)
    assert "<script>" not in html and "https://" not in html
    csp = r.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe" not in csp
    # every script and stylesheet it names (the vendored libraries included) is served from here
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert "/static/chat/main.js" in assets and len(assets) >= 6
    for path in assets:
        assert fake_client.get(path).status_code == 200, path


def test_config_comes_from_defaults_then_env_then_the_argument(fake_engine, monkeypatch):
    monkeypatch.setenv("LLM_MAX_CONTEXT", "8192")
    monkeypatch.setenv("LLM_SLOTS", "4")
    app = create_app({"SLOTS": 2}, engine=fake_engine)
    assert (app.config["MAX_CONTEXT"], app.config["SLOTS"], app.config["QUEUE_LIMIT"]) == (
        8192,
        2,
        64,
    )
    assert app.extensions["engine"] is fake_engine


def test_a_zero_setting_is_a_value_not_a_missing_one(fake_engine, monkeypatch, tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    monkeypatch.setenv("LLM_BEAM", "0")  # turns tuned kernels off even after `make tune`
    monkeypatch.setenv("LLM_MODEL", str(model))
    app = create_app({"QUEUE_LIMIT": 0, "MAX_CONTEXT": None}, engine=fake_engine)
    settings = engine_settings(app.config)
    assert (settings.beam, settings.queue_limit) == (0, 0)
    assert ENGINE_DEFAULTS["MAX_CONTEXT"] == "auto" and settings.context is None  # None is unset: sized at load
    assert engine_settings({"MODEL": str(model), "BEAM": ""}).beam == "auto"


def test_the_prefix_cache_folder_and_its_cap(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    assert engine_settings({"MODEL": str(model)}).prefix_cache is None  # off unless a folder is named
    folder = str(tmp_path / "cache")  # made at the first save
    assert engine_settings({"MODEL": str(model), "PREFIX_CACHE_DIR": folder}).prefix_cache == (folder, 512 << 20)
    assert engine_settings({"MODEL": str(model), "PREFIX_CACHE_DIR": folder, "PREFIX_CACHE_BYTES": "2G"}).prefix_cache == (
        folder,
        2 << 30,
    )
    with pytest.raises(FileNotFoundError, match="not a folder"):
        engine_settings({"MODEL": str(model), "PREFIX_CACHE_DIR": str(model)})
