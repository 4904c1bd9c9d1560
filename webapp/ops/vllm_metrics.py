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
from operator import itemgetter

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
    """Aliases over `stats()` (the engine's stats dict), read once per scrape; nothing while loading.
    With a model set, `models()` gives every loaded model's stats by name, one sample each."""

    def __init__(self, stats: Callable[[], dict], models: Callable[[], dict[str, dict]] | None = None):
        self._stats, self._models = stats, models

    def collect(self) -> Iterator[Metric]:
        every = [self._stats()] if self._models is None else list(self._models().values())
        every = [stats for stats in every if counted(stats)]
        if not every:
            return

        def each(family, value: Callable[[dict], float]):
            for stats in every:
                family.add_metric([str(stats.get("model"))], value(stats))
            return family

        for name, doc, key in GAUGES:
            yield each(GaugeMetricFamily(PREFIX + name, doc, labels=[LABEL]), itemgetter(key))
        for name in KV_CACHE_GAUGES:
            yield each(GaugeMetricFamily(PREFIX + name, "KV-cache usage, 1 means 100 percent.", labels=[LABEL]), kv_cache_usage)
        for name, doc, key in COUNTERS:
            yield each(CounterMetricFamily(PREFIX + name, doc, labels=[LABEL]), itemgetter(key))
        success = CounterMetricFamily(PREFIX + "request_success", "Finished requests, by finish reason.", labels=[LABEL, "finished_reason"])
        for stats in every:
            counts: dict[str, int] = {}
            for ours, theirs in SUCCESS_REASONS.items():
                counts[theirs] = counts.get(theirs, 0) + stats["requests_total"].get(ours, 0)
            for reason, count in counts.items():
                success.add_metric([str(stats.get("model")), reason], count)
        yield success
        for name, doc, key in HISTOGRAMS:
            family = HistogramMetricFamily(PREFIX + name, doc, labels=[LABEL])
            for stats in every:
                h = stats["histograms"][key]
                family.add_metric([str(stats.get("model"))], histogram_buckets(h), h["sum"])
            yield family
