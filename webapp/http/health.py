"""`GET /health`, for load balancers and orchestrators: public and never drained, since a draining
replica must still say so (`webapp.http.families`).
"""

from __future__ import annotations

from flask import jsonify

from webapp.engine.serving.errors import RETRY_AFTER_S
from webapp.http import generation as gen
from webapp.http.families import PUBLIC, Family

bp = Family("health", __name__, guard=PUBLIC, drained=False)


@bp.get("/health")
def health():
    """The engine's health dict: 200 when it serves requests; 503 with `Retry-After` while loading,
    failed, stalled (a step has run longer than STALL_SECONDS) or draining for shutdown. A draining
    replica answers before asking the engine anything, so a proxy's check takes it out at once."""
    if gen.lifecycle().draining:
        return jsonify(status="draining"), 503, {"Retry-After": str(RETRY_AFTER_S)}
    state = gen.served().health()
    if state.get("status") != "ok":
        return jsonify(state), 503, {"Retry-After": str(RETRY_AFTER_S)}
    return jsonify(state)
