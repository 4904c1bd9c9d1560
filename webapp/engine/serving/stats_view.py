"""What a metrics snapshot says at a given moment: the dict `engine.stats()` returns, that the pages,
/health and /metrics read.

Contract: `stats_view(snapshot, now)` derives the time-dependent figures (10-second rates, ages,
uptime, the 10-minute history) from an immutable snapshot and the clock, so when the engine sleeps
its rates still fall to zero. Pure: no locks, no engine state.
"""

from __future__ import annotations

from collections import deque

from webapp.engine.serving.timeline import (
    CACHED,
    DECODE,
    HISTORY_S,
    PREFILL,
    PROMPT,
    QUEUE_LAST,
    QUEUE_MAX,
    RUNNING_LAST,
    RUNNING_MAX,
    SEC,
    WINDOW_S,
)


def stats_view(snap, now: float) -> dict:
    """A snapshot as the pages and /metrics see it at monotonic time `now`: plain dicts and lists,
    rates over the last WINDOW_S seconds and since start, slot ages and the per-second history."""
    if not snap:
        return {}
    timeline = snap["timeline"]
    uptime = max(now - snap["started_at"], 1e-9)
    # whole seconds int(now)-WINDOW_S+1 .. now: between WINDOW_S-1 and WINDOW_S seconds, never more than uptime
    first = int(now) - WINDOW_S + 1
    span = min(now - first, uptime)
    window = [b for b in timeline if b[SEC] >= first]
    prompt, cached = sum(b[PROMPT] for b in window), sum(b[CACHED] for b in window)
    out = {k: v for k, v in snap.items() if k not in _RAW_KEYS}
    out.update(
        uptime_s=uptime,
        prefill_tokens_per_s=sum(b[PREFILL] for b in window) / span,
        decode_tokens_per_s=sum(b[DECODE] for b in window) / span,
        prefill_tokens_per_s_avg=snap["prefill_tokens_total"] / uptime,
        decode_tokens_per_s_avg=snap["generated_tokens_total"] / uptime,
        prefix_reuse=cached / prompt if prompt else None,
        prefix_reuse_total=snap["cached_tokens_total"] / snap["prompt_tokens_total"] if snap["prompt_tokens_total"] else None,
        seconds_since_step=now - snap["last_step_at"],
        kv_tokens=sum(s["tokens_cached"] for s in snap["slots"]),
        requests_total=dict(snap["requests_total"]),
        slots=[_slot_view(s, now) for s in snap["slots"]],
        recent_requests=[dict(r) for r in snap["recent_requests"]],
        history=history(timeline, now, snap["started_at"]),
        histograms={name: {**h, "buckets": [list(b) for b in h["buckets"]]} for name, h in snap["histograms"].items()},
    )
    if "kv_pool" in snap:
        out["kv_pool"] = dict(snap["kv_pool"])
    if "state_snapshots" in snap:
        out["state_snapshots"] = dict(snap["state_snapshots"])
    if "experts" in snap:
        out["experts"] = {k: list(v) if isinstance(v, tuple) else v for k, v in snap["experts"].items()}
    return out


_RAW_KEYS = frozenset({"published_at", "started_at", "last_step_at", "timeline"})


def _slot_view(slot, now: float) -> dict:
    view = {k: v for k, v in slot.items() if k != "submitted_at"}
    view["age_s"] = now - slot["submitted_at"] if slot["submitted_at"] is not None else None
    return view


def history(timeline: tuple[tuple, ...], now: float, started: float) -> dict:
    """The last HISTORY_S complete seconds as columns, oldest first; None before the engine started.

    Token rates are that second's totals; queue depth and running are the peak seen in that second;
    prefix reuse is over the WINDOW_S seconds ending there (None when no prompt was admitted)."""
    by_sec = {b[SEC]: b for b in timeline}
    end = int(now)  # the current second is incomplete: leave it out
    first = end - HISTORY_S
    lead_in = first - WINDOW_S + 1  # seconds before the range that the first prefix-reuse value covers
    start_sec = int(started)
    cols = {k: [] for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "queue_depth", "running", "prefix_reuse")}
    # gauges carry over seconds without a bucket: start from the last value before the lead-in
    earlier = [b for b in timeline if b[SEC] < lead_in]
    queue, running = (earlier[-1][QUEUE_LAST], earlier[-1][RUNNING_LAST]) if earlier else (0, 0)
    prompts: deque[int] = deque()
    cached: deque[int] = deque()
    for sec in range(lead_in, end):
        b = by_sec.get(sec)
        prompts.append(b[PROMPT] if b else 0)
        cached.append(b[CACHED] if b else 0)
        if len(prompts) > WINDOW_S:
            prompts.popleft()
            cached.popleft()
        peak_queue, peak_running = (b[QUEUE_MAX], b[RUNNING_MAX]) if b else (queue, running)
        if b is not None:
            queue, running = b[QUEUE_LAST], b[RUNNING_LAST]
        if sec < first:
            continue
        if sec < start_sec:
            for col in cols.values():
                col.append(None)
            continue
        cols["prefill_tokens_per_s"].append(b[PREFILL] if b else 0)
        cols["decode_tokens_per_s"].append(b[DECODE] if b else 0)
        cols["queue_depth"].append(peak_queue)
        cols["running"].append(peak_running)
        p = sum(prompts)
        cols["prefix_reuse"].append(round(sum(cached) / p, 4) if p else None)
    return {"step_s": 1, "points": HISTORY_S, **cols}
