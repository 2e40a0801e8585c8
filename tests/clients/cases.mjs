// cases.mjs: `moe serve` driven by the official SDKs (openai, @anthropic-ai/sdk).
//
// Run by tests/test_serve.c, one case per process:
//   node tests/clients/cases.mjs --base URL --slow URL --key KEY --runc FILE CASE...
// --base: a server on stories260K with --ctx 1024 --parallel 16 and --api-key KEY;
// --slow: a server on the demo model with --parallel 1 --queue 1 --queue-timeout 1
//         --step-delay 20 --keepalive 0.01 (no key), where a stream stays open long enough to
//         be interfered with and keep-alives come between tokens;
// --hybrid: a server on ../shared/parity/qwen3next-f32 (linear-attention hybrid) with
//         --parallel 2 --cache-slots 4 --expert-cache 100K (5 of its 16 experts resident),
//         fresh when hybrid_reuse starts.
// --think: instead of the cases above, the reasoning ones, on a server with GLM-5.3-Flash's
//         template (no enable_thinking switch) and --reasoning-budget 10 (no key).
// No CASE: every case, in order. Prints "ok CASE" per passing case and "FAIL CASE: reason"
// per failing one, exiting 1 if any failed. Every loop is
// bounded and every wait has a deadline.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const args = { cases: [] };
for (let i = 2; i < process.argv.length; i++) {
  const a = process.argv[i];
  if (a.startsWith('--')) args[a.slice(2)] = process.argv[++i];
  else args.cases.push(a);
}
const KEY = args.key;
const oa = new OpenAI({ baseURL: `${args.base}/v1`, apiKey: KEY, maxRetries: 0, timeout: 30000 });
const an = new Anthropic({ baseURL: args.base, apiKey: KEY, maxRetries: 0, timeout: 30000 });
const slowOa = new OpenAI({ baseURL: `${args.slow}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 30000 });
const hyOa = new OpenAI({ baseURL: `${args.hybrid}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 30000 });
const slowAn = new Anthropic({ baseURL: args.slow, apiKey: 'unused', maxRetries: 0, timeout: 30000 });

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const STORY = [{ role: 'user', content: 'Tell me a story about a cat.' }];

async function metric(base, name) {
  const res = await fetch(`${base}/metrics`, { headers: { authorization: `Bearer ${KEY}` } });
  const text = await res.text();
  const line = text.split('\n').find((l) => l.startsWith(name + ' '));
  return line ? Number(line.split(' ')[1]) : NaN;
}

async function waitFor(what, fn, ms = 5000) {
  const until = Date.now() + ms;
  for (let i = 0; i < 1000 && Date.now() < until; i++) {
    if (await fn()) return;
    await sleep(20);
  }
  assert.fail(`timed out waiting for ${what}`);
}

async function expectStatus(promise, status, check) {
  try {
    await promise;
  } catch (e) {
    assert.equal(e.status, status, `expected HTTP ${status}, got ${e.status}: ${e.message}`);
    if (check) check(e);
    return e;
  }
  assert.fail(`expected HTTP ${status}, got success`);
}

const cases = {
  async models() {
    const list = await oa.models.list();
    assert.equal(list.data.length, 1);
    assert.equal(list.data[0].id, 'stories260K');
    assert.equal(list.data[0].context_length, 1024); // --ctx 1024 (the model's own is 512)
    assert.equal(list.data[0].max_model_len, 1024);
    const am = await an.models.list();
    assert.equal(am.data[0].type, 'model');
    assert.equal(am.data[0].id, 'stories260K');
  },

  async chat_nonstream() {
    const r = await oa.chat.completions.create({ model: 'anything', messages: STORY, max_tokens: 24, temperature: 0 });
    assert.equal(r.object, 'chat.completion');
    assert.match(r.id, /^chatcmpl-/);
    assert.equal(r.model, 'stories260K');
    const c = r.choices[0];
    assert.equal(c.message.role, 'assistant');
    assert.equal(typeof c.message.content, 'string');
    assert.ok(c.message.content.length > 0);
    assert.ok(['stop', 'length'].includes(c.finish_reason));
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
    assert.ok(r.usage.completion_tokens <= 24);
  },

  async chat_stream() {
    const req = { model: 'x', messages: STORY, max_tokens: 24, temperature: 0 };
    const whole = await oa.chat.completions.create(req);
    const stream = await oa.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
    let text = '', finish = null, usage = null, role = null, n = 0;
    for await (const chunk of stream) {
      assert.equal(chunk.object, 'chat.completion.chunk');
      if (n++ > 1000) assert.fail('too many chunks');
      if (chunk.usage) usage = chunk.usage;
      for (const ch of chunk.choices) {
        if (ch.delta.role) role = ch.delta.role;
        if (ch.delta.content) text += ch.delta.content;
        if (ch.finish_reason) finish = ch.finish_reason;
      }
    }
    assert.equal(role, 'assistant');
    assert.equal(text, whole.choices[0].message.content);
    assert.equal(finish, whole.choices[0].finish_reason);
    assert.equal(usage.completion_tokens, whole.usage.completion_tokens);
    // the SDK's stream helper assembles the same message
    const helper = oa.chat.completions.stream(req);
    const final = await helper.finalChatCompletion();
    assert.equal(final.choices[0].message.content, text);
  },

  async completions_runc() {
    // greedy from BOS reproduces run.c's text (../shared fixture), through the token-id prompt
    const want = readFileSync(args.runc, 'utf8');
    const r = await oa.completions.create({ model: 'x', prompt: [1], max_tokens: 200, temperature: 0 });
    assert.equal(r.object, 'text_completion');
    const text = r.choices[0].text;
    assert.ok(text.length > 400, `only ${text.length} bytes`);
    assert.ok(want.startsWith(text), `text diverges from run.c: ${JSON.stringify(text.slice(0, 80))}`);
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.equal(r.usage.completion_tokens, 200);
    // a text prompt continues the same way
    const t = await oa.completions.create({ model: 'x', prompt: 'Once upon a time', max_tokens: 20, temperature: 0 });
    assert.ok(want.startsWith('Once upon a time' + t.choices[0].text), JSON.stringify(t.choices[0].text));
  },

  async stop_strings() {
    const r = await oa.completions.create({ model: 'x', prompt: [1], max_tokens: 100, temperature: 0, stop: ['Lily'] });
    assert.equal(r.choices[0].text, 'Once upon a time, there was a little girl named ');
    assert.equal(r.choices[0].finish_reason, 'stop');
    // the stop string may span tokens; streamed output is cut the same way
    const s = await oa.completions.create({ model: 'x', prompt: [1], max_tokens: 100, temperature: 0, stop: ['girl n', 'zzz'], stream: true });
    let text = '', finish = null;
    for await (const c of s) {
      text += c.choices[0]?.text ?? '';
      finish = c.choices[0]?.finish_reason ?? finish;
    }
    assert.equal(text, 'Once upon a time, there was a little ');
    assert.equal(finish, 'stop');
    const m = await an.messages.create({ model: 'x', max_tokens: 50, messages: STORY, stop_sequences: ['a'], temperature: 0 });
    assert.equal(m.stop_reason, 'stop_sequence');
    assert.equal(m.stop_sequence, 'a');
    assert.ok(!m.content[0].text.includes('a'));
  },

  async logprobs() {
    const r = await oa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 12, temperature: 0, logprobs: true, top_logprobs: 3 });
    const lp = r.choices[0].logprobs.content;
    assert.equal(lp.length, r.usage.completion_tokens);
    let joined = '';
    for (const e of lp) {
      assert.ok(e.logprob <= 0);
      assert.equal(e.top_logprobs.length, 3);
      assert.equal(e.top_logprobs[0].token, e.token, 'greedy picks the most likely token');
      assert.ok(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob);
      assert.deepEqual(e.bytes, [...Buffer.from(e.token, 'utf8')]);
      joined += e.token;
    }
    assert.equal(joined.trimStart(), r.choices[0].message.content.trimStart());
    // streamed: one logprobs entry per token, the same values
    const s = await oa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 12, temperature: 0, logprobs: true, top_logprobs: 3, stream: true });
    const streamed = [];
    for await (const c of s) for (const e of c.choices[0]?.logprobs?.content ?? []) streamed.push(e);
    assert.deepEqual(streamed.map((e) => e.token), lp.map((e) => e.token));
    assert.deepEqual(streamed.map((e) => e.logprob), lp.map((e) => e.logprob));
    // completions: the legacy shape
    const c = await oa.completions.create({ model: 'x', prompt: [1], max_tokens: 5, temperature: 0, logprobs: 2 });
    const l = c.choices[0].logprobs;
    assert.equal(l.tokens.length, 5);
    assert.equal(l.token_logprobs.length, 5);
    assert.equal(Object.keys(l.top_logprobs[0]).length, 2);
    await expectStatus(oa.chat.completions.create({ model: 'x', messages: STORY, top_logprobs: 50, logprobs: true }), 400,
      (e) => assert.equal(e.param, 'top_logprobs'));
  },

  async cached_tokens() {
    const messages = [{ role: 'system', content: 'You tell short stories about animals in the forest.' },
                      { role: 'user', content: 'A story about a brave little fox, please.' }];
    const a = await oa.chat.completions.create({ model: 'x', messages, max_tokens: 8, temperature: 0 });
    const b = await oa.chat.completions.create({ model: 'x', messages, max_tokens: 8, temperature: 0 });
    assert.equal(b.usage.prompt_tokens, a.usage.prompt_tokens);
    assert.equal(b.usage.prompt_tokens_details.cached_tokens, b.usage.prompt_tokens - 1);
    assert.equal(b.choices[0].message.content, a.choices[0].message.content, 'reuse must not change the answer');
    // a conversation that extends the first one reuses all of its prompt
    const more = [...messages, { role: 'assistant', content: a.choices[0].message.content }, { role: 'user', content: 'And then?' }];
    const c = await oa.chat.completions.create({ model: 'x', messages: more, max_tokens: 8, temperature: 0 });
    assert.ok(c.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens, JSON.stringify(c.usage));
    const am = { model: 'x', max_tokens: 8, system: 'You are a storyteller.', messages: STORY, temperature: 0 };
    await an.messages.create(am);
    const m = await an.messages.create(am);
    assert.ok(m.usage.cache_read_input_tokens > 0, JSON.stringify(m.usage));
  },

  async hybrid_reuse() {
    // A hybrid's recurrent state cannot be cut back: prefixes come back whole or from the
    // snapshot each prompt leaves before its last token. Greedy tokens must not change.
    // P1 is the parity prompt and G its greedy ids (llama.cpp, qwen3next-f32.tokens.json).
    const P1 = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426];
    const G = [110, 493, 220, 441, 128, 450, 457, 361, 464, 10, 489, 62, 509, 364, 343, 361];
    const P2 = [1, 300, 301, 302, 303, 304, 305, 306];
    const run = async (prompt, n) => {
      const r = await hyOa.completions.create({ model: 'x', prompt, max_tokens: n, temperature: 0, ignore_eos: true, logprobs: 1 });
      return { tokens: r.choices[0].logprobs.tokens, cached: r.usage.prompt_tokens_details.cached_tokens };
    };
    // alone: nothing to reuse (P2 shares only BOS with P1, and a partial sequence is no use)
    const a = await run(P1, 16);
    const b = await run(P2, 16);
    assert.equal(a.cached, 0);
    assert.equal(b.cached, 0);
    // interleaved in one batch: each reuses its prompt's snapshot and makes the tokens it made alone
    const [a2, b2] = await Promise.all([run(P1, 16), run(P2, 16)]);
    assert.deepEqual(a2.tokens, a.tokens);
    assert.deepEqual(b2.tokens, b.tokens);
    assert.equal(a2.cached, P1.length - 1);
    assert.equal(b2.cached, P2.length - 1);
    // a third request extends the first's prompt by its first 8 greedy tokens: it can only start
    // from the prompt snapshot (the live sequences hold more), and continues as the first did
    const c = await run([...P1, ...G.slice(0, 8)], 8);
    assert.equal(c.cached, P1.length - 1);
    assert.deepEqual(c.tokens, a.tokens.slice(8));
    // one that extends a whole finished sequence (prompt + 15 fed tokens) takes all of it
    const d = await run([...P1, ...G], 1);
    assert.equal(d.cached, P1.length + G.length - 1);
  },

  async anthropic_messages() {
    const m = await an.messages.create({ model: 'claude-unknown-alias', max_tokens: 16, temperature: 0,
      system: [{ type: 'text', text: 'x-anthropic-billing-header: cc_version=1; cch=abc' }, { type: 'text', text: 'Be brief.' }],
      messages: STORY });
    assert.equal(m.type, 'message');
    assert.equal(m.role, 'assistant');
    assert.match(m.id, /^msg_/);
    assert.equal(m.content[0].type, 'text');
    assert.ok(['end_turn', 'max_tokens'].includes(m.stop_reason));
    assert.equal(m.stop_sequence, null);
    assert.ok(m.usage.input_tokens > 0 && m.usage.output_tokens > 0);
    // the billing header changes every request and is dropped: it does not change the count
    const withHeader = await an.messages.countTokens({ model: 'x', messages: STORY,
      system: [{ type: 'text', text: 'x-anthropic-billing-header: cch=1' }, { type: 'text', text: 'Be brief.' }] });
    const without = await an.messages.countTokens({ model: 'x', messages: STORY, system: 'Be brief.' });
    assert.equal(withHeader.input_tokens, without.input_tokens);
    assert.ok(without.input_tokens > 5);
    await expectStatus(an.messages.create({ model: 'x', messages: STORY }), 400,
      (e) => assert.match(e.message, /max_tokens/));
    await expectStatus(an.messages.create({ model: 'x', max_tokens: 5, messages: [{ role: 'user', content: [
      { type: 'image', source: { type: 'base64', media_type: 'image/png', data: 'AAAA' } }] }] }), 400,
      (e) => assert.match(e.message, /image/));
  },

  async anthropic_stream() {
    const req = { model: 'x', max_tokens: 16, temperature: 0, messages: STORY };
    const whole = await an.messages.create(req);
    const types = [];
    let text = '';
    const stream = await an.messages.create({ ...req, stream: true });
    for await (const ev of stream) {
      if (types.length > 1000) assert.fail('too many events');
      types.push(ev.type);
      if (ev.type === 'content_block_delta') {
        assert.equal(ev.delta.type, 'text_delta');
        text += ev.delta.text;
      }
      if (ev.type === 'message_delta') {
        assert.equal(ev.delta.stop_reason, whole.stop_reason);
        assert.equal(ev.usage.output_tokens, whole.usage.output_tokens);
      }
    }
    const squeezed = types.filter((t, i) => t !== 'content_block_delta' || types[i - 1] !== 'content_block_delta');
    assert.deepEqual(squeezed, ['message_start', 'content_block_start', 'content_block_delta',
      'content_block_stop', 'message_delta', 'message_stop']);
    assert.equal(text, whole.content[0].text);
    // the SDK's stream helper assembles the same message
    const final = await an.messages.stream(req).finalMessage();
    assert.equal(final.content[0].text, text);
    assert.equal(final.stop_reason, whole.stop_reason);
    // on the wire: event lines in order, a ping right after the first block starts
    const res = await fetch(`${args.base}/v1/messages?beta=true`, { method: 'POST',
      headers: { 'x-api-key': KEY, 'anthropic-version': '2023-06-01', 'content-type': 'application/json' },
      body: JSON.stringify({ ...req, stream: true }) });
    assert.equal(res.status, 200);
    assert.match(res.headers.get('content-type'), /text\/event-stream/);
    const events = (await res.text()).split('\n').filter((l) => l.startsWith('event: ')).map((l) => l.slice(7));
    assert.deepEqual(events.slice(0, 3), ['message_start', 'content_block_start', 'ping']);
    assert.deepEqual(events.slice(-3), ['content_block_stop', 'message_delta', 'message_stop']);
  },

  async tools_shape() {
    const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather for a city',
      parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }];
    const messages = [
      { role: 'user', content: 'Weather in Paris?' },
      { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Paris"}' } }] },
      { role: 'tool', tool_call_id: 'call_1', content: '{"temp": 21}' },
    ];
    const r = await oa.chat.completions.create({ model: 'x', messages, tools, tool_choice: 'auto', parallel_tool_calls: false, max_tokens: 8, temperature: 0 });
    const msg = r.choices[0].message;
    assert.equal(msg.role, 'assistant');
    assert.ok(['stop', 'length', 'tool_calls'].includes(r.choices[0].finish_reason));
    if (msg.tool_calls) for (const tc of msg.tool_calls) JSON.parse(tc.function.arguments);
    // the tool definitions are in the prompt: it is longer than without them
    const bare = await oa.chat.completions.create({ model: 'x', messages: messages.slice(0, 1), max_tokens: 1 });
    const withTools = await oa.chat.completions.create({ model: 'x', messages: messages.slice(0, 1), tools, max_tokens: 1 });
    assert.ok(withTools.usage.prompt_tokens > bare.usage.prompt_tokens + 20);
    // Anthropic: tool_use / tool_result blocks round-trip into the prompt
    const m = await an.messages.create({ model: 'x', max_tokens: 8, temperature: 0,
      tools: [{ name: 'get_weather', description: 'Weather', input_schema: { type: 'object', properties: { city: { type: 'string' } } } }],
      messages: [{ role: 'user', content: 'Weather in Paris?' },
        { role: 'assistant', content: [{ type: 'text', text: 'Let me look.' }, { type: 'tool_use', id: 'toolu_1', name: 'get_weather', input: { city: 'Paris' } }] },
        { role: 'user', content: [{ type: 'tool_result', tool_use_id: 'toolu_1', content: '21 C' }] }] });
    assert.equal(m.type, 'message');
    assert.ok(['end_turn', 'max_tokens', 'tool_use'].includes(m.stop_reason));
    await expectStatus(oa.chat.completions.create({ model: 'x', messages: STORY, tools: [{ type: 'function' }] }), 400,
      (e) => assert.equal(e.param, 'tools'));
  },

  // Structured output through the SDKs: forced tool calls (OpenAI required / named, streamed
  // too; Anthropic any) always come back as calls with JSON arguments, json_schema replies parse.
  async structured_output() {
    const tools = [{ type: 'function', function: { name: 'get_weather', parameters: { type: 'object',
      properties: { city: { type: 'string', maxLength: 8 }, unit: { enum: ['c', 'f'] } }, required: ['city'] } } }];
    const ask = [{ role: 'user', content: 'Weather?' }];
    for (let seed = 1; seed <= 5; seed++) {
      const r = await oa.chat.completions.create({ model: 'x', messages: ask, tools, tool_choice: 'required',
        max_tokens: 200, temperature: 1, seed });
      assert.equal(r.choices[0].finish_reason, 'tool_calls');
      const calls = r.choices[0].message.tool_calls;
      assert.equal(calls.length, 1);
      assert.equal(calls[0].function.name, 'get_weather');
      const a = JSON.parse(calls[0].function.arguments);
      assert.equal(typeof a.city, 'string');
      assert.ok([...a.city].length <= 8);
    }
    const stream = await oa.chat.completions.create({ model: 'x', messages: ask, tools, stream: true,
      tool_choice: { type: 'function', function: { name: 'get_weather' } }, max_tokens: 200, temperature: 1, seed: 9 });
    let name = '', argText = '', finish = null;
    for await (const chunk of stream) {
      const c = chunk.choices[0];
      for (const tc of c?.delta?.tool_calls ?? []) {
        name += tc.function?.name ?? '';
        argText += tc.function?.arguments ?? '';
      }
      finish = c?.finish_reason ?? finish;
    }
    assert.equal(name, 'get_weather');
    assert.equal(finish, 'tool_calls');
    assert.equal(typeof JSON.parse(argText).city, 'string');
    const schema = { type: 'object', properties: { n: { type: 'integer', minimum: 1, maximum: 9 },
      w: { enum: ['cat', 'dog'] } }, required: ['n', 'w'], additionalProperties: false };
    const j = await oa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 100, temperature: 1, seed: 3,
      response_format: { type: 'json_schema', json_schema: { name: 'pet', schema } } });
    const v = JSON.parse(j.choices[0].message.content);
    assert.ok(Number.isInteger(v.n) && v.n >= 1 && v.n <= 9 && ['cat', 'dog'].includes(v.w));
    const m = await an.messages.create({ model: 'x', max_tokens: 200, temperature: 1, messages: ask,
      tools: [{ name: 'get_weather', input_schema: tools[0].function.parameters }], tool_choice: { type: 'any' } });
    assert.equal(m.stop_reason, 'tool_use');
    const use = m.content.find((b) => b.type === 'tool_use');
    assert.equal(use.name, 'get_weather');
    assert.equal(typeof use.input.city, 'string');
    await expectStatus(oa.chat.completions.create({ model: 'x', messages: ask, tools,
      tool_choice: { type: 'function', function: { name: 'nope' } } }), 400, (e) => assert.equal(e.param, 'tool_choice'));
  },

  async responses() {
    const req = { model: 'x', instructions: 'Tell stories.', input: 'A story about a cat.', max_output_tokens: 12, temperature: 0 };
    const r = await oa.responses.create(req);
    assert.equal(r.object, 'response');
    assert.match(r.id, /^resp_/);
    assert.equal(r.status, 'incomplete');
    assert.equal(r.incomplete_details.reason, 'max_output_tokens');
    assert.equal(r.output[0].type, 'message');
    assert.equal(r.output[0].content[0].type, 'output_text');
    assert.ok(r.output_text.length > 0);
    assert.equal(r.usage.output_tokens, 12);
    assert.equal(r.usage.total_tokens, r.usage.input_tokens + 12);
    // streamed: the SDK's accumulator rebuilds the same text, events in order
    const types = [];
    let text = '';
    const stream = await oa.responses.create({ ...req, stream: true });
    let seq = -1;
    for await (const ev of stream) {
      if (types.length > 1000) assert.fail('too many events');
      assert.equal(ev.sequence_number, seq + 1);
      seq = ev.sequence_number;
      types.push(ev.type);
      if (ev.type === 'response.output_text.delta') text += ev.delta;
    }
    assert.equal(text, r.output_text);
    const squeezed = types.filter((t, i) => t !== types[i - 1]);
    assert.deepEqual(squeezed, ['response.created', 'response.in_progress', 'response.output_item.added',
      'response.content_part.added', 'response.output_text.delta', 'response.output_text.done',
      'response.content_part.done', 'response.output_item.done', 'response.incomplete']);
    const final = await oa.responses.stream(req).finalResponse();
    assert.equal(final.output[0].content[0].text, r.output_text); // (its status stays as created:
    // the helper only takes the final object from response.completed, not response.incomplete)
    // a tool round trip as input items, and function tools, are accepted
    const t = await oa.responses.create({ model: 'x', max_output_tokens: 4, temperature: 0,
      tools: [{ type: 'function', name: 'get_weather', parameters: { type: 'object', properties: {} } }],
      input: [{ role: 'user', content: [{ type: 'input_text', text: 'Weather?' }] },
        { type: 'function_call', call_id: 'call_1', name: 'get_weather', arguments: '{}' },
        { type: 'function_call_output', call_id: 'call_1', output: 'sunny' }] });
    assert.equal(t.object, 'response');
    // a deeply nested field that is echoed back (metadata) cannot push the writer past its limit
    let deep = {};
    for (let i = 0; i < 61; i++) deep = { d: deep }; // 63 levels with the body: just under the limit
    const echoed = await oa.responses.create({ model: 'x', input: 'hi', max_output_tokens: 1, metadata: deep });
    assert.equal(echoed.object, 'response');
    await expectStatus(oa.responses.create({ model: 'x', input: 'hi', previous_response_id: 'resp_1' }), 400,
      (e) => assert.equal(e.param, 'previous_response_id'));
  },

  async errors() {
    const badOa = new OpenAI({ baseURL: `${args.base}/v1`, apiKey: 'wrong', maxRetries: 0 });
    const e1 = await expectStatus(badOa.chat.completions.create({ model: 'x', messages: STORY }), 401);
    assert.ok(e1 instanceof OpenAI.AuthenticationError);
    assert.equal(e1.code, 'invalid_api_key');
    const badAn = new Anthropic({ baseURL: args.base, apiKey: 'wrong', maxRetries: 0 });
    const e2 = await expectStatus(badAn.messages.create({ model: 'x', max_tokens: 5, messages: STORY }), 401);
    assert.ok(e2 instanceof Anthropic.AuthenticationError);
    assert.equal(e2.error.type, 'error');
    assert.equal(e2.error.error.type, 'authentication_error');
    // no key at all: the same, and /health needs none
    const none = await fetch(`${args.base}/v1/models`);
    assert.equal(none.status, 401);
    assert.equal((await fetch(`${args.base}/health`)).status, 200);
    // malformed JSON: 400 in each API's shape
    const post = (path, body, extra = {}) => fetch(`${args.base}${path}`, { method: 'POST',
      headers: { authorization: `Bearer ${KEY}`, 'content-type': 'application/json', ...extra }, body });
    let res = await post('/v1/chat/completions', '{"messages": [');
    assert.equal(res.status, 400);
    let j = await res.json();
    assert.equal(j.error.type, 'invalid_request_error');
    assert.match(j.error.message, /parse/);
    res = await post('/v1/messages', '{"max_tokens": 5,');
    assert.equal(res.status, 400);
    j = await res.json();
    assert.equal(j.type, 'error');
    assert.equal(j.error.type, 'invalid_request_error');
    // a bad field is named
    const e3 = await expectStatus(oa.chat.completions.create({ model: 'x', messages: STORY, temperature: 'hot' }), 400);
    assert.equal(e3.param, 'temperature');
    assert.match(e3.message, /temperature/);
    const e4 = await expectStatus(oa.chat.completions.create({ model: 'x', messages: [{ role: 'wizard', content: 'hi' }] }), 400);
    assert.equal(e4.param, 'messages[0].role');
    // context overflow: 400 saying how many tokens of how many
    const long = 'the cat sat on the mat and '.repeat(400);
    const e5 = await expectStatus(oa.chat.completions.create({ model: 'x', messages: [{ role: 'user', content: long }] }), 400);
    assert.match(e5.message, /\d+ tokens of 1024/);
    assert.equal(e5.code, 'context_length_exceeded');
    const e6 = await expectStatus(an.messages.create({ model: 'x', max_tokens: 5, messages: [{ role: 'user', content: long }] }), 400);
    assert.match(e6.message, /\d+ tokens of 1024/);
    // unknown route: 404; deep nesting: 400
    const e7 = await fetch(`${args.base}/v1/nothing`, { headers: { authorization: `Bearer ${KEY}` } });
    assert.equal(e7.status, 404);
    res = await post('/v1/chat/completions', '['.repeat(100000) + ']'.repeat(100000));
    assert.equal(res.status, 400);
  },

  async cors() {
    // off unless --cors: the base server allows only http://allowed.example (and same-origin)
    const url = `${args.base}/v1/chat/completions`;
    const auth = { authorization: `Bearer ${KEY}`, 'content-type': 'application/json' };
    const body = JSON.stringify({ model: 'x', messages: STORY, max_tokens: 2 });
    let res = await fetch(url, { method: 'OPTIONS' });
    assert.equal(res.status, 204);
    assert.equal(res.headers.get('access-control-allow-origin'), null);
    const preflight = (origin) => fetch(url, { method: 'OPTIONS', headers: { origin,
      'access-control-request-method': 'POST', 'access-control-request-headers': 'authorization, content-type' } });
    res = await preflight('http://allowed.example');
    assert.equal(res.status, 204);
    assert.equal(res.headers.get('access-control-allow-origin'), 'http://allowed.example');
    assert.match(res.headers.get('access-control-allow-methods'), /POST/);
    assert.match(res.headers.get('access-control-allow-headers'), /authorization/);
    assert.match(res.headers.get('vary'), /Origin/);
    res = await preflight('http://evil.example');
    assert.equal(res.status, 403);
    assert.equal(res.headers.get('access-control-allow-origin'), null);
    // a page elsewhere cannot drive the API, not even with a "simple" request
    res = await fetch(url, { method: 'POST', headers: { ...auth, origin: 'http://evil.example' }, body });
    assert.equal(res.status, 403);
    assert.match((await res.json()).error.message, /--cors/);
    res = await fetch(`${args.base}/v1/messages`, { method: 'POST', body,
      headers: { ...auth, origin: 'http://evil.example', 'anthropic-version': '2023-06-01' } });
    assert.equal(res.status, 403);
    assert.equal((await res.json()).type, 'error');
    res = await fetch(url, { method: 'POST', headers: { ...auth, origin: 'http://allowed.example' }, body });
    assert.equal(res.status, 200);
    assert.equal(res.headers.get('access-control-allow-origin'), 'http://allowed.example');
    // same origin (a page the server itself serves) needs no --cors; no Origin: no CORS headers
    const host = new URL(args.base).host;
    res = await fetch(url, { method: 'POST', headers: { ...auth, origin: `http://${host}` }, body });
    assert.equal(res.status, 200);
    // behind a reverse proxy (TLS or not): the page's origin is the host the proxy was asked for
    res = await fetch(url, { method: 'POST', headers: { ...auth, origin: `https://${host}` }, body });
    assert.equal(res.status, 200);
    const proxied = (origin) => fetch(url, { method: 'POST', body,
      headers: { ...auth, origin, 'x-forwarded-host': 'chat.example.org' } });
    assert.equal((await proxied('https://chat.example.org')).status, 200);
    assert.equal((await proxied('https://evil.example')).status, 403);
    assert.equal((await proxied('https://chat.example.org.evil.example')).status, 403);
    assert.equal((await proxied('ftp://chat.example.org')).status, 403);
    res = await fetch(url, { method: 'POST', headers: auth, body });
    assert.equal(res.status, 200);
    assert.equal(res.headers.get('access-control-allow-origin'), null);
  },

  async round_trip() {
    // what the server sends it takes back: 200 replies (sampled at temperature 1, a third pushed
    // by logit_bias towards the byte tokens of control characters, NUL first: ids 3.. are
    // <0x00>..; every fifth streamed and put together from its deltas), each sent back as
    // assistant history through OpenAI chat, Anthropic or Responses
    const replies = [];
    for (let b = 0; b < 200; b += 20)
      replies.push(...await Promise.all(Array.from({ length: 20 }, async (_, k) => {
        const i = b + k;
        const bias = i % 3 === 0 ? { [3 + (i % 32)]: 30, 3: 30 } : undefined;
        const req = { model: 'x', messages: [{ role: 'user', content: `Tale ${i}` }],
          max_tokens: 16, temperature: 1, seed: i, logit_bias: bias };
        if (i % 5 === 4) {
          let text = '';
          for await (const chunk of await oa.chat.completions.create({ ...req, stream: true }))
            text += chunk.choices[0]?.delta?.content ?? '';
          return text;
        }
        const r = await oa.chat.completions.create(req);
        return r.choices[0].message.content;
      })));
    const controls = replies.filter((c) => /[\u0000-\u001f]/.test(c.replace(/\n/g, '')));
    assert.ok(replies.some((c) => c.includes('\u0000')), 'no reply holds a NUL: the bias did not work');
    let accepted = 0;
    for (let b = 0; b < replies.length; b += 20)
      await Promise.all(replies.slice(b, b + 20).map(async (content, k) => {
        const i = b + k, turn = [{ role: 'user', content: `Tale ${i}` }];
        if (i % 3 === 0) {
          const r = await oa.chat.completions.create({ model: 'x', max_tokens: 2,
            messages: [...turn, { role: 'assistant', content }, { role: 'user', content: 'More.' }] });
          assert.equal(r.object, 'chat.completion');
        } else if (i % 3 === 1) {
          const r = await an.messages.create({ model: 'x', max_tokens: 2,
            messages: [...turn, { role: 'assistant', content }, { role: 'user', content: 'More.' }] });
          assert.equal(r.type, 'message');
        } else {
          const r = await oa.responses.create({ model: 'x', max_output_tokens: 2,
            input: [...turn, { role: 'assistant', content }, { role: 'user', content: 'More.' }] });
          assert.equal(r.object, 'response');
        }
        accepted++;
      }));
    assert.equal(accepted, replies.length);
    // and the NUL reaches the model as its byte token, not cut off
    const nul = replies.find((c) => c.includes('\u0000'));
    const tok = await (await fetch(`${args.base}/tokenize`, { method: 'POST',
      headers: { authorization: `Bearer ${KEY}` }, body: JSON.stringify({ content: `a${nul}b` }) })).json();
    assert.ok(tok.tokens.includes(3), JSON.stringify(tok));
    const full = await oa.chat.completions.create({ model: 'x', max_tokens: 1, messages: [{ role: 'user', content: `a${nul}b` }] });
    const cut = await oa.chat.completions.create({ model: 'x', max_tokens: 1, messages: [{ role: 'user', content: 'a' }] });
    assert.ok(full.usage.prompt_tokens > cut.usage.prompt_tokens, 'the text after the NUL was dropped');
    const shown = await (await fetch(`${args.base}/apply-template`, { method: 'POST',
      headers: { authorization: `Bearer ${KEY}` }, body: JSON.stringify({ messages: [{ role: 'user', content: `a${nul}b` }] }) })).json();
    assert.ok(shown.prompt.includes(`a${nul}b`), JSON.stringify(shown.prompt));
    console.log(`round_trip: ${accepted} replies accepted back as history, ${controls.length} of them with control characters`);
  },

  async concurrent_streams() {
    // 16 greedy streams at once give each the tokens it gets alone: batching changes nothing
    const prompts = Array.from({ length: 16 }, (_, i) => [1, 300 + i * 7]);
    const run = async (prompt) => {
      const s = await oa.completions.create({ model: 'x', prompt, max_tokens: 40, temperature: 0, stream: true, ignore_eos: true });
      let text = '';
      for await (const c of s) text += c.choices[0]?.text ?? '';
      return text;
    };
    const alone = [];
    for (const p of prompts) alone.push(await run(p));
    const together = await Promise.all(prompts.map(run));
    assert.deepEqual(together, alone);
    assert.ok(await metric(args.base, 'moe_decode_batch_rows_max') >= 8, 'the streams should have shared forward steps');
    assert.ok(new Set(alone).size > 8, 'prompts should lead to different texts');
  },

  async disconnect() {
    // a stream aborted mid-way is cancelled at the next step and frees its slot
    const cancelled0 = await metric(args.slow, 'moe_requests_cancelled_total');
    const ac = new AbortController();
    const s = await slowOa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 2000, stream: true, ignore_eos: true },
      { signal: ac.signal });
    let n = 0;
    try {
      for await (const c of s) {
        if (c.choices[0]?.delta?.content && ++n === 3) ac.abort();
      }
    } catch (e) {
      assert.ok(/abort/i.test(e.name + e.message), e.message);
    }
    await waitFor('the slot to be freed', async () => (await metric(args.slow, 'moe_streams_active')) === 0, 3000);
    assert.equal(await metric(args.slow, 'moe_requests_cancelled_total'), cancelled0 + 1);
    // and the server keeps serving
    const r = await slowOa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 3 });
    assert.equal(r.choices[0].finish_reason, 'length');
  },

  async disconnect_storm() {
    // 100 requests, most abandoned at random moments: nothing stays active, the server serves on
    const ac = [];
    const one = async (i) => {
      const c = new AbortController();
      ac.push(c);
      const stream = i % 2 === 0;
      setTimeout(() => c.abort(), (i * 7919) % 40);
      try {
        const r = await oa.chat.completions.create({ model: 'x', messages: [{ role: 'user', content: `story ${i}` }],
          max_tokens: 60, stream }, { signal: c.signal });
        if (stream) for await (const _ of r) { /* drain */ }
      } catch { /* aborted */ }
    };
    for (let b = 0; b < 5; b++) await Promise.all(Array.from({ length: 20 }, (_, k) => one(b * 20 + k)));
    await waitFor('all streams to end', async () => (await metric(args.base, 'moe_streams_active')) === 0 &&
      (await metric(args.base, 'moe_queue_depth')) === 0, 5000);
    const r = await oa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 4 });
    assert.equal(r.usage.completion_tokens, 4);
  },

  async disconnect_whole() {
    // a non-streaming request whose client hangs up is cancelled within a step, as a stream is
    const whole = 'moe_client_hangups_total{mode="whole"}';
    const hang0 = await metric(args.slow, whole), cancelled0 = await metric(args.slow, 'moe_requests_cancelled_total');
    const g0 = await metric(args.slow, 'moe_generated_tokens_total');
    const ac = new AbortController();
    const p = slowOa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 2000, ignore_eos: true },
      { signal: ac.signal });
    p.catch(() => {});
    await waitFor('tokens to flow', async () => (await metric(args.slow, 'moe_generated_tokens_total')) >= g0 + 3, 5000);
    ac.abort();
    await waitFor('the generation to stop', async () => (await metric(args.slow, 'moe_streams_active')) === 0, 3000);
    assert.equal(await metric(args.slow, whole), hang0 + 1);
    assert.equal(await metric(args.slow, 'moe_requests_cancelled_total'), cancelled0 + 1);
    // at most the step that was running when the cancel came (over every cancel so far)
    const after = await metric(args.slow, 'moe_tokens_after_cancel_max');
    assert.ok(after <= 1, `${after} tokens generated after a cancel`);
    const generated = await metric(args.slow, 'moe_generated_tokens_total') - g0;
    assert.ok(generated < 2000, `${generated} tokens: the request ran to max_tokens`);
    console.log(`disconnect_whole: cancelled after ${generated} tokens, <= ${after} after the hang-up`);
  },

  async queue_limits() {
    // --parallel 1 --queue 1: one stream runs, one waits, the third is refused with 429
    const acA = new AbortController(), acB = new AbortController();
    const a = await slowOa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 2000, stream: true, ignore_eos: true },
      { signal: acA.signal });
    const itA = a[Symbol.asyncIterator]();
    await itA.next(); // A holds the only stream
    const bPromise = slowOa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 5 }, { signal: acB.signal });
    bPromise.catch(() => {});
    await waitFor('B to queue', async () => (await metric(args.slow, 'moe_queue_depth')) === 1, 3000);
    const res = await fetch(`${args.slow}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'x', messages: STORY, max_tokens: 5 }) });
    assert.equal(res.status, 429);
    assert.ok(Number(res.headers.get('retry-after')) >= 1);
    const e = await res.json();
    assert.equal(e.error.code, 'rate_limit_exceeded');
    // B waits past --queue-timeout 1 and gets 503
    const eb = await expectStatus(bPromise, 503);
    assert.match(eb.message, /overloaded/);
    // the same through the Anthropic API: 529 overloaded_error, Anthropic's own status
    await waitFor('B to leave the queue', async () => (await metric(args.slow, 'moe_queue_depth')) === 0, 3000);
    const ec = await expectStatus(slowAn.messages.create({ model: 'x', max_tokens: 5, messages: STORY }), 529);
    assert.equal(ec.error.error.type, 'overloaded_error');
    acA.abort();
    await waitFor('A to end', async () => (await metric(args.slow, 'moe_streams_active')) === 0, 3000);
  },

  async demo_model() {
    // the slow server runs the built-in demo model (no model argument)
    const list = await slowOa.models.list();
    assert.equal(list.data[0].id, 'moe-demo');
    const r = await slowOa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 4, temperature: 0 });
    assert.equal(r.usage.completion_tokens, 4);
  },

  async keepalive() {
    // SSE keep-alives: an OpenAI stream gets comment lines, an Anthropic stream ping events;
    // the SDKs skip both and see the same text
    const body = { model: 'x', messages: STORY, max_tokens: 6, temperature: 0 };
    const raw = await (await fetch(`${args.slow}/v1/chat/completions`, { method: 'POST',
      headers: { 'content-type': 'application/json' }, body: JSON.stringify({ ...body, stream: true }) })).text();
    assert.ok(raw.includes('\n: keep-alive\n') || raw.startsWith(': keep-alive\n'), raw.slice(0, 300));
    let text = '';
    for await (const c of await slowOa.chat.completions.create({ ...body, stream: true })) text += c.choices[0]?.delta?.content ?? '';
    assert.equal(text, (await slowOa.chat.completions.create(body)).choices[0].message.content);
    const an = await (await fetch(`${args.slow}/v1/messages`, { method: 'POST',
      headers: { 'content-type': 'application/json', 'anthropic-version': '2023-06-01' },
      body: JSON.stringify({ ...body, stream: true }) })).text();
    assert.ok(an.split('event: ping\n').length > 2, 'expected pings beyond the first');
    assert.ok(an.trimEnd().endsWith('event: message_stop\ndata: {"type":"message_stop"}'));
  },

  async bench_8_streams() {
    // aggregate decode throughput of 8 concurrent greedy streams (reported, not asserted)
    const n = 8, tokens = 200;
    const t0 = performance.now();
    const rs = await Promise.all(Array.from({ length: n }, (_, i) => oa.completions.create(
      { model: 'x', prompt: [1, 260 + i], max_tokens: tokens, temperature: 0, ignore_eos: true })));
    const s = (performance.now() - t0) / 1000;
    const generated = rs.reduce((a, r) => a + r.usage.completion_tokens, 0);
    console.log(`bench_8_streams: ${generated} tokens in ${s.toFixed(3)} s = ${(generated / s).toFixed(0)} tok/s aggregate ` +
      `(server's last decode step: ${(await metric(args.base, 'moe_decode_tokens_per_second')).toFixed(0)} tok/s; stories260K)`);
    assert.equal(generated, n * tokens);
  },

  async ops() {
    const m = await (await fetch(`${args.base}/metrics`, { headers: { authorization: `Bearer ${KEY}` } })).text();
    for (const name of ['moe_requests_total', 'moe_queue_depth', 'moe_prompt_tokens_total', 'moe_generated_tokens_total',
      'moe_prefix_cache_hits_total', 'moe_decode_tokens_per_second', 'moe_time_to_first_token_seconds_bucket'])
      assert.ok(m.includes(name), `metrics lack ${name}`);
    const tok = await (await fetch(`${args.base}/tokenize`, { method: 'POST', headers: { authorization: `Bearer ${KEY}` },
      body: JSON.stringify({ content: 'Once upon a time' }) })).json();
    assert.ok(tok.tokens.length >= 4);
    const detok = await (await fetch(`${args.base}/detokenize`, { method: 'POST', headers: { authorization: `Bearer ${KEY}` },
      body: JSON.stringify({ tokens: tok.tokens }) })).json();
    assert.equal(detok.content.trim(), 'Once upon a time');
  },
};

// Reasoning controls through both SDKs (run with --think only).
const thinkOa = new OpenAI({ baseURL: `${args.think}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 30000 });
const thinkAn = new Anthropic({ baseURL: args.think, apiKey: 'unused', maxRetries: 0, timeout: 30000 });
const thinkCases = {
  async reasoning_controls() {
    // Anthropic: a budget under the server's; the stream adds up to the whole reply
    const req = { model: 'x', max_tokens: 24, temperature: 0, messages: STORY,
      thinking: { type: 'enabled', budget_tokens: 4 } };
    const m = await thinkAn.messages.create(req);
    assert.deepEqual(m.content.map((b) => b.type), ['thinking', 'text']);
    assert.ok(m.content[0].thinking.length > 0 && m.content[1].text.length > 0);
    assert.equal(m.usage.output_tokens, 24);
    let thinking = '', text = '';
    for await (const ev of await thinkAn.messages.create({ ...req, stream: true })) {
      if (ev.type === 'content_block_delta' && ev.delta.type === 'thinking_delta') thinking += ev.delta.thinking;
      if (ev.type === 'content_block_delta' && ev.delta.type === 'text_delta') text += ev.delta.text;
    }
    assert.equal(thinking, m.content[0].thinking);
    assert.equal(text, m.content[1].text);
    // budgets differ per stream in one batch: each reply equals the same request alone
    const budgets = [1, 2, 3, 5, 7, 9];
    const alone = [];
    for (const b of budgets)
      alone.push(await thinkAn.messages.create({ ...req, thinking: { type: 'enabled', budget_tokens: b } }));
    const together = await Promise.all(budgets.map((b) =>
      thinkAn.messages.create({ ...req, thinking: { type: 'enabled', budget_tokens: b } })));
    for (let i = 0; i < budgets.length; i++) assert.deepEqual(together[i].content, alone[i].content);
    assert.ok(alone[0].content[0].thinking.length < alone[5].content[0].thinking.length);
    // thinking off, which the template cannot switch: no thinking block at all
    const off = await thinkAn.messages.create({ ...req, thinking: { type: 'disabled' } });
    assert.deepEqual(off.content.map((b) => b.type), ['text']);
    // OpenAI: the server's budget of 10, then reasoning_effort "none"
    const r = await thinkOa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 30, temperature: 0 });
    assert.ok(r.choices[0].message.reasoning_content.length > 0);
    const rt = r.usage.completion_tokens_details.reasoning_tokens;
    assert.ok(rt > 10 && rt < 30, `reasoning_tokens ${rt}: the budget of 10 and the closing tag`);
    const none = await thinkOa.chat.completions.create({ model: 'x', messages: STORY, max_tokens: 8, temperature: 0,
      reasoning_effort: 'none' });
    assert.equal(none.choices[0].message.reasoning_content, undefined);
    assert.equal(none.usage.completion_tokens_details.reasoning_tokens, 0);
    assert.ok(none.choices[0].message.content.length > 0);
  },
};

let failed = 0;
const table = args.think ? thinkCases : cases;
for (const name of args.cases.length ? args.cases : Object.keys(table)) {
  const fn = table[name];
  if (!fn) {
    console.log(`FAIL ${name}: no such case`);
    failed++;
    continue;
  }
  try {
    await fn();
    console.log(`ok ${name}`);
  } catch (e) {
    console.log(`FAIL ${name}: ${e.stack || e}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
