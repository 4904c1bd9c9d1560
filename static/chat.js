// The chat page's client. It keeps the conversation in memory, sends it to
// /v1/chat/completions with stream: true and renders the server-sent events as they arrive.
// User and model text only ever goes through textContent, never innerHTML.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  model: null,           // id from /v1/models, echoed back in each request
  chat: { history: [] },  // history: [{role, content}]; replaced, not emptied, by New chat
  controller: null,       // AbortController of the reply being streamed, if any
};

const SETTINGS = ["system-prompt", "temperature", "max-tokens", "api-key"];

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key");
  if (key && key.value.trim()) h.Authorization = "Bearer " + key.value.trim();
  return h;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) {
    // not JSON: fall through to the status line
  }
  return `${response.status} ${response.statusText}`.trim();
}

function showError(message) {
  const el = $("error");
  el.textContent = message;
  el.hidden = !message;
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorMessage(response));
    const body = await response.json();
    state.model = body.data[0].id;
    $("model-name").textContent = state.model;
    document.title = state.model;
  } catch (e) {
    $("model-name").textContent = "Chat";
    showError("Could not load the model: " + e.message);
  }
}

function scrollToEnd() {
  const log = $("log");
  log.scrollTop = log.scrollHeight;
}

// One chat bubble. The assistant's has a collapsed <details> for reasoning.
function addBubble(role, text) {
  $("empty").hidden = true;
  const bubble = document.createElement("article");
  bubble.className = "msg " + role;
  let reasoning = null;
  if (role === "assistant") {
    const details = document.createElement("details");
    details.className = "reasoning";
    details.hidden = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    reasoning = document.createElement("div");
    reasoning.className = "text";
    details.append(summary, reasoning);
    bubble.append(details);
  }
  const content = document.createElement("div");
  content.className = "text content";
  content.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  bubble.append(content, meta);
  $("log").append(bubble);
  scrollToEnd();
  return { bubble, content, reasoning, meta };
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

async function send(text) {
  showError("");
  // A reply that finishes after New chat must not land in the new conversation.
  const chat = state.chat;
  chat.history.push({ role: "user", content: text });
  const userBubble = addBubble("user", text);
  const reply = addBubble("assistant", "");
  reply.bubble.classList.add("pending");
  setBusy(true);

  const controller = new AbortController();
  state.controller = controller;
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
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message || "The server failed.");
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.reasoning_content) {
        reply.reasoning.parentElement.hidden = false;
        reply.reasoning.textContent += delta.reasoning_content;
      }
      if (delta.content) {
        content += delta.content;
        reply.content.textContent = content;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      scrollToEnd();
    }
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped";
    } else {
      showError(e.message);
      finish = "error";
    }
  } finally {
    reply.bubble.classList.remove("pending");
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
    $("empty").hidden = $("log").querySelector(".msg") !== null;
    return;
  } else {
    chat.history.push({ role: "assistant", content: "" });
  }
  const notes = [];
  if (finish && finish !== "stop") notes.push(finish === "length" ? "cut off at the token limit" : finish);
  if (usage) notes.push(`${usage.completion_tokens} tokens`);
  reply.meta.textContent = notes.join(" · ");
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function newChat() {
  if (state.controller) {
    state.controller.abort();
    state.controller = null;
    setBusy(false);
  }
  state.chat = { history: [] };
  for (const el of $("log").querySelectorAll(".msg")) el.remove();
  $("empty").hidden = false;
  showError("");
  $("input").focus();
}

function autoGrow() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = Math.min(input.scrollHeight, window.innerHeight / 3) + "px";
}

function restoreSettings() {
  for (const id of SETTINGS) {
    const el = $(id);
    if (!el) continue;
    const saved = localStorage.getItem("chat." + id);
    if (saved !== null) el.value = saved;
    el.addEventListener("change", () => localStorage.setItem("chat." + id, el.value));
  }
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
  input.addEventListener("input", autoGrow);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  const key = $("api-key");
  if (key) key.addEventListener("change", loadModel);
}

document.addEventListener("DOMContentLoaded", init);
