// Markdown for model replies: marked parses, DOMPurify sanitizes, highlight.js colours code.
//
// Contract: `renderMarkdown(container, text)` makes `container` show `text` as sanitized markup and
// may be called again with a longer text on every streamed token. The text is split into marked's
// top-level blocks; a block whose source is unchanged keeps its DOM node, so only the growing last
// block is rebuilt: no flicker, selections and copy buttons above it survive, and the cost per
// token stays that of one block. Model text is untrusted: raw HTML in it is shown as text, images
// become links (no request leaves the page on a reply's say-so), and every fragment of markup goes
// through DOMPurify, whose URI rules drop `javascript:` links.
"use strict";

const { Marked } = window.marked;
const DOMPurify = window.DOMPurify;
const hljs = window.hljs;

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

const parser = new Marked({
  gfm: true,
  breaks: true, // a model's single newline is meant as a line break
  renderer: {
    html(token) {
      const text = escapeHtml(token.text);
      return token.block ? `<p>${text}</p>` : text;
    },
    image(token) {
      const label = escapeHtml(token.text || token.href);
      return `<a href="${escapeHtml(token.href)}">${label}</a>`;
    },
  },
});

const PURIFY = {
  RETURN_DOM_FRAGMENT: true,
  FORBID_TAGS: ["style", "img", "svg", "math", "form", "input", "button", "textarea", "select", "iframe"],
  FORBID_ATTR: ["style", "class", "id"], // classes are ours to give; an id could clobber ours
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});

// "python" from a fence's info string such as "python title=x.py".
function fenceLanguage(token) {
  return (token.lang || "").trim().split(/\s+/)[0].toLowerCase();
}

function codeBlock(token) {
  const language = fenceLanguage(token);
  const figure = document.createElement("div");
  figure.className = "code";
  const head = document.createElement("div");
  head.className = "code-head";
  const label = document.createElement("span");
  label.textContent = language || "text";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy-code";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", `Copy ${language || "text"} code`);
  head.append(label, copy);
  const pre = document.createElement("pre");
  pre.tabIndex = 0; // a wide block scrolls sideways; the keyboard must be able to scroll it too
  const code = document.createElement("code");
  code.className = "hljs";
  const source = token.text;
  if (language && hljs.getLanguage(language)) {
    const html = hljs.highlight(source, { language, ignoreIllegals: true }).value;
    code.append(DOMPurify.sanitize(html, { RETURN_DOM_FRAGMENT: true, ALLOWED_TAGS: ["span"], ALLOWED_ATTR: ["class"] }));
  } else {
    code.textContent = source;
  }
  pre.append(code);
  figure.append(head, pre);
  return figure;
}

function renderBlock(token) {
  if (token.type === "code") return codeBlock(token);
  const block = document.createElement("div");
  block.className = "md-block";
  block.append(DOMPurify.sanitize(parser.parser([token]), PURIFY));
  for (const table of block.querySelectorAll("table")) {
    // wide tables scroll inside the bubble instead of stretching it
    const wrap = document.createElement("div");
    wrap.className = "table-wrap";
    wrap.tabIndex = 0;
    table.replaceWith(wrap);
    wrap.append(table);
  }
  return block;
}

export function renderMarkdown(container, text) {
  const tokens = parser.lexer(text).filter((t) => t.type !== "space" && t.type !== "def");
  const kept = container._mdBlocks || [];
  const next = [];
  tokens.forEach((token, i) => {
    const old = kept[i];
    const raw = token.raw.trimEnd(); // a block's trailing newlines arrive after it is complete
    if (old && old.raw === raw) {
      next.push(old);
      return;
    }
    const node = renderBlock(token);
    if (old) old.node.replaceWith(node);
    else container.append(node);
    next.push({ raw, node });
  });
  for (const gone of kept.slice(tokens.length)) gone.node.remove();
  container._mdBlocks = next;
}

// Replies that are JSON (structured output) show as one formatted, highlighted block.
export function asJsonBlock(text) {
  const trimmed = text.trim();
  if (!/^[[{]/.test(trimmed)) return null;
  try {
    return "```json\n" + JSON.stringify(JSON.parse(trimmed), null, 2) + "\n```";
  } catch (_) {
    return null;
  }
}

export function jsonFence(text) {
  return "```json\n" + text + "\n```";
}

// Copies `text`; the fallback covers browsers without the async clipboard API.
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.className = "offscreen";
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

// One listener for every code block's Copy button, present or future.
export function handleCodeCopy(root) {
  root.addEventListener("click", async (e) => {
    const button = e.target.closest(".copy-code");
    if (!button) return;
    const code = button.closest(".code").querySelector("code");
    await copyText(code.textContent);
    button.textContent = "Copied";
    setTimeout(() => (button.textContent = "Copy"), 1500);
  });
}
