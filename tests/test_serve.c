/* Suite "serve": `moe serve` on loopback, driven by the official SDKs, plus the prompt formatter
 * and output parser on their own.
 *
 * Two servers are started once (on free ports, found by --port 0 and read from their stdout):
 *   base: stories260K (../shared) with --ctx 1024 --parallel 16 and an API key;
 *   slow: the built-in demo model with --parallel 1 --queue 1 --queue-timeout 1 --step-delay 20
 *         --keepalive 0.01, where a stream lasts long enough to be aborted, queued behind or
 *         refused, and keep-alives come between tokens.
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

#include "../src/serve/serve_internal.h"

#define SERVER_START_SECONDS 30 /* load + listen; generous for ASan builds */
#define SERVER_STOP_SECONDS  10
#define API_KEY              "sk-moe-test"
#define CLIENTS_DIR          "tests/clients"

/* ==== Servers ==== */

typedef struct server {
    pid_t pid;
    char url[128];
    char log[512];
} server;

static server base_srv, slow_srv;
static bool servers_tried, servers_ok;
static const char *runc_text;

static int in_ci(void) {
    const char *ci = getenv("CI");
    return ci && strcmp(ci, "true") == 0;
}

/* Start `moe serve ARGS`; waits for its "ready" line and reads the URL. */
static bool server_start(server *s, const char *name, char *const extra[]) {
    int fds[2];
    if (pipe(fds) != 0) return false;
    snprintf(s->log, sizeof s->log, "%s/%s.log", moe_test_tmpdir(), name);
    char *argv[32];
    int n = 0;
    argv[n++] = (char *)moe_test_bin();
    argv[n++] = "serve";
    argv[n++] = "--port";
    argv[n++] = "0";
    for (int i = 0; extra[i] && n < 31; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    char cache[600];
    snprintf(cache, sizeof cache, "%s/cache", moe_test_tmpdir());
    const pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
        dup2(fds[1], 1);
        FILE *log = fopen(s->log, "w");
        if (log) dup2(fileno(log), 2);
        close(fds[0]);
        setenv("XDG_CACHE_HOME", cache, 1);
        execv(argv[0], argv);
        _exit(127);
    }
    close(fds[1]);
    s->pid = pid;
    char buf[4096];
    size_t len = 0;
    const time_t until = time(NULL) + SERVER_START_SECONDS;
    bool ready = false;
    while (!ready && time(NULL) < until && len < sizeof buf - 1) {
        struct pollfd p = {.fd = fds[0], .events = POLLIN};
        if (poll(&p, 1, 200) <= 0) continue;
        const ssize_t got = read(fds[0], buf + len, sizeof buf - 1 - len);
        if (got <= 0) break;
        len += (size_t)got;
        buf[len] = '\0';
        ready = strstr(buf, "moe serve: ready\n") != NULL;
    }
    close(fds[0]);
    const char *at = strstr(buf, "listening on ");
    if (!ready || !at) {
        print_message("moe serve (%s) did not become ready; its log: %s\n", name, s->log);
        return false;
    }
    sscanf(at + 13, "%127s", s->url);
    return true;
}

/* SIGTERM, then wait (bounded); the exit status, or -1 if it had to be killed. */
static int server_stop(server *s) {
    if (s->pid <= 0) return 0;
    kill(s->pid, SIGTERM);
    int status = 0;
    for (int i = 0; i < SERVER_STOP_SECONDS * 20; i++) {
        const pid_t r = waitpid(s->pid, &status, WNOHANG);
        if (r == s->pid) {
            s->pid = 0;
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
        struct timespec d = {0, 50 * 1000000L};
        nanosleep(&d, NULL);
    }
    kill(s->pid, SIGKILL);
    waitpid(s->pid, &status, 0);
    s->pid = 0;
    return -1;
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
    if (!model || !runc_text) {
        skip();
        return false;
    }
    char *base_args[] = {(char *)model, "--ctx",     "1024",  "--parallel",
                         "16",          "--api-key", API_KEY, NULL};
    char *slow_args[] = {"--parallel",   "1",  "--queue", "1", "--queue-timeout", "1",
                         "--step-delay", "20", "--keepalive", "0.01", NULL};
    if (!server_start(&base_srv, "base", base_args) || !server_start(&slow_srv, "slow", slow_args))
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
        snprintf(cmd, sizeof cmd, "node %s/cases.mjs --base %s --slow %s --key %s --runc %s",
                 CLIENTS_DIR, base_srv.url, slow_srv.url, API_KEY, runc_text);
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
CLIENT_CASE(anthropic_messages)
CLIENT_CASE(anthropic_stream)
CLIENT_CASE(tools_shape)
CLIENT_CASE(responses)
CLIENT_CASE(errors)
CLIENT_CASE(concurrent_streams)
CLIENT_CASE(disconnect)
CLIENT_CASE(disconnect_storm)
CLIENT_CASE(queue_limits)
CLIENT_CASE(demo_model)
CLIENT_CASE(ops)
CLIENT_CASE(keepalive)
CLIENT_CASE(bench_8_streams)

/* Last: SIGTERM ends both servers cleanly (no crash, no leak under ASan). */
static void servers_stop_cleanly(void **state) {
    (void)state;
    if (!servers()) return;
    const int a = server_stop(&base_srv), b = server_stop(&slow_srv);
    if (a != 0 || b != 0)
        fail_msg("servers exited with %d and %d (logs: %s, %s)", a, b, base_srv.log, slow_srv.log);
}

static int teardown(void **state) {
    (void)state;
    free(clients_out);
    clients_out = NULL;
    server_stop(&base_srv);
    server_stop(&slow_srv);
    return 0;
}

static void json_depth_counts_outside_strings(void **state) {
    (void)state;
    assert_int_equal(serve_json_depth("{\"a\":[1,{\"b\":2}]}", 17), 3);
    assert_int_equal(serve_json_depth("\"[[[[\"", 6), 0);
    assert_int_equal(serve_json_depth("[\"\\\"[\"]", 7), 1);
}

int moe_suite_serve(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(json_depth_counts_outside_strings),
        cmocka_unit_test(client_models),
        cmocka_unit_test(client_chat_nonstream),
        cmocka_unit_test(client_chat_stream),
        cmocka_unit_test(client_completions_runc),
        cmocka_unit_test(client_stop_strings),
        cmocka_unit_test(client_logprobs),
        cmocka_unit_test(client_cached_tokens),
        cmocka_unit_test(client_anthropic_messages),
        cmocka_unit_test(client_anthropic_stream),
        cmocka_unit_test(client_tools_shape),
        cmocka_unit_test(client_responses),
        cmocka_unit_test(client_errors),
        cmocka_unit_test(client_concurrent_streams),
        cmocka_unit_test(client_disconnect),
        cmocka_unit_test(client_disconnect_storm),
        cmocka_unit_test(client_queue_limits),
        cmocka_unit_test(client_demo_model),
        cmocka_unit_test(client_ops),
        cmocka_unit_test(client_keepalive),
        cmocka_unit_test(client_bench_8_streams),
        cmocka_unit_test(servers_stop_cleanly),
    };
    return cmocka_run_group_tests_name("serve", tests, NULL, teardown);
}
