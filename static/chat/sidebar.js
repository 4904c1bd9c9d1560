// The side list of saved conversations: open, rename (inline), delete (asked twice), search, import,
// and export of the open one. It reads and writes store.js and tells main.js through callbacks:
// open(id) to show a conversation, deleted(id) after a delete, imported(conversation).
"use strict";

import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const CONFIRM_MS = 4000; // how long a first click on Delete waits for the second

function button(className, text, ariaLabel) {
  const node = document.createElement("button");
  node.type = "button";
  node.className = className;
  node.textContent = text;
  if (ariaLabel) node.setAttribute("aria-label", ariaLabel);
  return node;
}

function download(name, type, text) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const link = document.createElement("a");
  link.href = url;
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

function fileName(conversation, extension) {
  const stem = store.titleOf(conversation).replace(/[^\w\- ]+/g, "").trim().replace(/\s+/g, "-").slice(0, 40);
  return `${stem || "chat"}.${extension}`;
}

export class Sidebar {
  constructor({ current, open, deleted, imported, failed }) {
    this.current = current; // () => the conversation on screen
    this.callbacks = { open, deleted, imported, failed };
    $("search").addEventListener("input", () => this.render());
    $("import").addEventListener("click", () => $("import-file").click());
    $("import-file").addEventListener("change", () => this.importFile());
    $("export-md").addEventListener("click", () => this.export("md"));
    $("export-json").addEventListener("click", () => this.export("json"));
    $("open-sidebar").addEventListener("click", () => this.show(true));
    $("close-sidebar").addEventListener("click", () => this.show(false));
    document.querySelector(".main").addEventListener("click", (e) => {
      if (document.body.classList.contains("side-open") && !e.target.closest("#open-sidebar")) this.show(false);
    });
    $("sidebar").addEventListener("keydown", (e) => {
      if (e.key === "Escape" && document.body.classList.contains("side-open")) this.show(false);
    });
  }

  // Opens or closes the list where it slides over the page (narrow screens).
  show(open, moveFocus = true) {
    document.body.classList.toggle("side-open", open);
    $("open-sidebar").setAttribute("aria-expanded", String(open));
    if (moveFocus) (open ? $("search") : $("open-sidebar")).focus();
  }

  render() {
    const query = $("search").value;
    const all = store.listConversations();
    const shown = all.filter((c) => store.matches(c, query));
    const current = this.current();
    const list = $("conversations");
    list.replaceChildren(...shown.map((c) => this.item(c, current && c.id === current.id)));
    const empty = $("no-conversations");
    empty.hidden = shown.length > 0;
    empty.textContent = all.length ? "No chat matches." : "No saved chats yet.";
  }

  item(conversation, isCurrent) {
    const title = store.titleOf(conversation);
    const li = document.createElement("li");
    li.className = "conversation" + (isCurrent ? " current" : "");
    const open = button("open", title);
    open.title = title;
    if (isCurrent) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => {
      this.callbacks.open(conversation.id);
      this.show(false, false);
    });
    const rename = button("icon rename", "✎", `Rename “${title}”`);
    rename.title = "Rename";
    rename.addEventListener("click", () => this.rename(li, conversation));
    const remove = button("icon delete", "✕", `Delete “${title}”`);
    remove.title = "Delete";
    remove.addEventListener("click", () => this.remove(remove, conversation, title));
    li.append(open, rename, remove);
    return li;
  }

  rename(li, conversation) {
    const input = document.createElement("input");
    input.value = store.titleOf(conversation);
    input.setAttribute("aria-label", "New name");
    input.className = "rename-input";
    li.replaceChildren(input);
    input.focus();
    input.select();
    let done = false;
    const finish = (save) => {
      if (done) return;
      done = true;
      const fresh = store.getConversation(conversation.id);
      if (save && fresh && input.value.trim()) {
        fresh.title = input.value.trim().slice(0, 200);
        store.saveConversation(fresh, false);
        const shown = this.current();
        if (shown && shown.id === fresh.id) shown.title = fresh.title;
      }
      this.render();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") finish(true);
      else if (e.key === "Escape") {
        e.stopPropagation();
        finish(false);
      }
    });
    input.addEventListener("blur", () => finish(true));
  }

  remove(node, conversation, title) {
    if (node.dataset.confirm !== "yes") {
      node.dataset.confirm = "yes";
      node.textContent = "Delete?";
      node.setAttribute("aria-label", `Really delete “${title}”? Press again to delete`);
      setTimeout(() => {
        node.dataset.confirm = "";
        node.textContent = "✕";
        node.setAttribute("aria-label", `Delete “${title}”`);
      }, CONFIRM_MS);
      return;
    }
    store.deleteConversation(conversation.id);
    this.callbacks.deleted(conversation.id);
    this.render();
  }

  export(kind) {
    const conversation = this.current();
    if (!conversation || !conversation.messages.length) {
      this.callbacks.failed("There is nothing to export yet.");
      return;
    }
    if (kind === "md") download(fileName(conversation, "md"), "text/markdown", store.toMarkdown(conversation));
    else download(fileName(conversation, "json"), "application/json", store.toJson(conversation));
  }

  async importFile() {
    const input = $("import-file");
    const file = input.files[0];
    input.value = "";
    if (!file) return;
    try {
      const conversation = store.parseImport(await file.text());
      store.saveConversation(conversation);
      this.callbacks.imported(conversation);
    } catch (e) {
      this.callbacks.failed("Could not import " + file.name + ": " + e.message);
    }
    this.render();
  }
}
