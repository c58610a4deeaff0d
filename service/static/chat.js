"use strict";

/*
 * The chat page: keeps the conversation, streams each reply from POST /v1/chat/completions, and
 * shows per reply the time to first token, tokens per second and whether the cache answered.
 * Model output is only ever put into the page as text (textContent, text nodes), never as markup.
 */

const API_KEY_STORAGE = "corechat.apiKey";
const COMPLETIONS_URL = "/v1/chat/completions";

const page = {
  conversation: document.getElementById("conversation"),
  composer: document.getElementById("composer"),
  prompt: document.getElementById("prompt"),
  send: document.getElementById("send"),
  stop: document.getElementById("stop"),
  newChat: document.getElementById("new-chat"),
  settings: document.getElementById("settings"),
  apiKey: document.getElementById("api-key"),
  systemPrompt: document.getElementById("system-prompt"),
  temperature: document.getElementById("temperature"),
  maxTokens: document.getElementById("max-tokens"),
};

// The conversation so far, as OpenAI messages (the system prompt is added per request).
let history = [];
let running = null;

/** Append a message bubble and return it with its content element. */
function addBubble(kind, text = "") {
  const bubble = document.createElement("div");
  bubble.className = `message ${kind}`;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  bubble.append(content);
  page.conversation.append(bubble);
  scrollToEnd();
  return { bubble, content };
}

function scrollToEnd() {
  page.conversation.scrollTop = page.conversation.scrollHeight;
}

function showError(text) {
  addBubble("error", text);
}

/** Build the request headers, with the API key if one was entered. */
function requestHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = page.apiKey.value.trim();
  if (key) {
    headers.Authorization = `Bearer ${key}`;
  }
  return headers;
}

function requestBody() {
  const messages = [];
  const system = page.systemPrompt.value.trim();
  if (system) {
    messages.push({ role: "system", content: system });
  }
  messages.push(...history);
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat(page.temperature.value);
  if (!Number.isNaN(temperature)) {
    body.temperature = temperature;
  }
  const maxTokens = parseInt(page.maxTokens.value, 10);
  if (!Number.isNaN(maxTokens)) {
    body.max_tokens = maxTokens;
  }
  return body;
}

/** Turn a refused request into a sentence a person can act on. */
async function describeHttpError(response) {
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    message = body.error?.message || message;
  } catch {
    // Not JSON (a proxy's HTML page, say): the status line is all there is.
  }
  const status = response.status;
  if (status === 401) {
    page.settings.open = true;
    return `The server refused the API key (401): ${message}. Enter a valid key in Settings.`;
  }
  if (status === 503 || status === 429) {
    const retryAfter = response.headers.get("Retry-After");
    const wait = retryAfter ? ` Try again in ${retryAfter} s.` : "";
    return `The server is busy (${status}): ${message}.${wait}`;
  }
  if (status >= 400 && status < 500) {
    return `The server rejected the request (${status}): ${message}`;
  }
  return `The server failed (${status}): ${message}`;
}

function formatStats(reply) {
  const parts = [];
  if (reply.firstTokenAt !== null) {
    parts.push(`first token ${((reply.firstTokenAt - reply.startedAt) / 1000).toFixed(2)} s`);
  }
  const tokens = reply.completionTokens ?? reply.deltas;
  const approximate = reply.completionTokens === null ? "≈" : "";
  parts.push(`${approximate}${tokens} tokens`);
  const decodeSeconds = (reply.endedAt - reply.firstTokenAt) / 1000;
  if (reply.firstTokenAt !== null && tokens > 1 && decodeSeconds > 0) {
    parts.push(`${((tokens - 1) / decodeSeconds).toFixed(1)} tokens/s`);
  }
  if (reply.cache) {
    parts.push(`cache ${reply.cache}`);
  }
  if (reply.finishReason) {
    parts.push(`finish: ${reply.finishReason}`);
  }
  if (reply.state === "stopped") {
    parts.push("stopped");
  }
  return parts.join(" · ");
}

/** Apply one parsed SSE event of the stream to the reply. */
function applyEvent(reply, event) {
  if (event.data === "[DONE]") {
    reply.done = true;
    return;
  }
  const payload = JSON.parse(event.data);
  if (payload.error) {
    reply.failure = payload.error.message || "the server failed while streaming";
    return;
  }
  if (payload.usage) {
    reply.completionTokens = payload.usage.completion_tokens;
  }
  const choice = payload.choices?.[0];
  if (!choice) {
    return;
  }
  if (choice.delta?.content) {
    if (reply.firstTokenAt === null) {
      reply.firstTokenAt = performance.now();
    }
    reply.deltas += 1;
    reply.text += choice.delta.content;
    // A text node per piece: setting the whole text again on every piece made a long reply cost the
    // page its length squared (a 30,000-token stream kept a core busy for minutes).
    reply.content.append(choice.delta.content);
    scrollToEnd();
  }
  if (choice.finish_reason) {
    reply.finishReason = choice.finish_reason;
  }
}

/** Read the streamed body to its end (or until Stop), feeding the SSE parser. */
async function readStream(response, reply) {
  const parser = new SSEParser((event) => applyEvent(reply, event));
  const reader = response.body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) {
      parser.end();
      return;
    }
    parser.push(value);
  }
}

function setRunning(isRunning) {
  page.send.disabled = isRunning;
  page.stop.disabled = !isRunning;
  page.newChat.disabled = isRunning;
}

/** Send the conversation and stream the reply into a new bubble. */
async function sendMessage(text) {
  history.push({ role: "user", content: text });
  addBubble("user", text);
  const { bubble, content } = addBubble("assistant");
  const reply = {
    bubble, content, text: "", deltas: 0, completionTokens: null, finishReason: null, cache: null,
    failure: null, done: false, state: "streaming",
    startedAt: performance.now(), firstTokenAt: null, endedAt: null,
  };
  bubble.dataset.state = reply.state;
  const controller = new AbortController();
  running = controller;
  setRunning(true);
  try {
    const response = await fetch(COMPLETIONS_URL, {
      method: "POST",
      headers: requestHeaders(),
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
      cache: "no-store",
    });
    if (!response.ok) {
      throw new Error(await describeHttpError(response));
    }
    reply.cache = response.headers.get("X-Cache");
    await readStream(response, reply);
    if (reply.failure) {
      throw new Error(`The server failed mid-reply: ${reply.failure}`);
    }
    if (!reply.done) {
      throw new Error("The connection closed before the reply was complete.");
    }
    reply.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      reply.state = "stopped";
    } else {
      reply.state = "error";
      showError(error instanceof TypeError ? `Could not reach the server: ${error.message}` : error.message);
    }
  } finally {
    running = null;
    setRunning(false);
  }
  reply.endedAt = performance.now();
  finishReply(reply, text);
}

/** Record the reply in the conversation (or take back the question when nothing came). */
function finishReply(reply, question) {
  reply.bubble.dataset.state = reply.state;
  if (reply.text === "") {
    // Nothing to keep: drop the exchange and give the question back for another try.
    history.pop();
    reply.bubble.previousElementSibling.remove();
    reply.bubble.remove();
    if (page.prompt.value === "") {
      page.prompt.value = question;
    }
    return;
  }
  history.push({ role: "assistant", content: reply.text });
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = formatStats(reply);
  reply.bubble.append(stats);
  scrollToEnd();
}

page.composer.addEventListener("submit", (submitted) => {
  submitted.preventDefault();
  const text = page.prompt.value.trim();
  if (!text || running) {
    return;
  }
  page.prompt.value = "";
  sendMessage(text);
});

page.prompt.addEventListener("keydown", (pressed) => {
  if (pressed.key === "Enter" && !pressed.shiftKey && !pressed.isComposing) {
    pressed.preventDefault();
    page.composer.requestSubmit();
  }
});

page.stop.addEventListener("click", () => running?.abort());

page.newChat.addEventListener("click", () => {
  history = [];
  page.conversation.replaceChildren();
});

page.apiKey.value = localStorage.getItem(API_KEY_STORAGE) || "";
page.apiKey.addEventListener("change", () => {
  const key = page.apiKey.value.trim();
  if (key) {
    localStorage.setItem(API_KEY_STORAGE, key);
  } else {
    localStorage.removeItem(API_KEY_STORAGE);
  }
});
