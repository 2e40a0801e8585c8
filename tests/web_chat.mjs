// The chat page of `moe serve` in headless Chromium, driven over the DevTools protocol (a pipe:
// --remote-debugging-pipe, JSON messages ended by NUL on fds 3 and 4; no npm packages needed).
//
//   node tests/web_chat.mjs --bin ./moe --model CHAT.gguf --tmp DIR [--keep SHOT.png]
//
// Starts `moe serve` (an API key, --step-delay so a reply lasts long enough to stop), checks
// the page's files as served (bytes equal to src/serve/web/, Content-Type, CSP), then in the
// browser: the model line asks for the key, the key typed in, the model line from /v1/models, a
// message sent, streamed text seen growing, a screenshot saved mid-stream (its path printed),
// Stop pressed: the reply ends "stopped" and the server's cancel counter moves by one; a reload
// brings the conversation back from localStorage; a canned stream (reasoning, code, a tool
// call) is rendered as it should be. Every request the page makes must stay on the server's
// origin, and the console must show no error (a CSP violation is one). The server must then
// exit cleanly on SIGTERM. Prints "web: ok" at the end; any failure exits 1 with the reason.
import { spawn } from "node:child_process";
import { readFileSync, writeFileSync } from "node:fs";

const args = {};
for (let i = 2; i < process.argv.length; i += 2) args[process.argv[i].slice(2)] = process.argv[i + 1];
const { bin, model: modelPath, tmp } = args;
if (!bin || !modelPath || !tmp) throw new Error("usage: web_chat.mjs --bin MOE --model GGUF --tmp DIR");
const key = "sk-web-test";

let browser = null, server = null, done = false;
const fail = (msg) => {
  console.log("web: FAIL " + msg);
  for (const p of [browser, server]) try { if (p) p.kill("SIGKILL"); } catch { /* gone */ }
  process.exit(1);
};
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
setTimeout(() => fail("the whole check took over 100 s"), 100000).unref();

// ==== The server ====

server = spawn(bin, ["serve", modelPath, "--port", "0", "--api-key", key, "--ctx", "512",
  "--step-delay", "30"], { stdio: ["ignore", "pipe", "pipe"] });
let serverOut = "", serverErr = "";
server.stderr.on("data", (d) => { serverErr += d; });
server.on("exit", (code) => { if (!done) fail(`moe serve exited (${code}):\n${serverErr.slice(-2000)}`); });
const base = await new Promise((resolve) => {
  server.stdout.on("data", (d) => {
    serverOut += d;
    const m = /listening on (http:\/\/\S+)/.exec(serverOut);
    if (m && /moe serve: ready.*\n/.test(serverOut)) resolve(m[1]);
  });
});

if (!/moe serve: ready \(loaded in \d+\.\d\d s\)\n/.test(serverOut))
  fail(`the ready line gives no load time:\n${serverOut}`);

// the page's files, as served: the bytes of src/serve/web/, their type, the CSP
for (const [path, file, type] of [["/", "index.html", "text/html"], ["/chat.js", "chat.js",
  "text/javascript"], ["/chat.css", "chat.css", "text/css"]]) {
  const res = await fetch(base + path);
  const body = Buffer.from(await res.arrayBuffer());
  const csp = res.headers.get("content-security-policy") || "";
  if (res.status !== 200) fail(`GET ${path}: ${res.status}`);
  if (!(res.headers.get("content-type") || "").startsWith(type + "; charset=utf-8"))
    fail(`GET ${path}: Content-Type ${res.headers.get("content-type")}`);
  if (!csp.includes("default-src 'none'") || !csp.includes("connect-src 'self'") ||
      !csp.includes("script-src 'self'"))
    fail(`GET ${path}: Content-Security-Policy "${csp}"`);
  if (!body.equals(readFileSync("src/serve/web/" + file))) fail(`GET ${path}: not src/serve/web/${file}`);
}

// ==== The browser and its protocol ====

// as root (CI) Chromium needs --no-sandbox; the network flags keep it off a closed network
browser = spawn("chromium", [
  "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync",
  "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1200,800",
  `--user-data-dir=${tmp}/chromium-web`, "--remote-debugging-pipe", "about:blank",
], { stdio: ["ignore", "ignore", "pipe", "pipe", "pipe"] });
let stderr = "";
browser.stdio[2].on("data", (d) => { stderr += d; });
browser.on("exit", (code) => { if (!done) fail(`chromium exited (${code}):\n${stderr.slice(-2000)}`); });

let nextId = 1, inbox = "";
const pending = new Map();
const listeners = [];
browser.stdio[4].on("data", (d) => {
  inbox += d.toString("utf8");
  let end;
  while ((end = inbox.indexOf("\0")) >= 0) {
    const msg = JSON.parse(inbox.slice(0, end));
    inbox = inbox.slice(end + 1);
    if (msg.id && pending.has(msg.id)) {
      const { resolve, reject, method } = pending.get(msg.id);
      pending.delete(msg.id);
      if (msg.error) reject(new Error(`${method}: ${msg.error.message}`));
      else resolve(msg.result);
    } else if (msg.method) {
      for (const l of listeners) l(msg);
    }
  }
});
function cdp(method, params = {}, sessionId) {
  const id = nextId++;
  browser.stdio[3].write(JSON.stringify({ id, method, params, sessionId }) + "\0");
  return new Promise((resolve, reject) => pending.set(id, { resolve, reject, method }));
}

const { targetId } = await cdp("Target.createTarget", { url: "about:blank" });
const { sessionId } = await cdp("Target.attachToTarget", { targetId, flatten: true });
const page = (method, params) => cdp(method, params, sessionId);
const problems = [], requests = [];
listeners.push((m) => {
  if (m.sessionId !== sessionId) return;
  if (m.method === "Runtime.exceptionThrown")
    problems.push("exception: " + JSON.stringify(m.params.exceptionDetails).slice(0, 500));
  const e = m.method === "Log.entryAdded" && m.params.entry;
  const keyless = e && e.source === "network" && /\/v1\/models$/.test(e.url || "") &&
    e.text.includes("401"); /* the model line before the key is typed: expected */
  if (e && e.level === "error" && !keyless) problems.push("console: " + e.text);
  if (m.method === "Runtime.consoleAPICalled" && m.params.type === "error")
    problems.push("console.error: " + JSON.stringify(m.params.args).slice(0, 500));
  if (m.method === "Network.requestWillBeSent") requests.push(m.params.request.url);
});
await page("Runtime.enable");
await page("Log.enable");
await page("Network.enable");
await page("Page.enable");

async function evaluate(expression) {
  const r = await page("Runtime.evaluate", { expression, awaitPromise: true, returnByValue: true });
  if (r.exceptionDetails) fail(`${expression}: ${JSON.stringify(r.exceptionDetails).slice(0, 500)}`);
  return r.result.value;
}
async function waitFor(what, expression, seconds) {
  for (let t = 0; t < seconds * 10; t++) {
    const v = await evaluate(expression);
    if (v) return v;
    await sleep(100);
  }
  fail(`${what}: not seen within ${seconds} s`);
}
async function load() {
  const loaded = new Promise((r) => listeners.push((m) => {
    if (m.sessionId === sessionId && m.method === "Page.loadEventFired") r();
  }));
  await page("Page.navigate", { url: base + "/" });
  await loaded;
}
async function cancelledOnServer() {
  const res = await fetch(base + "/metrics", { headers: { Authorization: "Bearer " + key } });
  const m = /^moe_requests_cancelled_total (\d+)/m.exec(await res.text());
  if (!m) fail("no moe_requests_cancelled_total in /metrics");
  return Number(m[1]);
}

// ==== The checks ====

await load();
await waitFor("the page's script", "typeof renderMarkdown === 'function'", 10);
// without the key, /v1/models is refused and the model line says so
await waitFor("the model line asking for the key",
  "document.getElementById('model').textContent.includes('401')", 10);
// the key typed in (a change event, as a user's), then the model line from /v1/models
await page("Runtime.evaluate", { expression: "document.getElementById('api-key').focus()" });
await page("Input.insertText", { text: key });
await evaluate(`(() => { const k = document.getElementById('api-key');
  k.dispatchEvent(new Event('change')); document.getElementById('max-tokens').value = '400';
  document.getElementById('max-tokens').dispatchEvent(new Event('change')); })()`);
const model = await waitFor("the model line",
  "(t => t.includes('context') ? t : '')(document.getElementById('model').textContent)", 10);
console.log("web: " + model);

const cancelledBefore = await cancelledOnServer();
await page("Runtime.evaluate", { expression: "document.getElementById('prompt').focus()" });
await page("Input.insertText", { text: "Once upon a time" });
await page("Input.dispatchKeyEvent", { type: "keyDown", key: "Enter", code: "Enter",
  windowsVirtualKeyCode: 13, text: "\r" });
await page("Input.dispatchKeyEvent", { type: "keyUp", key: "Enter", code: "Enter",
  windowsVirtualKeyCode: 13 });
const reply = "document.querySelector('#messages .msg.assistant:last-child')";
await waitFor("a streaming reply", `${reply} && ${reply}.dataset.state === 'streaming'`, 10);
const first = await waitFor("streamed text", `${reply}.querySelector('.content').textContent`, 20);
const later = await waitFor("more streamed text",
  `(t => t.length > ${first.length} ? t : '')(${reply}.querySelector('.content').textContent)`, 20);
if (!later.startsWith(first)) fail(`the reply was rewritten, not extended: "${first}" then "${later}"`);
const stats = await evaluate("document.getElementById('stats').textContent");
if (!/tok\/s/.test(stats)) fail(`no tok/s while streaming: "${stats}"`);
const shot = await page("Page.captureScreenshot", { format: "png" });
const shotPath = `${tmp}/web-chat-midstream.png`;
writeFileSync(shotPath, Buffer.from(shot.data, "base64"));
console.log(`web: screenshot mid-stream (${later.length} characters in, ${stats}): ${shotPath}`);
if (args.keep) { /* the tmpdir goes at exit: a copy that stays */
  writeFileSync(args.keep, Buffer.from(shot.data, "base64"));
  console.log(`web: kept as ${args.keep}`);
}
if (!(await evaluate("!document.getElementById('stop').hidden"))) fail("no Stop button while streaming");

await evaluate("document.getElementById('stop').click()");
await waitFor("the reply marked stopped", `${reply}.dataset.state === 'stopped'`, 5);
const stopped = await evaluate(`${reply}.querySelector('.content').textContent`);
const meta = await evaluate(`${reply}.querySelector('.meta').textContent`);
console.log(`web: stopped after ${stopped.length} characters (${meta})`);
// the server cancels on the disconnect: its counter moves (within a few seconds)
let cancelled = 0;
for (let t = 0; t < 50 && (cancelled = await cancelledOnServer()) <= cancelledBefore; t++) await sleep(100);
if (cancelled !== cancelledBefore + 1)
  fail(`moe_requests_cancelled_total went ${cancelledBefore} -> ${cancelled}, expected +1`);
await sleep(300);
const after = await evaluate(`${reply}.querySelector('.content').textContent`);
if (after !== stopped) fail("text kept arriving after Stop");
if (!(await evaluate("document.getElementById('stop').hidden && !document.getElementById('send').disabled")))
  fail("the Stop button stayed, or Send stayed disabled, after Stop");

// a reload brings the conversation back from localStorage
await load();
await waitFor("the page's script after reload", "typeof renderMarkdown === 'function'", 10);
const restored = await evaluate(`[document.querySelectorAll('#chats li').length,
  document.querySelector('#messages .msg.user .content').textContent,
  document.querySelector('#messages .msg.assistant .content').textContent]`);
if (restored[0] !== 1 || restored[1] !== "Once upon a time" || restored[2] !== stopped)
  fail(`the conversation did not come back from localStorage: ${JSON.stringify(restored)}`);

// a canned stream (the Fetch domain answers in the server's place) with what stories260K never
// writes: reasoning (shown collapsed), a fenced code block, inline code, markup that must stay
// text, and a tool call
const canned = [
  { delta: { role: "assistant", reasoning_content: "The user wants code." } },
  { delta: { content: "Here:\n\n```c\nint main(void) { return 0; }\n```\n\nuse `cc` <img src=x>" } },
  { delta: { tool_calls: [{ index: 0, id: "call_1", type: "function",
    function: { name: "get_weather", arguments: '{"city":"Paris"}' } }] } },
  { delta: {}, finish_reason: "tool_calls" },
].map((c) => "data: " + JSON.stringify({ object: "chat.completion.chunk",
  choices: [{ index: 0, ...c }] }) + "\n\n").join("") + "data: [DONE]\n\n";
listeners.push((m) => {
  if (m.sessionId !== sessionId || m.method !== "Fetch.requestPaused") return;
  page("Fetch.fulfillRequest", { requestId: m.params.requestId, responseCode: 200,
    responseHeaders: [{ name: "Content-Type", value: "text/event-stream" }],
    body: Buffer.from(canned).toString("base64") });
});
await page("Fetch.enable", { patterns: [{ urlPattern: "*/v1/chat/completions" }] });
await evaluate("document.getElementById('new-chat').click()");
await page("Runtime.evaluate", { expression: "document.getElementById('prompt').focus()" });
await page("Input.insertText", { text: "weather?" });
await evaluate("document.getElementById('send').click()");
await waitFor("the canned reply", `${reply} && ${reply}.dataset.state === 'done'`, 10);
await page("Fetch.disable");
const shown = await evaluate(`(() => { const r = ${reply}, d = r.querySelector('details.reasoning');
  const pre = r.querySelector('.content pre');
  return { chats: document.querySelectorAll('#chats li').length,
    reasoning: d && d.textContent, open: d && d.open, lang: pre && pre.dataset.lang,
    code: pre && pre.textContent, inline: [...r.querySelectorAll('.content p code')].map(c => c.textContent),
    imgs: document.querySelectorAll('#messages img').length,
    text: r.querySelector('.content').textContent,
    tool: r.querySelector('.tool-call b') && r.querySelector('.tool-call b').textContent,
    args: r.querySelector('.tool-call pre') && JSON.parse(r.querySelector('.tool-call pre').textContent),
    meta: r.querySelector('.meta').textContent }; })()`);
const want = { chats: 2, reasoning: "ReasoningThe user wants code.", open: false, lang: "c",
  code: "int main(void) { return 0; }", inline: ["cc"], imgs: 0, tool: "get_weather" };
for (const [k, v] of Object.entries(want))
  if (JSON.stringify(shown[k]) !== JSON.stringify(v))
    fail(`canned reply: ${k} is ${JSON.stringify(shown[k])}, expected ${JSON.stringify(v)}`);
if (!shown.text.includes("<img src=x>")) fail(`markup was not kept as text: ${shown.text}`);
if (shown.args.city !== "Paris") fail(`tool arguments: ${JSON.stringify(shown.args)}`);
if (!shown.meta.includes("tool_calls")) fail(`no finish reason in "${shown.meta}"`);
const shot2 = await page("Page.captureScreenshot", { format: "png" });
writeFileSync(`${tmp}/web-chat-canned.png`, Buffer.from(shot2.data, "base64"));
console.log("web: reasoning collapsed, code block, inline code, markup as text, tool call: shown " +
  `(${tmp}/web-chat-canned.png)`);

const foreign = requests.filter((u) => !u.startsWith(base + "/") && !u.startsWith("data:"));
if (foreign.length) fail("requests off the server's origin: " + foreign.join(", "));
if (problems.length) fail("the page reported errors:\n" + problems.join("\n"));
done = true;
// Chromium gone before its profile directory (in the caller's tmpdir) is removed
const browserGone = browser.exitCode !== null ? Promise.resolve()
  : new Promise((r) => browser.on("exit", r));
browser.kill("SIGTERM");
await browserGone;
server.kill("SIGTERM");
const code = await new Promise((r) => server.on("exit", (c, sig) => r(sig || c)));
if (code !== 0) { done = false; fail(`moe serve exited ${code} on SIGTERM:\n${serverErr.slice(-2000)}`); }
console.log("web: ok");
process.exit(0);
