"""API families (Flask's test client over a real engine on a scripted runner, through the lifecycle's WSGI
middleware): a blueprint registered with no options is guarded by the API key and drained, a family
that declares otherwise is not, /tokenize is drained like the API, and every family's errors keep
their own shape, for its routes and for unknown routes in the URL space it owns."""

from __future__ import annotations

import pytest
from flask import Blueprint, current_app, jsonify
from support import HELLO, assert_error_shape

from webapp import create_app
from webapp.http.families import PUBLIC, Family
from webapp.openai.errors import ApiError

KEY = "sekret"
RIGHT = {"Authorization": f"Bearer {KEY}"}


def _in_flight():
    """Inside a view: how many drained requests the lifecycle counts (this one included, if drained)."""
    return jsonify(in_flight=current_app.extensions["lifecycle"].in_flight)


def _ollama_error(e: ApiError) -> dict:
    return {"error": e.message}  # Ollama's shape: a bare message


@pytest.fixture
def app(fake_engine):
    app = create_app({"TESTING": True, "API_KEY": KEY}, engine=fake_engine)
    plain = Blueprint("plain", __name__)  # a new family that declares nothing
    plain.add_url_rule("/api/plain", "probe", _in_flight)
    app.register_blueprint(plain)
    ollama = Family("ollama_like", __name__, errors=_ollama_error, owns=("/api/ollama",))
    ollama.add_url_rule("/api/ollama/tags", "tags", _in_flight)
    app.register_blueprint(ollama)
    public = Family("status_page", __name__, guard=PUBLIC, drained=False)
    public.add_url_rule("/status", "status", _in_flight)
    app.register_blueprint(public)
    return app


@pytest.fixture
def client(app):
    return app.test_client()


def test_a_blueprint_registered_without_options_needs_the_api_key(client):
    r = client.get("/api/plain")
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    assert_error_shape(r.get_json(), code="invalid_api_key")
    assert client.get("/api/plain", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/api/plain", headers=RIGHT).status_code == 200
    assert client.get("/api/plain", headers={"x-api-key": KEY}).status_code == 200


def test_a_blueprint_registered_without_options_is_counted_and_drained(app, client):
    with client.get("/api/plain", headers=RIGHT) as r:  # counted until the server closes it
        assert r.get_json() == {"in_flight": 1}
    with client.get("/status") as r:  # declared undrained: not counted
        assert r.get_json() == {"in_flight": 0}
    app.extensions["lifecycle"].drain(0)
    r = client.get("/api/plain", headers=RIGHT)
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert_error_shape(r.get_json(), "server_error", "server_shutting_down")
    assert r.headers["X-Content-Type-Options"] == "nosniff"  # a refusal is a response like any other
    assert client.get("/status").status_code == 200


def test_tokenize_and_detokenize_are_drained(app, client):
    app.extensions["lifecycle"].drain(0)
    for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [104]})):
        r = client.post(path, json=body)
        assert r.status_code == 503, path
        assert_error_shape(r.get_json(), "server_error", "server_shutting_down")


def test_each_family_refuses_in_its_own_shape_while_draining(app, client):
    app.extensions["lifecycle"].drain(0)
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503
    assert r.get_json()["type"] == "error" and r.get_json()["error"]["type"] == "overloaded_error"
    r = client.get("/api/ollama/tags", headers=RIGHT)
    assert r.status_code == 503 and r.get_json() == {"error": "The server is shutting down and accepts no new requests."}
    assert client.get("/health").get_json() == {"status": "draining"}  # its own answer, not a refusal
    assert client.get("/").status_code == 200
    assert client.get("/admin/stats.json").status_code == 200


def test_a_family_declares_its_own_error_shape_over_the_space_it_owns(client):
    assert client.get("/api/ollama/tags").get_json() == {"error": "Invalid or missing API key. Send it as 'Authorization: Bearer <key>'."}
    r = client.get("/api/ollama/nope", headers=RIGHT)
    assert r.status_code == 404 and r.get_json() == {"error": "Unknown route: GET /api/ollama/nope"}
    r = client.post("/api/ollama/tags", headers=RIGHT)
    assert r.status_code == 405 and "GET" in r.headers["Allow"] and set(r.get_json()) == {"error"}


def test_every_family_errs_in_its_own_shape(client):
    # OpenAI's: a route of the family, an unknown route under /v1, a wrong method
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/nope"), ("GET", "/v1/chat/completions")):
        r = client.open(path, method=method, json={}, headers=RIGHT)
        assert r.status_code in (400, 404, 405), path
        assert_error_shape(r.get_json())
    # Anthropic's, for the same three, and for a missing key
    for method, path, headers in (
        ("POST", "/v1/messages", RIGHT),
        ("GET", "/v1/messages/nope", RIGHT),
        ("GET", "/v1/messages", RIGHT),
        ("POST", "/v1/messages", {}),
    ):
        r = client.open(path, method=method, json={}, headers=headers)
        body = r.get_json()
        assert r.status_code in (400, 401, 404, 405), path
        assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert client.post("/v1/messages", json={}).get_json()["error"]["type"] == "authentication_error"
    # the token routes, the Responses API and embeddings are OpenAI's
    for method, path in (("GET", "/tokenize"), ("POST", "/v1/responses"), ("POST", "/v1/embeddings")):
        r = client.open(path, method=method, json={}, headers=RIGHT)
        assert r.status_code in (400, 405), path
        assert_error_shape(r.get_json())
    # a path no family owns: a public 404
    r = client.get("/nope")
    assert r.status_code == 404
    assert_error_shape(r.get_json(), code="not_found")


def test_the_pages_health_and_static_files_need_no_api_key(client):
    for path in ("/", "/health", "/static/chat.css", "/admin", "/metrics", "/admin/login"):
        assert client.get(path).status_code in (200, 303), path  # the login form sends on when no token is set


def test_a_chat_still_runs_through_the_default_family(client):
    r = client.post("/v1/chat/completions", json={"messages": HELLO}, headers=RIGHT)
    assert r.status_code == 200 and r.get_json()["object"] == "chat.completion"
