/* Suite "cli": what the `moe` command line tells its user -- every command's --help lists every
 * option its parser takes (the flags are read from the command's source, cli/<command>.c and the
 * shared tables it uses, not from a list kept here), and a mistyped command or option gets the
 * nearest one suggested; loading reports progress; Ctrl-C stops a reply (run: with its stats,
 * chat: not the session) and control characters from the model are escaped on a terminal. */
#include "testutil.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static char *run_moe(const char *args, int *rc) {
    char cmd[1024];
    char **out = moe_xmalloc(sizeof *out); /* (a local here trips gcc's -Wdangling-pointer) */
    snprintf(cmd, sizeof cmd, "'%s' %s", moe_test_bin(), args);
    *rc = moe_test_run(cmd, out);
    char *text = *out;
    free(out);
    return text;
}

static bool flag_char(char c) {
    return isalnum((unsigned char)c) || c == '-';
}

/* `flag` in text as a whole word. */
static bool has_flag(const char *text, const char *flag) {
    const size_t n = strlen(flag);
    for (const char *p = strstr(text, flag); p; p = strstr(p + 1, flag))
        if ((p == text || !flag_char(p[-1])) && !flag_char(p[n])) return true;
    return false;
}

/* Every "-x" / "--long-flag" string literal of a source file not in help; the count missing. */
static int check_source(const char *path, const char *help, const char *command) {
    size_t size;
    uint8_t *src = NULL;
    moe_error err = {0};
    if (moe_file_read(path, &src, &size, &err) != MOE_OK) fail_msg("%s: %s", path, err.msg);
    int missing = 0, seen = 0;
    for (size_t i = 0; i + 3 < size; i++) { /* "-x" or "--word-word" */
        if (src[i] != '"' || src[i + 1] != '-') continue;
        size_t j = i + 1;
        while (j < size && flag_char((char)src[j])) j++;
        const size_t len = j - i - 1, dashes = src[i + 2] == '-' ? 2 : 1;
        if (j >= size || src[j] != '"' || (dashes == 1 && len != 2) || len <= dashes ||
            !isalpha(src[i + 1 + dashes]))
            continue;
        char flag[64];
        snprintf(flag, sizeof flag, "%.*s", (int)len, (const char *)src + i + 1);
        i = j;
        if (!strcmp(flag, "--help") || !strcmp(flag, "-h") || !strcmp(flag, "--help-options"))
            continue;
        seen++;
        if (!has_flag(help, flag)) {
            print_message("moe %s --help does not list %s (parsed in %s)\n", command, flag, path);
            missing++;
        }
    }
    free(src);
    if (!seen) fail_msg("%s: no flags found (is the scan broken?)", path);
    return missing;
}

static void help_lists_every_option(void **state) {
    (void)state;
    int rc;
    char *top = run_moe("--help", &rc);
    assert_int_equal(rc, 0);
    const char *at = strstr(top, "commands:\n");
    assert_non_null(at);
    int missing = 0, commands = 0;
    for (const char *line = strchr(at, '\n') + 1; line[0] == ' ' && line[1] == ' ';
         line = strchr(line, '\n') + 1) {
        char name[32], path[64];
        if (sscanf(line, " %31s", name) != 1) break;
        commands++;
        char *help;
        if (!strcmp(name, "eval")) { /* its subcommands have their own help */
            int r1, r2, r3;
            char *a = run_moe("eval labels --help", &r1), *b = run_moe("eval compare --help", &r2),
                 *c = run_moe("eval kl --help", &r3);
            assert_true(r1 == 0 && r2 == 0 && r3 == 0);
            help = moe_xmalloc(strlen(a) + strlen(b) + strlen(c) + 1);
            strcat(strcat(strcpy(help, a), b), c);
            free(a), free(b), free(c);
        } else {
            char args[96];
            snprintf(args, sizeof args, "%s --help", name);
            help = run_moe(args, &rc);
            assert_int_equal(rc, 0);
            if (!strcmp(name, "serve")) {
                char *more = run_moe("serve --help-options", &rc);
                assert_int_equal(rc, 0);
                help = moe_xrealloc(help, strlen(help) + strlen(more) + 1);
                strcat(help, more);
                free(more);
            }
        }
        snprintf(path, sizeof path, "cli/%s.c", name);
        missing += check_source(path, help, name);
        /* the shared tables a command parses with */
        size_t size;
        uint8_t *bytes = NULL;
        moe_error err = {0};
        assert_int_equal(moe_file_read(path, &bytes, &size, &err), MOE_OK);
        char *src = moe_xstrndup((const char *)bytes, size);
        free(bytes);
        if (strstr(src, "moe_gen_parse_option"))
            missing += check_source("cli/generate.c", help, name);
        if (strstr(src, "moe_gen_parse_option") || strstr(src, "moe_engine_args_parse"))
            missing += check_source("cli/args.c", help, name);
        free(src);
        free(help);
    }
    free(top);
    assert_true(commands >= 10);
    if (missing) fail_msg("%d options are parsed but not in --help (above)", missing);
}

/* A typo gets the nearest name; nothing near, no guess. */
static void suggests_the_nearest(void **state) {
    (void)state;
    static const struct {
        const char *args, *want;
    } cases[] = {
        {"rn", "did you mean 'moe run'?"},
        {"sevre", "did you mean 'moe serve'?"},
        {"run --tmep 0", "unknown option '--tmep' (did you mean --temp?)"},
        {"chat --sytem hi", "(did you mean --system?)"},
        {"serve --paralel 2", "(did you mean --parallel?)"},
        {"run --kvtype f16", "(did you mean --kv-type?)"},
        {"inspect --jsn x.gguf", "(did you mean --json?)"},
        {"bench --thread 2", "(did you mean --threads?)"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int rc;
        char *out = run_moe(cases[k].args, &rc);
        if (rc != 2 || !strstr(out, cases[k].want))
            fail_msg("moe %s: exit %d, wanted \"%s\" in:\n%s", cases[k].args, rc, cases[k].want,
                     out);
        free(out);
    }
    int rc;
    char *out = run_moe("run --zzzzzzzzzz", &rc);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "unknown option '--zzzzzzzzzz'"));
    assert_null(strstr(out, "did you mean"));
    free(out);
    out = run_moe("run -m x.gguf", &rc); /* one edit from -n, -p, -t: no guess */
    assert_int_equal(rc, 2);
    assert_null(strstr(out, "did you mean"));
    free(out);
    out = run_moe("qqqqqqq", &rc);
    assert_int_equal(rc, 2);
    assert_null(strstr(out, "did you mean"));
    free(out);
}

/* Reading the weights reports its progress past a second (MOE_PROGRESS_AFTER=0: always, with
 * its last line at least): the bytes read are the weights' part of the file, so at most the
 * file's size as stat says and most of it; a quick load says nothing. */
static void load_progress(void **state) {
    (void)state;
    const char *model = moe_test_shared("parity/deepseek2-f32.gguf"); /* has routed experts */
    MOE_SKIP_IF_NULL(model);
    struct stat st;
    assert_int_equal(stat(model, &st), 0);
    char args[600];
    snprintf(args, sizeof args, "run '%s' --expert-cache 1M -n 1 --tokens 1,2", model);
    int rc;
    char *quiet = run_moe(args, &rc);
    assert_null(strstr(quiet, "weights"));
    free(quiet);
    char env[700];
    snprintf(env, sizeof env, "MOE_PROGRESS_AFTER=0 '%s' %s", moe_test_bin(), args);
    char *out = NULL;
    moe_test_run(env, &out);
    const char *at = strstr(out, "moe run: weights read: ");
    double mib = 0, seconds = -1;
    if (!at || sscanf(at, "moe run: weights read: %lf MiB in %lf s", &mib, &seconds) != 2)
        fail_msg("no progress line:\n%s", out);
    const double file_mib = (double)st.st_size / 1048576.0;
    if (mib > file_mib + 0.05 || mib < 0.5 * file_mib || seconds < 0)
        fail_msg("%.2f MiB read of a %.2f MiB file:\n%s", mib, file_mib, out);
    free(out);
}

/* MOE_PROFILE=1 names the step's parts outside the matmuls (README's list), each on its own
 * line with calls, ms and share but no weight bytes, beside the matmuls' lines with theirs. */
static void profile_names_the_parts(void **state) {
    (void)state;
    const char *model = moe_test_shared("parity/qwen3moe-mixed.gguf"); /* attention + experts */
    MOE_SKIP_IF_NULL(model);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "MOE_PROFILE=1 '%s' run '%s' -n 1 --tokens 1,2,3,4", moe_test_bin(),
             model);
    char *out = NULL;
    if (moe_test_run(cmd, &out) != 0) fail_msg("%s", out);
    static const char *const parts[] = {"attention (QK, softmax, V)",
                                        "rope + KV store",
                                        "rmsnorm",
                                        "activation quantize",
                                        "router top-k",
                                        "experts sort + gather",
                                        "experts GLU",
                                        "experts weighted sum",
                                        "residual stream",
                                        "token embedding"};
    unsigned calls;
    double ms, share, mb, gbs;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        const char *line = strstr(out, parts[i]);
        if (!line ||
            sscanf(line + strlen(parts[i]), "%u %lf %lf%% %lf", &calls, &ms, &share, &mb) != 3)
            fail_msg("no line \"%s\" of calls, ms and share alone:\n%s", parts[i], out);
    }
    const char *matmul = strstr(out, "attn_q.weight");
    if (!matmul || sscanf(matmul + strlen("attn_q.weight"), "%u %lf %lf%% %lf %lf", &calls, &ms,
                          &share, &mb, &gbs) != 5)
        fail_msg("no attn_q.weight line with MB and GB/s:\n%s", out);
    assert_non_null(strstr(out, "(rest of the step)"));
    free(out);
}

/* Ctrl-C in run and chat, and control characters on a terminal: tests/cli_terminal.py (a
 * Python pty and signals), on stories260K and its ChatML copy. */
static void terminal(void **state) {
    (void)state;
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(model);
    const char *chat = moe_test_chat_model("cli-chat", NULL);
    MOE_SKIP_IF_NULL(chat);
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "timeout 300 /usr/bin/python3 tests/cli_terminal.py '%s' '%s' '%s'",
             moe_test_bin(), model, chat);
    const int rc = moe_test_run(cmd, &out);
    print_message("%s", out);
    if (rc != 0) fail_msg("tests/cli_terminal.py failed (exit %d)", rc);
    free(out);
}

int moe_suite_cli(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(help_lists_every_option),
        cmocka_unit_test(suggests_the_nearest),
        cmocka_unit_test(load_progress),
        cmocka_unit_test(profile_names_the_parts),
        cmocka_unit_test(terminal),
    };
    return cmocka_run_group_tests_name("cli", tests, NULL, NULL);
}
