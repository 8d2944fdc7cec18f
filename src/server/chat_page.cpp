#include "server/chat_page.h"

namespace sparsemla::server {

// Streams replies from /v1/chat/completions (SSE read from fetch's body), shows reasoning in a
// collapsed <details>, tool calls as JSON, and the token counts of the last reply.
const std::string_view kChatPage = R"html(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>sparsemla chat</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0; display: flex; flex-direction: column; height: 100vh; }
  header { padding: 8px 12px; background: #223; color: #eee; display: flex; gap: 12px; align-items: center; flex-wrap: wrap; }
  header label { font-size: 13px; }
  header input { width: 70px; }
  #messages { flex: 1; overflow-y: auto; padding: 12px; background: #f6f6f8; }
  .msg { max-width: 800px; margin: 8px auto; padding: 8px 12px; border-radius: 8px; white-space: pre-wrap; }
  .user { background: #dde7ff; }
  .assistant { background: #fff; border: 1px solid #ddd; }
  .error { background: #fdd; }
  details.reasoning { color: #555; font-size: 14px; margin-bottom: 6px; }
  pre.tool { background: #eef; padding: 6px; white-space: pre-wrap; }
  footer { display: flex; gap: 8px; padding: 8px 12px; border-top: 1px solid #ccc; }
  #input { flex: 1; height: 60px; font: inherit; }
  #status { font-size: 12px; color: #666; padding: 0 12px 6px; }
</style>
</head>
<body>
<header>
  <strong>sparsemla</strong> <span id="model">…</span>
  <label>temperature <input id="temperature" type="number" step="0.1" min="0" value="0.7"></label>
  <label>max tokens <input id="max-tokens" type="number" min="1" value="512"></label>
  <label>system <input id="system" style="width:200px" placeholder="(none)"></label>
  <label>API key <input id="api-key" type="password" style="width:120px"></label>
  <button id="clear">New chat</button>
</header>
<div id="messages"></div>
<div id="status"></div>
<footer>
  <textarea id="input" placeholder="Message (Enter to send, Shift+Enter for a new line)"></textarea>
  <button id="send">Send</button>
  <button id="stop" disabled>Stop</button>
</footer>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const state = { history: [], busy: false, controller: null, model: "" };
window.chatState = state;

$("api-key").value = localStorage.getItem("sparsemla-api-key") || "";
$("api-key").addEventListener("change", () => localStorage.setItem("sparsemla-api-key", $("api-key").value));

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("api-key").value) h["Authorization"] = "Bearer " + $("api-key").value;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const j = await r.json();
    if (j.data && j.data.length) { state.model = j.data[0].id; $("model").textContent = state.model; }
    else $("model").textContent = j.error ? j.error.message : "no model";
  } catch (e) { $("model").textContent = "offline"; }
}

function bubble(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  $("messages").appendChild(div);
  return div;
}

// An assistant reply as it streams: reasoning (collapsed), content, tool calls.
function replyView() {
  const div = bubble("assistant");
  const view = { div, reasoning: "", content: "", toolCalls: [], details: null, contentNode: document.createElement("div") };
  view.contentNode.className = "content";
  div.appendChild(view.contentNode);
  return view;
}

function applyDelta(view, delta) {
  if (delta.reasoning_content) {
    if (!view.details) {
      view.details = document.createElement("details");
      view.details.className = "reasoning";
      view.details.innerHTML = "<summary>Reasoning</summary><div class='text'></div>";
      view.div.insertBefore(view.details, view.contentNode);
    }
    view.reasoning += delta.reasoning_content;
    view.details.querySelector(".text").textContent = view.reasoning;
  }
  if (delta.content) {
    view.content += delta.content;
    view.contentNode.textContent = view.content;
  }
  for (const call of delta.tool_calls || []) {
    view.toolCalls.push(call);
    const pre = document.createElement("pre");
    pre.className = "tool";
    pre.textContent = call.function.name + "(" + call.function.arguments + ")";
    view.div.appendChild(pre);
  }
  $("messages").scrollTop = $("messages").scrollHeight;
}

// Reads the SSE body; calls onEvent for every JSON event until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send() {
  const text = $("input").value;
  if (state.busy || !text.trim()) return;
  $("input").value = "";
  bubble("user").textContent = text;
  state.history.push({ role: "user", content: text });
  const messages = [];
  if ($("system").value) messages.push({ role: "system", content: $("system").value });
  messages.push(...state.history);
  const body = {
    messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  if (state.model) body.model = state.model;
  setBusy(true);
  const view = replyView();
  const started = performance.now();
  let usage = null, finish = null;
  state.controller = new AbortController();
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      throw new Error(j.error ? j.error.message : "HTTP " + r.status);
    }
    await readEvents(r, (ev) => {
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) usage = ev.usage;
      for (const c of ev.choices || []) {
        applyDelta(view, c.delta || {});
        if (c.finish_reason) finish = c.finish_reason;
      }
    });
    const msg = { role: "assistant", content: view.content };
    if (view.toolCalls.length) msg.tool_calls = view.toolCalls;
    state.history.push(msg);
    const secs = (performance.now() - started) / 1000;
    $("status").textContent = (usage ? usage.prompt_tokens + " prompt + " + usage.completion_tokens + " generated tokens, " : "") +
      secs.toFixed(2) + " s" + (finish ? ", finish: " + finish : "");
  } catch (e) {
    if (e.name !== "AbortError") { view.div.classList.add("error"); view.div.appendChild(document.createTextNode("\n" + e.message)); }
    state.history.pop();
  } finally {
    view.div.dataset.done = "1";
    setBusy(false);
  }
}

function setBusy(b) {
  state.busy = b;
  $("send").disabled = b;
  $("stop").disabled = !b;
}

$("send").addEventListener("click", send);
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => { state.history = []; $("messages").innerHTML = ""; $("status").textContent = ""; });
$("input").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } });
loadModel();
</script>
</body>
</html>
)html";

}  // namespace sparsemla::server
