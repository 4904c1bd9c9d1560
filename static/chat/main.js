// The chat page's controller. The open conversation lives in `state.conversation` and in
// localStorage (store.js); each turn sends its messages to /v1/chat/completions with stream: true
// (api.js) and renders the deltas as they arrive, at most once per animation frame (view.js).
// Stop (or Esc) aborts the fetch; the server sees the connection close and frees the request's slot.
// Regenerate drops the last reply and asks again; Edit cuts the conversation at a user message and
// resends from there. Either way the prompt's start is already in the server's KV cache, which the
// figures under the reply report ("N of M prompt tokens cached"). Each conversation records the
// model it talks to (the header's picker, models.js); a chat not sent yet takes the last one picked.
// A user message may carry images (attachments.js), saved with it as data: URLs.
"use strict";

import { events, figures, openStream } from "./api.js";
import { Attachments, apiContent } from "./attachments.js";
import { copyText, handleCodeCopy } from "./markdown.js";
import { ModelPicker } from "./models.js";
import { Sidebar } from "./sidebar.js";
import * as store from "./store.js";
import { MessageView } from "./view.js";

const $ = (id) => document.getElementById(id);

const state = {
  conversation: null, // the conversation on screen
  views: [],          // a MessageView per message of it
  controller: null,   // AbortController of the reply being streamed, if any
};

const SETTINGS = ["system-prompt", "temperature", "max-tokens", "reply-format", "json-schema", "api-key"];

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function showNotice(message) {
  $("notice").textContent = message;
  $("notice").hidden = !message;
}

function save(conversation, touch = true) {
  try {
    store.saveConversation(conversation, touch);
  } catch (e) {
    showError("Could not save this chat in the browser (" + e.message + "). Delete old chats to make room.");
  }
}

// Reads /v1/models again (statuses change as models load and unload, files come and go).
async function refreshModels() {
  try {
    await picker.refresh();
  } catch (e) {
    showError("Could not load the list of models. " + e.message);
    return;
  }
  showModel();
}

// Shows the model the conversation on screen talks to: its own, or the last pick for a chat not sent yet.
function showModel() {
  const wanted = state.conversation.model;
  picker.select(wanted || picker.lastPick);
  if (wanted && picker.value && !picker.offers(wanted)) {
    showError(`The server no longer offers “${wanted}”: this chat now talks to “${picker.value}” (pick another at the top).`);
  }
}

function failedLoad(detail) {
  return detail.charAt(0).toUpperCase() + detail.slice(1) + ". Pick another model at the top, or fix its file and send again.";
}

function picked(id) {
  const conversation = state.conversation;
  conversation.model = id;
  showError("");
  if (conversation.messages.length) save(conversation, false); // a pick does not move the chat up the list
}

function scrollToEnd() {
  const log = $("log");
  log.scrollTop = log.scrollHeight;
}

// --- the conversation on screen -------------------------------------------------------------------

function refreshActions() {
  const messages = state.conversation.messages;
  state.views.forEach((view, i) => view.setActions(messages[i], i === messages.length - 1));
}

function addView(message) {
  const view = new MessageView(message, state.views.length);
  state.views.push(view);
  $("log").append(view.bubble);
  $("empty").hidden = true;
  return view;
}

function dropView() {
  state.views.pop().bubble.remove();
  $("empty").hidden = state.views.length > 0;
}

function show(conversation) {
  stop();
  state.conversation = conversation;
  store.setCurrentId(conversation.id);
  for (const view of state.views) view.bubble.remove();
  state.views = [];
  for (const message of conversation.messages) addView(message);
  $("empty").hidden = state.views.length > 0;
  refreshActions();
  showError("");
  showModel();
  sidebar.render();
  scrollToEnd();
}

function newChat() {
  show(store.newConversation());
  $("input").focus();
}

// --- a turn ---------------------------------------------------------------------------------------

function responseFormat() {
  const kind = $("reply-format").value;
  if (kind === "json_object") return { type: "json_object" };
  if (kind !== "json_schema") return null;
  let schema;
  try {
    schema = JSON.parse($("json-schema").value);
  } catch (e) {
    $("settings").open = true;
    throw new Error("The JSON schema under Settings is not valid JSON: " + e.message);
  }
  return { type: "json_schema", json_schema: { name: "reply", schema, strict: true } };
}

function requestBody(messages) {
  const body = { messages: [], stream: true, stream_options: { include_usage: true } };
  const system = $("system-prompt").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  body.messages.push(...messages.map((m) => ({ role: m.role, content: apiContent(m) })));
  if (picker.value) body.model = picker.value;
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const format = responseFormat();
  if (format) body.response_format = format;
  return body;
}

function applyDelta(reply, delta) {
  if (delta.reasoning_content) reply.reasoning = (reply.reasoning || "") + delta.reasoning_content;
  if (delta.content) reply.content += delta.content;
  for (const call of delta.tool_calls || []) {
    reply.tool_calls = reply.tool_calls || [];
    const slot = reply.tool_calls[call.index || 0] || { id: call.id, type: "function", function: { name: "", arguments: "" } };
    reply.tool_calls[call.index || 0] = slot;
    if (call.id) slot.id = call.id;
    if (call.function && call.function.name) slot.function.name += call.function.name;
    if (call.function && call.function.arguments) slot.function.arguments += call.function.arguments;
  }
}

// Streams a reply to the conversation's messages. `typed` is the text just sent from the composer:
// when nothing at all comes back, that turn is undone and the text given back to edit.
async function generate(typed) {
  const conversation = state.conversation;
  let body;
  try {
    body = requestBody(conversation.messages);
  } catch (e) {
    showError(e.message);
    return;
  }
  showError("");
  if (body.model) conversation.model = body.model;
  save(conversation);
  sidebar.render(); // a new chat is listed from its first message on
  const reply = { role: "assistant", content: "" };
  if (body.response_format) reply.json = true;
  conversation.messages.push(reply);
  const view = addView(reply);
  view.update(reply, true);
  refreshActions();
  scrollToEnd();
  setBusy(true);

  const controller = new AbortController();
  state.controller = controller;
  const timing = { start: performance.now(), first: null, end: null, deltas: 0 };
  let finish = null;
  let usage = null;
  let frame = 0;
  const paint = () => {
    frame = 0;
    view.update(reply, true);
    scrollToEnd();
  };
  // A model set loads a model on its first request, which waits for it (seconds for a big file).
  if (["unloaded", "loading"].includes(picker.status(body.model))) {
    showNotice(`Loading ${body.model}: the reply starts once it is ready.`);
  }
  try {
    const response = await openStream(body, { signal: controller.signal, onWait: showNotice, worthWaiting: () => picker.mayLoad(body.model) });
    showNotice("");
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error("The server failed while replying: " + (chunk.error.message || "unknown error"));
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.reasoning_content || delta.content || delta.tool_calls) {
        if (timing.first === null) timing.first = performance.now();
        timing.deltas += 1;
        applyDelta(reply, delta);
        frame = frame || requestAnimationFrame(paint);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped";
    } else {
      if (e.name === "TypeError") showError("Could not reach the server: " + e.message);
      else if (e.status === 503 && picker.status(body.model) === "failed") showError(failedLoad(e.detail));
      else showError(e.message);
      if (e.status === 401) $("settings").open = true;
      finish = "error";
    }
  } finally {
    if (frame) cancelAnimationFrame(frame);
    timing.end = performance.now();
    showNotice("");
    if (state.controller === controller) {
      state.controller = null;
      setBusy(false);
    }
  }
  const got = reply.content || reply.reasoning || reply.tool_calls;
  if (!got && finish === "error") {
    conversation.messages.pop();
    if (typed !== undefined) conversation.messages.pop();
  } else {
    reply.meta = figures(finish, usage, timing);
  }
  save(conversation);
  refreshModels(); // the hints follow: this model now loaded, another maybe unloaded, or gone (a 404)
  if (conversation !== state.conversation) return; // another chat was opened meanwhile
  if (!got && finish === "error") {
    dropView();
    if (typed !== undefined) {
      dropView();
      $("input").value = typed;
      autoGrow();
    }
  } else {
    view.update(reply, false);
    $("announce").textContent = "Reply finished. " + (reply.meta || "");
  }
  refreshActions();
  sidebar.render();
}

function sendTyped(text, images) {
  const message = { role: "user", content: text };
  if (images.length) message.images = images;
  state.conversation.messages.push(message);
  addView(message);
  generate(text);
}

function regenerate() {
  const messages = state.conversation.messages;
  if (state.controller || messages[messages.length - 1].role !== "assistant") return;
  messages.pop();
  dropView();
  generate();
}

function edit(index) {
  if (state.controller) return;
  state.views[index].edit((text) => {
    if (text === null) return;
    const conversation = state.conversation;
    const images = conversation.messages[index].images; // an edit changes the text, not the images
    conversation.messages = conversation.messages.slice(0, index);
    conversation.messages.push(images ? { role: "user", content: text, images } : { role: "user", content: text });
    show(conversation);
    generate();
  });
}

async function copyReply(index, button) {
  try {
    const message = state.conversation.messages[index];
    const calls = message.tool_calls ? JSON.stringify(message.tool_calls, null, 2) : "";
    await copyText(message.content || calls);
    button.textContent = "Copied";
    setTimeout(() => (button.textContent = "Copy"), 1500);
  } catch (e) {
    showError("Could not copy: " + e.message);
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function stop() {
  if (state.controller) state.controller.abort();
}

// --- set-up ---------------------------------------------------------------------------------------

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
  const format = $("reply-format");
  const schemaShown = () => ($("schema-label").hidden = format.value !== "json_schema");
  format.addEventListener("change", schemaShown);
  schemaShown();
}

const picker = new ModelPicker({ onPick: picked });

const sidebar = new Sidebar({
  current: () => state.conversation,
  open: (id) => {
    const conversation = store.getConversation(id);
    if (conversation) show(conversation);
  },
  deleted: (id) => {
    if (state.conversation && state.conversation.id === id) newChat();
  },
  imported: (conversation) => show(conversation),
  failed: showError,
});

let attachments;

function init() {
  attachments = new Attachments({
    strip: $("attached"),
    picker: $("attach-file"),
    button: $("attach"),
    dropZone: document.querySelector(".main"),
    pasteTarget: $("input"),
    failed: showError,
  });
  restoreSettings();
  refreshModels();
  const saved = store.currentId() && store.getConversation(store.currentId());
  show(saved || store.newConversation());
  const input = $("input");
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = input.value.trim();
    if ((!text && !attachments.urls.length) || state.controller) return;
    input.value = "";
    autoGrow();
    sendTyped(text, attachments.take());
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
  $("log").addEventListener("click", (e) => {
    const button = e.target.closest("button[data-action]");
    if (!button) return;
    const index = Number(button.closest(".msg").dataset.index);
    if (button.dataset.action === "copy") copyReply(index, button);
    else if (button.dataset.action === "regenerate") regenerate();
    else if (button.dataset.action === "edit") edit(index);
  });
  handleCodeCopy($("log"));
  const key = $("api-key");
  if (key) key.addEventListener("change", refreshModels);
}

init();
