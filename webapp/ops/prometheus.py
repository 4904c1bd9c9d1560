"""The engine's counters as Prometheus metric families, for `GET /metrics` (`webapp.http.metrics`).

`EngineCollector` turns a fresh `engine.stats()` into metric families at every scrape. Names share
the `llm_` prefix, after vLLM's `vllm:` ones; with `METRICS_COMPAT` "vllm" (`LLM_METRICS_COMPAT=vllm`)
`webapp.ops.vllm_metrics` adds vLLM's own names beside them, for gateways and dashboards that read
those. Counters are exposed with the `_total` suffix; token counts are in tokens, times in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from operator import itemgetter

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from webapp.engine.serving.metrics import REQUEST_OUTCOMES, counted

PREFIX = "llm_"

# name (without prefix), help, key in engine.stats()
GAUGES = (
    ("num_requests_waiting", "Requests waiting for a slot.", "queue_depth"),
    ("num_requests_running", "Requests holding a slot (prefilling or decoding).", "running"),
    ("num_slots", "Slots: requests the engine decodes together.", "slots_total"),
)
COUNTERS = (
    ("prompt_tokens", "Prompt tokens of admitted requests.", "prompt_tokens_total"),
    ("prefill_tokens", "Prompt tokens run through the model (prompt tokens not served from the cache).", "prefill_tokens_total"),
    ("generation_tokens", "Generated tokens.", "generated_tokens_total"),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prompt_tokens_total"),
    ("prefix_cache_hits", "Prompt tokens served from the prefix cache instead of prefilled.", "cached_tokens_total"),
    ("draft_tokens", "Tokens drafted for speculative decoding (prompt lookup).", "drafted_tokens_total"),
    ("draft_accepted_tokens", "Drafted tokens that sampling confirmed (each saved a decode step).", "accepted_tokens_total"),
)
HISTOGRAMS = (
    ("time_to_first_token_seconds", "Time from submission to the first generated token.", "ttft_s"),
    ("inter_token_latency_seconds", "Time between consecutive generated tokens of a request.", "itl_s"),
    ("request_queue_time_seconds", "Time from submission until a slot was free.", "queue_time_s"),
    ("e2e_request_latency_seconds", "Time from submission until the request finished, for any reason.", "e2e_s"),
)


class EngineCollector:
    """A custom collector over `stats()` (the engine's stats dict), read once per scrape. With a model
    set (LLM_MODELS_DIR), `models()` gives every loaded model's stats dict by name instead, and each
    family carries a `model` label (`llm_model_info` names the model already)."""

    def __init__(self, stats: Callable[[], dict], models: Callable[[], dict[str, dict]] | None = None):
        self._stats, self._models = stats, models

    def collect(self) -> Iterator[Metric]:
        if self._models is None:
            return engine_families({(): self._stats()}, ())
        return engine_families({(name,): stats for name, stats in self._models().items()}, ("model",))


def engine_families(rows: dict[tuple[str, ...], dict], labels: tuple[str, ...]) -> Iterator[Metric]:
    """The metric families of engines' stats, one sample per engine, told apart by `labels`."""
    ready = GaugeMetricFamily(PREFIX + "engine_ready", "1 when the model is loaded and serving, else 0.", labels=labels)
    for key, stats in rows.items():
        ready.add_metric(key, 1.0 if stats.get("state") == "ok" else 0.0)
    yield ready
    rows = {key: stats for key, stats in rows.items() if counted(stats)}
    if not rows:
        return
    info = InfoMetricFamily(PREFIX + "model", "The model being served.")
    for stats in rows.values():
        info.add_metric([], {"model": str(stats.get("model")), "device": str(stats.get("device")), "context": str(stats.get("context"))})
    yield info

    def each(family, value: Callable[[dict], float]):
        for key, stats in rows.items():
            family.add_metric(key, value(stats))
        return family

    for name, doc, key in GAUGES:
        yield each(GaugeMetricFamily(PREFIX + name, doc, labels=labels), itemgetter(key))
    usage = "Share of the KV cache holding tokens: a pool's blocks running requests hold, or slots x context (idle slots' kept tokens included)."
    yield each(GaugeMetricFamily(PREFIX + "kv_cache_usage_ratio", usage, labels=labels), kv_cache_usage)
    for name, doc, key in COUNTERS:
        yield each(CounterMetricFamily(PREFIX + name, doc, labels=labels), itemgetter(key))
    finished = CounterMetricFamily(
        PREFIX + "requests", "Requests ended, by finish reason (rejected: refused with a full queue).", labels=[*labels, "finish_reason"]
    )
    for key, stats in rows.items():
        for reason in REQUEST_OUTCOMES:
            finished.add_metric([*key, reason], stats["requests_total"].get(reason, 0))
    yield finished
    for name, doc, hist in HISTOGRAMS:
        family = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
        for key, stats in rows.items():
            h = stats["histograms"][hist]
            family.add_metric(key, histogram_buckets(h), h["sum"])
        yield family
    pools = {key: stats["kv_pool"] for key, stats in rows.items() if "kv_pool" in stats}
    if pools:
        yield from kv_pool_families(pools, labels)
    states = {key: stats["state_snapshots"] for key, stats in rows.items() if "state_snapshots" in stats}
    if states:
        yield from state_snapshot_families(states, labels)
    experts = {key: stats["experts"] for key, stats in rows.items() if "experts" in stats}
    if experts:
        yield from expert_families(experts, labels)


def kv_pool_families(rows: dict[tuple[str, ...], dict], labels: tuple[str, ...] = ()) -> Iterator[Metric]:
    """A paged KV cache's pool: its blocks by state, those several sequences share, and preemptions."""
    blocks = GaugeMetricFamily(
        PREFIX + "kv_blocks",
        "KV-cache blocks: used (held by running requests), cached (held by none, kept for prefix reuse), free.",
        labels=[*labels, "state"],
    )
    shared = GaugeMetricFamily(PREFIX + "kv_blocks_shared", "KV-cache blocks more than one request holds.", labels=labels)
    preempted = CounterMetricFamily(
        PREFIX + "preemptions", "Requests that gave their KV blocks back when the pool ran out, computed again later.", labels=labels
    )
    for key, pool in rows.items():
        for state in ("used", "cached", "free"):
            blocks.add_metric([*key, state], pool[f"blocks_{state}"])
        shared.add_metric(key, pool["blocks_shared"])
        preempted.add_metric(key, pool["preemptions_total"])
    yield from (blocks, shared, preempted)


def state_snapshot_families(rows: dict[tuple[str, ...], dict], labels: tuple[str, ...] = ()) -> Iterator[Metric]:
    """A recurrent model's snapshots of its states, kept for prefix reuse: rows, those held, taken and restored."""
    rows_of = GaugeMetricFamily(
        PREFIX + "state_snapshots", "Rows for snapshots of a recurrent model's states: held (valid) or total.", labels=[*labels, "state"]
    )
    taken = CounterMetricFamily(
        PREFIX + "state_snapshots_taken", "Snapshots of a slot's states taken where a chunk ended at a mark.", labels=labels
    )
    restored = CounterMetricFamily(
        PREFIX + "state_snapshots_restored", "Prompts that started from a snapshot of the states.", labels=labels
    )
    for key, states in rows.items():
        rows_of.add_metric([*key, "held"], states["held"])
        rows_of.add_metric([*key, "total"], states["rows"])
        taken.add_metric(key, states["taken_total"])
        restored.add_metric(key, states["restored_total"])
    yield from (rows_of, taken, restored)


def expert_families(rows: dict[tuple[str, ...], dict], labels: tuple[str, ...] = ()) -> Iterator[Metric]:
    """A mixture of experts' routing: lanes per expert (summed over layers) and how uneven they are."""
    tokens = CounterMetricFamily(
        PREFIX + "expert_tokens", "Token lanes the routers sent to each expert, summed over layers.", labels=[*labels, "expert"]
    )
    for key, experts in rows.items():
        for expert, n in enumerate(experts["tokens_total"]):
            tokens.add_metric([*key, str(expert)], n)
    yield tokens
    imbalance = GaugeMetricFamily(
        PREFIX + "expert_load_imbalance", "The busiest expert's lanes over the mean expert's, since load (1: even).", labels=labels
    )
    for key, experts in rows.items():
        if experts["imbalance"] is not None:
            imbalance.add_metric(key, experts["imbalance"])
    if imbalance.samples:
        yield imbalance


def kv_cache_usage(stats: dict) -> float:
    """Share of the KV cache holding tokens, from 0 to 1: a pool's blocks that running requests hold,
    or the slots' positions (slots x context) holding tokens, idle slots kept for reuse included."""
    if "kv_pool" in stats:
        pool = stats["kv_pool"]
        return pool["blocks_used"] / pool["blocks_total"] if pool["blocks_total"] else 0.0
    context, slots = stats.get("context") or 0, stats["slots_total"]
    return stats.get("kv_tokens", 0) / (slots * context) if slots and context else 0.0


def histogram_buckets(h: dict) -> list[tuple[str, int]]:
    """A stats histogram's cumulative buckets as Prometheus wants them, `+Inf` last."""
    return [(repr(float(le)), count) for le, count in h["buckets"]] + [("+Inf", h["count"])]
