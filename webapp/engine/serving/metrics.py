"""Counters the model thread keeps, and the immutable snapshot everyone else reads.

Only the model thread calls the `on_*` methods and `publish`. `publish` swaps in a new
`EngineMetrics.snapshot` whole (one reference assignment, a read-only mapping of tuples), so a reader
never waits on the model thread and no lock is held while a page renders. Readers call `current()`,
which derives the time-dependent figures (10-second rates, ages, uptime, the 10-minute history) from
that snapshot and the clock: when the engine sleeps, its rates still fall to zero.

Token counts go into one-second buckets (a `Timeline`); rates and plots are sums over buckets.
Latencies go into `Histogram`s: cumulative bucket counts for Prometheus and a bounded sample of recent
values for percentiles.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from collections.abc import Callable
from types import MappingProxyType

from webapp.engine.serving.request import FINISH_REASONS
from webapp.engine.serving.stats_view import stats_view
from webapp.engine.serving.timeline import CACHED, DECODE, PREFILL, PROMPT, Timeline

RECENT_REQUESTS = 50
REJECTED = "rejected"  # refused at submit with a full queue: counted, though it never became a request
REQUEST_OUTCOMES = (*FINISH_REASONS, REJECTED)  # the keys of "requests_total"

# Histogram upper bounds in seconds (Prometheus `le`); +Inf is implied.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def percentile(values, q: float) -> float | None:
    """Nearest-rank percentile of `values` (q in 0..1); None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Histogram:
    """Counts per bucket (Prometheus semantics: v <= bound), their sum, and the last `keep` values."""

    def __init__(self, bounds: tuple[float, ...], keep: int = 1000):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.recent: deque[float] = deque(maxlen=keep)
        self._quantiles: tuple[float | None, float | None] | None = (None, None)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.recent.append(value)
        self._quantiles = None  # recomputed at the next publish, not on every token

    def quantiles(self) -> tuple[float | None, float | None]:
        """(p50, p95) of the recent values."""
        if self._quantiles is None:
            self._quantiles = (percentile(self.recent, 0.5), percentile(self.recent, 0.95))
        return self._quantiles

    def frozen(self) -> dict:
        """Cumulative (upper bound, count) pairs for the finite bounds; `count` is the +Inf bucket
        (JSON has no infinity)."""
        cumulative, total = [], 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            cumulative.append((bound, total))
        return {"buckets": tuple(cumulative), "count": total + self.counts[-1], "sum": self.sum}


class EngineMetrics:
    def __init__(self, static: dict, clock: Callable[[], float] = time.monotonic, routed: Callable | None = None):
        self.static = static  # model name, context, device, prefill chunk: fixed once loaded
        self.clock = clock  # time.monotonic; tests pass a fake
        self.routed = routed  # a mixture of experts' lanes per expert since load (layers, experts), or None
        self.started = clock()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.drafted_tokens = 0  # speculation: tokens drafted, and those the samples confirmed
        self.accepted_tokens = 0
        self.finished = Counter()
        self.timeline = Timeline()
        self.ttft = Histogram(TTFT_BUCKETS, keep=1000)
        self.itl = Histogram(ITL_BUCKETS, keep=5000)
        self.queue_time = Histogram(REQUEST_BUCKETS, keep=1000)
        self.e2e = Histogram(REQUEST_BUCKETS, keep=1000)
        self.recent: deque[MappingProxyType] = deque(maxlen=RECENT_REQUESTS)
        self.steps = 0
        self.last_step_at = self.started
        self.snapshot: MappingProxyType | dict = {}

    # --- the model thread's hooks ----------------------------------------------------------------

    def on_admit(self, request) -> None:
        now = self.clock()
        self.prompt_tokens += request.prompt_len
        self.cached_tokens += request.cached_tokens
        self.timeline.add(now, PROMPT, request.prompt_len)
        self.timeline.add(now, CACHED, request.cached_tokens)
        self.queue_time.observe(now - request.submitted_at)

    def on_cached(self, n: int) -> None:
        """n more prompt tokens of an admitted request came from a cache, copied from another slot."""
        self.cached_tokens += n
        self.timeline.add(self.clock(), CACHED, n)

    def on_prefill(self, n: int) -> None:
        self.prefill_tokens += n
        self.timeline.add(self.clock(), PREFILL, n)

    def on_token(self, request, now: float) -> None:
        """Called before the engine stamps `first_token_at` / `last_token_at` for this token."""
        self.generated_tokens += 1
        self.timeline.add(now, DECODE, 1)
        if request.first_token_at is None:
            self.ttft.observe(now - request.submitted_at)
        elif request.last_token_at is not None:
            self.itl.observe(now - request.last_token_at)

    def on_drafts(self, drafted: int, accepted: int) -> None:
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted

    def on_finish(self, request) -> None:
        self.finished[request.finish_reason] += 1
        end = request.finished_at or self.clock()
        self.e2e.observe(end - request.submitted_at)
        generated = len(request.output_ids)
        decode_s = end - request.first_token_at if request.first_token_at else 0.0
        admitted = request.admitted_at
        self.recent.appendleft(
            MappingProxyType(
                {
                    "id": request.id,
                    "prompt_tokens": request.prompt_len,
                    "cached_tokens": request.cached_tokens,
                    "generated_tokens": generated,
                    "drafted_tokens": request.drafted_tokens,
                    "accepted_tokens": request.accepted_tokens,
                    "queue_wait_s": (admitted or end) - request.submitted_at,
                    "ttft_s": (request.first_token_at - request.submitted_at) if request.first_token_at else None,
                    "decode_tokens_per_s": (generated - 1) / decode_s if generated > 1 and decode_s > 0 else None,
                    "e2e_s": end - request.submitted_at,
                    "finish_reason": request.finish_reason,
                }
            )
        )

    def on_step(self) -> None:
        self.steps += 1
        self.last_step_at = self.clock()

    def publish(
        self, waiting: int, running: list, slots: list, kv_pool: dict | None = None, state_snapshots: dict | None = None
    ) -> MappingProxyType:
        """Freeze the counters and the slot table (and a paged cache's pool: Scheduler.kv_pool; a
        recurrent model's state snapshots: Scheduler.state_snapshots) into a new read-only snapshot."""
        now = self.clock()
        self.timeline.gauges(now, waiting, len(running))
        ttft, itl, queue_time = self.ttft.quantiles(), self.itl.quantiles(), self.queue_time.quantiles()
        snap = {
            **self.static,
            "published_at": now,
            "started_at": self.started,
            "queue_depth": waiting,
            "running": len(running),
            "slots_total": len(slots),
            "cached_tokens_total": self.cached_tokens,
            "prompt_tokens_total": self.prompt_tokens,
            "prefill_tokens_total": self.prefill_tokens,
            "generated_tokens_total": self.generated_tokens,
            "drafted_tokens_total": self.drafted_tokens,
            "accepted_tokens_total": self.accepted_tokens,
            "requests_total": MappingProxyType({r: self.finished[r] for r in REQUEST_OUTCOMES}),
            "ttft_p50_s": ttft[0],
            "ttft_p95_s": ttft[1],
            "itl_p50_s": itl[0],
            "itl_p95_s": itl[1],
            "queue_wait_p50_s": queue_time[0],
            "queue_wait_p95_s": queue_time[1],
            "steps_total": self.steps,
            "last_step_at": self.last_step_at,
            "slots": tuple(_slot(s) for s in slots),
            "recent_requests": tuple(self.recent),
            "timeline": self.timeline.frozen(),
            "histograms": MappingProxyType(
                {
                    "ttft_s": self.ttft.frozen(),
                    "itl_s": self.itl.frozen(),
                    "queue_time_s": self.queue_time.frozen(),
                    "e2e_s": self.e2e.frozen(),
                }
            ),
        }
        if kv_pool is not None:
            snap["kv_pool"] = MappingProxyType(kv_pool)
        if state_snapshots is not None:
            snap["state_snapshots"] = MappingProxyType(state_snapshots)
        routed = self.routed() if self.routed is not None else None
        if routed is not None:
            snap["experts"] = expert_load(routed, self.steps)
        self.snapshot = MappingProxyType(snap)
        return self.snapshot

    # --- any thread --------------------------------------------------------------------------------

    def current(self, now: float | None = None) -> dict:
        """The latest snapshot brought up to `now`, as a fresh JSON-ready dict ({} before the first
        publish). Reads only the immutable snapshot, so it is safe from any thread."""
        return stats_view(self.snapshot, self.clock() if now is None else now)


def _slot(slot) -> MappingProxyType:
    owner = slot.owner
    return MappingProxyType(
        {
            "index": slot.index,
            "state": owner.status.value if owner is not None else ("cached" if slot.tokens else "empty"),
            "request_id": owner.id if owner is not None else None,
            "adapter": owner.lora.name if owner is not None and owner.lora is not None else None,
            # positions the slot's KV cache holds now (prompt and output so far, or what an idle slot keeps)
            "tokens_cached": len(slot.tokens),
            "prompt_tokens": owner.prompt_len if owner is not None else None,
            # the owner's prompt tokens found in this cache at admission (Request.cached_tokens)
            "reused_tokens": owner.cached_tokens if owner is not None else None,
            "tokens_generated": len(owner.output_ids) if owner is not None else 0,
            "submitted_at": owner.submitted_at if owner is not None else None,
        }
    )


def expert_load(routed, steps: int) -> MappingProxyType:
    """A mixture of experts' load at a glance from its lanes per expert since load (layers, experts):
    each expert's lanes summed over layers, the lanes an expert takes in a layer's step (mean, and the
    busiest expert's), and the busiest over the mean (1 when the router spreads tokens evenly)."""
    totals = routed.sum(axis=0)
    layer_steps = max(1, routed.shape[0] * steps)
    mean = float(totals.mean())
    busiest = int(totals.argmax())
    return MappingProxyType(
        {
            "count": len(totals),
            "tokens_total": tuple(int(n) for n in totals),
            "per_step": tuple(float(n) / layer_steps for n in totals),
            "mean_per_step": mean / layer_steps,
            "busiest": busiest,
            "busiest_per_step": float(totals[busiest]) / layer_steps,
            "imbalance": float(totals[busiest]) / mean if mean else None,
        }
    )


def counted(stats: dict) -> bool:
    """Whether `engine.stats()` carries counters: a loading or failed engine's stats hold only its state."""
    return "slots_total" in stats
