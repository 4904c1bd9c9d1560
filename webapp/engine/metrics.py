"""Counters the model thread keeps, and the immutable snapshot everyone else reads.

Only the model thread calls the `on_*` methods; pages and /metrics read `EngineMetrics.snapshot`,
a plain dict swapped in whole (an atomic reference assignment), so no reader ever waits on the model
thread and no lock is held while a page renders.
"""

from __future__ import annotations

import time
from collections import Counter, deque

WINDOW_S = 10.0


def percentile(values, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class RateWindow:
    """Token counts over the last WINDOW_S seconds."""

    def __init__(self):
        self.events: deque[tuple[float, int]] = deque()

    def add(self, now: float, n: int) -> None:
        self.events.append((now, n))

    def rate(self, now: float) -> float:
        while self.events and self.events[0][0] < now - WINDOW_S:
            self.events.popleft()
        return sum(n for _, n in self.events) / WINDOW_S


class EngineMetrics:
    def __init__(self, static: dict):
        self.static = static  # model name, context, device, slots: fixed for the process lifetime
        self.started = time.monotonic()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.finished = Counter()
        self.prefill_window, self.decode_window = RateWindow(), RateWindow()
        self.prompt_window, self.cached_window = RateWindow(), RateWindow()
        self.ttft: deque[float] = deque(maxlen=1000)
        self.itl: deque[float] = deque(maxlen=5000)
        self.queue_wait: deque[float] = deque(maxlen=1000)
        self.recent: deque[dict] = deque(maxlen=50)
        self.steps = 0
        self.last_step_at = time.monotonic()
        self.snapshot: dict = {}

    def on_admit(self, request) -> None:
        now = time.monotonic()
        self.prompt_tokens += request.prompt_len
        self.cached_tokens += request.cached_tokens
        self.prompt_window.add(now, request.prompt_len)
        self.cached_window.add(now, request.cached_tokens)
        self.queue_wait.append(now - request.submitted_at)

    def on_prefill(self, n: int) -> None:
        self.prefill_tokens += n
        self.prefill_window.add(time.monotonic(), n)

    def on_token(self, request, now: float) -> None:
        self.generated_tokens += 1
        self.decode_window.add(now, 1)
        if request.first_token_at is None:
            self.ttft.append(now - request.submitted_at)
        elif request.last_token_at is not None:
            self.itl.append(now - request.last_token_at)

    def on_rejected(self) -> None:
        self.finished["rejected"] += 1

    def on_finish(self, request) -> None:
        self.finished[request.finish_reason] += 1
        end = request.finished_at or time.monotonic()
        decode_s = end - request.first_token_at if request.first_token_at else 0.0
        self.recent.appendleft(
            {
                "id": request.id,
                "prompt_tokens": request.prompt_len,
                "cached_tokens": request.cached_tokens,
                "generated_tokens": len(request.output_ids),
                "queue_wait_s": (request.admitted_at - request.submitted_at) if request.admitted_at else end - request.submitted_at,
                "ttft_s": (request.first_token_at - request.submitted_at) if request.first_token_at else None,
                "decode_tokens_per_s": (len(request.output_ids) - 1) / decode_s if decode_s > 0 else None,
                "finish_reason": request.finish_reason,
            }
        )

    def on_step(self) -> None:
        self.steps += 1
        self.last_step_at = time.monotonic()

    def publish(self, waiting: int, running: list, slots: list) -> dict:
        now = time.monotonic()
        prompt_recent = self.prompt_window.rate(now)
        snap = {
            **self.static,
            "uptime_s": now - self.started,
            "queue_depth": waiting,
            "running": len(running),
            "slots_total": len(slots),
            "prefill_tokens_per_s": self.prefill_window.rate(now),
            "decode_tokens_per_s": self.decode_window.rate(now),
            "prefill_tokens_per_s_avg": self.prefill_tokens / max(now - self.started, 1e-9),
            "decode_tokens_per_s_avg": self.generated_tokens / max(now - self.started, 1e-9),
            "prefix_reuse": self.cached_window.rate(now) / prompt_recent if prompt_recent else None,
            "prefix_reuse_total": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "cached_tokens_total": self.cached_tokens,
            "prompt_tokens_total": self.prompt_tokens,
            "prefill_tokens_total": self.prefill_tokens,
            "generated_tokens_total": self.generated_tokens,
            "requests_total": {r: self.finished[r] for r in ("stop", "length", "cancelled", "error", "rejected")},
            "ttft_p50_s": percentile(self.ttft, 0.5),
            "ttft_p95_s": percentile(self.ttft, 0.95),
            "itl_p50_s": percentile(self.itl, 0.5),
            "itl_p95_s": percentile(self.itl, 0.95),
            "queue_wait_p50_s": percentile(self.queue_wait, 0.5),
            "steps_total": self.steps,
            "seconds_since_step": now - self.last_step_at,
            "slots": [
                {
                    "index": s.index,
                    "state": s.owner.status.value if s.owner is not None else ("cached" if s.tokens else "empty"),
                    "request_id": s.owner.id if s.owner is not None else None,
                    "tokens_cached": len(s.tokens),
                    "tokens_generated": len(s.owner.output_ids) if s.owner is not None else 0,
                    "age_s": now - s.owner.submitted_at if s.owner is not None else None,
                }
                for s in slots
            ],
            "recent_requests": list(self.recent),
        }
        self.snapshot = snap
        return snap
