"""The dashboard: `/admin` (a Jinja page) and `/admin/stats.json` (what the page polls).
With LLM_MODELS_DIR the panels are one model's (`?model=<name>`, else the most recently used one)
and a Models table lists every model of the folder with its status (loaded, loading, unloaded, failed).
While LLM_MODEL=hf:... is being fetched, the header says which file and how much of it has come.

Both read `engine.stats()`, a fresh dict derived from the engine's immutable metrics snapshot, so
they answer at once however busy the model thread is. The page is complete without JavaScript:
tiles, tables and the SVG plots are rendered here, and a `<noscript>` refresh reloads it every few
seconds. With JavaScript, `static/admin.js` polls stats.json every second and redraws the same
elements (those marked `data-stat`, the tables and the plots) from the JSON.

The family owns /admin and declares the admin token as its guard (`webapp.http.auth.require_admin`,
enforced by `webapp.http.families` before any view, unknown routes under /admin included); it is not
drained.
"""

from __future__ import annotations

import math

from flask import (
    Response,
    current_app,
    jsonify,
    make_response,
    render_template,
    request,
)

from webapp.engine.serving import adapters, hub_pull
from webapp.engine.serving.metrics import REQUEST_OUTCOMES
from webapp.engine.serving.model_set import ModelSet
from webapp.http.families import ADMIN_TOKEN, Family
from webapp.http.headers import PAGE_CSP

bp = Family("admin", __name__, guard=ADMIN_TOKEN, drained=False, owns=("/admin",), url_prefix="/admin")

PLOT_W, PLOT_H = 600, 100  # SVG user units of a plot; one x unit per second of history
NO_VALUE = "–"


@bp.get("")
def dashboard():
    """The dashboard page, rendered with the current numbers (it works without JavaScript)."""
    stats = _engine_stats()
    html = render_template(
        "admin.html",
        stats=stats,
        format_value=format_value,
        get=lookup,
        request_outcomes=REQUEST_OUTCOMES,
        plots=plots(stats),
        slot_rows=[slot_row(s, stats.get("context")) for s in stats.get("slots", [])],
        expert_bars=expert_bars(stats.get("experts")),
    )
    return _no_store(make_response(html))


@bp.get("/stats.json")
def stats_json():
    """`engine.stats()` as JSON: counters, rates, percentiles, slots, recent requests, history."""
    return _no_store(jsonify(_engine_stats()))


def _engine_stats() -> dict:
    served = current_app.extensions["engine"]
    if isinstance(served, ModelSet):  # the panels are one model's: ?model=, else the most recently used
        return served.stats(request.args.get("model"))
    stats = served.stats()
    if stats.get("state") == "loading" and (download := hub_pull.progress()):
        stats["download"] = download  # LLM_MODEL=hf:...: its files are still coming
    if listing := adapters.listing_of(served):
        stats["adapters"] = listing
    return stats


def _no_store(response: Response) -> Response:
    response.headers["Cache-Control"] = "no-store"
    response.headers["Content-Security-Policy"] = PAGE_CSP  # the JSON too
    return response


# --- what the template renders; static/admin.js mirrors each of these -------------------------------


def lookup(stats: dict, path: str):
    """`stats["a"]["b"]` for path "a.b"; None when any part is missing."""
    value = stats
    for key in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def format_value(value, kind: str = "int") -> str:
    """A number as the dashboard shows it: int, rate (tok/s), ratio (two decimals), pct (0..1), bytes,
    latency (s) or duration (s)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return NO_VALUE
    if kind == "text":
        return str(value)
    if kind == "int":
        return f"{int(value):,}"
    if kind == "rate":
        return f"{value:,.1f}" if value < 10 else f"{value:,.0f}"
    if kind == "ratio":
        return f"{value:,.2f}"
    if kind == "pct":
        return f"{value * 100:.0f}%"
    if kind == "bytes":
        return f"{value / 2**30:,.2f} GiB" if value >= 2**30 else f"{value / 2**20:,.1f} MiB"
    if kind == "latency":
        if value < 1:
            return f"{value * 1000:.0f} ms"
        if value < 60:
            return f"{value:.2f} s"
        kind = "duration"
    if kind == "duration":
        total = int(value)
        if total < 60:
            return f"{total} s"
        if total < 3600:
            return f"{total // 60}m {total % 60:02d}s"
        return f"{total // 3600}h {total % 3600 // 60:02d}m"
    raise ValueError(f"unknown format {kind!r}")


EXPERT_BAR_H = 40  # SVG user units of the experts' bars; one x unit an expert


def expert_bars(experts: dict | None) -> list[dict]:
    """A mixture of experts' bars: each expert's lanes a layer step, as a height in EXPERT_BAR_H
    (the busiest expert's full height). static/admin.js's drawExperts draws the same."""
    if not experts:
        return []
    top = max(experts["per_step"]) or 1.0
    return [{"expert": e, "per_step": v, "height": EXPERT_BAR_H * v / top} for e, v in enumerate(experts["per_step"])]


def nice_max(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is >= value (at least 1)."""
    if value <= 1:
        return 1
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 5, 10) if value <= m * power)


def plot_paths(values: list, y_max: float) -> tuple[str, str]:
    """SVG path data (line, filled area) for one series; None values break the line."""
    line, area, run = [], [], []

    def close_run():
        if run:
            line.append("M" + " L".join(f"{x},{y}" for x, y in run))
            area.append(f"M{run[0][0]},{PLOT_H} L" + " L".join(f"{x},{y}" for x, y in run) + f" L{run[-1][0]},{PLOT_H} Z")
            run.clear()

    offset = PLOT_W - len(values)  # the newest value sits at the right edge
    for i, value in enumerate(values):
        if value is None:
            close_run()
            continue
        y = PLOT_H - min(value, y_max) / y_max * PLOT_H
        run.append((offset + i, round(y, 2)))
    close_run()
    return " ".join(line), " ".join(area)


def plots(stats: dict) -> dict:
    """Each plot's y-axis maximum and, per series, its (line, area) path data."""
    history = stats.get("history") or {}

    def series(name):
        return history.get(name) or []

    def peak(*names):
        return max((v for n in names for v in series(n) if v is not None), default=0)

    scales = {
        "tokens": nice_max(peak("prefill_tokens_per_s", "decode_tokens_per_s")),
        "queue": nice_max(peak("queue_depth")),
        "running": max(stats.get("slots_total") or 1, 1),
        "reuse": 1,
    }
    members = {
        "tokens": ("prefill_tokens_per_s", "decode_tokens_per_s"),
        "queue": ("queue_depth",),
        "running": ("running",),
        "reuse": ("prefix_reuse",),
    }
    return {
        plot: {"max": scales[plot], "series": {n: plot_paths(series(n), scales[plot]) for n in names}} for plot, names in members.items()
    }


def slot_row(slot: dict, context: int | None) -> dict:
    """A slot plus its KV-cache bar: segments (kind, x %, width %) of the model's context."""
    context = context or 1
    cached = slot.get("tokens_cached") or 0
    prompt = slot.get("prompt_tokens")
    if prompt is None:  # no request: what the slot still caches for prefix reuse
        parts = [("idle", cached)]
    else:
        reused = slot.get("reused_tokens") or 0
        in_cache = min(cached, prompt)
        parts = [("reused", min(reused, in_cache)), ("prefilled", max(in_cache - reused, 0)), ("generated", max(cached - prompt, 0))]
    segments, x = [], 0.0
    for kind, n in parts:
        width = 100 * n / context
        if width > 0:
            segments.append((kind, round(x, 3), round(width, 3)))
        x += width
    reused_share = (slot.get("reused_tokens") or 0) / prompt if prompt else None
    return {**slot, "segments": segments, "reused_share": reused_share}
