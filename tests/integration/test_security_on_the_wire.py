"""What Flask's test client cannot send, sent to a real Waitress server over the scripted fake
engine: doubled slashes in front of the admin guard, and a chunked body past the size limit. The
rest of the security checks are tests/unit/test_security.py."""

from __future__ import annotations

import http.client
import json

from support import assert_error_shape, get, running_server

from webapp import create_app


def test_doubled_slashes_do_not_slip_past_the_guard(fake_engine):
    app = create_app({"TESTING": True, "ADMIN_TOKEN": "letmein-admin"}, engine=fake_engine)
    app.add_url_rule("/admin/probe", "admin_probe", lambda: "admin ok")
    with running_server(app) as srv:
        for path in ("//admin/probe", "/admin//probe", "///metrics", "//admin"):
            conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
            conn.request("GET", path, headers={"Accept": "application/json"})
            response = conn.getresponse()
            body = response.read()
            conn.close()
            assert response.status in (308, 401), (path, response.status)
            assert b"admin ok" not in body


def test_chunked_body_over_the_limit_is_413(fake_engine):
    app = create_app({"TESTING": True, "MAX_CONTENT_LENGTH": 64 * 1024}, engine=fake_engine)
    with running_server(app) as srv:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
        body = json.dumps({"prompt": "x" * 100_000}).encode()
        chunks = (body[i : i + 8192] for i in range(0, len(body), 8192))
        conn.request(
            "POST",
            "/v1/completions",
            chunks,
            {"Content-Type": "application/json"},
            encode_chunked=True,
        )
        response = conn.getresponse()
        assert response.status == 413
        assert_error_shape(json.loads(response.read()))
        conn.close()
        assert get(srv, "/health")[0] == 200
