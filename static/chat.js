// The chat page's client. It keeps the conversation in memory, sends it to
// /v1/chat/completions with stream: true and renders the server-sent events as they arrive.
// Stop aborts the fetch; the server sees the connection close and frees the request's slot.
// User and model text only ever goes through textContent, never innerHTML.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  model: null,           // id from /v1/models, echoed back in each request
  chat: { history: [] },  // history: [{role, content}]; replaced, not emptied, by New chat
  controller: null,       // AbortController of the reply being streamed, if any
};

const SETTINGS = ["system-prompt", "temperature", "max-tokens", "output-format", "json-schema", "api-key"];

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key");
  if (key && key.value.trim()) h.Authorization = "Bearer " + key.value.trim();
  return h;
}

// An Error whose message says what went wrong in words a person can act on.
async function responseError(response) {
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    // not JSON: only the status line is known
  }
  const error = (body && body.error) || {};
  const detail = error.message || `${response.status} ${response.statusText}`.trim();
  let message = detail;
  if (response.status === 429) {
    const wait = parseInt(response.headers.get("Retry-After"), 10);
    message = "The server is busy: every slot and the queue are taken. " +
      (wait > 0 ? `Try again in ${wait} s.` : "Try again shortly.");
  } else if (error.code === "context_length_exceeded") {
    message = "This conversation is too long for the model. " + detail + " Start a new chat, or send something shorter.";
  } else if (response.status === 503) {
    message = "The model is not ready yet (" + detail + "). Try again in a moment.";
  } else if (response.status === 401) {
    message = "The server wants an API key: enter it under Settings.";
    $("settings").open = true;
  }
  const e = new Error(message);
  e.status = response.status;
  return e;
}

function showError(message) {
  const el = $("error");
  el.textContent = message;
  el.hidden = !message;
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) throw await responseError(response);
    const body = await response.json();
    state.model = body.data[0].id;
    $("model-name").textContent = state.model;
    document.title = state.model + " · Chat";
  } catch (e) {
    $("model-name").textContent = "Chat";
    showError("Could not load the model name. " + e.message);
  }
}

function scrollToEnd() {
  const log = $("log");
  log.scrollTop = log.scrollHeight;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// One chat bubble. The assistant's has a collapsed <details> for reasoning and a line of figures.
function addBubble(role, text) {
  $("empty").hidden = true;
  const bubble = el("article", "msg " + role);
  let reasoning = null;
  let summary = null;
  if (role === "assistant") {
    const details = el("details", "reasoning");
    details.hidden = true;
    summary = el("summary", "", "Thinking…");
    reasoning = el("div", "text");
    details.append(summary, reasoning);
    bubble.append(details);
  }
  const content = el("div", "text content", text);
  const meta = el("div", "meta");
  bubble.append(content, meta);
  $("log").append(bubble);
  scrollToEnd();
  return { bubble, content, reasoning, summary, meta };
}

function requestBody(history) {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (state.model) body.model = state.model;
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  // "JSON output": the server constrains the reply to JSON (any object, or the given schema)
  const format = $("output-format").value;
  if (format === "json_object") body.response_format = { type: "json_object" };
  if (format === "json_schema") {
    let schema;
    try {
      schema = JSON.parse($("json-schema").value);
    } catch (e) {
      $("settings").open = true;
      throw new Error("The JSON schema under Settings is not valid JSON: " + e.message);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "chat_output", schema, strict: true } };
  }
  return body;
}

// Yields each JSON payload of a server-sent event stream; returns at [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function seconds(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

// "42 tokens · 31.5 tok/s · first token 120 ms · 96 of 120 prompt tokens cached"
function figures(finish, usage, timing) {
  const notes = [];
  if (finish === "length") notes.push("cut off at the token limit");
  else if (finish === "stopped") notes.push("stopped");
  else if (finish === "error") notes.push("failed");
  else if (finish && finish !== "stop") notes.push(finish);
  // Without a usage chunk (a stopped reply) each streamed delta counts as about one token.
  const tokens = usage ? usage.completion_tokens : timing.deltas;
  if (tokens) notes.push(`${usage ? "" : "~"}${tokens} token${tokens === 1 ? "" : "s"}`);
  if (tokens > 1 && timing.first !== null && timing.end > timing.first) {
    notes.push(`${((tokens - 1) / ((timing.end - timing.first) / 1000)).toFixed(1)} tok/s`);
  }
  if (timing.first !== null) notes.push(`first token ${seconds(timing.first - timing.start)}`);
  const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
  if (usage && cached) notes.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  return notes.join(" · ");
}

async function send(text) {
  showError("");
  // A reply that finishes after New chat must not land in the new conversation.
  const chat = state.chat;
  chat.history.push({ role: "user", content: text });
  const userBubble = addBubble("user", text);
  const reply = addBubble("assistant", "");
  reply.bubble.classList.add("pending");
  reply.bubble.setAttribute("aria-busy", "true");
  setBusy(true);

  const controller = new AbortController();
  state.controller = controller;
  const timing = { start: performance.now(), first: null, end: null, deltas: 0 };
  let content = "";
  let finish = null;
  let usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(requestBody(chat.history)),
      signal: controller.signal,
    });
    if (!response.ok) throw await responseError(response);
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error("The server failed while replying: " + (chunk.error.message || "unknown error"));
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.reasoning_content || delta.content) {
        if (timing.first === null) timing.first = performance.now();
        timing.deltas += 1;
      }
      if (delta.reasoning_content) {
        reply.reasoning.parentElement.hidden = false;
        reply.reasoning.textContent += delta.reasoning_content;
      }
      if (delta.content) {
        content += delta.content;
        reply.content.textContent = content;
        if (reply.summary) reply.summary.textContent = "Reasoning";
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      scrollToEnd();
    }
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped";
    } else {
      showError(e.name === "TypeError" ? "Could not reach the server: " + e.message : e.message);
      finish = "error";
    }
  } finally {
    timing.end = performance.now();
    reply.bubble.classList.remove("pending");
    reply.bubble.removeAttribute("aria-busy");
    if (reply.summary) reply.summary.textContent = "Reasoning";
    if (state.controller === controller) {
      state.controller = null;
      setBusy(false);
    }
  }
  if (chat !== state.chat) return;

  if (content) {
    chat.history.push({ role: "assistant", content });
  } else if (finish === "error") {
    // Nothing came back: forget the turn and give the text back so it can be resent.
    chat.history.pop();
    userBubble.bubble.remove();
    reply.bubble.remove();
    $("input").value = text;
    autoGrow();
    $("empty").hidden = $("log").querySelector(".msg") !== null;
    return;
  } else {
    chat.history.push({ role: "assistant", content: "" });
  }
  reply.meta.textContent = figures(finish, usage, timing);
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function stop() {
  if (state.controller) state.controller.abort();
}

function newChat() {
  if (state.controller) {
    state.controller.abort();
    state.controller = null;
    setBusy(false);
  }
  state.chat = { history: [] };
  for (const node of $("log").querySelectorAll(".msg")) node.remove();
  $("empty").hidden = false;
  showError("");
  $("input").focus();
}

function autoGrow() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = Math.min(input.scrollHeight + 2, window.innerHeight / 3) + "px";
}

function restoreSettings() {
  for (const id of SETTINGS) {
    const node = $(id);
    if (!node) continue;
    const saved = localStorage.getItem("chat." + id);
    if (saved !== null) node.value = saved;
    node.addEventListener("change", () => localStorage.setItem("chat." + id, node.value));
  }
  const showSchema = () => { $("json-schema-label").hidden = $("output-format").value !== "json_schema"; };
  $("output-format").addEventListener("change", showSchema);
  showSchema();
}

function init() {
  restoreSettings();
  loadModel();
  const input = $("input");
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = input.value.trim();
    if (!text || state.controller) return;
    input.value = "";
    autoGrow();
    send(text);
  });
  input.addEventListener("keydown", (e) => {
    // isComposing: Enter that confirms an IME composition must not send.
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.controller) stop();
  });
  input.addEventListener("input", autoGrow);
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  const key = $("api-key");
  if (key) key.addEventListener("change", loadModel);
}

document.addEventListener("DOMContentLoaded", init);
