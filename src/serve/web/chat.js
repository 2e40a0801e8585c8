/* moe serve's chat page: conversations in localStorage, replies streamed from
 * /v1/chat/completions (server-sent events), the model from /v1/models. Model text is only ever
 * put into the page as text nodes (never as HTML), so nothing it writes can run. */
"use strict";

const STORE_CHATS = "moe.chats";
const STORE_CURRENT = "moe.current";
const STORE_SETTINGS = "moe.settings";

const $ = (id) => document.getElementById(id);
let chats = [];       /* [{id, title, messages: [{role, content, reasoning, tool_calls, meta}]}] */
let current = null;   /* the conversation shown */
let controller = null; /* the AbortController of the reply being streamed */

/* ==== Storage ==== */

function load() {
  try { chats = JSON.parse(localStorage.getItem(STORE_CHATS) || "[]"); } catch { chats = []; }
  if (!Array.isArray(chats)) chats = [];
  const id = localStorage.getItem(STORE_CURRENT);
  current = chats.find((c) => c.id === id) || chats[0] || null;
  let s = {};
  try { s = JSON.parse(localStorage.getItem(STORE_SETTINGS) || "{}") || {}; } catch { s = {}; }
  for (const k of ["api-key", "system", "max-tokens", "temperature"])
    if (typeof s[k] === "string") $(k).value = s[k];
}

function save() {
  localStorage.setItem(STORE_CHATS, JSON.stringify(chats));
  if (current) localStorage.setItem(STORE_CURRENT, current.id);
}

function saveSettings() {
  const s = {};
  for (const k of ["api-key", "system", "max-tokens", "temperature"]) s[k] = $(k).value;
  localStorage.setItem(STORE_SETTINGS, JSON.stringify(s));
}

function newChat() {
  const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6),
              title: "New chat", messages: [] };
  chats.unshift(c);
  current = c;
  save();
  render();
}

/* ==== Rendering ==== */

/* Markdown-ish: ``` fenced blocks become <pre><code>, `spans` become <code>, the rest stays
 * text in paragraphs split at blank lines. An unclosed fence (mid-stream) runs to the end. */
function renderMarkdown(el, text) {
  el.replaceChildren();
  const fence = /^```([^\n`]*)\n?/m;
  let rest = text;
  while (rest.length) {
    const m = fence.exec(rest);
    if (!m) { paragraphs(el, rest); break; }
    if (m.index) paragraphs(el, rest.slice(0, m.index));
    rest = rest.slice(m.index + m[0].length);
    const end = rest.search(/^```[ \t]*$/m);
    const code = end < 0 ? rest : rest.slice(0, end);
    rest = end < 0 ? "" : rest.slice(end).replace(/^```[ \t]*\n?/, "");
    const pre = document.createElement("pre");
    if (m[1].trim()) pre.dataset.lang = m[1].trim();
    const c = document.createElement("code");
    c.textContent = code.replace(/\n$/, "");
    pre.append(c);
    el.append(pre);
  }
}

function paragraphs(el, text) {
  for (const para of text.split(/\n{2,}/)) {
    if (!para.trim()) continue;
    const p = document.createElement("p");
    const parts = para.replace(/^\n+|\n+$/g, "").split(/(`[^`\n]+`)/);
    for (const part of parts) {
      if (part.length > 2 && part[0] === "`" && part[part.length - 1] === "`") {
        const c = document.createElement("code");
        c.textContent = part.slice(1, -1);
        p.append(c);
      } else if (part) {
        p.append(document.createTextNode(part));
      }
    }
    el.append(p);
  }
}

function messageView(m) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role;
  div.append(role);
  if (m.reasoning) {
    const d = document.createElement("details");
    d.className = "reasoning";
    const s = document.createElement("summary");
    s.textContent = "Reasoning";
    const body = document.createElement("div");
    body.textContent = m.reasoning;
    d.append(s, body);
    div.append(d);
  }
  const content = document.createElement("div");
  content.className = "content";
  renderMarkdown(content, m.content || "");
  div.append(content);
  for (const call of m.tool_calls || []) {
    const t = document.createElement("div");
    t.className = "tool-call";
    const name = document.createElement("b");
    name.textContent = (call.function && call.function.name) || "?";
    const args = document.createElement("pre");
    let a = (call.function && call.function.arguments) || "";
    try { a = JSON.stringify(JSON.parse(a), null, 2); } catch { /* shown as sent */ }
    args.textContent = a;
    t.append("tool call ", name, args);
    div.append(t);
  }
  if (m.meta) {
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = m.meta;
    div.append(meta);
  }
  if (m.state) div.dataset.state = m.state;
  return div;
}

function renderList() {
  const ul = $("chats");
  ul.replaceChildren();
  for (const c of chats) {
    const li = document.createElement("li");
    if (c === current) li.className = "current";
    const title = document.createElement("span");
    title.textContent = c.title;
    const del = document.createElement("button");
    del.type = "button";
    del.title = "Delete";
    del.textContent = "×";
    del.addEventListener("click", (e) => {
      e.stopPropagation();
      if (controller && c === current) return;
      chats = chats.filter((x) => x !== c);
      if (current === c) current = chats[0] || null;
      save();
      render();
    });
    li.append(title, del);
    li.addEventListener("click", () => {
      if (controller) return; /* one reply at a time */
      current = c;
      save();
      render();
    });
    ul.append(li);
  }
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren(...(current ? current.messages.map(messageView) : []));
  box.scrollTop = box.scrollHeight;
}

function render() {
  renderList();
  renderMessages();
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function setStreaming(on) {
  $("send").disabled = on;
  $("stop").hidden = !on;
}

/* ==== The API ==== */

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorText(res) {
  const body = await res.text();
  try {
    const e = JSON.parse(body).error;
    return `${res.status}: ${(e && e.message) || body}`;
  } catch {
    return `${res.status}: ${body || res.statusText}`;
  }
}

async function loadModel() {
  try {
    const res = await fetch("/v1/models", { headers: headers() });
    if (!res.ok) { $("model").textContent = "model: " + (await errorText(res)); return; }
    const m = (await res.json()).data[0];
    const ctx = m.context_length || m.max_model_len;
    $("model").textContent = `model: ${m.id}` + (ctx ? ` · context ${ctx}` : "");
  } catch (e) {
    $("model").textContent = "model: unreachable (" + e.message + ")";
  }
}

/* The history as the API takes it. */
function apiMessages(c) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of c.messages) {
    if (m.role === "assistant") {
      const a = { role: "assistant", content: m.content || "" };
      if (m.tool_calls && m.tool_calls.length) a.tool_calls = m.tool_calls;
      out.push(a);
    } else {
      out.push({ role: m.role, content: m.content });
    }
  }
  return out;
}

/* Server-sent events from a fetch body: calls onData(json) for every `data:` line. */
async function readEvents(body, onData) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).replace(/\r$/, "");
      buf = buf.slice(nl + 1);
      if (!line.startsWith("data:")) continue; /* comments (keep-alives), event names */
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onData(JSON.parse(data));
    }
  }
}

function fmtStats(n, seconds) {
  const tps = seconds > 0 ? (n / seconds).toFixed(1) : "–";
  return `${n} tokens · ${tps} tok/s`;
}

async function send(text) {
  if (!current) newChat();
  const c = current;
  c.messages.push({ role: "user", content: text });
  if (c.title === "New chat") c.title = text.slice(0, 40);
  const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [], state: "streaming" };
  const history = apiMessages(c);
  c.messages.push(reply);
  save();
  render();
  showError("");
  setStreaming(true);
  const view = () => $("messages").lastElementChild;
  let chunks = 0, tFirst = 0, usage = null;
  const update = () => {
    const fresh = messageView(reply);
    const open = view().querySelector("details.reasoning");
    if (open && open.open) fresh.querySelector("details.reasoning").open = true;
    view().replaceWith(fresh);
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
    if (tFirst) $("stats").textContent = fmtStats(chunks, (performance.now() - tFirst) / 1000);
  };
  controller = new AbortController();
  const body = {
    messages: history, stream: true, stream_options: { include_usage: true },
    max_tokens: parseInt($("max-tokens").value, 10) || undefined,
    temperature: parseFloat($("temperature").value),
  };
  if (Number.isNaN(body.temperature)) delete body.temperature;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!res.ok) throw new Error(await errorText(res));
    await readEvents(res.body, (ev) => {
      if (ev.error) throw new Error(ev.error.message || JSON.stringify(ev.error));
      if (ev.usage) usage = ev.usage;
      const ch = ev.choices && ev.choices[0];
      if (!ch || !ch.delta) return;
      const d = ch.delta;
      if (d.content || d.reasoning_content || d.tool_calls) {
        if (!tFirst) tFirst = performance.now();
        chunks++;
      }
      if (d.content) reply.content += d.content;
      if (d.reasoning_content) reply.reasoning += d.reasoning_content;
      for (const t of d.tool_calls || []) {
        const at = t.index || 0;
        const prev = reply.tool_calls[at];
        if (!prev) {
          reply.tool_calls[at] = { id: t.id, type: "function",
            function: { name: (t.function && t.function.name) || "",
                        arguments: (t.function && t.function.arguments) || "" } };
        } else if (t.function) {
          prev.function.name += t.function.name || "";
          prev.function.arguments += t.function.arguments || "";
        }
      }
      if (ch.finish_reason) reply.finish = ch.finish_reason;
      update();
    });
    reply.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      reply.state = "stopped";
    } else {
      reply.state = "error";
      showError(e.message);
    }
  }
  const seconds = tFirst ? (performance.now() - tFirst) / 1000 : 0;
  const n = usage ? usage.completion_tokens : chunks;
  reply.meta = (reply.state === "stopped" ? "stopped · " : "") + fmtStats(n, seconds) +
               (reply.finish ? ` · ${reply.finish}` : "");
  $("stats").textContent = fmtStats(n, seconds);
  controller = null;
  setStreaming(false);
  save();
  update();
}

/* ==== Wiring ==== */

function init() {
  load();
  for (const k of ["api-key", "system", "max-tokens", "temperature"])
    $(k).addEventListener("change", saveSettings);
  $("api-key").addEventListener("change", loadModel);
  $("new-chat").addEventListener("click", () => { if (!controller) newChat(); });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  /* a reply left streaming by a closed tab is what was saved of it */
  for (const c of chats)
    for (const m of c.messages) if (m.state === "streaming") m.state = "stopped";
  render();
  loadModel();
}

init();
