// Talking to /v1/chat/completions like any other API client.
//
// Contract: `openStream(body, {signal, onWait, worthWaiting})` POSTs a streaming chat request and
// resolves to the Response once the server accepts it. A 429 (every slot and the queue taken) or 503
// (model still loading) is not an error yet: `onWait(message, secondsLeft)` is told once a second
// while it waits for the server's Retry-After, then it asks again, up to MAX_TRIES times, unless
// `await worthWaiting()` says no first (a model set's model that failed to load answers 503 at once
// until its file changes); Stop (the signal) ends the wait at once. Any other refusal throws an
// Error whose message a person can act on.
// `events(response)` yields each JSON payload of the server-sent event stream. `listModels()` is
// /v1/models' `data`: one entry with LLM_MODEL, every model of the folder with LLM_MODELS_DIR (each
// with its `status`: loaded, loading, unloaded or failed). A thrown Error carries the HTTP `status`,
// the API's error `code` (model_not_found: the named model is not, or no longer, offered) and the
// server's own words (`detail`).
"use strict";

const MAX_TRIES = 8;
const DEFAULT_WAIT_S = 2; // when a 429/503 comes without Retry-After
const MAX_WAIT_S = 60;

export function headers() {
  const h = { "Content-Type": "application/json" };
  const key = document.getElementById("api-key");
  if (key && key.value.trim()) h.Authorization = "Bearer " + key.value.trim();
  return h;
}

async function errorBody(response) {
  try {
    const body = await response.json();
    return (body && body.error) || {};
  } catch (_) {
    return {}; // not JSON: only the status line is known
  }
}

function retryAfter(response) {
  const wait = parseInt(response.headers.get("Retry-After"), 10);
  return Math.min(wait > 0 ? wait : DEFAULT_WAIT_S, MAX_WAIT_S);
}

function waitingMessage(status, error, detail, seconds) {
  let why = `The model is not ready yet (${detail}).`;
  if (status === 429) why = "The server is busy: every slot and the queue are taken.";
  else if (error.code === "model_busy") why = "Every loaded model is busy, so this one cannot be loaded yet.";
  return `${why} Trying again in ${seconds} s…`;
}

// An Error whose message says what went wrong in words a person can act on.
export function describeError(response, error) {
  const detail = error.message || `${response.status} ${response.statusText}`.trim();
  let message = detail;
  if (response.status === 429) {
    message = "The server is busy: every slot and the queue are taken. Try again shortly.";
  } else if (error.code === "context_length_exceeded") {
    message = "This conversation is too long for the model. " + detail + " Start a new chat, or send something shorter.";
  } else if (response.status === 503) {
    message = "The model is not ready yet (" + detail + "). Try again in a moment.";
  } else if (response.status === 401) {
    message = "The server wants an API key: enter it under Settings.";
  } else if (error.param) {
    message = `${detail} (${error.param})`;
  }
  const e = new Error(message);
  e.status = response.status;
  e.code = error.code || null;
  e.detail = detail;
  return e;
}

function sleep(seconds, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, seconds * 1000);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(new DOMException("Stopped while waiting", "AbortError"));
    }, { once: true });
  });
}

export async function openStream(body, { signal, onWait, worthWaiting = async () => true }) {
  for (let attempt = 1; ; attempt++) {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal,
    });
    if (response.ok) return response;
    const error = await errorBody(response);
    const transient = response.status === 429 || (response.status === 503 && error.code !== "cancelled");
    if (!transient || attempt >= MAX_TRIES || !(await worthWaiting())) throw describeError(response, error);
    const detail = error.message || response.statusText;
    for (let left = retryAfter(response); left > 0; left--) {
      onWait(waitingMessage(response.status, error, detail, left));
      await sleep(1, signal);
    }
    onWait("");
  }
}

export async function* events(response) {
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

export async function listModels() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) throw describeError(response, await errorBody(response));
  const body = await response.json();
  return body.data;
}

function seconds(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

// "42 tokens · 31.5 tok/s · first token 120 ms · 96 of 120 prompt tokens cached"
export function figures(finish, usage, timing) {
  const notes = [];
  if (finish === "length") notes.push("cut off at the token limit");
  else if (finish === "stopped") notes.push("stopped");
  else if (finish === "error") notes.push("failed");
  else if (finish && finish !== "stop") notes.push(finish.replace("_", " "));
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
