"""`GET /metrics`: the engine's counters in the Prometheus text format (OpenMetrics when asked for).

Each app gets its own `CollectorRegistry` holding one `EngineCollector` (and, with
`LLM_METRICS_COMPAT=vllm`, a `VllmCollector`), so nothing is counted twice and the global registry
of `prometheus_client` is never touched. The family declares the admin token as its guard, like the
dashboard's, and is not drained (`webapp.http.families`).
"""

from __future__ import annotations

from flask import Response, current_app, request
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from webapp.engine.serving.model_set import ModelSet
from webapp.http.families import ADMIN_TOKEN, Family
from webapp.ops.prometheus import EngineCollector

bp = Family("prometheus", __name__, guard=ADMIN_TOKEN, drained=False, owns=("/metrics",))


def _install(state) -> None:
    app = state.app
    registry = CollectorRegistry(auto_describe=False)

    def stats() -> dict:
        return app.extensions["engine"].stats()

    def models() -> dict[str, dict]:
        return app.extensions["engine"].model_stats()

    per_model = models if isinstance(app.extensions.get("engine"), ModelSet) else None  # LLM_MODELS_DIR: a `model` label
    registry.register(EngineCollector(stats, per_model))
    compat = app.config.get("METRICS_COMPAT")
    if compat:
        from webapp.ops.vllm_metrics import MODES, VllmCollector

        if compat not in MODES:
            raise ValueError(f"LLM_METRICS_COMPAT={compat!r}: the supported value is {' or '.join(MODES)}")
        registry.register(VllmCollector(stats, per_model))
    app.extensions["prometheus_registry"] = registry


bp.record_once(_install)


@bp.get("/metrics")
def metrics():
    """The engine's metrics for a Prometheus scrape."""
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    body = encode(current_app.extensions["prometheus_registry"])
    return Response(body, content_type=content_type, headers={"Cache-Control": "no-store"})
