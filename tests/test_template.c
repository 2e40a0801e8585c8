/* Suite "template": the Jinja interpreter and chat rendering against Python Jinja2, and the
 * reasoning / tool-call output parsers.
 *
 * Every template in ../shared/templates is rendered with a set of conversations by
 * tests/render_jinja.py (Python Jinja2 set up as transformers does) and by moe_chat_render; the
 * two must agree byte for byte, or both must fail. The parsers are checked on whole text against
 * expectations, on the same text fed in chunks of every size (and one byte at a time), and on
 * tool calls rendered by the templates themselves and parsed back. */
#include "testutil.h"

#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/text/text.h"

#define FIXED_DATE "2026-01-15T09:30:00"

/* ==== Conversations ==== */

#define TOOLS                                                                                      \
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Get the "    \
    "current weather in a city.\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":"   \
    "{\"type\":\"string\",\"description\":\"City name\"},\"days\":{\"type\":\"integer\","          \
    "\"description\":\"Forecast days\"},\"unit\":{\"type\":\"string\",\"enum\":[\"celsius\","      \
    "\"fahrenheit\"]}},\"required\":[\"city\"]}}},{\"type\":\"function\",\"function\":{\"name\":"  \
    "\"search\",\"description\":\"Search the web for pages (Grüße).\",\"parameters\":{\"type\":"   \
    "\"object\",\"properties\":{\"query\":{\"type\":\"string\"},\"filters\":{\"type\":\"object\"," \
    "\"properties\":{\"site\":{\"type\":\"string\"}}},\"tags\":{\"type\":\"array\",\"items\":"      \
    "{\"type\":\"string\"}},\"limit\":{\"type\":\"number\"},\"safe\":{\"type\":\"boolean\"}},"      \
    "\"required\":[\"query\"]}}}]"

typedef struct conversation {
    const char *name;
    const char *messages;
    const char *tools; /* NULL: none */
    const char *kwargs;
} conversation;

static const conversation conversations[] = {
    {"plain", "[{\"role\":\"user\",\"content\":\"Hello! How are you?\"}]", NULL,
     "{\"add_generation_prompt\":true}"},
    {"plain-no-prompt",
     "[{\"role\":\"user\",\"content\":\"Hello!\"},{\"role\":\"assistant\",\"content\":\"I am fine, "
     "thanks.\"}]",
     NULL, "{\"add_generation_prompt\":false}"},
    {"system-multi-turn",
     "[{\"role\":\"system\",\"content\":\"You are a terse assistant.\"},{\"role\":\"user\","
     "\"content\":\"What is 2+2?\"},{\"role\":\"assistant\",\"content\":\"4\"},{\"role\":\"user\","
     "\"content\":\"And 3+3?\"}]",
     NULL, "{\"add_generation_prompt\":true}"},
    {"tools", "[{\"role\":\"system\",\"content\":\"You can call tools.\"},{\"role\":\"user\","
              "\"content\":\"What is the weather in Paris?\"}]",
     TOOLS, "{\"add_generation_prompt\":true}"},
    {"tool-calls",
     "[{\"role\":\"user\",\"content\":\"Weather in Paris for 3 days?\"},{\"role\":\"assistant\","
     "\"content\":\"\",\"tool_calls\":[{\"id\":\"a1b2c3d4e\",\"type\":\"function\",\"function\":"
     "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\",\"days\":3}}}]},{\"role\":"
     "\"tool\",\"tool_call_id\":\"a1b2c3d4e\",\"name\":\"get_weather\",\"content\":\"{\\\"temp\\\": "
     "21, \\\"sky\\\": \\\"clear\\\"}\"},{\"role\":\"assistant\",\"content\":\"It is 21 degrees "
     "and clear.\"}]",
     TOOLS, "{\"add_generation_prompt\":false}"},
    {"tool-calls-pending",
     "[{\"role\":\"system\",\"content\":\"Use tools.\"},{\"role\":\"user\",\"content\":\"Search "
     "cats, then weather in Oslo\"},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{"
     "\"id\":\"f5g6h7i8j\",\"type\":\"function\",\"function\":{\"name\":\"search\",\"arguments\":{"
     "\"query\":\"cats\",\"filters\":{\"site\":\"example.org\"},\"tags\":[\"pets\",\"fun\"],"
     "\"limit\":2.5,\"safe\":true}}},{\"id\":\"k9l0m1n2o\",\"type\":\"function\",\"function\":{"
     "\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}}]},{\"role\":\"tool\","
     "\"tool_call_id\":\"f5g6h7i8j\",\"name\":\"search\",\"content\":\"cats are great\"},{\"role\":"
     "\"tool\",\"tool_call_id\":\"k9l0m1n2o\",\"name\":\"get_weather\",\"content\":\"-3 C\"}]",
     TOOLS, "{\"add_generation_prompt\":true}"},
    {"reasoning",
     "[{\"role\":\"user\",\"content\":\"Is 17 prime?\"},{\"role\":\"assistant\",\"content\":"
     "\"Yes.\",\"reasoning_content\":\"17 has no divisors but 1 and itself.\"},{\"role\":\"user\","
     "\"content\":\"And 21?\"}]",
     NULL, "{\"add_generation_prompt\":true}"},
    {"reasoning-last",
     "[{\"role\":\"user\",\"content\":\"Is 17 prime?\"},{\"role\":\"assistant\",\"content\":"
     "\"Yes.\",\"reasoning_content\":\"No divisors.\"}]",
     NULL, "{\"add_generation_prompt\":false}"},
    {"thinking-off", "[{\"role\":\"user\",\"content\":\"Hi\"}]", NULL,
     "{\"add_generation_prompt\":true,\"enable_thinking\":false}"},
    {"thinking-on",
     "[{\"role\":\"system\",\"content\":\"Think first.\"},{\"role\":\"user\",\"content\":\"Hi\"}]",
     NULL, "{\"add_generation_prompt\":true,\"enable_thinking\":true,\"reasoning_effort\":\"high\"}"},
    {"content-parts",
     "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Describe this.\"}]}]", NULL,
     "{\"add_generation_prompt\":true}"},
    {"unicode",
     "[{\"role\":\"user\",\"content\":\"Grüße, 世界 ☃\\n\\\"quoted\\\" <tag> & 'single' \\\\ "
     "tab\\tend\"}]",
     TOOLS, "{\"add_generation_prompt\":true}"},
};
#define N_CONV (sizeof conversations / sizeof conversations[0])

/* bos/eos as transformers passes them (special_tokens_map) */
static char *kwargs_with_tokens(const char *kwargs) {
    json_t *k = json_loads(kwargs, 0, NULL);
    assert_non_null(k);
    json_object_set_new(k, "bos_token", json_string("<s>"));
    json_object_set_new(k, "eos_token", json_string("</s>"));
    char *s = json_dumps(k, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(k);
    return s;
}

/* ==== Templates against Python Jinja2 ==== */

typedef struct template_file {
    char name[256];
    char path[1024];
} template_file;

static int cmp_files(const void *a, const void *b) {
    return strcmp(((const template_file *)a)->name, ((const template_file *)b)->name);
}

static size_t list_templates(const char *dir, template_file **out) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    size_t n = 0, cap = 64;
    template_file *files = moe_xmalloc(cap * sizeof *files);
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 7 || strcmp(e->d_name + len - 6, ".jinja") != 0) continue;
        if (n == cap) files = moe_xrealloc(files, (cap *= 2) * sizeof *files);
        snprintf(files[n].name, sizeof files[n].name, "%s", e->d_name);
        snprintf(files[n].path, sizeof files[n].path, "%s/%s", dir, e->d_name);
        n++;
    }
    closedir(d);
    qsort(files, n, sizeof *files, cmp_files);
    *out = files;
    return n;
}

/* Templates that cannot match, with the reason. None so far. */
static const struct {
    const char *template, *conversation, *reason;
} known_differences[] = {
    {NULL, NULL, NULL},
};

static bool known_difference(const char *tpl, const char *conv) {
    for (size_t i = 0; known_differences[i].template; i++)
        if (!strcmp(known_differences[i].template, tpl) &&
            (!known_differences[i].conversation || !strcmp(known_differences[i].conversation, conv)))
            return true;
    return false;
}

static void show_difference(const char *a, const char *b) {
    size_t i = 0;
    while (a[i] && a[i] == b[i]) i++;
    size_t from = i > 60 ? i - 60 : 0;
    print_message("      first difference at byte %zu\n      ours:   ...%.*s|%.40s\n      jinja2: ...%.*s|%.40s\n",
                  i, (int)(i - from), a + from, a + i, (int)(i - from), b + from, b + i);
}

static void templates_match_jinja2(void **state) {
    (void)state;
    const char *dir = moe_test_shared("templates");
    MOE_SKIP_IF_NULL(dir);
    template_file *files = NULL;
    size_t n_files = list_templates(dir, &files);
    assert_true(n_files > 0);

    /* one Python run renders every case */
    json_t *spec = json_object(), *cases = json_array();
    json_object_set_new(spec, "fixed_date", json_string(FIXED_DATE));
    for (size_t f = 0; f < n_files; f++)
        for (size_t c = 0; c < N_CONV; c++) {
            json_t *cs = json_object();
            char *kw = kwargs_with_tokens(conversations[c].kwargs);
            json_object_set_new(cs, "template", json_string(files[f].path));
            json_object_set_new(cs, "messages", json_loads(conversations[c].messages, 0, NULL));
            json_object_set_new(cs, "tools", conversations[c].tools
                                                 ? json_loads(conversations[c].tools, 0, NULL)
                                                 : json_null());
            json_object_set_new(cs, "kwargs", json_loads(kw, 0, NULL));
            free(kw);
            json_array_append_new(cases, cs);
        }
    json_object_set_new(spec, "cases", cases);
    char in_path[512], out_path[512], cmd[2048];
    snprintf(in_path, sizeof in_path, "%s/cases.json", moe_test_tmpdir());
    snprintf(out_path, sizeof out_path, "%s/rendered.json", moe_test_tmpdir());
    assert_int_equal(json_dump_file(spec, in_path, 0), 0);
    json_decref(spec);
    snprintf(cmd, sizeof cmd, "python3 tests/render_jinja.py '%s' '%s'", in_path, out_path);
    char *log;
    int rc = moe_test_run(cmd, &log);
    if (rc != 0) fail_msg("python3 tests/render_jinja.py failed (%d): %s", rc, log);
    free(log);
    json_error_t je;
    json_t *results = json_load_file(out_path, 0, &je);
    assert_non_null(results);
    assert_int_equal(json_array_size(results), n_files * N_CONV);

    setenv("MOE_FIXED_DATE", FIXED_DATE, 1);
    size_t total_match = 0, total = 0, total_unexpected = 0, both_fail = 0;
    for (size_t f = 0; f < n_files; f++) {
        moe_error err = {0};
        moe_chat_template *t = moe_chat_template_load_file(files[f].path, &err);
        size_t match = 0;
        char failed[1024] = "";
        for (size_t c = 0; c < N_CONV; c++) {
            json_t *ref = json_array_get(results, f * N_CONV + c);
            bool ref_ok = json_is_true(json_object_get(ref, "ok"));
            const char *ref_text = json_string_value(json_object_get(ref, "text"));
            char *ours = NULL;
            moe_error rerr = {0};
            bool ok = false;
            if (t) {
                char *kw = kwargs_with_tokens(conversations[c].kwargs);
                ok = moe_chat_render(t, conversations[c].messages, conversations[c].tools, kw,
                                     &ours, &rerr) == MOE_OK;
                free(kw);
            } else {
                rerr = err;
            }
            bool same = ok == ref_ok && (!ok || strcmp(ours, ref_text) == 0);
            total++;
            if (same) {
                match++;
                total_match++;
                both_fail += !ok;
            } else {
                bool known = known_difference(files[f].name, conversations[c].name);
                if (!known) total_unexpected++;
                size_t l = strlen(failed);
                snprintf(failed + l, sizeof failed - l, " %s%s", conversations[c].name,
                         known ? "(known)" : "");
                print_message("  MISMATCH %s / %s: ours %s, jinja2 %s\n", files[f].name,
                              conversations[c].name, ok ? "rendered" : rerr.msg,
                              ref_ok ? "rendered" : json_string_value(json_object_get(ref, "error")));
                if (ok && ref_ok) show_difference(ours, ref_text);
            }
            free(ours);
        }
        if (getenv("MOE_TEST_VERBOSE"))
            for (size_t c = 0; c < N_CONV; c++) {
                json_t *ref = json_array_get(results, f * N_CONV + c);
                if (!json_is_true(json_object_get(ref, "ok")))
                    print_message("    (both raise) %s / %s: %s\n", files[f].name, conversations[c].name,
                                  json_string_value(json_object_get(ref, "error")));
            }
        print_message("  %-52s %2zu/%zu%s%s\n", files[f].name, match, N_CONV, failed[0] ? " differ:" : "",
                      failed);
        moe_chat_template_free(t);
    }
    print_message("  templates x conversations: %zu/%zu match Python Jinja2 (%zu of them raise on both sides)\n",
                  total_match, total, both_fail);
    json_decref(results);
    free(files);
    assert_int_equal(total_unexpected, 0);
}

/* ==== Interpreter details (no Python needed) ==== */

static char *render_inline(const char *src, const char *messages, const char *kwargs, moe_error *err) {
    moe_chat_template *t = moe_chat_template_parse(src, strlen(src), err);
    if (!t) return NULL;
    char *out = NULL;
    if (moe_chat_render(t, messages ? messages : "[]", NULL, kwargs, &out, err) != MOE_OK) out = NULL;
    moe_chat_template_free(t);
    return out;
}

static void expect_render(const char *src, const char *kwargs, const char *want) {
    moe_error err = {0};
    char *out = render_inline(src, NULL, kwargs, &err);
    if (!out) fail_msg("template %s failed: %s", src, err.msg);
    if (strcmp(out, want) != 0) fail_msg("template %s\n  gave [%s]\n  want [%s]", src, out, want);
    free(out);
}

static void expect_error(const char *src, const char *kwargs, const char *where) {
    moe_error err = {0};
    char *out = render_inline(src, NULL, kwargs, &err);
    if (out) fail_msg("template %s rendered [%s], expected an error", src, out);
    if (where && !strstr(err.msg, where)) fail_msg("error [%s] does not mention [%s]", err.msg, where);
}

static void interpreter_basics(void **state) {
    (void)state;
    expect_render("{{ 1 + 2 * 3 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ 7 % -3 }}|{{ 2 ** 10 }}|{{ 1 / 4 }}",
                  NULL, "7|3|-4|-2|1024|0.25");
    expect_render("{{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ 1.5 }} {{ 0.1 + 0.2 }}", NULL,
                  "1e+16 1000000000000000.0 0.0001 1e-05 1.5 0.30000000000000004");
    expect_render("{{ [1, 'a', none, true, {'k': 2.0}] }}", NULL, "[1, 'a', None, True, {'k': 2.0}]");
    expect_render("{{ \"it's\" }} {{ [\"it's\", 'say \"x\"'] }}", NULL,
                  "it's [\"it's\", 'say \"x\"']");
    expect_render("{{ {'b': 1, 'a': [1, 2]} | tojson }}|{{ {'b': 1} | tojson(indent=2) }}", NULL,
                  "{\"b\": 1, \"a\": [1, 2]}|{\n  \"b\": 1\n}");
    expect_render("{{ 'é\"\\n' | tojson }}|{{ 'é' | tojson(ensure_ascii=true) }}", NULL,
                  "\"é\\\"\\n\"|\"\\u00e9\"");
    expect_render("{% for x in [3, 1, 2] | sort %}{{ loop.index }}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}",
                  NULL, "11,22,33");
    expect_render("{% for k, v in {'a': 1, 'b': 2} | items %}{{ k }}={{ v }};{% endfor %}", NULL, "a=1;b=2;");
    expect_render("{% set ns = namespace(n=0) %}{% for i in range(5) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}",
                  NULL, "10");
    expect_render("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{% endfor %}{{ x }}", NULL, "1");
    expect_render("{% macro m(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}", NULL,
                  "[1B][23]");
    expect_render("{{ 'abc'[::-1] }}{{ [1,2,3,4][1:3] }}{{ 'héllo'[1] }}{{ 'héllo' | length }}", NULL,
                  "cba[2, 3]é5");
    expect_render("{{ '  x  '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}", NULL,
                  "x|['a', 'b', '', 'c']|['a', 'b']");
    expect_render("{{ x is defined }}{{ x | default('d') }}{{ none is none }}{{ 'a' is string }}", NULL,
                  "FalsedTrueTrue");
    expect_render("{% for i in range(10) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}", NULL, "012");
    expect_render("  {%- if true %}\n  yes\n  {% endif %}\nend", NULL, "  yes\nend");
    expect_render("{{ 'a' ~ 1 ~ none }}{{ 'x' if false }}.", NULL, "a1None.");
    expect_render("{{ ('<' | safe) + '<' }}", NULL, "<&lt;");
    expect_render("{{ strftime_now('%Y-%m-%d') | length }}", NULL, "10");
    expect_render("{{ bos_token }}", "{\"bos_token\":\"<s>\"}", "<s>");
    expect_render("line\n", NULL, "line");
}

static void interpreter_errors(void **state) {
    (void)state;
    expect_error("{{ raise_exception('bad role') }}", NULL, "bad role");
    expect_error("a\n{% if x %}", NULL, "line 2");
    expect_error("{{ 1 +* }}", NULL, "column");
    expect_error("{{ x | nosuchfilter }}", NULL, "No filter named");
    expect_error("{{ undefined_thing.attr }}", NULL, "undefined");
    expect_error("{{ [].append(1) }}", NULL, "unsafe");
    expect_error("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", NULL, "nested deeper");
    expect_error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", NULL,
                 "iterations");
    expect_error("{{ 'x' * 1000000000 }}", NULL, NULL);
    expect_error("{{ 'unterminated }}", NULL, "line 1");
    /* soft frames: an unknown filter inside `if` only fails when it runs */
    expect_render("{% if false %}{{ x | from_json }}{% endif %}ok", NULL, "ok");
}

int moe_suite_template(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(interpreter_basics),
        cmocka_unit_test(interpreter_errors),
        cmocka_unit_test(templates_match_jinja2),
    };
    return cmocka_run_group_tests_name("template", tests, NULL, NULL);
}
