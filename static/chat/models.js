// The header's model: with one model (LLM_MODEL) its name as the page's heading, as it always was;
// with several (LLM_MODELS_DIR) a labelled <select> of every id /v1/models lists, each with what the
// listing says of it (loaded, not loaded, loading, failed to load), the heading kept for screen
// readers. main.js decides which model a conversation talks to; this file only shows and reads it.
//
// Contract: `refresh()` reads /v1/models again (after each reply, after a 404 model_not_found, when
// the API key changes) and keeps the selection when it is still listed. `select(id)` shows `id`
// when listed, else the last pick, else the first listed; `value` is the id shown, the one requests
// send (null until the first listing arrives). `offers(id)` and `status(id)` read the listing;
// `mayLoad(id)` reads it again first, and says whether a 503 for `id` is worth waiting out.
// `onPick(id)` is told when a person picks; their pick is remembered in localStorage ("chat.model")
// as `lastPick`, the model a new chat starts with.
"use strict";

import { listModels } from "./api.js";

const $ = (id) => document.getElementById(id);
const LAST_PICK = "chat.model";
const HINTS = { loaded: "loaded", unloaded: "not loaded", loading: "loading…", failed: "failed to load" };

export class ModelPicker {
  constructor({ onPick }) {
    this.models = null; // /v1/models' data, once read
    this.wanted = null; // the id main.js asked for, shown once it is listed
    this.node = $("model-picker");
    this.node.addEventListener("change", () => {
      this.wanted = this.node.value;
      localStorage.setItem(LAST_PICK, this.wanted);
      this.showName();
      onPick(this.wanted);
    });
  }

  get lastPick() {
    return localStorage.getItem(LAST_PICK);
  }

  get value() {
    return this.models && this.models.length ? this.node.value : null;
  }

  offers(id) {
    return Boolean(this.models && this.models.some((m) => m.id === id));
  }

  status(id) {
    const model = this.models && this.models.find((m) => m.id === id);
    return model ? model.status || "loaded" : null; // a lone LLM_MODEL is listed without one: it is loaded
  }

  // Not when the listing says its load failed: the server refuses it at once until its file changes.
  async mayLoad(id) {
    try {
      await this.refresh();
    } catch (_) {
      return true; // the listing could not be read: the retries decide
    }
    return this.status(id) !== "failed";
  }

  async refresh() {
    this.models = await listModels();
    this.render();
  }

  select(id) {
    this.wanted = id;
    this.render();
  }

  render() {
    if (!this.models) return;
    const several = this.models.length > 1;
    $("model-choice").hidden = !several;
    $("model-name").classList.toggle("sr-only", several);
    const options = this.models.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = m.status && HINTS[m.status] ? `${m.id} · ${HINTS[m.status]}` : m.id;
      return option;
    });
    const same = options.length === this.node.options.length
      && options.every((o, i) => o.value === this.node.options[i].value && o.textContent === this.node.options[i].textContent);
    if (!same) this.node.replaceChildren(...options);
    const shown = [this.wanted, this.lastPick].find((id) => this.offers(id));
    if (shown) this.node.value = shown;
    else if (options.length) this.node.selectedIndex = 0;
    this.showName();
  }

  showName() {
    const name = this.value || "Chat";
    $("model-name").textContent = name;
    document.title = this.value ? `${name} · Chat` : "Chat";
  }
}
