// The DOM of one message. User text is shown as text (textContent), its images as <img>; a reply as sanitized markdown
// (markdown.js), with its reasoning in a collapsed <details>, each tool call and a JSON reply as a
// formatted block, a line of figures and its action buttons. Buttons carry `data-action`; main.js
// handles them all with one listener on the log.
"use strict";

import { asJsonBlock, jsonFence, renderMarkdown } from "./markdown.js";

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function actionButton(action, label, ariaLabel) {
  const button = el("button", "action", label);
  button.type = "button";
  button.dataset.action = action;
  if (ariaLabel) button.setAttribute("aria-label", ariaLabel);
  return button;
}

function prettyArguments(args) {
  try {
    return JSON.stringify(JSON.parse(args), null, 2);
  } catch (_) {
    return args; // still streaming, or not JSON: shown as it came
  }
}

export class MessageView {
  constructor(message, index) {
    this.index = index;
    this.bubble = el("article", "msg " + message.role);
    this.bubble.dataset.index = index;
    if (message.role === "assistant") {
      this.reasoning = el("details", "reasoning");
      this.reasoning.hidden = true;
      this.summary = el("summary", "", "Thinking…");
      this.reasoningText = el("div", "md");
      this.reasoning.append(this.summary, this.reasoningText);
      this.content = el("div", "content md");
      this.tools = el("div", "tools");
      this.bubble.append(this.reasoning, this.content, this.tools);
    } else {
      this.content = el("div", "text content");
      this.bubble.append(this.content);
    }
    this.meta = el("div", "meta");
    this.actions = el("div", "msg-actions");
    this.bubble.append(this.meta, this.actions);
    this.update(message, false);
  }

  // Shows `message` as it stands; `streaming` while tokens still arrive.
  update(message, streaming) {
    this.bubble.classList.toggle("pending", streaming);
    if (streaming) this.bubble.setAttribute("aria-busy", "true");
    else this.bubble.removeAttribute("aria-busy");
    if (message.role === "user") {
      this.content.textContent = message.content;
      this.showImages(message.images || []);
    } else {
      this.showReply(message, streaming);
    }
    this.meta.textContent = message.meta || "";
  }

  showImages(urls) {
    if (!this.images) {
      this.images = el("div", "images");
      this.bubble.insertBefore(this.images, this.content);
    }
    this.images.hidden = !urls.length;
    this.images.replaceChildren(
      ...urls.map((url, i) => {
        const img = el("img");
        img.src = url; // a data: URL the user attached; never markup
        img.alt = `Image ${i + 1} of the message`;
        return img;
      }),
    );
  }

  showReply(message, streaming) {
    if (message.reasoning) {
      this.reasoning.hidden = false;
      renderMarkdown(this.reasoningText, message.reasoning);
    }
    this.summary.textContent = streaming && !message.content ? "Thinking…" : "Reasoning";
    let text = message.content;
    if (message.json) text = asJsonBlock(text) || jsonFence(text);
    else if (!streaming) text = asJsonBlock(text) || text;
    renderMarkdown(this.content, text);
    const calls = message.tool_calls || [];
    while (this.tools.children.length > calls.length) this.tools.lastChild.remove();
    calls.forEach((call, i) => {
      let block = this.tools.children[i];
      if (!block) {
        block = el("details", "tool-call");
        block.open = true;
        block.append(el("summary"), el("div", "md"));
        this.tools.append(block);
      }
      const fn = call.function || {};
      block.firstChild.textContent = `Tool call: ${fn.name || "…"}`;
      renderMarkdown(block.lastChild, jsonFence(prettyArguments(fn.arguments || "")));
    });
  }

  // The buttons under a finished message; `last` says whether it ends the conversation.
  setActions(message, last) {
    this.actions.replaceChildren();
    if (message.role === "user") {
      this.actions.append(actionButton("edit", "Edit", "Edit this message and resend from here"));
    } else {
      this.actions.append(actionButton("copy", "Copy", "Copy this reply"));
      if (last) this.actions.append(actionButton("regenerate", "Regenerate", "Regenerate this reply"));
    }
  }

  // Swaps the user text for an editor; `onDone(text or null)` when sent or cancelled.
  edit(onDone) {
    const original = this.content.textContent;
    const form = el("form", "editor");
    const area = el("textarea");
    area.value = original;
    area.rows = Math.min(12, original.split("\n").length + 1);
    area.setAttribute("aria-label", "Edit message");
    const send = el("button", "", "Send");
    send.type = "submit";
    const cancel = el("button", "secondary", "Cancel");
    cancel.type = "button";
    form.append(area, send, cancel);
    this.content.hidden = true;
    this.actions.hidden = true;
    this.bubble.insertBefore(form, this.content);
    const finish = (text) => {
      form.remove();
      this.content.hidden = false;
      this.actions.hidden = false;
      onDone(text);
    };
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      if (area.value.trim()) finish(area.value.trim());
    });
    cancel.addEventListener("click", () => finish(null));
    area.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        form.requestSubmit();
      } else if (e.key === "Escape") {
        e.stopPropagation();
        finish(null);
      }
    });
    area.focus();
  }
}
