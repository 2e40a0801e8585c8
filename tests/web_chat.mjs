// The chat page of `moe serve` in headless Chromium, driven over the DevTools protocol (a pipe:
// --remote-debugging-pipe, JSON messages ended by NUL on fds 3 and 4; no npm packages needed).
//
//   node tests/web_chat.mjs --url http://127.0.0.1:PORT --key KEY --tmp DIR
//
// Loads the page, reads the model line (/v1/models, with the key typed in), sends a message,
// waits for streamed text to grow, saves a screenshot mid-stream (its path printed), presses
// Stop and checks the reply ends "stopped" with the server's cancel counter up by one; then
// reloads the page and checks the conversation came back from localStorage. Every request the
// page makes must stay on the server's origin, and the console must show no error (a CSP
// violation is one). Prints "web: ok" at the end; any failure exits 1 with the reason.
import { spawn } from "node:child_process";
import { writeFileSync } from "node:fs";

const args = {};
for (let i = 2; i < process.argv.length; i += 2) args[process.argv[i].slice(2)] = process.argv[i + 1];
const base = args.url, key = args.key || "", tmp = args.tmp;
if (!base || !tmp) throw new Error("usage: web_chat.mjs --url URL --key KEY --tmp DIR");

const fail = (msg) => {
  console.log("web: FAIL " + msg);
  try { browser.kill("SIGKILL"); } catch { /* already gone */ }
  process.exit(1);
};
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
setTimeout(() => fail("the whole check took over 90 s"), 90000).unref();

// ==== The browser and its protocol ====

// as root (CI) Chromium needs --no-sandbox; the network flags keep it off a closed network
const browser = spawn("chromium", [
  "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync",
  "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1200,800",
  `--user-data-dir=${tmp}/chromium-web`, "--remote-debugging-pipe", "about:blank",
], { stdio: ["ignore", "ignore", "pipe", "pipe", "pipe"] });
let stderr = "";
browser.stdio[2].on("data", (d) => { stderr += d; });
browser.on("exit", (code) => { if (!done) fail(`chromium exited (${code}):\n${stderr.slice(-2000)}`); });
let done = false;

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
  if (m.method === "Log.entryAdded" && m.params.entry.level === "error")
    problems.push("console: " + m.params.entry.text);
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

const foreign = requests.filter((u) => !u.startsWith(base + "/") && !u.startsWith("data:"));
if (foreign.length) fail("requests off the server's origin: " + foreign.join(", "));
if (problems.length) fail("the page reported errors:\n" + problems.join("\n"));
done = true;
writeFileSync(`${tmp}/web-chat-requests.txt`, requests.join("\n") + "\n");
console.log("web: ok");
browser.kill("SIGTERM");
process.exit(0);
