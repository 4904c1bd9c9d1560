// The dashboard's live updates. templates/admin.html is complete on its own; this polls
// /admin/stats.json once a second and redraws the same elements: every [data-stat] value, the
// plots (plain SVG paths, one x unit per second) and the slot, recent-request and model tables.
// format(), plotPaths() and kvSegments() mirror format_value, plot_paths and slot_row in
// webapp/http/admin.py. Every string from the server goes in through textContent or an attribute.
"use strict";

const POLL_MS = 1000;
const PLOT_W = 600;
const PLOT_H = 100;
const EXPERT_BAR_H = 40;
const DASH = "–";
const SVG_NS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

function number(value, digits) {
  return value.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
}

function format(value, kind) {
  if (value === null || value === undefined || (typeof value === "number" && !Number.isFinite(value))) return DASH;
  switch (kind) {
    case "text":
      return String(value);
    case "int":
      return number(Math.trunc(value), 0);
    case "rate":
      return number(value, value < 10 ? 1 : 0);
    case "ratio":
      return number(value, 2);
    case "pct":
      return (value * 100).toFixed(0) + "%";
    case "bytes":
      return value >= 2 ** 30 ? number(value / 2 ** 30, 2) + " GiB" : number(value / 2 ** 20, 1) + " MiB";
    case "latency":
      if (value < 1) return (value * 1000).toFixed(0) + " ms";
      if (value < 60) return value.toFixed(2) + " s";
      return format(value, "duration");
    case "duration": {
      const total = Math.floor(value);
      const pad = (n) => String(n).padStart(2, "0");
      if (total < 60) return total + " s";
      if (total < 3600) return `${Math.floor(total / 60)}m ${pad(total % 60)}s`;
      return `${Math.floor(total / 3600)}h ${pad(Math.floor((total % 3600) / 60))}m`;
    }
    default:
      throw new Error("unknown format " + kind);
  }
}

function lookup(stats, path) {
  let value = stats;
  for (const key of path.split(".")) {
    if (value === null || typeof value !== "object") return null;
    value = value[key];
  }
  return value === undefined ? null : value;
}

function niceMax(value) {
  if (!(value > 1)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * power).find((v) => value <= v);
}

// [line, area] path data for one series; null values break the line.
function plotPaths(values, yMax) {
  const line = [];
  const area = [];
  let run = [];
  const xy = (p) => `${p[0]},${p[1]}`;
  const closeRun = () => {
    if (!run.length) return;
    line.push("M" + run.map(xy).join(" L"));
    area.push(`M${run[0][0]},${PLOT_H} L` + run.map(xy).join(" L") + ` L${run[run.length - 1][0]},${PLOT_H} Z`);
    run = [];
  };
  const offset = PLOT_W - values.length; // the newest value sits at the right edge
  values.forEach((value, i) => {
    if (value === null) {
      closeRun();
      return;
    }
    const y = PLOT_H - (Math.min(value, yMax) / yMax) * PLOT_H;
    run.push([offset + i, Math.round(y * 100) / 100]);
  });
  closeRun();
  return [line.join(" "), area.join(" ")];
}

function plotMax(name, stats, seriesNames) {
  if (name === "running") return Math.max(stats.slots_total || 1, 1);
  if (name === "reuse") return 1;
  let peak = 0;
  for (const key of seriesNames) {
    for (const v of (stats.history && stats.history[key]) || []) if (v !== null && v > peak) peak = v;
  }
  return niceMax(peak);
}

function drawPlots(stats) {
  for (const figure of document.querySelectorAll("[data-plot]")) {
    const paths = figure.querySelectorAll("path[data-series]");
    const names = [...new Set([...paths].map((p) => p.dataset.series))];
    const yMax = plotMax(figure.dataset.plot, stats, names);
    const label = figure.querySelector("[data-plot-max]");
    label.textContent = format(yMax, label.dataset.format);
    for (const path of paths) {
      const values = (stats.history && stats.history[path.dataset.series]) || [];
      const [line, area] = plotPaths(values, yMax);
      path.setAttribute("d", path.dataset.part === "area" ? area : line);
    }
  }
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function badge(kind, value) {
  const td = el("td");
  td.append(el("span", `badge ${kind}-${value}`, value));
  return td;
}

// (kind, x %, width %) pieces of the context that a slot's KV cache holds.
function kvSegments(slot, context) {
  context = context || 1;
  const cached = slot.tokens_cached || 0;
  const prompt = slot.prompt_tokens;
  let parts;
  if (prompt === null || prompt === undefined) {
    parts = [["idle", cached]];
  } else {
    const reused = slot.reused_tokens || 0;
    const inCache = Math.min(cached, prompt);
    parts = [
      ["reused", Math.min(reused, inCache)],
      ["prefilled", Math.max(inCache - reused, 0)],
      ["generated", Math.max(cached - prompt, 0)],
    ];
  }
  const segments = [];
  let x = 0;
  for (const [kind, n] of parts) {
    const width = (100 * n) / context;
    if (width > 0) segments.push([kind, x, width]);
    x += width;
  }
  return segments;
}

function slotRow(slot, context) {
  const tr = el("tr");
  const id = el("td", "id", slot.request_id || DASH);
  if (slot.adapter) id.append(" ", el("span", "muted", "· " + slot.adapter)); // its LoRA adapter
  tr.append(el("td", "", String(slot.index)), badge("st", slot.state), id);
  const kv = el("td", "kv");
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("class", "kv-bar");
  svg.setAttribute("viewBox", "0 0 100 10");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("aria-hidden", "true");
  for (const [kind, x, width] of kvSegments(slot, context)) {
    const rect = document.createElementNS(SVG_NS, "rect");
    rect.setAttribute("class", "kv-" + kind);
    for (const [k, v] of [["x", x], ["y", 0], ["width", width], ["height", 10]]) rect.setAttribute(k, String(v));
    svg.append(rect);
  }
  kv.append(svg, el("span", "kv-text", `${format(slot.tokens_cached, "int")} / ${format(context, "int")}`));
  tr.append(kv);
  const reused = el("td", "num");
  if (slot.prompt_tokens === null || slot.prompt_tokens === undefined) {
    reused.textContent = DASH;
  } else {
    const share = slot.prompt_tokens ? slot.reused_tokens / slot.prompt_tokens : null;
    reused.append(format(slot.reused_tokens, "int") + " ", el("span", "muted", `(${format(share, "pct")})`));
  }
  tr.append(
    reused,
    el("td", "num", slot.request_id ? format(slot.tokens_generated, "int") : DASH),
    el("td", "num age", format(slot.age_s, "duration")),
  );
  return tr;
}

function recentRow(r) {
  const tr = el("tr");
  const rate = r.decode_tokens_per_s === null ? DASH : format(r.decode_tokens_per_s, "rate") + " tok/s";
  tr.append(
    el("td", "id", r.id),
    el("td", "num", format(r.prompt_tokens, "int")),
    el("td", "num", format(r.cached_tokens, "int")),
    el("td", "num", format(r.generated_tokens, "int")),
    el("td", "num", format(r.queue_wait_s, "latency")),
    el("td", "num", format(r.ttft_s, "latency")),
    el("td", "num", rate),
    el("td", "num", format(r.e2e_s, "latency")),
    badge("fr", r.finish_reason),
  );
  return tr;
}

let lastRecent = null; // rebuilt only when it changed, so a selection in it survives the poll

function drawTables(stats) {
  const slots = stats.slots || [];
  $("slot-rows").replaceChildren(...slots.map((s) => slotRow(s, stats.context)));
  const recent = stats.recent_requests || [];
  const key = JSON.stringify(recent);
  if (key === lastRecent) return;
  lastRecent = key;
  if (recent.length) {
    $("recent-rows").replaceChildren(...recent.map(recentRow));
  } else {
    const tr = el("tr", "none");
    const td = el("td", "", "No finished requests yet.");
    td.colSpan = 9;
    tr.append(td);
    $("recent-rows").replaceChildren(tr);
  }
}

// One bar an expert, its lanes a layer step, the busiest full height (admin.py's expert_bars).
function drawExperts(stats) {
  const svg = $("expert-bars");
  if (!svg || !stats.experts) return;
  const perStep = stats.experts.per_step;
  const top = Math.max(...perStep) || 1;
  svg.replaceChildren(
    ...perStep.map((value, expert) => {
      const bar = document.createElementNS(SVG_NS, "rect");
      const height = (EXPERT_BAR_H * value) / top;
      bar.setAttribute("x", expert + 0.1);
      bar.setAttribute("width", 0.8);
      bar.setAttribute("y", EXPERT_BAR_H - height);
      bar.setAttribute("height", height);
      const title = document.createElementNS(SVG_NS, "title");
      title.textContent = `expert ${expert}: ${format(value, "ratio")} lanes a layer step`;
      bar.append(title);
      return bar;
    }),
  );
}

// LLM_MODELS_DIR: each model of the folder, its status and what it is counted for (templates/admin.html)
function modelRow(m) {
  const tr = el("tr");
  const link = el("a", "", m.id);
  link.href = "?model=" + encodeURIComponent(m.id);
  const name = el("td", "id");
  name.append(link);
  tr.append(
    name,
    badge("ms", m.status),
    el("td", "num", format(m.size, "bytes")),
    el("td", "num", format(m.memory_bytes, "bytes")),
    el("td", "num", format(m.running, "int")),
  );
  return tr;
}

function adapterRow(a) {
  const tr = el("tr");
  const status = el("td");
  status.append(el("span", "badge", a.retired ? "unloading" : "loaded"));
  tr.append(
    el("td", "id", a.name),
    el("td", "num", format(a.rank, "int")),
    el("td", "num", String(a.alpha)),
    el("td", "num", format(a.bytes, "bytes")),
    status,
  );
  return tr;
}

function render(stats) {
  for (const node of document.querySelectorAll("[data-stat]")) {
    node.textContent = format(lookup(stats, node.dataset.stat), node.dataset.format);
  }
  $("state").className = "state state-" + (stats.state || "unknown");
  $("download").hidden = !stats.download; // LLM_MODEL=hf:...: the file being fetched while the model loads
  $("download").textContent = stats.download || "";
  if (stats.model) document.title = "Admin · " + stats.model;
  drawPlots(stats);
  drawTables(stats);
  drawExperts(stats);
  if (stats.models && $("model-rows")) $("model-rows").replaceChildren(...stats.models.map(modelRow));
  if (stats.adapters && $("adapter-rows")) $("adapter-rows").replaceChildren(...stats.adapters.map(adapterRow));
}

function setLive(ok, text) {
  const live = $("live");
  live.className = "live " + (ok ? "ok" : "bad");
  live.textContent = text;
}

let timer = null; // the next poll, while one is scheduled
let inFlight = false;

async function poll() {
  timer = null;
  if (inFlight || document.hidden) return; // a hidden page polls again when it is shown
  inFlight = true;
  const started = performance.now();
  try {
    const response = await fetch(document.body.dataset.statsUrl + location.search, {
      cache: "no-store",
      headers: { Accept: "application/json" },
    });
    if (!response.ok) throw new Error(response.status === 401 ? "not authorized" : `HTTP ${response.status}`);
    render(await response.json());
    setLive(true, "live");
  } catch (e) {
    setLive(false, `offline (${e.message}), retrying`);
  } finally {
    inFlight = false;
  }
  if (!document.hidden) timer = setTimeout(poll, Math.max(0, POLL_MS - (performance.now() - started)));
}

document.addEventListener("DOMContentLoaded", () => {
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && timer === null) poll();
  });
  poll();
});
