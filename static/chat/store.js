// Conversations kept in this browser's localStorage; nothing is stored on the server.
//
// Contract: one key holds every conversation as JSON, newest first:
//   {id, title, created, updated, model?, messages: [{role: "user" | "assistant", content, reasoning?,
//    tool_calls?, meta?, json?}]}
// `model` is the id of /v1/models the conversation talks to, set from its first turn on (or a pick).
// `saveConversation` writes through at once (a reload loses nothing but a reply still streaming).
// Imported files are untrusted: `parseImport` keeps only well-formed messages with string fields,
// and every text is rendered later as text or sanitized markdown, never as raw HTML.
"use strict";

const KEY = "chat.conversations.v1";
const CURRENT = "chat.current";
export const EXPORT_FORMAT = "tinyserve-chat";

function readAll() {
  try {
    const list = JSON.parse(localStorage.getItem(KEY) || "[]");
    return Array.isArray(list) ? list : [];
  } catch (_) {
    return [];
  }
}

function writeAll(list) {
  localStorage.setItem(KEY, JSON.stringify(list)); // throws QuotaExceededError when full
}

export function listConversations() {
  return readAll().sort((a, b) => b.updated - a.updated);
}

export function getConversation(id) {
  return readAll().find((c) => c.id === id) || null;
}

export function newConversation() {
  const now = Date.now();
  const id = (crypto.randomUUID ? crypto.randomUUID() : String(now) + Math.random().toString(16).slice(2));
  return { id, title: "", created: now, updated: now, messages: [] };
}

// The first user line, cut to a length that fits the side list.
export function titleOf(conversation) {
  if (conversation.title) return conversation.title;
  const first = conversation.messages.find((m) => m.role === "user");
  const line = first ? first.content.trim().split("\n")[0] : "";
  return line ? (line.length > 60 ? line.slice(0, 57) + "…" : line) : "New chat";
}

// `touch`: the conversation moved on, so it goes to the top of the list (a rename does not).
export function saveConversation(conversation, touch = true) {
  const list = readAll().filter((c) => c.id !== conversation.id);
  if (conversation.messages.length || conversation.title) {
    if (touch) conversation.updated = Date.now();
    list.push(conversation);
  } // else: an empty chat is not kept (a first turn that failed leaves nothing behind)
  writeAll(list);
}

export function deleteConversation(id) {
  writeAll(readAll().filter((c) => c.id !== id));
  if (localStorage.getItem(CURRENT) === id) localStorage.removeItem(CURRENT);
}

export function currentId() {
  return localStorage.getItem(CURRENT);
}

export function setCurrentId(id) {
  localStorage.setItem(CURRENT, id);
}

export function matches(conversation, query) {
  const q = query.trim().toLowerCase();
  if (!q) return true;
  if (titleOf(conversation).toLowerCase().includes(q)) return true;
  return conversation.messages.some((m) => m.content.toLowerCase().includes(q));
}

// --- export and import ----------------------------------------------------------------------------

export function toJson(conversation) {
  const { created, updated, model, messages } = conversation;
  const title = titleOf(conversation);
  return JSON.stringify({ format: EXPORT_FORMAT, version: 1, title, created, updated, model, messages }, null, 2);
}

export function toMarkdown(conversation) {
  const parts = [`# ${titleOf(conversation)}`, ""];
  for (const m of conversation.messages) {
    parts.push(`## ${m.role === "user" ? "User" : "Assistant"}`, "");
    if (m.reasoning) parts.push("<details><summary>Reasoning</summary>", "", m.reasoning, "", "</details>", "");
    parts.push(m.content, "");
    for (const call of m.tool_calls || []) {
      parts.push("```json", JSON.stringify(call, null, 2), "```", "");
    }
  }
  return parts.join("\n");
}

function cleanMessage(m) {
  if (!m || typeof m !== "object" || !["user", "assistant"].includes(m.role)) return null;
  if (typeof m.content !== "string") return null;
  const out = { role: m.role, content: m.content };
  for (const key of ["reasoning", "meta"]) if (typeof m[key] === "string") out[key] = m[key];
  if (m.json === true) out.json = true;
  if (Array.isArray(m.tool_calls)) out.tool_calls = JSON.parse(JSON.stringify(m.tool_calls));
  return out;
}

// A conversation from an exported file (ours, or any {messages: [...]} in OpenAI's shape);
// throws an Error that says what is wrong.
export function parseImport(text) {
  let data;
  try {
    data = JSON.parse(text);
  } catch (e) {
    throw new Error("That file is not JSON: " + e.message);
  }
  if (!data || !Array.isArray(data.messages)) throw new Error("That file has no \"messages\" list.");
  const messages = data.messages.filter((m) => m && m.role !== "system").map(cleanMessage);
  if (!messages.length || messages.includes(null)) {
    throw new Error("Each message needs a role (user or assistant) and a text content.");
  }
  const conversation = newConversation();
  conversation.title = typeof data.title === "string" ? data.title.slice(0, 200) : "";
  if (typeof data.model === "string" && data.model) conversation.model = data.model.slice(0, 200);
  conversation.messages = messages;
  return conversation;
}
