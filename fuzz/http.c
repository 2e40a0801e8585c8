/* fuzz/http.c: libFuzzer entry for the request parsers of `moe serve` -- the JSON body of each
 * API (OpenAI chat and completions, Responses, Anthropic messages and count_tokens, and
 * /apply-template) through the same handler a live request reaches: body, sampling fields,
 * messages, tools, template kwargs, chat template, tokenizer, up to the scheduler, which here
 * refuses every submission (serve_sched_offline: no engine).
 *
 * The first byte picks the endpoint, the rest is the body. Every input must be answered, with
 * 200 (the endpoints that do not generate), a 4xx, or the refused submission's 503 (529 in
 * Anthropic's shape) -- never a 500, a crash, a leak or a sanitizer report -- and every answer
 * must be valid JSON. MOE_FUZZ_VERBOSE=1 prints each answer (to see what the seeds reach).
 * The tokenizer and chat template are stories260K's (../shared, or MOE_FUZZ_MODEL), loaded once.
 * Build and run: `make fuzz-http`. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/serve/serve_internal.h"

static serve_server *srv;

static const struct endpoint {
    const char *path;
    void (*fn)(serve_http *h);
} endpoints[] = {
    {"/v1/chat/completions", serve_openai_chat},
    {"/v1/completions", serve_openai_completions},
    {"/v1/responses", serve_openai_responses},
    {"/v1/messages", serve_anthropic_messages},
    {"/v1/messages/count_tokens", serve_anthropic_count_tokens},
    {"/apply-template", serve_openai_apply_template},
};
#define N_ENDPOINTS (sizeof endpoints / sizeof endpoints[0])

static serve_server *server_new(void) {
    const char *path = getenv("MOE_FUZZ_MODEL");
    if (!path) path = "../shared/models/stories260K/stories260K.gguf";
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(path, &err);
    moe_tokenizer *tok = g ? moe_tokenizer_from_gguf(g, &err) : NULL;
    if (g) moe_gguf_close(g);
    if (!tok) {
        fprintf(stderr, "fuzz/http: no tokenizer from %s (%s); set MOE_FUZZ_MODEL\n", path,
                err.msg);
        exit(1);
    }
    serve_server *s = moe_xcalloc(1, sizeof *s);
    moe_serve_params_default(&s->p);
    s->p.model_path = path;
    pthread_mutex_init(&s->metrics.mu, NULL);
    atomic_init(&s->next_id, 1);
    snprintf(s->model_id, sizeof s->model_id, "fuzz");
    char msg[MOE_ERROR_MSG_MAX + 128];
    if (!serve_template_load(s, msg, sizeof msg)) {
        fprintf(stderr, "fuzz/http: %s\n", msg);
        exit(1);
    }
    s->sched = serve_sched_offline(tok, 4096);
    return s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!srv) srv = server_new();
    if (size < 1) return 0;
    const struct endpoint *e = &endpoints[data[0] % N_ENDPOINTS];
    moe_strbuf reply = {0};
    serve_http h = {.srv = srv,
                    .method = "POST",
                    .path = e->path,
                    .body = (const char *)data + 1,
                    .body_len = size - 1,
                    .offline_reply = &reply};
    e->fn(&h);
    const bool expected = h.status == 200 || (h.status >= 400 && h.status < 500) ||
                          h.status == 503 || h.status == 529;
    if (!h.replied || !expected) {
        fprintf(stderr, "fuzz/http: %s answered %d (replied %d): %.*s\n", e->path, h.status,
                (int)h.replied, (int)reply.len, reply.s ? reply.s : "");
        abort();
    }
    if (getenv("MOE_FUZZ_VERBOSE")) /* what each seed reached */
        fprintf(stderr, "%s %d %.*s\n", e->path, h.status, (int)(reply.len < 160 ? reply.len : 160),
                reply.s);
    json_error_t je;
    json_t *j = json_loadb(reply.s, reply.len, JSON_ALLOW_NUL, &je);
    if (!j) {
        fprintf(stderr, "fuzz/http: %s answered invalid JSON (%s): %.*s\n", e->path, je.text,
                (int)reply.len, reply.s);
        abort();
    }
    json_decref(j);
    moe_strbuf_free(&reply);
    return 0;
}
