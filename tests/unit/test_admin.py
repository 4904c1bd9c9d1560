"""/admin, /admin/stats.json and /metrics over a real engine whose stats real requests made on a
settable clock (`stats_engine`): numbers in the page without JavaScript, a strict CSP, the admin
token, and every promised Prometheus family parsed back with prometheus_client's own parser."""

import json
import re
import threading

import pytest
from prometheus_client import REGISTRY
from support import metric_families
from support.fakes import start_scripted_engine

from webapp import create_app
from webapp.http.admin import format_value, nice_max, plot_paths, slot_row


def stat(html: str, path: str) -> str:
    m = re.search(rf'data-stat="{re.escape(path)}" data-format="\w+">([^<]*)<', html)
    assert m, f"no data-stat {path!r} in the page"
    return m.group(1)


def ran(engine) -> list:
    """The requests the stats engine's runner ran: done0, done1, live."""
    return engine.loaded.runner.requests


def step(engine) -> float:
    """A model step's length on the stats engine's clock."""
    return engine.loaded.runner.clock_step


def test_dashboard_shows_the_numbers_without_javascript(stats_engine, stats_client):
    response = stats_client.get("/admin")
    assert response.status_code == 200
    html = response.get_data(as_text=True)
    done0, done1, live = ran(stats_engine)
    assert stat(html, "model") == "fake-model" and stat(html, "context") == "256"
    assert stat(html, "queue_depth") == "2"
    assert stat(html, "running") == "1" and stat(html, "slots_total") == "2"
    assert stat(html, "generated_tokens_total") == "23" and stat(html, "prompt_tokens_total") == "150"
    assert (done0.cached_tokens, done1.cached_tokens, live.cached_tokens) == (0, 0, 30)
    assert stat(html, "prefix_reuse") == "20%" and stat(html, "prefix_reuse_total") == "20%"  # all within the last 10 s
    assert stat(html, "decode_tokens_per_s") != "–" and stat(html, "ttft_p50_s") == format_value(step(stats_engine), "latency")
    assert stat(html, "requests_total.stop") == "1" and stat(html, "requests_total.length") == "1"
    # the slot table: who runs where (live: its prompt and the two outputs fed back so far; done1's
    # slot: its prompt and nine of its ten outputs), the KV bar split into reused / prefilled / generated
    assert "chatcmpl-live" in html and "52 / 256" in html and "69 / 256" in html
    for kind in ("reused", "prefilled", "generated", "idle"):
        assert f'<rect class="kv-{kind}"' in html
    assert '30 <span class="muted">(60%)</span>' in html  # 30 of the 50 prompt tokens were reused
    # recent requests, newest first
    assert html.index("chatcmpl-done1") < html.index("chatcmpl-done0")
    # the plots are drawn here too, not only by the script
    assert re.search(r'data-series="decode_tokens_per_s" data-part="line" d="M[\d.]+,[\d.]+ L', html)
    assert '<meta http-equiv="refresh"' in html  # inside <noscript>: without JS the page reloads


def test_pages_run_under_a_strict_csp(stats_client):
    response = stats_client.get("/admin")
    csp = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp and "unsafe-inline" not in csp
    assert response.headers["Cache-Control"] == "no-store"
    html = response.get_data(as_text=True)
    scripts = re.findall(r"<script\b[^>]*>", html)
    assert scripts and all(" src=" in s for s in scripts)
    assert not re.search(r"<script\b[^>]*>\s*[^<\s]", html)  # no inline code
    assert not re.search(r"\son\w+=", html) and " style=" not in html and "<style" not in html
    for asset in ("/static/admin.js", "/static/admin.css"):
        assert stats_client.get(asset).status_code == 200


def test_stats_json(stats_engine, stats_client):
    response = stats_client.get("/admin/stats.json")
    assert response.status_code == 200 and response.is_json
    assert response.headers["Cache-Control"] == "no-store"
    # strict JSON, as browsers parse it: no NaN or Infinity
    s = json.loads(response.get_data(as_text=True), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    for key in (
        "queue_depth", "running", "slots_total", "prefill_tokens_per_s", "decode_tokens_per_s",
        "prefill_tokens_per_s_avg", "decode_tokens_per_s_avg", "prefix_reuse", "prefix_reuse_total",
        "cached_tokens_total", "prompt_tokens_total", "generated_tokens_total", "requests_total",
        "ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s", "uptime_s", "model", "context", "device",
    ):  # fmt: skip
        assert key in s, key
    assert set(s["requests_total"]) == {"stop", "length", "cancelled", "shutdown", "error", "rejected"}
    assert s["slots"][0] == {
        "index": 0, "state": "decode", "request_id": "chatcmpl-live", "adapter": None, "tokens_cached": 52, "prompt_tokens": 50,
        "reused_tokens": 30, "tokens_generated": 3, "age_s": pytest.approx(3 * step(stats_engine) + 1.5),
    }  # fmt: skip
    assert s["slots"][1]["state"] == "cached" and s["slots"][1]["tokens_cached"] == 69
    recent = s["recent_requests"][0]
    assert set(recent) >= {
        "id",
        "prompt_tokens",
        "cached_tokens",
        "generated_tokens",
        "queue_wait_s",
        "ttft_s",
        "decode_tokens_per_s",
        "finish_reason",
    }
    assert len(s["history"]["decode_tokens_per_s"]) == 600


def test_dashboard_of_an_engine_still_loading():
    held = threading.Event()
    engine = start_scripted_engine(held=held)  # nothing published yet: the model is loading
    client = create_app({"TESTING": True}, engine=engine).test_client()
    html = client.get("/admin").get_data(as_text=True)
    assert 'class="state state-loading"' in html and stat(html, "running") == "–"
    assert client.get("/admin/stats.json").get_json() == {"state": "loading", "model": "loading"}
    assert metric_families(client).keys() == {"llm_engine_ready"}
    held.set()
    assert engine.settled.wait(10)
    engine.stop(5)


def test_a_real_engines_stats_make_the_page_before_and_after_a_request(fake_engine, fake_client):
    assert fake_client.get("/admin").status_code == 200
    assert fake_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
    html = fake_client.get("/admin").get_data(as_text=True)
    assert 'class="state state-ok"' in html and fake_client.get("/admin/stats.json").get_json()["model"] == "fake-model"


PROMISED = {
    # name as the parser reports it: type
    "llm_engine_ready": "gauge",
    "llm_model_info": "gauge",  # an Info: a constant 1 with labels
    "llm_num_requests_waiting": "gauge",
    "llm_num_requests_running": "gauge",
    "llm_num_slots": "gauge",
    "llm_kv_cache_usage_ratio": "gauge",
    "llm_prompt_tokens": "counter",
    "llm_prefill_tokens": "counter",
    "llm_generation_tokens": "counter",
    "llm_prefix_cache_queries": "counter",
    "llm_prefix_cache_hits": "counter",
    "llm_requests": "counter",
    "llm_time_to_first_token_seconds": "histogram",
    "llm_inter_token_latency_seconds": "histogram",
    "llm_request_queue_time_seconds": "histogram",
    "llm_e2e_request_latency_seconds": "histogram",
}


def value(family, suffix="", **labels):
    (sample,) = [s for s in family.samples if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items())]
    return sample.value


def test_metrics_has_every_promised_family(stats_engine, stats_client):
    response = stats_client.get("/metrics")
    assert response.content_type.startswith("text/plain")
    families = metric_families(stats_client)
    assert {name: families[name].type for name in PROMISED if name in families} == PROMISED
    assert value(families["llm_engine_ready"]) == 1
    assert value(families["llm_num_requests_waiting"]) == 2 and value(families["llm_num_requests_running"]) == 1
    assert value(families["llm_num_slots"]) == 2
    runs, step_s = ran(stats_engine), step(stats_engine)
    assert value(families["llm_kv_cache_usage_ratio"]) == pytest.approx((52 + 69) / (2 * 256))
    assert value(families["llm_prompt_tokens"], "_total") == sum(r.prompt_len for r in runs) == 150
    assert value(families["llm_prefill_tokens"], "_total") == sum(r.prefilled_tokens for r in runs) == 120
    assert value(families["llm_generation_tokens"], "_total") == sum(len(r.output_ids) for r in runs) == 23
    assert value(families["llm_prefix_cache_queries"], "_total") == 150
    assert value(families["llm_prefix_cache_hits"], "_total") == sum(r.cached_tokens for r in runs) == 30
    requests = families["llm_requests"]
    assert {s.labels["finish_reason"]: s.value for s in requests.samples} == {
        "stop": 1, "length": 1, "cancelled": 0, "shutdown": 0, "error": 0, "rejected": 0
    }  # fmt: skip
    assert value(families["llm_model_info"], model="fake-model", device="FAKE", context="256") == 1
    for name in (
        "llm_time_to_first_token_seconds",
        "llm_inter_token_latency_seconds",
        "llm_request_queue_time_seconds",
        "llm_e2e_request_latency_seconds",
    ):
        h = families[name]
        buckets = [s for s in h.samples if s.name == name + "_bucket"]
        assert buckets[-1].labels["le"] == "+Inf"
        counts = [s.value for s in buckets]
        assert counts == sorted(counts) and counts[-1] == value(h, "_count")
    # each request's first token came at the end of its prefill step, one step after it was
    # submitted; the next ones one step apart
    assert [r.first_token_at - r.submitted_at for r in runs] == [step_s] * 3
    assert value(families["llm_time_to_first_token_seconds"], "_count") == 3
    assert value(families["llm_time_to_first_token_seconds"], "_bucket", le="0.1") == 0
    assert value(families["llm_time_to_first_token_seconds"], "_bucket", le="0.25") == 3
    gaps = sum(len(r.output_ids) - 1 for r in runs)
    assert value(families["llm_inter_token_latency_seconds"], "_count") == gaps == 20
    spans = sum(r.last_token_at - r.first_token_at for r in runs)
    assert value(families["llm_inter_token_latency_seconds"], "_sum") == pytest.approx(spans) == gaps * step_s


def test_metrics_in_openmetrics_when_asked(stats_client):
    response = stats_client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert response.content_type.startswith("application/openmetrics-text")
    assert response.get_data(as_text=True).endswith("# EOF\n")


def test_each_app_has_its_own_registry(stats_engine):
    a, b = (create_app({"TESTING": True}, engine=stats_engine) for _ in range(2))
    assert a.extensions["prometheus_registry"] is not b.extensions["prometheus_registry"]
    assert metric_families(a.test_client()).keys() == metric_families(b.test_client()).keys()
    assert not any(name.startswith("llm_") for name in REGISTRY._names_to_collectors)


def test_format_value_mirrors_the_script():
    assert [format_value(v) for v in (0, 7, 12345)] == ["0", "7", "12,345"]
    assert [format_value(v, "rate") for v in (0, 3.14159, 9.96, 1234.5)] == ["0.0", "3.1", "10.0", "1,234"]
    assert format_value(0.4567, "pct") == "46%" and format_value(None, "pct") == "–"
    assert [format_value(v, "latency") for v in (0.0123, 2.5, 75)] == ["12 ms", "2.50 s", "1m 15s"]
    assert [format_value(v, "duration") for v in (5.9, 125, 7300)] == ["5 s", "2m 05s", "2h 01m"]
    assert format_value(float("nan"), "rate") == "–" and format_value("cpu", "text") == "cpu"


def test_nice_max_and_plot_paths():
    assert [nice_max(v) for v in (0, 0.5, 1, 1.5, 3, 7, 10, 11, 450)] == [1, 1, 1, 2, 5, 10, 10, 20, 500]
    line, area = plot_paths([None, 0, 5, None, 10], 10)
    # 5 values end at x=599 (the right edge); the None breaks the line into two runs
    assert line == "M596,100.0 L597,50.0 M599,0.0"
    assert area.startswith("M596,100 L596,100.0 L597,50.0 L597,100 Z")
    assert plot_paths([], 1) == ("", "")


def test_slot_row_segments():
    row = slot_row({"tokens_cached": 60, "prompt_tokens": 50, "reused_tokens": 20}, 200)
    assert row["segments"] == [("reused", 0, 10.0), ("prefilled", 10.0, 15.0), ("generated", 25.0, 5.0)]
    assert row["reused_share"] == 0.4
    idle = slot_row({"tokens_cached": 50, "prompt_tokens": None}, 100)
    assert idle["segments"] == [("idle", 0, 50.0)] and idle["reused_share"] is None
    assert slot_row({"tokens_cached": 0, "prompt_tokens": None}, 100)["segments"] == []
