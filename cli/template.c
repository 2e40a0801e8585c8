/* template.c: `moe template` -- render a chat template exactly as the model will see it, or
 * parse model output (stdin) into reasoning, content and tool calls with `--parse FORMAT`.
 *
 * The template comes from a GGUF file's tokenizer.chat_template, a checkpoint directory's
 * (tokenizer_config.json or chat_template.jinja) or from a .jinja file. The
 * prompt is printed byte for byte: no newline is added at the end. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli.h"
#include "../src/chat/chat.h"

static char *read_text(const char *path, moe_error *err) {
    uint8_t *data;
    size_t size;
    if (moe_file_read(path, &data, &size, err) != MOE_OK) return NULL;
    return (char *)data;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

static moe_chat_template *load_template(const char *path, moe_error *err) {
    FILE *f = fopen(path, "rb");
    char magic[4] = {0};
    bool is_gguf = f && fread(magic, 1, 4, f) == 4 && memcmp(magic, "GGUF", 4) == 0;
    if (f) fclose(f);
    bool checkpoint = moe_st_is_checkpoint(path);
    if ((!is_gguf && !checkpoint) || ends_with(path, ".jinja"))
        return moe_chat_template_load_file(path, err);
    moe_gguf *g = checkpoint ? moe_hf_open(path, true, err) : moe_gguf_open(path, err);
    if (!g) return NULL;
    moe_chat_template *t = moe_chat_template_from_gguf(g, NULL, err);
    moe_gguf_close(g);
    return t;
}

static void put_delta(moe_chat_delta *all, moe_chat_delta *d) {
    /* accumulate d into all */
    if (d->content_len) {
        all->content = realloc(all->content, all->content_len + d->content_len + 1);
        memcpy(all->content + all->content_len, d->content, d->content_len);
        all->content_len += d->content_len;
        all->content[all->content_len] = '\0';
    }
    if (d->reasoning_len) {
        all->reasoning = realloc(all->reasoning, all->reasoning_len + d->reasoning_len + 1);
        memcpy(all->reasoning + all->reasoning_len, d->reasoning, d->reasoning_len);
        all->reasoning_len += d->reasoning_len;
        all->reasoning[all->reasoning_len] = '\0';
    }
    for (size_t i = 0; i < d->n_calls; i++) {
        all->calls = realloc(all->calls, (all->n_calls + 1) * sizeof *all->calls);
        all->calls[all->n_calls].name = moe_xstrdup(d->calls[i].name);
        all->calls[all->n_calls].arguments = moe_xstrdup(d->calls[i].arguments);
        all->n_calls++;
    }
    moe_chat_delta_clear(d);
}

static int parse_stdin(const char *format, const char *tools_path, const char *template_path,
                       bool reasoning_open) {
    moe_error err = {0};
    moe_chat_parse_options o = {0};
    if (template_path) {
        moe_chat_template *t = load_template(template_path, &err);
        if (!t) {
            fprintf(stderr, "moe template: %s\n", err.msg);
            return 1;
        }
        moe_chat_parse_options_detect(moe_chat_template_source(t), NULL, &o);
        moe_chat_template_free(t);
    } else {
        moe_chat_parse_options_detect("", NULL, &o);
    }
    if (format && strcmp(format, "auto") != 0 && !moe_chat_format_from_name(format, &o.format))
        return moe_cli_usage_error("template", "unknown format '%s'", format);
    if (reasoning_open) o.reasoning_open = true;
    char *tools = NULL;
    if (tools_path && !(tools = read_text(tools_path, &err))) {
        fprintf(stderr, "moe template: %s\n", err.msg);
        return 1;
    }
    o.tools_json = tools;
    moe_chat_parser *p = moe_chat_parser_new(&o, &err);
    if (!p) {
        fprintf(stderr, "moe template: %s\n", err.msg);
        free(tools);
        return 1;
    }
    moe_chat_delta all = {0}, d = {0};
    char buf[4096];
    size_t n;
    int rc = 0;
    while ((n = fread(buf, 1, sizeof buf, stdin)) > 0) {
        if (moe_chat_parser_feed(p, buf, n, &d, &err) != MOE_OK) break;
        put_delta(&all, &d);
    }
    if (!err.code && moe_chat_parser_finish(p, &d, &err) == MOE_OK) put_delta(&all, &d);
    if (err.code) {
        fprintf(stderr, "moe template: %s\n", err.msg);
        rc = 1;
    } else {
        json_t *j = json_object();
        json_object_set_new(j, "format", json_string(moe_chat_format_name(o.format)));
        json_object_set_new(j, "reasoning_content",
                            json_stringn(all.reasoning ? all.reasoning : "", all.reasoning_len));
        json_object_set_new(j, "content",
                            json_stringn(all.content ? all.content : "", all.content_len));
        json_t *calls = json_array();
        for (size_t i = 0; i < all.n_calls; i++) {
            json_t *c = json_object();
            json_object_set_new(c, "name", json_string(all.calls[i].name));
            json_t *args = json_loads(all.calls[i].arguments, 0, NULL);
            json_object_set_new(c, "arguments", args ? args : json_string(all.calls[i].arguments));
            json_array_append_new(calls, c);
        }
        json_object_set_new(j, "tool_calls", calls);
        char *s = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        printf("%s\n", s);
        free(s);
        json_decref(j);
    }
    moe_chat_delta_clear(&all);
    moe_chat_parser_free(p);
    free(tools);
    return rc;
}

int moe_cmd_template(int argc, char **argv) {
    const char *path = NULL, *messages_path = NULL, *tools_path = NULL, *kwargs = NULL;
    const char *parse_format = NULL;
    bool generation_prompt = true, parse = false, reasoning_open = false;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        bool has_value = i + 1 < argc;
        if (!strcmp(a, "--messages") && has_value)
            messages_path = argv[++i];
        else if (!strcmp(a, "--tools") && has_value)
            tools_path = argv[++i];
        else if (!strcmp(a, "--kwargs") && has_value)
            kwargs = argv[++i];
        else if (!strcmp(a, "--no-generation-prompt"))
            generation_prompt = false;
        else if (!strcmp(a, "--generation-prompt"))
            generation_prompt = true;
        else if (!strcmp(a, "--reasoning-open"))
            reasoning_open = true;
        else if (!strcmp(a, "--parse") && has_value) {
            parse = true;
            parse_format = argv[++i];
        } else if (a[0] == '-' && a[1])
            return moe_cli_unknown_option("template", a);
        else if (!path)
            path = a;
        else
            return moe_cli_usage_error("template", "unexpected argument '%s'", a);
    }
    if (parse) return parse_stdin(parse_format, tools_path, path, reasoning_open);
    if (!path) return moe_cli_usage_error("template", "missing MODEL or FILE.jinja");
    if (!messages_path) return moe_cli_usage_error("template", "missing --messages FILE.json");

    moe_error err = {0};
    int rc = 1;
    char *messages = NULL, *tools = NULL, *out = NULL;
    json_t *kw = NULL;
    moe_chat_template *t = load_template(path, &err);
    if (!t) goto done;
    if (!(messages = read_text(messages_path, &err))) goto done;
    if (tools_path && !(tools = read_text(tools_path, &err))) goto done;
    json_error_t je;
    kw = kwargs ? json_loads(kwargs, 0, &je) : json_object();
    if (!json_is_object(kw)) {
        json_decref(kw);
        kw = NULL;
        rc = moe_cli_usage_error("template", "--kwargs must be a JSON object");
        goto done;
    }
    if (!json_object_get(kw, "add_generation_prompt"))
        json_object_set_new(kw, "add_generation_prompt", json_boolean(generation_prompt));
    char *kw_text = json_dumps(kw, JSON_COMPACT | JSON_PRESERVE_ORDER);
    moe_status st = moe_chat_render(t, messages, tools, kw_text, &out, &err);
    free(kw_text);
    if (st != MOE_OK) goto done;
    fwrite(out, 1, strlen(out), stdout);
    rc = 0;
done:
    if (rc == 1 && err.code) fprintf(stderr, "moe template: %s\n", err.msg);
    json_decref(kw);
    free(out);
    free(messages);
    free(tools);
    moe_chat_template_free(t);
    return rc;
}
