"""Per-second buckets of what the engine did, kept for the rates and the dashboard's plots.

The model thread adds to the current second's bucket; `frozen()` is the immutable tuple of buckets a
snapshot holds, read by `webapp.engine.serving.stats_view`.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 10  # "recent" rates and prefix reuse
HISTORY_S = 600  # one-second samples kept for the plots

# Layout of a timeline bucket: counters are summed within the second, gauges keep peak and last.
SEC, PREFILL, DECODE, PROMPT, CACHED, QUEUE_MAX, RUNNING_MAX, QUEUE_LAST, RUNNING_LAST = range(9)


class Timeline:
    """One bucket per second: prefill / decode / admitted prompt / cache-served tokens, and queue
    depth and running requests (peak and last value seen). Seconds without any event have no bucket:
    nothing happened, and the gauges kept their last value."""

    def __init__(self):
        self.closed: deque[tuple] = deque(maxlen=HISTORY_S + WINDOW_S)
        self.current: list | None = None
        self._closed_tuple: tuple = ()  # rebuilt once a second, not at every publish

    def bucket(self, now: float) -> list:
        sec = int(now)
        if self.current is None or self.current[SEC] != sec:
            queue, running = (self.current[QUEUE_LAST], self.current[RUNNING_LAST]) if self.current else (0, 0)
            if self.current is not None:
                self.closed.append(tuple(self.current))
                self._closed_tuple = tuple(self.closed)
            self.current = [sec, 0, 0, 0, 0, queue, running, queue, running]
        return self.current

    def add(self, now: float, field: int, n: int) -> None:
        self.bucket(now)[field] += n

    def gauges(self, now: float, queue: int, running: int) -> None:
        b = self.bucket(now)
        b[QUEUE_MAX], b[RUNNING_MAX] = max(b[QUEUE_MAX], queue), max(b[RUNNING_MAX], running)
        b[QUEUE_LAST], b[RUNNING_LAST] = queue, running

    def frozen(self) -> tuple[tuple, ...]:
        return self._closed_tuple + ((tuple(self.current),) if self.current else ())
