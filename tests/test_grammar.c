/* Suite "grammar": constrained decoding -- the GBNF parser's errors, the token masks against an
 * independent reference, the sampler under a grammar, JSON Schema conversion errors, and
 * structured output through `moe serve` checked by Python's json and jsonschema.
 *
 * References we did not write: the masks are compared with Python's `regex` module (partial
 * matching of an equivalent regular expression) over the stories260K vocabulary as
 * tests/grammar_check.py reads it from the GGUF itself; server replies are parsed by Python's
 * json and validated by python3-jsonschema against schemas written here. The server cases draw
 * 50 samples at temperature 1 on stories260K and on a parity model (qwen3moe-mixed). */
#include "testutil.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/chat/chat.h"
#include "../src/engine/engine.h"

/* ==== Parser errors: line:column and what ==== */

static void parse_errors_name_the_place(void **state) {
    (void)state;
    static const struct {
        const char *src, *want;
    } cases[] = {
        {"root ::= foo\n", "grammar:1:10: undefined rule 'foo'"},
        {"root ::= \"abc\n", "grammar:1:10: unterminated string literal"},
        {"root ::= [a-z\n", "grammar:1:10: unterminated character class"},
        {"root ::= [z-a]\n", "grammar:1:12: character range ends below its start"},
        {"root ::= \"a\"\nexpr ::= expr \"+\" \"b\" | \"b\"\n", "grammar:2:1: rule 'expr' is "
                                                                "left-recursive"},
        {"root ::= (\"a\" | \"b\"\n", "grammar:1:10: '(' is never closed"},
        {"root := \"a\"\n", "grammar:1:6: expected '::=' after rule name 'root'"},
        {"root ::= \"a\"{3,1}\n", "grammar:1:13: repetition {3,1}: the maximum is below"},
        {"root ::= \"\\q\"\n", "grammar:1:11: unknown escape \\q"},
        {"# only a comment\nitem ::= \"a\"\n", "grammar:3:1: no rule named 'root'"},
        {"root ::= \"a\" )\n", "grammar:1:14: ')' without a matching '('"},
        {"root ::= * \"a\"\n", "grammar:1:10: '*' must follow something to repeat"},
        {"root ::= \"a\"\nroot ::= \"b\"\n", "grammar:2:1: rule 'root' is defined twice"},
        {"root ::= \"a\"{1,99999}\n", "grammar:1:16: repetition count above"},
        {"root ::= \"\\x4\"\n", "grammar:1:11: escape \\x needs 2 hex digits"},
        {"root ::= <[12]>\n", "grammar:1:10: token references"},
        {"root ::= \"a\" @\n", "grammar:1:14: unexpected '@'"},
        {"\n\n  root ::= \"\xff\"\n", "grammar:3:13: invalid UTF-8"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_error err = {0};
        moe_grammar *g = moe_grammar_parse(cases[i].src, strlen(cases[i].src), NULL, &err);
        if (g) fail_msg("case %zu parsed: %s", i, cases[i].src);
        if (strncmp(err.msg, cases[i].want, strlen(cases[i].want)) != 0)
            fail_msg("case %zu: got \"%s\", want \"%s...\"", i, err.msg, cases[i].want);
    }
}

/* ==== Masks against Python's regex over the real vocabulary ==== */

/* Every syntax feature: comments, alternation, sequences, literals with escapes (\x, \u),
 * classes with ranges and negation, groups, * + ? {m} {m,} {m,n}; non-ASCII literals (2 and 3
 * bytes) so that tokens ending inside a character are exercised. */
static const char mask_grammar[] =
    "# greetings, then words\n"
    "root  ::= greet (\" \" word){1,3} tail?   # a trailing comment\n"
    "greet ::= \"Once\" | \"Lily\" | \"\\u2603\" | \"\\x41b\"\n"
    "word  ::= [a-z]+ | \"\xc3\xa9\" [a-df-z]{0,2} | num | (\"x\" \"y\"?)*  \"!\"\n"
    "num   ::= [1-9] [0-9]{2} | \"0\"\n"
    "tail  ::= [.!] \"\\n\"? | \" (\" [^()\\x00-\\x1F\\x80-\\U0010FFFF]{1,} \")\"\n";
static const char mask_regex[] = "(?:Once|Lily|\xe2\x98\x83|Ab)(?: (?:[a-z]+|\xc3\xa9[a-df-z]{0,2}|"
                                 "(?:[1-9][0-9]{2}|0)|(?:xy?)*!)){1,3}"
                                 "(?:[.!]\\n?| \\([^()\\x00-\\x1F\\x80-\\U0010FFFF]+\\))?";

/* Long tool output, a line per print_message (cmocka cuts long messages). */
static void print_lines(const char *out) {
    for (const char *s = out; *s;) {
        const size_t n = strcspn(s, "\n");
        print_message("    %.*s\n", (int)n, s);
        s += n + (s[n] == '\n');
    }
}

static const char *piece_of(void *ud, int32_t id, size_t *len, bool *eog) {
    const moe_tokenizer *tok = ud;
    *eog = moe_tokenizer_is_eog(tok, id);
    return moe_tokenizer_token_piece(tok, id, false, len);
}

static void masks_match_python(void **state) {
    (void)state;
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    MOE_SKIP_IF_NULL(model);
    moe_error err = {0};
    moe_gguf *gg = moe_gguf_open(model, &err);
    moe_tokenizer *tok = gg ? moe_tokenizer_from_gguf(gg, &err) : NULL;
    if (!tok) fail_msg("%s", err.msg);
    moe_grammar *g = moe_grammar_parse(mask_grammar, strlen(mask_grammar), NULL, &err);
    if (!g) fail_msg("%s", err.msg);
    const uint32_t n_vocab = moe_tokenizer_n_vocab(tok);
    moe_grammar_vocab *v = moe_grammar_vocab_new(n_vocab, piece_of, tok, false);
    json_t *steps = json_array();
    uint64_t rng = 7;
    uint32_t n_steps = 0, n_partial = 0;
    int32_t *allowed = moe_xmalloc(sizeof(int32_t) * n_vocab);
    for (int walk = 0; walk < 24; walk++) {
        moe_grammar_state *st = moe_grammar_state_new(g, v);
        moe_strbuf prefix = {0};
        for (int step = 0; step < 14; step++) {
            uint32_t n = 0, n_text = 0;
            for (uint32_t t = 0; t < n_vocab; t++)
                if (moe_grammar_state_allows(st, (int32_t)t)) allowed[n++] = (int32_t)t;
            /* one token's check (the sampler's first try) agrees with the mask */
            for (uint32_t t = 0, k = 0; t < n_vocab; t++) {
                const bool in = k < n && allowed[k] == (int32_t)t;
                k += in;
                if (moe_grammar_state_can_take(st, (int32_t)t) != in)
                    fail_msg("token %u: the mask says %d, the single check %d", t, in, !in);
            }
            /* the mask the sampler applies is the same set */
            float *logits = moe_xcalloc(n_vocab, sizeof(float));
            assert_int_equal(moe_grammar_state_apply(st, logits), n);
            for (uint32_t k = 0, t = 0; t < n_vocab; t++)
                if (k < n && allowed[k] == (int32_t)t) {
                    assert_true(logits[t] == 0.0f);
                    k++;
                } else {
                    assert_true(isinf(logits[t]) && logits[t] < 0);
                }
            free(logits);
            json_t *js = json_object(), *ids = json_array();
            char *hex = moe_xmalloc(2 * prefix.len + 1);
            for (size_t i = 0; i < prefix.len; i++)
                sprintf(hex + 2 * i, "%02x", (unsigned char)prefix.s[i]);
            hex[2 * prefix.len] = 0;
            json_object_set_new(js, "prefix", json_string(hex));
            free(hex);
            for (uint32_t k = 0; k < n; k++) {
                json_array_append_new(ids, json_integer(allowed[k]));
                n_text += !moe_tokenizer_is_eog(tok, allowed[k]);
            }
            json_object_set_new(js, "allowed", ids);
            json_array_append_new(steps, js);
            n_steps++;
            if (!n_text) break;
            /* a random token among those with text: half the time a byte token, so that
             * characters get split across tokens */
            int32_t pick = -1;
            const bool want_byte = moe_rng_u64(&rng) & 1;
            for (int tries = 0; tries < 64 && pick < 0; tries++) {
                const int32_t t = allowed[moe_rng_u64(&rng) % n];
                size_t len;
                moe_tokenizer_token_piece(tok, t, false, &len);
                if (!len) continue;
                if (!want_byte || moe_tokenizer_token_type(tok, t) == MOE_TOKEN_BYTE || tries > 32)
                    pick = t;
            }
            if (pick < 0) break;
            size_t len;
            const char *p = moe_tokenizer_token_piece(tok, pick, false, &len);
            assert_true(moe_grammar_state_accept(st, pick));
            moe_strbuf_put(&prefix, p, len);
            n_partial += (unsigned char)p[len - 1] >= 0x80;
        }
        moe_strbuf_free(&prefix);
        moe_grammar_state_free(st);
    }
    free(allowed);
    char path[600], cmd[2048];
    snprintf(path, sizeof path, "%s/mask_steps.json", moe_test_tmpdir());
    json_dump_file(steps, path, JSON_COMPACT);
    json_decref(steps);
    /* the regex goes through a file: no shell quoting */
    char rx_path[600];
    snprintf(rx_path, sizeof rx_path, "%s/mask_regex.txt", moe_test_tmpdir());
    FILE *f = fopen(rx_path, "w");
    fputs(mask_regex, f);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 tests/grammar_check.py mask '%s' \"$(cat '%s')\" '%s'", model,
             rx_path, path);
    char *out;
    const int rc = moe_test_run(cmd, &out);
    print_message("    %u steps over 24 walks (%u tokens ended inside a character):\n", n_steps,
                  n_partial);
    print_lines(out);
    free(out);
    if (rc != 0) fail_msg("python's masks differ (exit %d)", rc);
    assert_true(n_partial > 0);
    moe_grammar_vocab_free(v);
    moe_grammar_free(g);
    moe_tokenizer_free(tok);
    moe_gguf_close(gg);
}

/* ==== The sampler under a grammar ==== */

static const char *const toy_pieces[] = {"", "</s>", "a", "b", "ab", "{", "}", "\"", "c\"", " {"};
#define TOY_N   10
#define TOY_EOS 1

static const char *toy_piece(void *ud, int32_t id, size_t *len, bool *eog) {
    (void)ud;
    *eog = id == TOY_EOS;
    *len = strlen(toy_pieces[id]);
    return toy_pieces[id];
}

static void sampler_never_leaves_the_grammar(void **state) {
    (void)state;
    moe_error err = {0};
    static const char src[] = "root ::= \"{\" \"\\\"\" [ab]{1,3} \"c\\\"\" \"}\"\n";
    moe_grammar *g = moe_grammar_parse(src, strlen(src), NULL, &err);
    if (!g) fail_msg("%s", err.msg);
    moe_grammar_vocab *v = moe_grammar_vocab_new(TOY_N, toy_piece, NULL, true);
    moe_sampler_params p = {
        .temperature = 1.0f, .top_p = 1, .repeat_penalty = 1, .grammar = g, .grammar_vocab = v};
    float logits[TOY_N];
    for (int run = 0; run < 200; run++) {
        p.seed = (uint64_t)run;
        moe_sampler *s = moe_sampler_new(&p, TOY_N);
        moe_strbuf text = {0};
        for (int step = 0; step < 12; step++) {
            for (int i = 0; i < TOY_N; i++) logits[i] = i == 9 ? 3.0f : (float)((run + i) % 3);
            const int32_t t = moe_sampler_sample(s, logits).token;
            if (t == TOY_EOS) break;
            moe_strbuf_puts(&text, toy_pieces[t]);
        }
        /* the first piece loses SPM's space, as the server's detokenizer does */
        const char *out = text.s[0] == ' ' ? text.s + 1 : text.s;
        const size_t n = strlen(out);
        if (n < 6 || n > 8 || strncmp(out, "{\"", 2) || strcmp(out + n - 3, "c\"}") ||
            strspn(out + 2, "ab") != n - 5)
            fail_msg("run %d wrote '%s'", run, text.s);
        moe_strbuf_free(&text);
        moe_sampler_free(s);
    }
    /* greedy, with the grammar's favourite banned: the best allowed token wins */
    p.temperature = 0;
    moe_sampler *s = moe_sampler_new(&p, TOY_N);
    for (int i = 0; i < TOY_N; i++) logits[i] = (float)i;
    assert_int_equal(moe_sampler_sample(s, logits).token, 9); /* " {" */
    assert_int_equal(moe_sampler_sample(s, logits).token, 7); /* "\"" */
    assert_int_equal(moe_sampler_sample(s, logits).token, 4); /* "ab" */
    assert_int_equal(moe_sampler_sample(s, logits).token, 8); /* "c\"" (max 3 of [ab]: "ab"+"ab"
                                                                 would be 4) */
    assert_int_equal(moe_sampler_sample(s, logits).token, 6);
    assert_int_equal(moe_sampler_sample(s, logits).token, TOY_EOS); /* complete: only EOS */
    moe_sampler_free(s);
    moe_grammar_vocab_free(v);
    moe_grammar_free(g);
}

/* ==== JSON Schema conversion: what is refused, and where ==== */

static void schema_errors_name_the_path(void **state) {
    (void)state;
    static const struct {
        const char *schema, *want;
    } cases[] = {
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"http://x/y\"}}}",
         "schema /properties/a: $ref 'http://x/y': only #"},
        {"{\"$ref\":\"#/$defs/missing\",\"$defs\":{}}", "schema (root): $ref '#/$defs/missing' "
                                                        "points at nothing"},
        {"{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"}]}", "schema (root): tuples"},
        {"{\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"integer\",\"minimum\":5,"
         "\"maximum\":2}}}",
         "schema /properties/n: no integer lies between"},
        {"{\"type\":\"decimal\"}", "schema (root): unknown type 'decimal'"},
        {"{\"enum\":[]}", "schema (root): enum: expected a non-empty array"},
        {"{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"minItems\":3,\"maxItems\":1}",
         "schema (root): maxItems is below minItems"},
        {"[1,", "schema: not JSON"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_error err = {0};
        char *g = moe_chat_schema_grammar(cases[i].schema, NULL, &err);
        if (g) fail_msg("case %zu converted:\n%s", i, g);
        if (strncmp(err.msg, cases[i].want, strlen(cases[i].want)) != 0)
            fail_msg("case %zu: got \"%s\", want \"%s...\"", i, err.msg, cases[i].want);
    }
    /* recursion through $ref is fine: it is a rule that refers to itself */
    moe_error err = {0};
    char *g = moe_chat_schema_grammar(
        "{\"$ref\":\"#/$defs/node\",\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{"
        "\"next\":{\"anyOf\":[{\"type\":\"null\"},{\"$ref\":\"#/$defs/node\"}]}},"
        "\"required\":[\"next\"]}}}",
        NULL, &err);
    if (!g) fail_msg("%s", err.msg);
    moe_grammar *gr = moe_grammar_parse(g, strlen(g), NULL, &err);
    if (!gr) fail_msg("%s\n%s", err.msg, g);
    moe_grammar_state *st = moe_grammar_state_new(gr, NULL);
    static const char doc[] = "{\"next\": {\"next\": {\"next\": null}}}";
    assert_true(moe_grammar_state_accept_bytes(st, doc, strlen(doc)));
    assert_true(moe_grammar_state_complete(st));
    moe_grammar_state_free(st);
    moe_grammar_free(gr);
    free(g);
}

/* ==== Forced calls: what the grammar writes, the format's own parser reads back ==== */

static const char *byte_piece(void *ud, int32_t id, size_t *len, bool *eog) {
    static char bytes[256];
    (void)ud;
    *eog = id == 256;
    *len = id < 256;
    bytes[id & 255] = (char)id;
    return bytes + (id & 255);
}

static void forced_calls_parse_in_every_format(void **state) {
    (void)state;
    /* city: a bounded string; note: any text (raw in the XML-ish formats); unit: an enum; days:
     * an integer range; exact: a boolean */
    static const char tools[] =
        "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{"
        "\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":6},"
        "\"note\":{\"type\":[\"string\",\"null\"]},"
        "\"unit\":{\"type\":\"string\",\"enum\":[\"C\",\"F\"]},"
        "\"days\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":7},"
        "\"exact\":{\"type\":\"boolean\"}},\"required\":[\"city\",\"exact\"]}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"ping\"}}]";
    static const moe_chat_format formats[] = {
        MOE_CHAT_FORMAT_HERMES,      MOE_CHAT_FORMAT_LLAMA3,       MOE_CHAT_FORMAT_MISTRAL,
        MOE_CHAT_FORMAT_DEEPSEEK_V3, MOE_CHAT_FORMAT_DEEPSEEK_V31, MOE_CHAT_FORMAT_KIMI_K2,
        MOE_CHAT_FORMAT_QWEN3_CODER, MOE_CHAT_FORMAT_GLM,          MOE_CHAT_FORMAT_MINIMAX_M2,
        MOE_CHAT_FORMAT_DSML,        MOE_CHAT_FORMAT_HARMONY,      MOE_CHAT_FORMAT_GEMMA4};
    moe_grammar_vocab *v = moe_grammar_vocab_new(257, byte_piece, NULL, false);
    float logits[257];
    uint64_t rng = 11;
    for (size_t fi = 0; fi <= sizeof formats / sizeof *formats; fi++) {
        /* the last round: Hermes behind an open reasoning block, closed by the grammar */
        const bool thinking = fi == sizeof formats / sizeof *formats;
        moe_chat_parse_options o = {.format = thinking ? MOE_CHAT_FORMAT_HERMES : formats[fi],
                                    .tools_json = tools};
        if (thinking) {
            o.think_open = "<think>";
            o.think_close = "</think>";
            o.reasoning_open = true;
        }
        moe_error err = {0};
        char *src = moe_chat_tool_grammar(&o, tools, NULL, thinking ? "\"</think>\" " : NULL, &err);
        if (!src) fail_msg("%s: %s", moe_chat_format_name(o.format), err.msg);
        moe_grammar *g = moe_grammar_parse(src, strlen(src), NULL, &err);
        if (!g) fail_msg("%s: %s\n%s", moe_chat_format_name(o.format), err.msg, src);
        for (int run = 0; run < 20; run++) {
            moe_sampler_params p = {.temperature = 1.0f,
                                    .top_p = 1,
                                    .repeat_penalty = 1,
                                    .seed = (uint64_t)run,
                                    .grammar = g,
                                    .grammar_vocab = v};
            moe_sampler *s = moe_sampler_new(&p, 257);
            moe_strbuf text = {0};
            int32_t t = 0;
            for (int step = 0; step < 4000 && t != 256; step++) {
                for (int i = 0; i < 257; i++) logits[i] = (float)(moe_rng_uniform(&rng) * 4.0);
                /* the bytes that end a string, an object, raw text ("</", "<|"): a bounded
                 * expected length */
                for (const char *e = "\"}]</|\n"; *e; e++) logits[(unsigned char)*e] += 6.0f;
                t = moe_sampler_sample(s, logits).token;
                if (t < 256) moe_strbuf_putc(&text, (char)t);
            }
            if (t != 256) /* the grammar ends it */
                fail_msg("%s: no end after %zu bytes: %.300s", moe_chat_format_name(o.format),
                         text.len, text.s);
            moe_chat_parser *cp = moe_chat_parser_new(&o, &err);
            moe_chat_delta d = {0};
            assert_int_equal(moe_chat_parser_feed(cp, text.s, text.len, &d, &err), MOE_OK);
            assert_int_equal(moe_chat_parser_finish(cp, &d, &err), MOE_OK);
            if (d.n_calls != 1 || d.content_len)
                fail_msg("%s: %zu calls and %zu bytes of content from:\n%s",
                         moe_chat_format_name(o.format), d.n_calls, d.content_len, text.s);
            json_t *args = json_loads(d.calls[0].arguments, 0, NULL);
            if (!json_is_object(args))
                fail_msg("%s: arguments %s from:\n%s", moe_chat_format_name(o.format),
                         d.calls[0].arguments, text.s);
            if (strcmp(d.calls[0].name, "get_weather") == 0) {
                json_t *city = json_object_get(args, "city"), *days = json_object_get(args, "days"),
                       *note = json_object_get(args, "note"), *unit = json_object_get(args, "unit");
                assert_true(json_is_string(city));
                assert_true(json_is_boolean(json_object_get(args, "exact")));
                assert_true(!note || json_is_string(note) || json_is_null(note));
                assert_true(!unit || !strcmp(json_string_value(unit), "C") ||
                            !strcmp(json_string_value(unit), "F"));
                assert_true(!days || (json_is_integer(days) && json_integer_value(days) >= 1 &&
                                      json_integer_value(days) <= 7));
                if (json_object_size(args) > 5) fail_msg("extra arguments: %s", text.s);
            } else {
                assert_string_equal(d.calls[0].name, "ping");
            }
            json_decref(args);
            moe_chat_delta_clear(&d);
            moe_chat_parser_free(cp);
            moe_strbuf_free(&text);
            moe_sampler_free(s);
        }
        moe_grammar_free(g);
        free(src);
    }
    /* Gemma 4's own value syntax for nested arguments is not written: refused, by path */
    static const char nested[] =
        "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":"
        "\"object\",\"properties\":{\"xs\":{\"type\":\"array\"}}}}}]";
    moe_chat_parse_options o = {.format = MOE_CHAT_FORMAT_GEMMA4};
    moe_error err = {0};
    assert_null(moe_chat_tool_grammar(&o, nested, NULL, NULL, &err));
    assert_non_null(strstr(err.msg, "tools[0].function.parameters/properties/xs"));
    o.format = MOE_CHAT_FORMAT_HERMES;
    err = (moe_error){0};
    assert_null(moe_chat_tool_grammar(&o, tools, "nope", NULL, &err));
    assert_string_equal(err.msg, "no tool named 'nope'");
    moe_grammar_vocab_free(v);
}

/* ==== Through the server, validated by Python ==== */

/* The held-out schema: nested object through $ref, optional properties, bounded strings, a
 * pattern, integer bounds, enum, const, anyOf, arrays with min/maxItems, numbers, booleans. */
#define PERSON_SCHEMA                                                                              \
    "{\"type\":\"object\",\"properties\":{"                                                        \
    "\"name\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":12},"                             \
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":120},"                                \
    "\"email\":{\"type\":\"string\",\"pattern\":\"^[a-z]{1,8}@[a-z]{1,8}\\\\.(com|org)$\"},"       \
    "\"role\":{\"enum\":[\"cat\",\"dog\",\"bird\"]},"                                              \
    "\"version\":{\"const\":2},"                                                                   \
    "\"score\":{\"anyOf\":[{\"type\":\"null\"},{\"type\":\"number\"}]},"                           \
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":5},"                \
    "\"minItems\":1,\"maxItems\":3},"                                                              \
    "\"home\":{\"$ref\":\"#/$defs/place\"},"                                                       \
    "\"happy\":{\"type\":\"boolean\"}},"                                                           \
    "\"required\":[\"name\",\"age\",\"role\",\"version\",\"tags\"],"                               \
    "\"additionalProperties\":false,"                                                              \
    "\"$defs\":{\"place\":{\"type\":\"object\",\"properties\":{"                                   \
    "\"city\":{\"type\":\"string\",\"maxLength\":8},"                                              \
    "\"floor\":{\"type\":\"integer\",\"exclusiveMinimum\":-3,\"exclusiveMaximum\":40}},"           \
    "\"required\":[\"city\"]}}}"

#define TOOLS                                                                                      \
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather\","  \
    "\"parameters\":{"                                                                             \
    "\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":10},"         \
    "\"unit\":{\"enum\":[\"c\",\"f\"]}},\"required\":[\"city\"]}}},"                               \
    "{\"type\":\"function\",\"function\":{\"name\":\"add\",\"description\":\"Sum\","               \
    "\"parameters\":{\"type\":\"object\","                                                         \
    "\"properties\":{\"a\":{\"type\":\"integer\",\"minimum\":-50,\"maximum\":50},"                 \
    "\"b\":{\"type\":\"integer\"}},\"required\":[\"a\",\"b\"]}}}]"

#define ANTHROPIC_TOOLS                                                                            \
    "[{\"name\":\"lookup\",\"input_schema\":{\"type\":\"object\",\"properties\":{\"word\":{"       \
    "\"type\":\"string\",\"maxLength\":8},\"limit\":{\"type\":\"integer\",\"minimum\":1,"          \
    "\"maximum\":9}},\"required\":[\"word\",\"limit\"]}}]"

#define USER_MSG "[{\"role\":\"user\",\"content\":\"Tell me about someone.\"}]"

static const char serve_cases[] =
    "["
    /* response_format json_schema: the held-out schema, 50 samples at temperature 1 */
    "{\"name\":\"json_schema\",\"kind\":\"content\",\"n\":50,\"schema\":" PERSON_SCHEMA ","
    "\"request\":{\"messages\":" USER_MSG ",\"temperature\":1,\"max_tokens\":900,"
    "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"person\","
    "\"schema\":" PERSON_SCHEMA "}}}},"
    /* json_object mode: any JSON object; strings are unbounded there, so a reply cut by
     * max_tokens is excused (at least one must finish) */
    "{\"name\":\"json_object\",\"kind\":\"content\",\"n\":10,\"allow_length\":true,\"schema\":{"
    "\"type\":\"object\"},"
    "\"request\":{\"messages\":" USER_MSG ",\"temperature\":1,\"max_tokens\":600,"
    "\"response_format\":{\"type\":\"json_object\"}}},"
    /* Responses API text.format */
    "{\"name\":\"responses_text_format\",\"kind\":\"responses\",\"n\":5,\"path\":\"/v1/responses\","
    "\"schema\":" PERSON_SCHEMA ",\"request\":{\"input\":\"Tell me about someone.\","
    "\"temperature\":1,\"max_output_tokens\":900,\"text\":{\"format\":{\"type\":\"json_schema\","
    "\"name\":\"person\",\"schema\":" PERSON_SCHEMA "}}}},"
    /* tool_choice required: one call, to either tool, arguments valid */
    "{\"name\":\"tool_choice_required\",\"kind\":\"tool\",\"n\":20,\"names\":[\"get_weather\","
    "\"add\"],\"request\":{\"messages\":" USER_MSG ",\"temperature\":1,\"max_tokens\":300,"
    "\"tools\":" TOOLS ",\"tool_choice\":\"required\"}},"
    /* a named function */
    "{\"name\":\"tool_choice_named\",\"kind\":\"tool\",\"n\":10,\"names\":[\"add\"],"
    "\"request\":{\"messages\":" USER_MSG ",\"temperature\":1,\"max_tokens\":300,"
    "\"tools\":" TOOLS ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"add\"}}}},"
    /* Anthropic: {type: any} */
    "{\"name\":\"anthropic_any\",\"kind\":\"anthropic_tool\",\"n\":10,\"names\":[\"lookup\"],"
    "\"path\":\"/v1/messages\",\"request\":{\"model\":\"m\",\"messages\":" USER_MSG ","
    "\"temperature\":1,\"max_tokens\":300,\"tools\":" ANTHROPIC_TOOLS ","
    "\"tool_choice\":{\"type\":\"any\"}}},"
    /* unknown names are a 400 */
    "{\"name\":\"unknown_tool_openai\",\"status\":400,\"error_contains\":\"no tool named 'nope'\","
    "\"request\":{\"messages\":" USER_MSG ",\"tools\":" TOOLS ","
    "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}}},"
    "{\"name\":\"unknown_tool_anthropic\",\"status\":400,\"error_contains\":\"no tool named "
    "'nope'\",\"path\":\"/v1/messages\",\"request\":{\"model\":\"m\",\"max_tokens\":9,"
    "\"messages\":" USER_MSG ",\"tools\":" ANTHROPIC_TOOLS ",\"tool_choice\":{\"type\":\"tool\","
    "\"name\":\"nope\"}}},"
    "{\"name\":\"required_without_tools\",\"status\":400,\"error_contains\":\"no tools\","
    "\"request\":{\"messages\":" USER_MSG ",\"tool_choice\":\"required\"}},"
    /* llama-server's grammar field, on plain completions */
    "{\"name\":\"grammar_field\",\"kind\":\"regex\",\"n\":10,\"path\":\"/v1/completions\","
    "\"regex\":\"(yes|no|maybe), [a-z]{2,6}[.!]\",\"request\":{\"prompt\":\"Once upon a time\","
    "\"temperature\":1,\"max_tokens\":40,\"grammar\":\"root ::= (\\\"yes\\\" | \\\"no\\\" | "
    "\\\"maybe\\\") \\\", \\\" [a-z]{2,6} [.!]\"}},"
    "{\"name\":\"bad_grammar\",\"status\":400,\"error_contains\":\"grammar:1:10: undefined rule "
    "'nothing'\",\"path\":\"/v1/completions\",\"request\":{\"prompt\":\"x\",\"grammar\":"
    "\"root ::= nothing\"}},"
    "{\"name\":\"bad_schema\",\"status\":400,\"error_contains\":\"unknown type 'decimal'\","
    "\"request\":{\"messages\":" USER_MSG ",\"response_format\":{\"type\":\"json_schema\","
    "\"json_schema\":{\"schema\":{\"type\":\"decimal\"}}}}}"
    "]";

/* Run tests/grammar_check.py serve on a model file with these cases (JSON text). */
static void served_by_cases(const char *model, const char *cases_json) {
    char cases[600], cmd[2048];
    snprintf(cases, sizeof cases, "%s/serve_cases.json", moe_test_tmpdir());
    json_error_t je;
    json_t *j = json_loads(cases_json, 0, &je);
    if (!j) fail_msg("the cases are not JSON: %s at %d", je.text, je.position);
    json_dump_file(j, cases, 0);
    json_decref(j);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 tests/grammar_check.py serve '%s' '%s' '%s' '%s'",
             moe_test_bin(), model, cases, moe_test_tmpdir());
    char *out;
    const int rc = moe_test_run(cmd, &out);
    print_lines(out);
    free(out);
    if (rc != 0) fail_msg("structured output on %s failed (exit %d)", model, rc);
}

static void served_by(const char *model_rel) {
    const char *model = moe_test_shared(model_rel);
    MOE_SKIP_IF_NULL(model);
    served_by_cases(model, serve_cases);
}

/* The model's own call formats: stories260K with real templates in its GGUF (DeepSeek V3.1 with
 * thinking on, so the prompt leaves a reasoning block open; Llama 3.1; Mistral Nemo), and for
 * forced calls only, the formats whose arguments are parameters (Qwen3-Coder, GLM, MiniMax M2,
 * DeepSeek V3.2's DSML, Gemma 4) or a harmony message (gpt-oss). */
#define FORCED_CALL_CASES                                                                          \
    "{\"name\":\"tool_choice_required\",\"kind\":\"tool\",\"n\":5,\"names\":[\"get_weather\","     \
    "\"add\"],\"request\":{\"messages\":" USER_MSG ",\"temperature\":1,\"max_tokens\":300,"        \
    "\"enable_thinking\":true,\"tools\":" TOOLS ",\"tool_choice\":\"required\"}},"                 \
    "{\"name\":\"tool_choice_named\",\"kind\":\"tool\",\"n\":3,\"names\":[\"add\"],"               \
    "\"request\":{\"messages\":" USER_MSG ",\"temperature\":1,\"max_tokens\":300,"                 \
    "\"enable_thinking\":true,\"tools\":" TOOLS ",\"tool_choice\":{\"type\":\"function\","         \
    "\"function\":{\"name\":\"add\"}}}}"
static const char forced_call_cases[] = "[" FORCED_CALL_CASES "]";
static const char format_cases[] =
    "[" FORCED_CALL_CASES ","
    "{\"name\":\"json_schema\",\"kind\":\"content\",\"n\":5,\"schema\":" PERSON_SCHEMA ","
    "\"request\":{\"messages\":" USER_MSG ",\"temperature\":1,\"max_tokens\":900,"
    "\"enable_thinking\":true,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{"
    "\"name\":\"person\",\"schema\":" PERSON_SCHEMA "}}}}"
    "]";

/* Each template (in ../shared) in stories260K's GGUF, served the cases. */
static void served_with_templates(const char *const *templates, size_t n, const char *cases) {
    for (size_t i = 0; i < n; i++) {
        char name[32];
        snprintf(name, sizeof name, "format%zu", i);
        const char *model = moe_test_chat_model(name, templates[i]);
        MOE_SKIP_IF_NULL(model);
        print_message("    %s:\n", templates[i]);
        served_by_cases(model, cases);
    }
}

static void structured_output_in_model_formats(void **state) {
    (void)state;
    static const char *const templates[] = {"templates/deepseek-ai-DeepSeek-V3.1.jinja",
                                            "templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
                                            "templates/mistralai-Mistral-Nemo-Instruct-2407.jinja"};
    served_with_templates(templates, sizeof templates / sizeof *templates, format_cases);
    static const char *const call_templates[] = {"templates/Qwen3-Coder.jinja",
                                                 "templates/GLM-4.7-Flash.jinja",
                                                 "templates/MiniMax-M2.jinja",
                                                 "templates/deepseek-ai-DeepSeek-V3.2.jinja",
                                                 "templates/google-gemma-4-31B-it.jinja",
                                                 "templates/openai-gpt-oss-120b.jinja"};
    served_with_templates(call_templates, sizeof call_templates / sizeof *call_templates,
                          forced_call_cases);
}

static void structured_output_stories260k(void **state) {
    (void)state;
    served_by("models/stories260K/stories260K.gguf");
}

static void structured_output_parity_model(void **state) {
    (void)state;
    served_by("parity/qwen3moe-mixed.gguf");
}

int moe_suite_grammar(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(parse_errors_name_the_place),
        cmocka_unit_test(masks_match_python),
        cmocka_unit_test(sampler_never_leaves_the_grammar),
        cmocka_unit_test(schema_errors_name_the_path),
        cmocka_unit_test(forced_calls_parse_in_every_format),
        cmocka_unit_test(structured_output_stories260k),
        cmocka_unit_test(structured_output_parity_model),
        cmocka_unit_test(structured_output_in_model_formats),
    };
    return cmocka_run_group_tests_name("grammar", tests, NULL, NULL);
}
