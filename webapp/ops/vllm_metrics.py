"""`LLM_METRICS_COMPAT=vllm`: the engine's metrics again under vLLM's names, beside our `llm_` ones.

Gateways, autoscalers and dashboards built for vLLM read fixed names: the Gateway API Inference
Extension's endpoint picker scores replicas by `vllm:num_requests_waiting`,
`vllm:num_requests_running` and `vllm:kv_cache_usage_perc` (its "model server protocol"); KEDA or
an HPA through prometheus-adapter scale on the same gauges; the common vLLM Grafana dashboards read
the token counters, `vllm:request_success_total` and the latency histograms. Every alias carries
vLLM's `model_name` label, which those dashboards filter on.

Only what we measure is exported, with vLLM's meaning: `*_perc` is a fraction from 0 to 1 (as in
vLLM), prefix-cache queries and hits count tokens (as in vLLM), `request_success_total` counts
finished requests by vLLM's reasons (our `cancelled` and `shutdown` are its `abort`; errors and
rejections are not successes). Older names that still-deployed dashboards and pickers read (`gpu_cache_usage_perc`,
`time_per_output_token_seconds`) are exported too. Nothing vLLM has and we do not (preemptions,
LoRA, speculative decoding) is faked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from webapp.engine.serving.metrics import counted
from webapp.engine.serving.request import FinishReason
from webapp.ops.prometheus import histogram_buckets, kv_cache_usage

MODES = ("vllm",)  # accepted values of LLM_METRICS_COMPAT
PREFIX = "vllm:"
LABEL = "model_name"

# vLLM name (without prefix), help, key in engine.stats()
GAUGES = (
    ("num_requests_waiting", "Requests waiting to be processed.", "queue_depth"),
    ("num_requests_running", "Requests in model execution batches.", "running"),
)
KV_CACHE_GAUGES = ("kv_cache_usage_perc", "gpu_cache_usage_perc")  # the newer name, then the older
COUNTERS = (
    ("prompt_tokens", "Prefill tokens processed (prompt tokens of admitted requests).", "prompt_tokens_total"),
    ("generation_tokens", "Generation tokens processed.", "generated_tokens_total"),
    ("prefix_cache_queries", "Prefix cache queries, in prompt tokens.", "prompt_tokens_total"),
    ("prefix_cache_hits", "Prefix cache hits, in prompt tokens.", "cached_tokens_total"),
)
# vLLM's finished_reason label value for each of ours that counts as a success
SUCCESS_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
    FinishReason.SHUTDOWN: "abort",
}
HISTOGRAMS = (
    ("time_to_first_token_seconds", "Time to first token in seconds.", "ttft_s"),
    ("inter_token_latency_seconds", "Inter-token latency in seconds.", "itl_s"),
    ("time_per_output_token_seconds", "Time per output token in seconds (the older name of inter-token latency).", "itl_s"),
    ("request_queue_time_seconds", "Time spent waiting in the queue, in seconds.", "queue_time_s"),
    ("e2e_request_latency_seconds", "End-to-end request latency in seconds.", "e2e_s"),
)


class VllmCollector:
    """Aliases over `stats()` (the engine's stats dict), read once per scrape; nothing while loading."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if not counted(stats):
            return
        model = [str(stats.get("model"))]
        for name, doc, key in GAUGES:
            yield _with(GaugeMetricFamily(PREFIX + name, doc, labels=[LABEL]), model, stats[key])
        usage = kv_cache_usage(stats)
        for name in KV_CACHE_GAUGES:
            yield _with(GaugeMetricFamily(PREFIX + name, "KV-cache usage, 1 means 100 percent.", labels=[LABEL]), model, usage)
        for name, doc, key in COUNTERS:
            yield _with(CounterMetricFamily(PREFIX + name, doc, labels=[LABEL]), model, stats[key])
        success = CounterMetricFamily(PREFIX + "request_success", "Finished requests, by finish reason.", labels=[LABEL, "finished_reason"])
        counts: dict[str, int] = {}
        for ours, theirs in SUCCESS_REASONS.items():
            counts[theirs] = counts.get(theirs, 0) + stats["requests_total"].get(ours, 0)
        for reason, count in counts.items():
            success.add_metric(model + [reason], count)
        yield success
        for name, doc, key in HISTOGRAMS:
            h = stats["histograms"][key]
            family = HistogramMetricFamily(PREFIX + name, doc, labels=[LABEL])
            family.add_metric(model, histogram_buckets(h), h["sum"])
            yield family


def _with(family, labels: list[str], value: float):
    family.add_metric(labels, value)
    return family
