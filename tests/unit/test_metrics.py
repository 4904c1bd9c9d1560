"""EngineMetrics on a fake clock: rates that fall to zero when the engine sleeps, prefix reuse,
histograms, the per-second history, an immutable snapshot; then the engine's stats() end to end."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest
from support import drain_outputs, engine_over, metric_families, wait_until
from support.fakes import Clock, FakeRunner

from webapp import create_app
from webapp.engine.decoding.sampling_params import SamplingParams
from webapp.engine.serving.engine import Engine
from webapp.engine.serving.errors import QueueFull
from webapp.engine.serving.loaded_model import LoadedModel
from webapp.engine.serving.metrics import (
    ITL_BUCKETS,
    REQUEST_OUTCOMES,
    EngineMetrics,
    Histogram,
    percentile,
)
from webapp.engine.serving.request import FINISH_REASONS, FinishReason, Request, Status
from webapp.engine.serving.timeline import HISTORY_S

STATIC = {"model": "m", "context": 100, "device": "TEST"}


def slot(index, owner=None, tokens=0):
    return SimpleNamespace(index=index, owner=owner, tokens=[0] * tokens)


def make_request(clock, prompt_len=10, cached=0, rid=None):
    r = Request([1] * prompt_len, SamplingParams(max_tokens=50), **({"id": rid} if rid else {}))
    r.submitted_at = clock.now
    r.cached_tokens = cached
    return r


def admit(metrics, clock, request):
    request.admitted_at = clock.now
    request.status = Status.PREFILL
    metrics.on_admit(request)


def emit(metrics, clock, request, n=1, every=0.0):
    """n generated tokens, `every` seconds apart, stamped the way Engine._emit does."""
    for _ in range(n):
        clock.now += every
        metrics.on_token(request, clock.now)
        if request.first_token_at is None:
            request.first_token_at = clock.now
        request.last_token_at = clock.now
        request.output_ids.append(7)


def finish(metrics, clock, request, reason="stop"):
    request.status, request.finish_reason, request.finished_at = Status.FINISHED, reason, clock.now
    metrics.on_finish(request)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def metrics(clock):
    return EngineMetrics(STATIC, clock=clock)


def test_nothing_before_the_first_publish(metrics):
    assert metrics.snapshot == {}
    assert metrics.current() == {}


def test_rates_prefix_reuse_and_totals(metrics, clock):
    a = make_request(clock, prompt_len=40, cached=0)
    admit(metrics, clock, a)
    metrics.on_prefill(40)
    emit(metrics, clock, a, n=20, every=0.1)  # 20 tokens over 2 s
    b = make_request(clock, prompt_len=60, cached=30)
    admit(metrics, clock, b)
    metrics.on_prefill(30)
    metrics.publish(1, [a, b], [slot(0, a, 50), slot(1, b, 30)])
    clock.now += 1
    s = metrics.current()
    assert s["prompt_tokens_total"] == 100 and s["cached_tokens_total"] == 30
    assert s["prefill_tokens_total"] == 70 and s["generated_tokens_total"] == 20
    assert s["prefix_reuse"] == pytest.approx(0.3) and s["prefix_reuse_total"] == pytest.approx(0.3)
    assert s["uptime_s"] == pytest.approx(3.0)
    # everything happened within the last 10 s, and the engine has run for 3 s
    assert s["prefill_tokens_per_s"] == pytest.approx(70 / 3)
    assert s["decode_tokens_per_s"] == pytest.approx(20 / 3)
    assert s["decode_tokens_per_s_avg"] == pytest.approx(20 / 3)
    assert (s["queue_depth"], s["running"], s["slots_total"], s["kv_tokens"]) == (1, 2, 2, 80)
    assert s["model"] == "m" and s["context"] == 100 and s["device"] == "TEST"

    # The model thread goes to sleep: no more publishes, yet the recent rates fall to zero.
    clock.now += 30
    s = metrics.current()
    assert s["prefill_tokens_per_s"] == 0 and s["decode_tokens_per_s"] == 0
    assert s["prefix_reuse"] is None and s["prefix_reuse_total"] == pytest.approx(0.3)
    assert s["decode_tokens_per_s_avg"] == pytest.approx(20 / 33)
    assert s["slots"][0]["age_s"] == pytest.approx(33.0)


def test_latency_percentiles_histograms_and_recent_requests(metrics, clock):
    for i in range(3):
        r = make_request(clock, prompt_len=5, rid=f"r{i}")
        clock.now += 0.5  # queue wait
        admit(metrics, clock, r)
        emit(metrics, clock, r, n=1, every=0.25)  # TTFT 0.75 s
        emit(metrics, clock, r, n=4, every=0.05)
        finish(metrics, clock, r, "length" if i == 2 else "stop")
    metrics.publish(0, [], [slot(0)])
    s = metrics.current()
    assert s["ttft_p50_s"] == pytest.approx(0.75) and s["ttft_p95_s"] == pytest.approx(0.75)
    assert s["itl_p50_s"] == pytest.approx(0.05) and s["queue_wait_p50_s"] == pytest.approx(0.5)
    assert s["requests_total"] == {"stop": 2, "length": 1, "cancelled": 0, "shutdown": 0, "error": 0, "rejected": 0}
    assert [r["id"] for r in s["recent_requests"]] == ["r2", "r1", "r0"]
    recent = s["recent_requests"][0]
    assert recent["queue_wait_s"] == pytest.approx(0.5) and recent["ttft_s"] == pytest.approx(0.75)
    assert recent["decode_tokens_per_s"] == pytest.approx(20.0) and recent["e2e_s"] == pytest.approx(0.95)
    assert (recent["prompt_tokens"], recent["generated_tokens"], recent["finish_reason"]) == (5, 5, "length")

    itl = s["histograms"]["itl_s"]
    assert itl["count"] == 12 and itl["sum"] == pytest.approx(0.6)
    bounds = [le for le, _ in itl["buckets"]]
    assert bounds == list(ITL_BUCKETS)  # +Inf is `count`: JSON has no infinity
    counts = [n for _, n in itl["buckets"]]
    assert counts == sorted(counts) and counts[-1] == 12  # cumulative
    assert dict(itl["buckets"])[0.04] == 0 and dict(itl["buckets"])[0.06] == 12
    assert s["histograms"]["e2e_s"]["count"] == 3 and s["histograms"]["ttft_s"]["count"] == 3


def test_histogram_bucket_edges_are_inclusive():
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 2.0, 3.0):
        h.observe(v)
    assert h.frozen()["buckets"] == ((1.0, 2), (2.0, 4)) and h.frozen()["count"] == 5
    assert h.quantiles() == (1.5, 3.0)
    assert percentile([], 0.5) is None


def test_recent_requests_keep_the_last_fifty(metrics, clock):
    for i in range(60):
        r = make_request(clock, rid=f"r{i}")
        finish(metrics, clock, r, "cancelled")  # cancelled while waiting: never admitted
    metrics.publish(0, [], [])
    recent = metrics.current()["recent_requests"]
    assert len(recent) == 50 and recent[0]["id"] == "r59"
    assert recent[0]["ttft_s"] is None and recent[0]["decode_tokens_per_s"] is None


def test_snapshot_is_immutable_and_readers_get_copies(metrics, clock):
    r = make_request(clock)
    admit(metrics, clock, r)
    snap = metrics.publish(0, [r], [slot(0, r, 10)])
    with pytest.raises(TypeError):
        snap["running"] = 5
    with pytest.raises(TypeError):
        snap["slots"][0]["state"] = "x"
    with pytest.raises(TypeError):
        snap["requests_total"]["stop"] = 1
    view = metrics.current()
    view["slots"][0]["state"] = "scribbled"
    view["requests_total"]["stop"] = 99
    assert metrics.current()["slots"][0]["state"] == "prefill"
    assert metrics.current()["requests_total"]["stop"] == 0
    # a new publish replaces the snapshot; the old one is unchanged
    finish(metrics, clock, r)
    metrics.publish(0, [], [slot(0, None, 10)])
    assert snap["running"] == 1 and metrics.snapshot["running"] == 0
    assert metrics.current()["slots"][0]["state"] == "cached"


def test_slot_rows(metrics, clock):
    r = make_request(clock, prompt_len=30, cached=12, rid="abc")
    admit(metrics, clock, r)
    emit(metrics, clock, r, n=3)
    r.status = Status.DECODE
    metrics.publish(0, [r], [slot(0, r, 32), slot(1, None, 7), slot(2)])
    clock.now += 2
    rows = metrics.current()["slots"]
    assert rows[0] == {
        "index": 0,
        "state": "decode",
        "request_id": "abc",
        "adapter": None,
        "tokens_cached": 32,
        "prompt_tokens": 30,
        "reused_tokens": 12,
        "tokens_generated": 3,
        "age_s": pytest.approx(2.0),
    }
    assert (rows[1]["state"], rows[1]["tokens_cached"], rows[1]["request_id"], rows[1]["age_s"]) == ("cached", 7, None, None)
    assert rows[2]["state"] == "empty"


def test_history_has_one_point_a_second_for_ten_minutes(metrics, clock):
    clock.now = 1000.2
    r = make_request(clock, prompt_len=10)
    admit(metrics, clock, r)  # second 1000: 10 prompt tokens, none cached
    metrics.on_prefill(10)
    metrics.publish(2, [r], [slot(0, r, 10)])
    clock.now = 1001.5
    emit(metrics, clock, r, n=5)  # second 1001: 5 tokens
    metrics.publish(1, [r], [slot(0, r, 15)])
    clock.now = 1003.1
    r2 = make_request(clock, prompt_len=10, cached=10)
    admit(metrics, clock, r2)  # second 1003: 10 more prompt tokens, all cached
    metrics.publish(0, [], [slot(0)])  # the last word before sleeping
    clock.now = 1010.7  # asleep since 1003
    h = metrics.current()["history"]
    assert h["step_s"] == 1 and h["points"] == HISTORY_S
    for column in ("prefill_tokens_per_s", "decode_tokens_per_s", "queue_depth", "running", "prefix_reuse"):
        assert len(h[column]) == HISTORY_S
    # the last point is second 1009 (1010 is not over yet); 1000 is 10 points earlier
    at = {sec: HISTORY_S - (1010 - sec) for sec in range(999, 1010)}
    assert h["decode_tokens_per_s"][at[999]] is None  # before the engine started
    assert h["prefill_tokens_per_s"][at[1000]] == 10 and h["decode_tokens_per_s"][at[1001]] == 5
    # a gauge's point is its peak in that second, counting the value it entered the second with
    assert h["queue_depth"][at[1000]] == 2 and h["queue_depth"][at[1001]] == 2
    assert h["running"][at[1001]] == 1 and h["running"][at[1003]] == 1
    # gauges carry their last value through seconds without events; the idle ones read 0
    assert h["queue_depth"][at[1002]] == 1 and h["running"][at[1002]] == 1
    assert h["queue_depth"][at[1005]] == 0 and h["running"][at[1009]] == 0
    assert h["decode_tokens_per_s"][at[1005]] == 0
    # prefix reuse over the trailing 10 s: 0 of 10, then 10 of 20
    assert h["prefix_reuse"][at[1000]] == 0 and h["prefix_reuse"][at[1002]] == 0
    assert h["prefix_reuse"][at[1003]] == 0.5 and h["prefix_reuse"][at[1009]] == 0.5


# --- the engine's stats() around these metrics -------------------------------------------------------


@pytest.fixture
def one_slot_engine():
    """The real engine over a FakeRunner that answers token 3 forever, one slot: (engine, runner)."""
    runner = FakeRunner(vocab=8, next_token=lambda last: 3)  # token 3 forever
    with engine_over(runner, context=64, slots=1, queue_limit=4, prefill_chunk=4) as eng:
        yield eng, runner


def test_engine_stats_have_every_promised_field_and_a_live_queue(one_slot_engine):
    eng, runner = one_slot_engine
    runner.gate.clear()  # the model thread stalls inside its first step
    first = Request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0))
    eng.submit(first)
    for _ in range(500):
        if eng.stats()["running"] == 1:
            break
        threading.Event().wait(0.01)
    waiting = [Request([1, 2], SamplingParams(max_tokens=2, temperature=0.0)) for _ in range(3)]
    for r in waiting:
        eng.submit(r)
    s = eng.stats()
    assert s["queue_depth"] == 3  # counted at submit, though no snapshot was published since
    assert s["running"] == 1 and s["slots"][0]["state"] in ("prefill", "decode")
    runner.gate.set()
    assert [drain_outputs(r)[1] for r in (first, *waiting)] == ["length"] * 4
    for _ in range(500):
        s = eng.stats()
        if s["running"] == 0 and s["queue_depth"] == 0:
            break
        threading.Event().wait(0.01)
    promised = {
        "queue_depth", "running", "slots_total", "prefill_tokens_per_s", "decode_tokens_per_s",
        "prefill_tokens_per_s_avg", "decode_tokens_per_s_avg", "prefix_reuse", "prefix_reuse_total",
        "cached_tokens_total", "prompt_tokens_total", "generated_tokens_total", "requests_total",
        "ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s", "uptime_s", "model", "context", "device",
        "slots", "recent_requests", "history", "histograms", "state",
    }  # fmt: skip
    assert promised <= s.keys()
    assert s["state"] == "ok" and (s["model"], s["context"], s["device"]) == ("fake", 64, "FAKE")
    assert s["requests_total"]["length"] == 4 and s["generated_tokens_total"] == 11
    assert s["prompt_tokens_total"] == 9 and len(s["recent_requests"]) == 4
    assert s["decode_tokens_per_s"] > 0 and s["ttft_p50_s"] is not None


def test_every_finish_reason_the_engine_produces_is_counted_in_metrics():
    runner = FakeRunner(vocab=8, next_token=lambda last: 3)
    engine = Engine(lambda: LoadedModel(runner, None, None, "fake", 64, "FAKE"), slots=1, queue_limit=1, prefill_chunk=4).start()
    client = create_app({"TESTING": True}, engine=engine).test_client()
    try:
        assert wait_until(lambda: engine.state == "ok")
        runner.gate.clear()  # the first request holds the only slot, the second waits
        aborted = Request([1, 2], SamplingParams(max_tokens=5, temperature=0.0))
        engine.submit(aborted)
        assert wait_until(lambda: engine.stats()["running"] == 1)
        drained = Request([1, 2], SamplingParams(max_tokens=5, temperature=0.0))
        engine.submit(drained)
        with pytest.raises(QueueFull):  # counted as "rejected"
            engine.submit(Request([1, 2], SamplingParams(temperature=0.0)))
        engine.abort(aborted)
        drained.cancel(FinishReason.SHUTDOWN)  # what Lifecycle does when a drain runs out of time
        engine.abort(drained)
        runner.gate.set()
        reasons = [drain_outputs(aborted)[1], drain_outputs(drained)[1]]
        stopped = Request([1, 2], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=frozenset({3})))
        engine.submit(stopped)
        reasons.append(drain_outputs(stopped)[1])
        ran_out = Request([1, 2], SamplingParams(max_tokens=1, temperature=0.0))
        engine.submit(ran_out)
        reasons.append(drain_outputs(ran_out)[1])
        runner.fault = RuntimeError("injected decode fault")
        failed = Request([1, 2], SamplingParams(max_tokens=5, temperature=0.0))
        engine.submit(failed)
        reasons.append(drain_outputs(failed)[1])
        assert sorted(reasons) == sorted(FINISH_REASONS)
        assert wait_until(lambda: sum(engine.stats()["requests_total"].values()) == len(FINISH_REASONS) + 1)
        assert engine.stats()["requests_total"] == dict.fromkeys(REQUEST_OUTCOMES, 1)
        families = metric_families(client)
        counted = {s.labels["finish_reason"]: s.value for s in families["llm_requests"].samples}
        assert counted == dict.fromkeys(REQUEST_OUTCOMES, 1.0)
    finally:
        runner.gate.set()
        engine.stop(5)


def test_a_mixture_of_experts_load_is_summed_over_layers_and_said_per_layer_step():
    routed = np.array([[3, 1, 0, 0], [5, 0, 1, 2]])  # lanes each of 2 layers sent each of 4 experts
    metrics = EngineMetrics({}, clock=lambda: 0.0, routed=lambda: routed)
    metrics.on_step(), metrics.on_step()
    experts = metrics.publish(0, [], [])["experts"]
    assert experts["tokens_total"] == (8, 1, 1, 2) and experts["count"] == 4
    assert experts["per_step"] == (2.0, 0.25, 0.25, 0.5)  # lanes / (2 layers x 2 steps)
    assert experts["mean_per_step"] == 0.75 and experts["busiest"] == 0 and experts["busiest_per_step"] == 2.0
    assert experts["imbalance"] == 8 / 3
    assert "experts" not in EngineMetrics({}, clock=lambda: 0.0).publish(0, [], [])  # a dense model has none
