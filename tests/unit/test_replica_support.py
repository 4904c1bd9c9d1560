"""What a replica behind a proxy, a gateway or an autoscaler relies on: the start-up warning about
Waitress settings (checked against the Makefile's and the Dockerfile's own command lines), the
vLLM-named metric aliases (`LLM_METRICS_COMPAT=vllm`) parsed back with prometheus_client, and
`/health` answering a draining replica's 503 at once, with `Retry-After`."""

import logging
import re
import resource
import shlex
import threading

import pytest
from support import ROOT, metric_families
from support.fakes import start_scripted_engine

from webapp import DEFAULTS, create_app
from webapp.engine.serving.errors import RETRY_AFTER_S
from webapp.ops.waitress_settings import (
    HEADROOM_THREADS,
    MIN_CONNECTIONS,
    allow_connections,
    missing_flags,
    waitress_adjustments,
    warn_if_underprovisioned,
)

CONFIG = {"SLOTS": DEFAULTS["SLOTS"], "QUEUE_LIMIT": DEFAULTS["QUEUE_LIMIT"]}
NEEDED = max(DEFAULTS["SLOTS"], DEFAULTS["MAX_BATCH"]) + DEFAULTS["QUEUE_LIMIT"] + HEADROOM_THREADS
CONNECTION_FLAGS = ("--connection-limit=4096", "--asyncore-use-poll")


# --- the Waitress warning -------------------------------------------------------------------------


def test_the_plain_invocation_gets_one_loud_warning_with_the_exact_flags(caplog):
    with caplog.at_level(logging.WARNING, logger="webapp.ops.waitress_settings"):
        flags = warn_if_underprovisioned(CONFIG, ["/venv/bin/waitress-serve", "wsgi:app"])
    assert flags == [f"--threads={NEEDED}", "--channel-request-lookahead=1", *CONNECTION_FLAGS]
    [record] = caplog.records
    assert f"Add: --threads={NEEDED} --channel-request-lookahead=1 {' '.join(CONNECTION_FLAGS)}" in record.getMessage()
    assert "at most 100 connections and watches them with select()" in record.getMessage()
    assert "Waitress runs 4 threads" in record.getMessage()


def test_enough_threads_and_lookahead_are_quiet(caplog):
    argv = ["waitress-serve", f"--threads={NEEDED}", "--channel-request-lookahead=1", *CONNECTION_FLAGS, "wsgi:app"]
    with caplog.at_level(logging.WARNING):
        assert warn_if_underprovisioned(CONFIG, argv) == []
    assert caplog.records == []


def test_more_slots_need_more_threads_and_other_servers_are_not_judged():
    adj = waitress_adjustments(["waitress-serve", "--threads=96", *CONNECTION_FLAGS, "--channel-request-lookahead=1", "wsgi:app"])
    assert missing_flags({"SLOTS": 32, "QUEUE_LIMIT": 64}, adj) == [f"--threads={32 + 64 + HEADROOM_THREADS}"]
    assert warn_if_underprovisioned(CONFIG, ["pytest", "-q"]) == []


def test_a_connection_limit_an_idle_crowd_could_fill_is_reported():
    adj = waitress_adjustments(["waitress-serve", f"--threads={NEEDED}", "--channel-request-lookahead=1", "wsgi:app"])
    assert missing_flags(CONFIG, adj) == [f"--connection-limit={4 * MIN_CONNECTIONS}", "--asyncore-use-poll"]


def test_the_open_file_limit_is_raised_to_hold_the_connections():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert allow_connections(["pytest"]) is None and resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 256
        limit = allow_connections(["waitress-serve", "--connection-limit=600", "--threads=40", "wsgi:app"])
        assert limit == resource.getrlimit(resource.RLIMIT_NOFILE)[0] == min(600 + 40 + 256, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_make_serve_and_the_container_start_waitress_well():
    makefile = (ROOT / "Makefile").read_text()
    defaults = dict(re.findall(r"^(\w+)\s*\?=\s*(\d+)\s*$", makefile, re.M))
    serve = re.search(r"^serve:.*\n\t((?:.*\\\n)*.*)", makefile, re.M).group(1).replace("\\\n", " ")
    serve = re.sub(r"\$\((\w+)\)", lambda m: defaults.get(m.group(1), ""), serve.replace("$(VENV)/bin/", ""))
    made = waitress_adjustments(shlex.split(serve.replace("--listen=:", "--listen=127.0.0.1:")))
    assert missing_flags(CONFIG, made) == [] and made.connection_limit >= MIN_CONNECTIONS

    dockerfile = (ROOT / "Dockerfile").read_text()
    cmd = re.search(r'^CMD \["sh", "-c", "exec (.*)"\]', dockerfile, re.M).group(1)
    env = dict(re.findall(r"\b(THREADS|MAX_BODY|PORT|CONNECTIONS|IDLE_TIMEOUT)=(\d+)", dockerfile))
    cmd = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], cmd)
    assert missing_flags(CONFIG, waitress_adjustments(shlex.split(cmd))) == []


# --- vLLM metric aliases ----------------------------------------------------------------------------


def samples(client) -> dict:
    """/metrics' samples by name, and histogram buckets by (name, le)."""
    found = [s for f in metric_families(client).values() for s in f.samples]
    return {s.name: s for s in found if not s.labels.get("le")} | {(s.name, s.labels["le"]): s for s in found if s.labels.get("le")}


def test_vllm_aliases_mirror_our_metrics_with_the_model_name_label(stats_engine):
    client = create_app({"TESTING": True, "METRICS_COMPAT": "vllm"}, engine=stats_engine).test_client()
    m = samples(client)
    pairs = {
        "vllm:num_requests_waiting": "llm_num_requests_waiting",
        "vllm:num_requests_running": "llm_num_requests_running",
        "vllm:kv_cache_usage_perc": "llm_kv_cache_usage_ratio",
        "vllm:gpu_cache_usage_perc": "llm_kv_cache_usage_ratio",
        "vllm:prompt_tokens_total": "llm_prompt_tokens_total",
        "vllm:generation_tokens_total": "llm_generation_tokens_total",
        "vllm:prefix_cache_queries_total": "llm_prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total": "llm_prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count": "llm_time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_sum": "llm_inter_token_latency_seconds_sum",
        "vllm:time_per_output_token_seconds_sum": "llm_inter_token_latency_seconds_sum",
        "vllm:request_queue_time_seconds_count": "llm_request_queue_time_seconds_count",
        "vllm:e2e_request_latency_seconds_count": "llm_e2e_request_latency_seconds_count",
    }
    for theirs, ours in pairs.items():
        assert m[theirs].value == m[ours].value, theirs
        assert m[theirs].labels == {"model_name": "fake-model"}, theirs
    assert m["vllm:num_requests_waiting"].value == 2 and 0 < m["vllm:kv_cache_usage_perc"].value < 1
    assert m[("vllm:time_to_first_token_seconds_bucket", "+Inf")].value == m["vllm:time_to_first_token_seconds_count"].value
    text = client.get("/metrics").get_data(as_text=True)
    assert 'vllm:request_success_total{finished_reason="stop",model_name="fake-model"} 1.0' in text
    assert 'vllm:request_success_total{finished_reason="length",model_name="fake-model"} 1.0' in text


def test_no_aliases_by_default_and_an_unknown_mode_stops_start_up(fake_engine):
    app = create_app({"TESTING": True}, engine=fake_engine)
    assert "vllm:" not in app.test_client().get("/metrics").get_data(as_text=True)
    with pytest.raises(ValueError, match="LLM_METRICS_COMPAT='sglang'"):
        create_app({"TESTING": True, "METRICS_COMPAT": "sglang"}, engine=fake_engine)


# --- health of a draining replica -------------------------------------------------------------------


def test_a_draining_replica_answers_503_with_retry_after_at_once(fake_engine, monkeypatch):
    release = threading.Event()
    asked = fake_engine.health

    def blocking() -> dict:  # a health() that would block: a draining replica must not need it to answer
        release.wait(10)
        return asked()

    monkeypatch.setattr(fake_engine, "health", blocking)
    app = create_app({"TESTING": True}, engine=fake_engine)
    app.extensions["lifecycle"].drain(0)
    response = app.test_client().get("/health")
    assert not release.is_set()  # answered without asking the engine
    assert response.status_code == 503 and response.get_json() == {"status": "draining"}
    assert response.headers["Retry-After"] == str(RETRY_AFTER_S)
    release.set()


def test_a_loading_replica_says_when_to_ask_again_and_a_serving_one_is_200():
    held = threading.Event()
    engine = start_scripted_engine(held=held)
    client = create_app({"TESTING": True}, engine=engine).test_client()
    loading = client.get("/health")
    assert loading.status_code == 503 and loading.headers["Retry-After"] == str(RETRY_AFTER_S)
    held.set()
    assert engine.settled.wait(10)
    ok = client.get("/health")
    assert ok.status_code == 200 and "Retry-After" not in ok.headers
    engine.stop(5)
