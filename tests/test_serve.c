/* Suite "serve": `moe serve` on loopback, driven by the official SDKs, plus the adapters' shapes
 * for parsed model output (replayed, no model) on their own.
 *
 * Two servers are started once (on free ports, found by --port 0 and read from their stdout):
 *   base: stories260K (../shared) with --ctx 1024 --parallel 16, an API key and --cors for one
 *         origin;
 *   slow: the built-in demo model with --parallel 1 --queue 1 --queue-timeout 1 --step-delay 20
 *         --keepalive 0.01, where a stream lasts long enough to be aborted, queued behind or
 *         refused, and keep-alives come between tokens;
 *   hybrid: qwen3next-f32 (../shared/parity: Gated DeltaNet + attention, stories260K vocab) with
 *         --parallel 2 --cache-slots 4, where prefix reuse must go through snapshots.
 * Two more, for chat templates, start in their own test: stories260K written again with
 * ChatML's control tokens and Qwen3's template in the GGUF, served as is and with
 * --chat-template-file; the prompts they render (/apply-template) must equal Python Jinja2's.
 * Two more for the reasoning controls: stories260K with GLM-5.3-Flash's template behind
 * --reasoning-budget 10, and with a template that has no switch; budgeted replies must equal the
 * model's own greedy continuation with the closing tag put in by hand, and the SDK case
 * reasoning_controls (cases.mjs --think) runs against the first.
 * The client cases live in tests/clients/cases.mjs (node, with the npm packages installed by
 * `npm ci --prefix tests/clients`); without node_modules they skip with a message, and fail
 * under CI=true. The last test stops both servers with SIGTERM and requires a clean exit
 * (under `make asan` that includes LeakSanitizer's verdict after 100 aborted requests). */
#include "testutil.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>

#include "../src/serve/serve_internal.h"

#define API_KEY     "sk-moe-test"
#define CLIENTS_DIR "tests/clients"

/* ==== Servers ==== */

typedef moe_test_server server; /* testutil: start, stop */
#define server_start moe_test_server_start
#define server_stop  moe_test_server_stop

static server base_srv, slow_srv, hybrid_srv;
static bool servers_tried, servers_ok;
static const char *runc_text;

static int in_ci(void) {
    const char *ci = getenv("CI");
    return ci && strcmp(ci, "true") == 0;
}

/* Both servers and the npm clients, started on first use; false: the test was skipped. */
static bool servers(void) {
    if (servers_tried) {
        if (!servers_ok) skip();
        return servers_ok;
    }
    servers_tried = true;
    struct stat st;
    if (stat(CLIENTS_DIR "/node_modules/openai/package.json", &st) != 0 ||
        stat(CLIENTS_DIR "/node_modules/@anthropic-ai/sdk/package.json", &st) != 0) {
        if (in_ci())
            fail_msg("%s/node_modules is missing and CI=true: run `npm ci --prefix %s`",
                     CLIENTS_DIR, CLIENTS_DIR);
        print_message("[  SKIP    ] %s/node_modules is absent (run `make clients`)\n", CLIENTS_DIR);
        skip();
        return false;
    }
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    runc_text = moe_test_shared("models/stories260K/runc_greedy_bos_n256.txt");
    const char *hybrid = moe_test_shared("parity/qwen3next-f32.gguf");
    if (!model || !runc_text || !hybrid) {
        skip();
        return false;
    }
    char *base_args[] = {(char *)model, "--ctx",  "1024",
                         "--parallel",  "16",     "--api-key",
                         API_KEY,       "--cors", "http://allowed.example",
                         NULL};
    char *slow_args[] = {
        "--parallel", "1",           "--queue", "1", "--queue-timeout", "1", "--step-delay",
        "20",         "--keepalive", "0.01",    NULL};
    /* the hybrid's experts stream through a cache of 5 of its 16 (logits stay bit for bit) */
    char *hybrid_args[] = {
        (char *)hybrid,   "--ctx", "128", "--parallel", "2", "--cache-slots", "4",
        "--expert-cache", "100K",  NULL};
    if (!server_start(&base_srv, "base", base_args) ||
        !server_start(&slow_srv, "slow", slow_args) ||
        !server_start(&hybrid_srv, "hybrid", hybrid_args))
        fail_msg("a server did not start (logs in %s)", moe_test_tmpdir());
    servers_ok = true;
    return true;
}

/* All cases run in one node process (SDK start-up is most of a case's time), on first use;
 * each test then reports its own case from that output. */
static char *clients_out;
static int clients_rc;

static void client_case(const char *name) {
    if (!servers()) return;
    if (!clients_out) {
        char cmd[4096];
        snprintf(cmd, sizeof cmd,
                 "node %s/cases.mjs --base %s --slow %s --hybrid %s --key %s --runc %s",
                 CLIENTS_DIR, base_srv.url, slow_srv.url, hybrid_srv.url, API_KEY, runc_text);
        clients_rc = moe_test_run(cmd, &clients_out);
    }
    char ok[128], bad[128];
    snprintf(ok, sizeof ok, "\nok %s\n", name);
    snprintf(bad, sizeof bad, "FAIL %s:", name);
    if (strncmp(clients_out, ok + 1, strlen(ok + 1)) == 0 || strstr(clients_out, ok)) {
        /* a case may report figures on lines "NAME: ..." (benchmarks: shown, not asserted) */
        char report[128];
        snprintf(report, sizeof report, "\n%s: ", name);
        const char *r = strstr(clients_out, report);
        if (r) print_message("%.*s\n", (int)strcspn(r + 1, "\n"), r + 1);
        return;
    }
    const char *at = strstr(clients_out, bad);
    if (!at)
        fail_msg("client case %s did not report (node exit %d):\n%s", name, clients_rc,
                 clients_out);
    /* the failure: up to the next case's line */
    const char *end = at + 1;
    while ((end = strchr(end, '\n')) && strncmp(end + 1, "ok ", 3) != 0 &&
           strncmp(end + 1, "FAIL ", 5) != 0)
        end++;
    const int len = end ? (int)(end - at) : (int)strlen(at);
    fail_msg("%.*s\n(server logs: %s, %s)", len, at, base_srv.log, slow_srv.log);
}

#define CLIENT_CASE(name)                                                                          \
    static void client_##name(void **state) {                                                      \
        (void)state;                                                                               \
        client_case(#name);                                                                        \
    }
CLIENT_CASE(models)
CLIENT_CASE(chat_nonstream)
CLIENT_CASE(chat_stream)
CLIENT_CASE(completions_runc)
CLIENT_CASE(stop_strings)
CLIENT_CASE(logprobs)
CLIENT_CASE(cached_tokens)
CLIENT_CASE(hybrid_reuse)
CLIENT_CASE(anthropic_messages)
CLIENT_CASE(anthropic_stream)
CLIENT_CASE(tools_shape)
CLIENT_CASE(structured_output)
CLIENT_CASE(responses)
CLIENT_CASE(errors)
CLIENT_CASE(cors)
CLIENT_CASE(round_trip)
CLIENT_CASE(concurrent_streams)
CLIENT_CASE(disconnect)
CLIENT_CASE(disconnect_storm)
CLIENT_CASE(disconnect_whole)
CLIENT_CASE(queue_limits)
CLIENT_CASE(demo_model)
CLIENT_CASE(ops)
CLIENT_CASE(keepalive)
CLIENT_CASE(bench_8_streams)

/* Last: SIGTERM ends both servers cleanly (no crash, no leak under ASan). */
static void servers_stop_cleanly(void **state) {
    (void)state;
    if (!servers()) return;
    const int a = server_stop(&base_srv), b = server_stop(&slow_srv), h = server_stop(&hybrid_srv);
    if (a != 0 || b != 0 || h != 0)
        fail_msg("servers exited with %d, %d and %d (logs: %s, %s, %s)", a, b, h, base_srv.log,
                 slow_srv.log, hybrid_srv.log);
}

static int teardown(void **state) {
    (void)state;
    free(clients_out);
    clients_out = NULL;
    server_stop(&base_srv);
    server_stop(&slow_srv);
    server_stop(&hybrid_srv);
    return 0;
}

/* ==== Connections under fire (tests/serve_flood.py) ==== */

/* 1000 idle connections and 50 header-tricklers against a server of its own: /health and a
 * chat request still answered, threads and RSS bounded, tricklers closed by --read-timeout,
 * nothing left once they close. Twice: with limits above the flood (every connection held, one
 * thread each no longer), and with the default limits (newcomers close the idle-longest ones,
 * all from one address). The script prints its measurements; times are shown, not asserted. */
static void flood_one(const char *name, char *const extra[]) {
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(model);
    char *args[16] = {(char *)model, "--api-key", API_KEY, "--read-timeout", "2"};
    int n = 5;
    for (int i = 0; extra[i] && n < 15; i++) args[n++] = extra[i];
    args[n] = NULL;
    server s = {0};
    if (!server_start(&s, name, args))
        fail_msg("the %s server did not start (log: %s)", name, s.log);
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 tests/serve_flood.py --url %s --pid %d --key %s 2>&1", s.url,
             (int)s.pid, API_KEY);
    const int rc = moe_test_run(cmd, &out);
    const int stopped = server_stop(&s);
    print_message("%s", out);
    if (rc != 0 || !strstr(out, "ok flood"))
        fail_msg("%s: serve_flood.py failed (log: %s)", name, s.log);
    if (stopped != 0) fail_msg("%s: the server exited with %d (log: %s)", name, stopped, s.log);
    free(out);
}

static void connection_flood(void **state) {
    (void)state;
    char *roomy[] = {"--max-connections", "1100", "--max-connections-per-ip", "1100", NULL};
    char *defaults[] = {NULL};
    flood_one("flood-roomy", roomy);
    flood_one("flood-limited", defaults);
}

/* ==== The fuzz target's seeds and past findings (tests/data/http) ==== */

#include "../fuzz/http.c"

/* Every seed through fuzz/http.c's checks (answered once, 200/4xx/503/529, valid JSON); under
 * `make asan` LeakSanitizer judges the found leak's input too. */
static void request_parser_seeds(void **state) {
    (void)state;
    MOE_SKIP_IF_NULL(moe_test_shared("models/stories260K/stories260K.gguf"));
    static const char *const seeds[] = {
        "apply-template",          "chat",         "chat-tools", "completions",
        "completions-ids",         "count-tokens", "messages",   "responses",
        "leak-tool-without-schema"};
    setenv("MOE_FUZZ_MODEL", moe_test_shared("models/stories260K/stories260K.gguf"), 1);
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
        char path[256];
        snprintf(path, sizeof path, "tests/data/http/%s", seeds[i]);
        uint8_t *data = NULL;
        size_t size = 0;
        moe_error err = {0};
        if (moe_file_read(path, &data, &size, &err) != MOE_OK) fail_msg("%s", err.msg);
        LLVMFuzzerTestOneInput(data, size); /* aborts on a wrong answer */
        free(data);
    }
    serve_sched_free(srv->sched);
    moe_chat_template_free(srv->tmpl);
    pthread_mutex_destroy(&srv->metrics.mu);
    free(srv);
    srv = NULL;
}

/* A file that is not a model fails before "listening": no port is opened for it. */
static void model_checked_before_listening(void **state) {
    (void)state;
    char bad[600], cmd[1400], *out = NULL;
    snprintf(bad, sizeof bad, "%s/not-a-model.gguf", moe_test_tmpdir());
    moe_error err = {0};
    assert_int_equal(moe_file_write(bad, "hello, world", 12, &err), MOE_OK);
    snprintf(cmd, sizeof cmd, "%s serve '%s' --port 0 2>&1", moe_test_bin(), bad);
    const int rc = moe_test_run(cmd, &out);
    if (rc == 0 || strstr(out, "listening") || !strstr(out, "not a GGUF file"))
        fail_msg("moe serve on a bad file: exit %d, output:\n%s", rc, out);
    free(out);
}

/* ==== Chat templates through the server and `moe chat` ==== */

/* POST a JSON body; the reply body (caller frees), its status in *status. */
static char *http_post(const char *base, const char *path, const char *body, long *status) {
    char url[512];
    snprintf(url, sizeof url, "%s%s", base, path);
    return moe_test_http(url, body, status);
}

#define QWEN3_TEMPLATE "templates/Qwen-Qwen3-0.6B.jinja"
/* --chat-template-file for the second server (and `moe chat`): its own shape, and a raise */
#define CUSTOM_TEMPLATE                                                                            \
    "{%- for m in messages %}{%- if m.content == 'boom' %}{{ raise_exception('no boom here') }}"   \
    "{%- endif %}[{{ m.role }}|{{ m.content }}]\n{%- endfor %}"                                    \
    "{%- if add_generation_prompt %}[assistant|{%- endif %}"

typedef struct chat_case {
    const char *messages, *tools, *template_kwargs; /* kwargs: the request's chat_template_kwargs */
} chat_case;

static const chat_case chat_cases[] = {
    {"[{\"role\":\"user\",\"content\":\"Tell me a story.\"}]", NULL, NULL},
    {"[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"},"
     "{\"role\":\"assistant\",\"content\":\"Hello!\",\"reasoning_content\":\"greet back\"},"
     "{\"role\":\"user\",\"content\":\"A story?\"}]",
     NULL, "{\"enable_thinking\":false}"},
    {"[{\"role\":\"user\",\"content\":\"Weather in Paris?\"},{\"role\":\"assistant\",\"content\":"
     "\"\",\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":"
     "\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}}]},{\"role\":\"tool\","
     "\"tool_call_id\":\"call_1\",\"content\":\"21 C\"}]",
     "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather "
     "for a city\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":"
     "\"string\"}},\"required\":[\"city\"]}}}]",
     NULL},
};
#define N_CHAT_CASES (sizeof chat_cases / sizeof chat_cases[0])

/* The request body for /apply-template. */
static char *chat_request(const chat_case *c) {
    json_t *b = json_object();
    json_object_set_new(b, "model", json_string("x"));
    json_object_set_new(b, "messages", json_loads(c->messages, 0, NULL));
    if (c->tools) json_object_set_new(b, "tools", json_loads(c->tools, 0, NULL));
    if (c->template_kwargs)
        json_object_set_new(b, "chat_template_kwargs", json_loads(c->template_kwargs, 0, NULL));
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* The same conversation as transformers' apply_chat_template gets it: arguments as objects,
 * bos/eos from the tokenizer, the generation prompt on. */
static json_t *reference_case(const char *template_path, const char *messages, const char *tools,
                              const char *template_kwargs) {
    json_t *msgs = json_loads(messages, 0, NULL);
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        size_t k;
        json_t *call;
        json_array_foreach(json_object_get(m, "tool_calls"), k, call) {
            json_t *fn = json_object_get(call, "function");
            json_object_set_new(
                fn, "arguments",
                json_loads(json_string_value(json_object_get(fn, "arguments")), 0, NULL));
        }
    }
    json_t *kw = json_pack("{s:b,s:s,s:s}", "add_generation_prompt", 1, "bos_token", "<s>",
                           "eos_token", "</s>");
    if (template_kwargs) {
        json_t *extra = json_loads(template_kwargs, 0, NULL);
        json_object_update(kw, extra);
        json_decref(extra);
    }
    return json_pack("{s:s,s:o,s:o,s:o}", "template", template_path, "messages", msgs, "tools",
                     tools ? json_loads(tools, 0, NULL) : json_null(), "kwargs", kw);
}

static size_t count_token(json_t *tokens, json_int_t id) {
    size_t n = 0, i;
    json_t *t;
    json_array_foreach(tokens, i, t) n += json_integer_value(t) == id;
    return n;
}

/* Write text to NAME in the scratch directory; its path into path. */
static void tmp_file(char *path, size_t size, const char *name, const char *text) {
    snprintf(path, size, "%s/%s", moe_test_tmpdir(), name);
    moe_error err = {0};
    if (moe_file_write(path, text, strlen(text), &err) != MOE_OK) fail_msg("%s", err.msg);
}

/* The prompt `moe chat --verbose-prompt` printed for its first turn. */
static char *chat_prompt_of(const char *model, const char *extra) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "printf 'Tell me a story.\\n' | %s chat '%s' --verbose-prompt -n 2 %s", moe_test_bin(),
             model, extra);
    char *out;
    if (moe_test_run(cmd, &out) != 0) fail_msg("moe chat failed:\n%s", out);
    const char *a = strstr(out, " tokens]\n"), *b = a ? strstr(a, "\n[/prompt]") : NULL;
    if (!a || !b) fail_msg("moe chat printed no prompt:\n%s", out);
    a += strlen(" tokens]\n");
    char *prompt = moe_xstrndup(a, (size_t)(b - a));
    free(out);
    return prompt;
}

static void chat_templates_served(void **state) {
    (void)state;
    const char *model = moe_test_chat_model("qwen3-chat", QWEN3_TEMPLATE);
    const char *qwen3 = moe_test_shared(QWEN3_TEMPLATE);
    MOE_SKIP_IF_NULL(model);
    MOE_SKIP_IF_NULL(qwen3);
    char custom[600];
    tmp_file(custom, sizeof custom, "custom.jinja", CUSTOM_TEMPLATE);
    server own = {0}, over = {0};
    char *own_args[] = {(char *)model, "--ctx", "2048", NULL};
    char *over_args[] = {(char *)model, "--ctx", "2048", "--chat-template-file", custom, NULL};
    if (!server_start(&own, "chat-own", own_args) ||
        !server_start(&over, "chat-override", over_args))
        fail_msg("a chat-template server did not start (logs in %s)", moe_test_tmpdir());

    /* every case through both servers, and through Python Jinja2 */
    json_t *spec = json_pack("{s:s,s:[]}", "fixed_date", "2026-01-15T09:30:00", "cases");
    json_t *cases = json_object_get(spec, "cases");
    char *served[2][N_CHAT_CASES];
    const server *srvs[2] = {&own, &over};
    const char *paths[2] = {qwen3, custom};
    for (size_t c = 0; c < N_CHAT_CASES; c++)
        for (int s = 0; s < 2; s++) {
            char *body = chat_request(&chat_cases[c]);
            long status;
            char *reply = http_post(srvs[s]->url, "/apply-template", body, &status);
            if (status != 200) fail_msg("/apply-template case %zu: %ld %s", c, status, reply);
            json_t *j = json_loads(reply, 0, NULL);
            served[s][c] = moe_xstrdup(json_string_value(json_object_get(j, "prompt")));
            json_decref(j);
            free(reply);
            free(body);
            json_array_append_new(cases, reference_case(paths[s], chat_cases[c].messages,
                                                        chat_cases[c].tools,
                                                        chat_cases[c].template_kwargs));
        }
    /* `moe chat` on the same model: its own template, then the override */
    char *chat_prompts[2] = {chat_prompt_of(model, ""), NULL};
    char extra[700];
    snprintf(extra, sizeof extra, "--chat-template-file '%s'", custom);
    chat_prompts[1] = chat_prompt_of(model, extra);
    for (int s = 0; s < 2; s++)
        json_array_append_new(cases, reference_case(paths[s], chat_cases[0].messages, NULL, NULL));

    json_t *ref = moe_test_render_jinja(spec, "served");
    json_decref(spec);
    for (size_t c = 0; c < N_CHAT_CASES; c++)
        for (int s = 0; s < 2; s++) {
            json_t *r = json_array_get(ref, c * 2 + s);
            const char *want = json_string_value(json_object_get(r, "text"));
            if (!want) fail_msg("jinja2 failed on case %zu: %s", c, json_dumps(r, 0));
            if (strcmp(served[s][c], want) != 0)
                fail_msg("%s server, case %zu:\n[%s]\njinja2:\n[%s]", s ? "override" : "own", c,
                         served[s][c], want);
            free(served[s][c]);
        }
    for (int s = 0; s < 2; s++) {
        const char *want =
            json_string_value(json_object_get(json_array_get(ref, 2 * N_CHAT_CASES + s), "text"));
        assert_non_null(want);
        assert_string_equal(chat_prompts[s], want);
        free(chat_prompts[s]);
    }
    json_decref(ref);

    /* a client's "<|im_start|>" stays text: the prompt holds only the template's two */
    long status;
    char *reply = http_post(
        own.url, "/apply-template",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x<|im_start|>system\"}]}", &status);
    json_t *j = json_loads(reply, 0, NULL);
    assert_int_equal(status, 200);
    assert_non_null(strstr(json_string_value(json_object_get(j, "prompt")), "x<|im_start|>system"));
    assert_int_equal(count_token(json_object_get(j, "tokens"), 3), 2);
    json_decref(j);
    free(reply);
    /* a template that raises: 400 with its message, in each API's shape */
    reply = http_post(over.url, "/v1/chat/completions",
                      "{\"model\":\"x\",\"messages\":[{\"role\":\"user\",\"content\":\"boom\"}]}",
                      &status);
    assert_int_equal(status, 400);
    if (!strstr(reply, "no boom here")) fail_msg("%s", reply);
    free(reply);
    reply = http_post(over.url, "/v1/messages",
                      "{\"model\":\"x\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\","
                      "\"content\":\"boom\"}]}",
                      &status);
    assert_int_equal(status, 400);
    if (!strstr(reply, "\"invalid_request_error\"") || !strstr(reply, "no boom here"))
        fail_msg("%s", reply);
    free(reply);
    /* and the model generates from the rendered prompts */
    reply = http_post(own.url, "/v1/chat/completions",
                      "{\"model\":\"x\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\","
                      "\"content\":\"Tell me a story.\"}],\"chat_template_kwargs\":"
                      "{\"enable_thinking\":false}}",
                      &status);
    if (status != 200) fail_msg("%s", reply);
    free(reply);
    assert_int_equal(server_stop(&own), 0);
    assert_int_equal(server_stop(&over), 0);
}

/* ==== Reasoning controls through the server ==== */

#define GLM5_TEMPLATE "tests/data/jinja/GLM-5.3-Flash.jinja"
/* a template that opens <think> and reads neither enable_thinking nor reasoning_effort */
#define THINK_TEMPLATE                                                                             \
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}{%- endfor %}"                         \
    "{%- if add_generation_prompt %}<|assistant|><think>{%- endif %}"
#define STORY "[{\"role\":\"user\",\"content\":\"Tell me a story.\"}]"

/* POST and parse; fails the test unless 200. */
static json_t *post_json(const server *s, const char *path, const char *body) {
    long status;
    char *reply = http_post(s->url, path, body, &status);
    json_t *j = json_loads(reply, 0, NULL);
    if (status != 200 || !j) fail_msg("POST %s %s: %ld %s", path, body, status, reply);
    free(reply);
    return j;
}

/* Greedy /v1/completions text of a prompt (a JSON string or token array). */
static char *greedy_completion(const server *s, json_t *prompt, int max_tokens) {
    json_t *b = json_pack("{s:s,s:O,s:i,s:f}", "model", "x", "prompt", prompt, "max_tokens",
                          max_tokens, "temperature", 0.0);
    char *body = json_dumps(b, JSON_COMPACT);
    json_t *r = post_json(s, "/v1/completions", body);
    char *text = moe_xstrdup(json_string_value(
        json_object_get(json_array_get(json_object_get(r, "choices"), 0), "text")));
    json_decref(r);
    json_decref(b);
    free(body);
    return text;
}

/* The answer after a closed think block starts mid-stream, so it keeps the space a first token's
 * piece carries, which /v1/completions strips from its first token. */
static void expect_answer(const char *got, const char *want, const char *what) {
    if (strcmp(got, want) && !(got[0] == ' ' && !strcmp(got + 1, want)))
        fail_msg("%s: answer [%s], the unbudgeted continuation gives [%s]", what, got, want);
}

static json_int_t usage_reasoning(json_t *r) {
    return json_integer_value(
        json_object_get(json_object_get(json_object_get(r, "usage"), "completion_tokens_details"),
                        "reasoning_tokens"));
}

/* stories260K with GLM-5.3-Flash's own template (no enable_thinking switch; reasoning_effort
 * low / high / max) behind --reasoning-budget 10, and with a template without any switch.
 * References: Python Jinja2 for the prompts; the same model's unbudgeted greedy continuation
 * (/v1/completions) for what a budgeted reply must be -- its first tokens as the reasoning, then
 * the closing tag, then what the model writes after it. */
static void reasoning_budget_served(void **state) {
    (void)state;
    const char *model = moe_test_chat_model("think-chat", NULL);
    MOE_SKIP_IF_NULL(model);
    char plain_tpl[600];
    tmp_file(plain_tpl, sizeof plain_tpl, "think.jinja", THINK_TEMPLATE);
    moe_error err = {0};
    server glm = {0}, plain = {0};
    char *glm_args[] = {
        (char *)model,        "--ctx", "1024", "--chat-template-file", (char *)GLM5_TEMPLATE,
        "--reasoning-budget", "10",    NULL};
    char *plain_args[] = {(char *)model, "--ctx", "1024", "--chat-template-file", plain_tpl, NULL};
    if (!server_start(&glm, "think-glm5", glm_args) ||
        !server_start(&plain, "think-plain", plain_args))
        fail_msg("a reasoning server did not start (logs in %s)", moe_test_tmpdir());

    /* the prompts: the template's own (effort High, ends inside <think>); thinking off, which
     * it has no switch for, closes the block */
    json_t *on = post_json(&glm, "/apply-template",
                           "{\"messages\":" STORY ",\"reasoning_effort\":\"high\"}");
    json_t *off = post_json(&glm, "/apply-template",
                            "{\"messages\":" STORY ",\"chat_template_kwargs\":"
                            "{\"enable_thinking\":false}}");
    json_t *spec =
        json_pack("{s:s,s:[o,o]}", "fixed_date", "2026-01-15T09:30:00", "cases",
                  reference_case(GLM5_TEMPLATE, STORY, NULL, "{\"reasoning_effort\":\"high\"}"),
                  reference_case(GLM5_TEMPLATE, STORY, NULL, "{\"enable_thinking\":false}"));
    json_t *ref = moe_test_render_jinja(spec, "think");
    json_decref(spec);
    const char *p_on = json_string_value(json_object_get(on, "prompt"));
    const char *p_off = json_string_value(json_object_get(off, "prompt"));
    const char *r_on = json_string_value(json_object_get(json_array_get(ref, 0), "text"));
    const char *r_off = json_string_value(json_object_get(json_array_get(ref, 1), "text"));
    assert_non_null(r_on);
    assert_non_null(r_off);
    assert_string_equal(p_on, r_on);
    assert_non_null(strstr(p_on, "Reasoning Effort: High<|user|>"));
    char *closed;
    if (asprintf(&closed, "%s</think>", r_off) < 0) fail_msg("asprintf");
    assert_string_equal(p_off, closed);
    free(closed);
    /* the closing tag as the server feeds it: after text, no SentencePiece dummy prefix */
    moe_gguf *gg = moe_gguf_open(model, &err);
    assert_non_null(gg);
    moe_tokenizer *tok = moe_tokenizer_from_gguf(gg, &err);
    assert_non_null(tok);
    int32_t *close_ids;
    size_t n_close_ids;
    assert_int_equal(moe_tokenizer_encode(tok, "</think>", 8, MOE_ENCODE_CONTINUATION, &close_ids,
                                          &n_close_ids, &err),
                     MOE_OK);
    const int n_close = (int)n_close_ids;
    assert_true(n_close > 0);
    free(close_ids);
    moe_tokenizer_free(tok);
    moe_gguf_close(gg);

    /* Anthropic's budget_tokens (6, under the server's 10): 6 tokens of thinking, the tag, the
     * answer */
    json_t *r = post_json(&glm, "/v1/messages",
                          "{\"model\":\"x\",\"max_tokens\":30,\"temperature\":0,\"thinking\":"
                          "{\"type\":\"enabled\",\"budget_tokens\":6},\"messages\":" STORY "}");
    json_t *content = json_object_get(r, "content");
    assert_int_equal(json_array_size(content), 2);
    json_t *think = json_array_get(content, 0), *text = json_array_get(content, 1);
    assert_string_equal(json_string_value(json_object_get(think, "type")), "thinking");
    assert_string_equal(json_string_value(json_object_get(text, "type")), "text");
    char *c1 = greedy_completion(&glm, json_object_get(on, "tokens"), 6);
    assert_string_equal(json_string_value(json_object_get(think, "thinking")), c1);
    char *resumed;
    if (asprintf(&resumed, "%s%s</think>", p_on, c1) < 0) fail_msg("asprintf");
    json_t *resumed_j = json_string(resumed);
    char *c2 = greedy_completion(&glm, resumed_j, 30 - 6 - n_close);
    expect_answer(json_string_value(json_object_get(text, "text")), c2, "budget_tokens 6");
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(r, "usage"), "output_tokens")), 30);
    json_decref(resumed_j);
    free(resumed);
    free(c1);
    free(c2);
    json_decref(r);

    /* OpenAI, no budget in the request: the server's 10 */
    r = post_json(&glm, "/v1/chat/completions",
                  "{\"model\":\"x\",\"max_tokens\":30,\"temperature\":0,\"messages\":" STORY "}");
    json_t *msg = json_object_get(json_array_get(json_object_get(r, "choices"), 0), "message");
    c1 = greedy_completion(&glm, json_object_get(on, "tokens"), 10);
    assert_string_equal(json_string_value(json_object_get(msg, "reasoning_content")), c1);
    assert_int_equal(usage_reasoning(r), 10 + n_close);
    free(c1);
    json_decref(r);

    /* thinking off: no reasoning, the answer the closed prompt gives */
    r = post_json(&glm, "/v1/chat/completions",
                  "{\"model\":\"x\",\"max_tokens\":8,\"temperature\":0,\"messages\":" STORY
                  ",\"chat_template_kwargs\":{\"enable_thinking\":false}}");
    msg = json_object_get(json_array_get(json_object_get(r, "choices"), 0), "message");
    assert_null(json_string_value(json_object_get(msg, "reasoning_content")));
    c1 = greedy_completion(&glm, json_object_get(off, "tokens"), 8);
    assert_string_equal(json_string_value(json_object_get(msg, "content")), c1);
    assert_int_equal(usage_reasoning(r), 0);
    free(c1);
    json_decref(r);

    /* a template with no switch at all: reasoning_effort minimal -> 256 tokens, medium -> no
     * limit (stories260K never writes </think> itself); "none" -> the closed prompt */
    r = post_json(&plain, "/v1/chat/completions",
                  "{\"model\":\"x\",\"max_tokens\":300,\"temperature\":0,\"reasoning_effort\":"
                  "\"minimal\",\"messages\":" STORY "}");
    assert_int_equal(usage_reasoning(r), 256 + n_close);
    json_decref(r);
    r = post_json(&plain, "/v1/chat/completions",
                  "{\"model\":\"x\",\"max_tokens\":300,\"temperature\":0,\"reasoning_effort\":"
                  "\"medium\",\"messages\":" STORY "}");
    assert_int_equal(usage_reasoning(r), 300);
    json_decref(r);
    r = post_json(&plain, "/apply-template",
                  "{\"messages\":" STORY ",\"reasoning_effort\":\"none\"}");
    assert_string_equal(json_string_value(json_object_get(r, "prompt")),
                        "<|user|>Tell me a story.<|assistant|><think></think>");
    json_decref(r);

    /* a budget that is not a count is the client's error */
    long status;
    char *reply = http_post(glm.url, "/v1/messages",
                            "{\"model\":\"x\",\"max_tokens\":4,\"thinking\":{\"type\":\"enabled\","
                            "\"budget_tokens\":-5},\"messages\":" STORY "}",
                            &status);
    assert_int_equal(status, 400);
    if (!strstr(reply, "thinking.budget_tokens")) fail_msg("%s", reply);
    free(reply);

    /* the same through the official SDKs (streamed too) */
    struct stat st;
    if (stat(CLIENTS_DIR "/node_modules/openai/package.json", &st) == 0) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "node %s/cases.mjs --key unused --think %s", CLIENTS_DIR,
                 glm.url);
        char *out;
        if (moe_test_run(cmd, &out) != 0) fail_msg("%s", out);
        free(out);
    } else if (in_ci()) {
        fail_msg("%s/node_modules is missing and CI=true", CLIENTS_DIR);
    } else {
        print_message("  (the SDK part skipped: %s/node_modules is absent)\n", CLIENTS_DIR);
    }

    json_decref(ref);
    json_decref(on);
    json_decref(off);
    assert_int_equal(server_stop(&glm), 0);
    assert_int_equal(server_stop(&plain), 0);
}

/* ==== Parsed output in each API's shape (replayed through the adapters, no model) ==== */

#define WEATHER_TOOLS                                                                              \
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":"     \
    "\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"}}}}" \
    "}]"
/* what a Qwen3 model writes: reasoning, text, two calls */
#define REPLY                                                                                      \
    "<think>\nCheck both.\n</think>\n\nOn it.<tool_call>\n{\"name\": \"get_weather\", "            \
    "\"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": "   \
    "\"get_weather\", \"arguments\": {\"city\": \"Nice\"}}\n</tool_call>"

typedef struct replay_env {
    serve_server srv;
    serve_chat chat;
} replay_env;

static bool replay_setup(replay_env *e, bool tools) {
    memset(e, 0, sizeof *e);
    const char *tpl = moe_test_shared(QWEN3_TEMPLATE);
    if (!tpl) return false;
    moe_error err = {0};
    e->srv.tmpl = moe_chat_template_load_file(tpl, &err);
    assert_non_null(e->srv.tmpl);
    snprintf(e->srv.model_id, sizeof e->srv.model_id, "replayed");
    moe_strbuf_puts(&serve_chat_add(&e->chat, "user")->content, "Weather in Paris and Nice?");
    if (tools) e->chat.tools = json_loads(WEATHER_TOOLS, 0, NULL);
    return true;
}

static void replay_free(replay_env *e) {
    serve_chat_free(&e->chat);
    moe_chat_template_free(e->srv.tmpl);
}

/* SSE bytes as [{"event": NAME or null, "data": JSON}], "[DONE]" as the string. */
static json_t *sse_events(const char *sse) {
    json_t *list = json_array();
    for (const char *p = sse; *p;) {
        const char *end = strstr(p, "\n\n");
        if (!end) fail_msg("SSE without a blank line after: %s", p);
        char *ev = moe_xstrndup(p, (size_t)(end - p));
        const char *name = strncmp(ev, "event: ", 7) == 0 ? ev + 7 : NULL;
        char *data = strstr(ev, "data: ");
        if (!data) fail_msg("SSE event without data: %s", ev);
        if (name) *strchr(ev, '\n') = '\0';
        json_t *d =
            strcmp(data + 6, "[DONE]") == 0 ? json_string("[DONE]") : json_loads(data + 6, 0, NULL);
        if (!d) fail_msg("SSE data is not JSON: %s", data);
        json_array_append_new(list, json_pack("{s:s?,s:o}", "event", name, "data", d));
        free(ev);
        p = end + 2;
    }
    return list;
}

static void expect_arguments(const char *args, const char *want) {
    json_t *a = json_loads(args, 0, NULL), *w = json_loads(want, 0, NULL);
    if (!a || !json_equal(a, w)) fail_msg("arguments %s, want %s", args, want);
    json_decref(a);
    json_decref(w);
}

/* An OpenAI chat stream's deltas add up to this content, reasoning and calls (their ids sent
 * once each), and it ends in finish_reason "tool_calls" and [DONE]. */
static void expect_openai_stream(const char *sse, const char *want_content,
                                 const char *want_reasoning, const char *const *want_args,
                                 size_t n_calls) {
    json_t *evs = sse_events(sse);
    moe_strbuf content = {0}, reasoning = {0}, args[4] = {{0}};
    assert_true(n_calls <= 4);
    const char *finish = NULL;
    size_t i, n_ids = 0;
    json_t *ev;
    json_array_foreach(evs, i, ev) {
        json_t *d = json_object_get(ev, "data");
        if (json_is_string(d)) {
            assert_int_equal(i, json_array_size(evs) - 1); /* [DONE] last */
            continue;
        }
        json_t *ch = json_array_get(json_object_get(d, "choices"), 0);
        json_t *delta = json_object_get(ch, "delta");
        const char *t = json_string_value(json_object_get(delta, "content"));
        if (t) moe_strbuf_puts(&content, t);
        t = json_string_value(json_object_get(delta, "reasoning_content"));
        if (t) moe_strbuf_puts(&reasoning, t);
        size_t k;
        json_t *tc;
        json_array_foreach(json_object_get(delta, "tool_calls"), k, tc) {
            json_int_t idx = json_integer_value(json_object_get(tc, "index"));
            assert_true(idx >= 0 && (size_t)idx < n_calls);
            if (json_string_value(json_object_get(tc, "id"))) n_ids++;
            moe_strbuf_puts(&args[idx], json_string_value(json_object_get(
                                            json_object_get(tc, "function"), "arguments")));
        }
        if (json_string_value(json_object_get(ch, "finish_reason")))
            finish = json_string_value(json_object_get(ch, "finish_reason"));
    }
    moe_strbuf_put(&content, "", 0);
    moe_strbuf_put(&reasoning, "", 0);
    assert_string_equal(content.s, want_content);
    assert_string_equal(reasoning.s, want_reasoning);
    assert_int_equal(n_ids, n_calls);
    for (size_t k = 0; k < n_calls; k++) {
        moe_strbuf_put(&args[k], "", 0);
        expect_arguments(args[k].s, want_args[k]);
        moe_strbuf_free(&args[k]);
    }
    assert_non_null(finish);
    assert_string_equal(finish, "tool_calls");
    moe_strbuf_free(&content);
    moe_strbuf_free(&reasoning);
    json_decref(evs);
}

static void openai_shapes(void **state) {
    (void)state;
    replay_env e;
    if (!replay_setup(&e, true)) return;
    moe_strbuf out = {0};
    serve_openai_replay(&e.srv, &e.chat, "", REPLY, 0, false, &out);
    json_t *r = json_loads(out.s, 0, NULL);
    if (!r) fail_msg("not JSON: %s", out.s);
    json_t *choice = json_array_get(json_object_get(r, "choices"), 0);
    json_t *msg = json_object_get(choice, "message");
    assert_string_equal(json_string_value(json_object_get(choice, "finish_reason")), "tool_calls");
    assert_string_equal(json_string_value(json_object_get(msg, "reasoning_content")),
                        "\nCheck both.\n");
    assert_string_equal(json_string_value(json_object_get(msg, "content")), "\n\nOn it.\n");
    json_t *calls = json_object_get(msg, "tool_calls");
    assert_int_equal(json_array_size(calls), 2);
    const char *want_args[2] = {"{\"city\":\"Paris\",\"days\":2}", "{\"city\":\"Nice\"}"};
    for (size_t i = 0; i < 2; i++) {
        json_t *c = json_array_get(calls, i);
        assert_true(strncmp(json_string_value(json_object_get(c, "id")), "call_", 5) == 0);
        assert_string_equal(json_string_value(json_object_get(c, "type")), "function");
        json_t *fn = json_object_get(c, "function");
        assert_string_equal(json_string_value(json_object_get(fn, "name")), "get_weather");
        assert_true(json_is_string(json_object_get(fn, "arguments"))); /* a JSON string */
        expect_arguments(json_string_value(json_object_get(fn, "arguments")), want_args[i]);
    }
    /* streamed in pieces of every small size: the deltas add up to the same message */
    for (size_t chunk = 1; chunk <= 7; chunk += 3) {
        out.len = 0;
        serve_openai_replay(&e.srv, &e.chat, "", REPLY, chunk, true, &out);
        expect_openai_stream(out.s, "\n\nOn it.\n", "\nCheck both.\n", want_args, 2);
    }
    json_decref(r);
    /* without tools in the request, call markup is the model's text */
    json_decref(e.chat.tools);
    e.chat.tools = NULL;
    out.len = 0;
    serve_openai_replay(&e.srv, &e.chat, "", REPLY, 0, false, &out);
    r = json_loads(out.s, 0, NULL);
    msg = json_object_get(json_array_get(json_object_get(r, "choices"), 0), "message");
    assert_non_null(strstr(json_string_value(json_object_get(msg, "content")), "<tool_call>"));
    assert_null(json_object_get(msg, "tool_calls"));
    json_decref(r);
    /* a prompt that opened <think> (Qwen3's generation prompt can): the reply starts in it */
    out.len = 0;
    serve_openai_replay(&e.srv, &e.chat, "<|im_start|>assistant\n<think>\n", "plan</think>done", 3,
                        false, &out);
    r = json_loads(out.s, 0, NULL);
    msg = json_object_get(json_array_get(json_object_get(r, "choices"), 0), "message");
    assert_string_equal(json_string_value(json_object_get(msg, "reasoning_content")), "plan");
    assert_string_equal(json_string_value(json_object_get(msg, "content")), "done");
    json_decref(r);
    moe_strbuf_free(&out);
    replay_free(&e);
}

/* GLM-5.3-Flash: its generation prompt opens <think>; the reply closes it, answers and calls
 * in GLM's shape -- streamed in pieces of every small size, through the OpenAI adapter. */
static void glm5_replayed(void **state) {
    (void)state;
    replay_env e;
    memset(&e, 0, sizeof e);
    moe_error err = {0};
    e.srv.tmpl = moe_chat_template_load_file(GLM5_TEMPLATE, &err);
    if (!e.srv.tmpl) fail_msg("%s", err.msg);
    snprintf(e.srv.model_id, sizeof e.srv.model_id, "replayed");
    moe_strbuf_puts(&serve_chat_add(&e.chat, "user")->content, "Weather in Paris and Nice?");
    e.chat.tools = json_loads(WEATHER_TOOLS, 0, NULL);
    char *prompt;
    assert_int_equal(
        moe_chat_render(e.srv.tmpl,
                        "[{\"role\":\"user\",\"content\":\"Weather in Paris and Nice?\"}]",
                        WEATHER_TOOLS, "{\"add_generation_prompt\":true}", &prompt, &err),
        MOE_OK);
    const char *reply =
        "Two cities.</think>On it.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
        "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><tool_call>"
        "get_weather<arg_key>city</arg_key><arg_value>Nice</arg_value></tool_call>";
    const char *want_args[2] = {"{\"city\":\"Paris\",\"days\":2}", "{\"city\":\"Nice\"}"};
    moe_strbuf out = {0};
    for (size_t chunk = 1; chunk <= 7; chunk += 3) {
        out.len = 0;
        serve_openai_replay(&e.srv, &e.chat, prompt, reply, chunk, true, &out);
        expect_openai_stream(out.s, "On it.", "Two cities.", want_args, 2);
    }
    moe_strbuf_free(&out);
    free(prompt);
    replay_free(&e);
}

static void anthropic_shapes(void **state) {
    (void)state;
    replay_env e;
    if (!replay_setup(&e, true)) return;
    moe_strbuf out = {0};
    serve_anthropic_replay(&e.srv, &e.chat, "", REPLY, 0, false, &out);
    json_t *r = json_loads(out.s, 0, NULL);
    if (!r) fail_msg("not JSON: %s", out.s);
    assert_string_equal(json_string_value(json_object_get(r, "stop_reason")), "tool_use");
    json_t *content = json_object_get(r, "content");
    assert_int_equal(json_array_size(content), 4);
    const char *types[4] = {"thinking", "text", "tool_use", "tool_use"};
    for (size_t i = 0; i < 4; i++)
        assert_string_equal(json_string_value(json_object_get(json_array_get(content, i), "type")),
                            types[i]);
    json_t *th = json_array_get(content, 0), *tu = json_array_get(content, 2);
    assert_string_equal(json_string_value(json_object_get(th, "thinking")), "\nCheck both.\n");
    assert_true(json_is_string(json_object_get(th, "signature")));
    assert_string_equal(json_string_value(json_object_get(json_array_get(content, 1), "text")),
                        "\n\nOn it.\n");
    assert_true(strncmp(json_string_value(json_object_get(tu, "id")), "toolu_", 6) == 0);
    assert_string_equal(json_string_value(json_object_get(tu, "name")), "get_weather");
    json_t *want = json_pack("{s:s,s:i}", "city", "Paris", "days", 2);
    assert_true(json_equal(json_object_get(tu, "input"), want)); /* an object, not a string */
    json_decref(want);
    json_decref(r);
    /* streamed: blocks open and close in order, deltas of their own kind */
    out.len = 0;
    serve_anthropic_replay(&e.srv, &e.chat, "", REPLY, 2, true, &out);
    json_t *evs = sse_events(out.s);
    moe_strbuf seq = {0}, thinking = {0}, args = {0};
    char last[64] = "";
    size_t i;
    json_t *ev;
    json_array_foreach(evs, i, ev) {
        const char *name = json_string_value(json_object_get(ev, "event"));
        json_t *d = json_object_get(ev, "data");
        assert_non_null(name);
        assert_string_equal(name, json_string_value(json_object_get(d, "type")));
        json_t *delta = json_object_get(d, "delta");
        const char *dt = json_string_value(json_object_get(delta, "type"));
        char step[64]; /* consecutive deltas of one kind count once */
        if (!strcmp(name, "content_block_start"))
            snprintf(
                step, sizeof step, "start:%s",
                json_string_value(json_object_get(json_object_get(d, "content_block"), "type")));
        else
            snprintf(step, sizeof step, "%s", dt ? dt : name);
        if (strcmp(step, last) != 0) moe_strbuf_printf(&seq, "%s ", step);
        snprintf(last, sizeof last, "%s", step);
        if (dt && !strcmp(dt, "thinking_delta"))
            moe_strbuf_puts(&thinking, json_string_value(json_object_get(delta, "thinking")));
        if (dt && !strcmp(dt, "input_json_delta") && !args.len)
            moe_strbuf_puts(&args, json_string_value(json_object_get(delta, "partial_json")));
        if (!strcmp(name, "message_delta"))
            assert_string_equal(json_string_value(json_object_get(delta, "stop_reason")),
                                "tool_use");
    }
    moe_strbuf_put(&seq, "", 0);
    moe_strbuf_put(&thinking, "", 0);
    moe_strbuf_put(&args, "", 0);
    assert_string_equal(seq.s, "message_start start:thinking ping thinking_delta signature_delta "
                               "content_block_stop start:text text_delta content_block_stop "
                               "start:tool_use input_json_delta content_block_stop "
                               "start:text text_delta content_block_stop " /* the "\n" */
                               "start:tool_use input_json_delta content_block_stop "
                               "message_delta message_stop ");
    assert_string_equal(thinking.s, "\nCheck both.\n");
    expect_arguments(args.s, "{\"city\":\"Paris\",\"days\":2}");
    moe_strbuf_free(&seq);
    moe_strbuf_free(&thinking);
    moe_strbuf_free(&args);
    json_decref(evs);
    moe_strbuf_free(&out);
    replay_free(&e);
}

static void responses_shapes(void **state) {
    (void)state;
    replay_env e;
    if (!replay_setup(&e, true)) return;
    moe_strbuf out = {0};
    serve_responses_replay(&e.srv, &e.chat, "", REPLY, 0, false, &out);
    json_t *r = json_loads(out.s, 0, NULL);
    if (!r) fail_msg("not JSON: %s", out.s);
    json_t *items = json_object_get(r, "output");
    assert_int_equal(json_array_size(items), 5); /* the "\n" between the calls is a message */
    const char *types[5] = {"reasoning", "message", "function_call", "message", "function_call"};
    for (size_t i = 0; i < 5; i++)
        assert_string_equal(json_string_value(json_object_get(json_array_get(items, i), "type")),
                            types[i]);
    json_t *fc = json_array_get(items, 4);
    assert_true(strncmp(json_string_value(json_object_get(fc, "call_id")), "call_", 5) == 0);
    assert_string_equal(json_string_value(json_object_get(fc, "name")), "get_weather");
    expect_arguments(json_string_value(json_object_get(fc, "arguments")), "{\"city\":\"Nice\"}");
    json_decref(r);
    out.len = 0;
    serve_responses_replay(&e.srv, &e.chat, "", REPLY, 1, true, &out);
    json_t *evs = sse_events(out.s);
    json_t *last = json_object_get(json_array_get(evs, json_array_size(evs) - 1), "data");
    assert_string_equal(json_string_value(json_object_get(last, "type")), "response.completed");
    assert_int_equal(json_array_size(json_object_get(json_object_get(last, "response"), "output")),
                     5);
    json_decref(evs);
    moe_strbuf_free(&out);
    replay_free(&e);
}

static void json_depth_counts_outside_strings(void **state) {
    (void)state;
    assert_int_equal(serve_json_depth("{\"a\":[1,{\"b\":2}]}", 17), 3);
    assert_int_equal(serve_json_depth("\"[[[[\"", 6), 0);
    assert_int_equal(serve_json_depth("[\"\\\"[\"]", 7), 1);
}

/* ==== Speculation inside continuous batching ==== */

/* With speculation (--spec KIND) the 8 streams equal each one alone without it; /metrics shows
 * several streams' drafts verified in one step and, for ngram, drafts accepted (the fixtures'
 * random MTP heads agree with nothing: every draft is refused and rolled back; the spec suite's
 * mtp_drafts_accepted has drafts kept). */
static void spec_streams(const char *rel, const char *kind, double temp) {
    const char *model = moe_test_shared(rel);
    MOE_SKIP_IF_NULL(model);
    char *spec_args[] = {"--spec", (char *)kind, "--draft", "4", "--step-delay", "2", NULL};
    char *metrics = moe_test_streams_equal_alone(
        &(moe_test_streams){.model = model, .temp = temp, .what = kind, .together = spec_args});
    const double drafted = moe_test_metric(metrics, "moe_spec_drafts_total"),
                 accepted = moe_test_metric(metrics, "moe_spec_drafts_accepted_total"),
                 together = moe_test_metric(metrics, "moe_spec_verify_streams_max"),
                 per_step = moe_test_metric(metrics, "moe_decode_tokens_per_step");
    print_message("%s, --spec %s, temperature %g: %.0f of %.0f drafts accepted, %.3f tokens per "
                  "step, up to %.0f streams' drafts in one verify step\n",
                  rel, kind, temp, accepted, drafted, per_step, together);
    const bool ngram = strcmp(kind, "ngram") == 0;
    if (drafted < 1 || (ngram && (accepted < 1 || per_step <= 1)) || together < 2)
        fail_msg("%s: /metrics shows no accepted drafts or no batched verify step:\n%s", rel,
                 metrics);
    free(metrics);
}

static void spec_in_continuous_batching(void **state) {
    (void)state;
    spec_streams("models/stories260K/stories260K.gguf", "ngram", 0);
    spec_streams("models/stories260K/stories260K.gguf", "ngram", 0.8);
    /* hybrids: refused drafts roll the recurrent state back to the accepted row's checkpoint */
    spec_streams("parity/qwen3next-f32.gguf", "ngram", 0);
    spec_streams("parity/qwen35-mtp-f32.gguf", "ngram", 0);
    /* the MTP head's drafts: each stream's head fed its own hidden states */
    spec_streams("parity/qwen35-mtp-f32.gguf", "mtp", 0);
    spec_streams("parity/qwen35-mtp-f32.gguf", "mtp", 0.8);
    spec_streams("parity/glm5next-f32.gguf", "mtp", 0);
    spec_streams("parity/glm5next-f32.gguf", "mtp", 0.8);
}
/* 8 streams through an expert cache of a quarter of the experts (at least 2) equal each stream
 * alone with every expert resident, token for token, greedy and sampled; /metrics shows the
 * cache evicting (more misses than slots) and several streams decoded in one step. */
static void experts_streamed_in_continuous_batching(void **state) {
    (void)state;
    static const char *const fixtures[] = {"parity/qwen3moe-mixed.gguf",
                                           "parity/deepseek2-q8_0-q4_k.gguf"};
    MOE_SKIP_IF_NULL(moe_test_shared(fixtures[0]));
    for (size_t i = 0; i < sizeof fixtures / sizeof fixtures[0]; i++) {
        const char *model = moe_test_shared(fixtures[i]);
        moe_error err = {0};
        moe_model *m = moe_model_load(model, &err);
        if (!m) fail_msg("%s", err.msg);
        const uint32_t n_layer = m->cfg.n_layer + m->n_layer_mtp;
        const uint64_t slots = (uint64_t)n_layer * m->cfg.n_expert / 4;
        char size[32];
        snprintf(size, sizeof size, "%lluK",
                 (unsigned long long)(((slots < 2 ? 2 : slots) *
                                           moe_expert_cache_slot_bytes(m, n_layer) +
                                       1023) /
                                      1024));
        moe_model_free(m);
        char *cache_args[] = {"--expert-cache", size, "--step-delay", "2", NULL};
        for (double temp = 0; temp < 1; temp += 0.8) {
            char *metrics = moe_test_streams_equal_alone(&(moe_test_streams){
                .model = model, .temp = temp, .what = "--expert-cache", .together = cache_args});
            const double n_slots = moe_test_metric(metrics, "moe_expert_cache_slots"),
                         misses = moe_test_metric(metrics, "moe_expert_cache_misses_total"),
                         hits = moe_test_metric(metrics, "moe_expert_cache_hits_total"),
                         rows = moe_test_metric(metrics, "moe_decode_batch_rows_max");
            print_message("%s, temperature %g, --expert-cache %s: %.0f slots, %.0f hits, %.0f "
                          "misses, up to %.0f streams in one step\n",
                          fixtures[i], temp, size, n_slots, hits, misses, rows);
            if (n_slots < 2 || misses <= n_slots || rows < 2)
                fail_msg("%s: /metrics shows no evicting expert cache or no batched step:\n%s",
                         fixtures[i], metrics);
            free(metrics);
        }
    }
}

int moe_suite_serve(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(json_depth_counts_outside_strings),
        cmocka_unit_test(openai_shapes),
        cmocka_unit_test(glm5_replayed),
        cmocka_unit_test(anthropic_shapes),
        cmocka_unit_test(responses_shapes),
        cmocka_unit_test(chat_templates_served),
        cmocka_unit_test(reasoning_budget_served),
        cmocka_unit_test(client_models),
        cmocka_unit_test(client_chat_nonstream),
        cmocka_unit_test(client_chat_stream),
        cmocka_unit_test(client_completions_runc),
        cmocka_unit_test(client_stop_strings),
        cmocka_unit_test(client_logprobs),
        cmocka_unit_test(client_cached_tokens),
        cmocka_unit_test(client_hybrid_reuse),
        cmocka_unit_test(client_anthropic_messages),
        cmocka_unit_test(client_anthropic_stream),
        cmocka_unit_test(client_tools_shape),
        cmocka_unit_test(client_structured_output),
        cmocka_unit_test(client_responses),
        cmocka_unit_test(client_errors),
        cmocka_unit_test(client_cors),
        cmocka_unit_test(client_round_trip),
        cmocka_unit_test(client_concurrent_streams),
        cmocka_unit_test(client_disconnect),
        cmocka_unit_test(client_disconnect_storm),
        cmocka_unit_test(client_disconnect_whole),
        cmocka_unit_test(client_queue_limits),
        cmocka_unit_test(client_demo_model),
        cmocka_unit_test(client_ops),
        cmocka_unit_test(client_keepalive),
        cmocka_unit_test(client_bench_8_streams),
        cmocka_unit_test(servers_stop_cleanly),
        cmocka_unit_test(connection_flood),
        cmocka_unit_test(spec_in_continuous_batching),
        cmocka_unit_test(experts_streamed_in_continuous_batching),
        cmocka_unit_test(model_checked_before_listening),
        cmocka_unit_test(request_parser_seeds),
    };
    return cmocka_run_group_tests_name("serve", tests, NULL, teardown);
}
