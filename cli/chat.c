/* chat.c: `moe chat [MODEL]` -- an interactive loop on the terminal, in the model's own chat
 * format: its GGUF chat template (or --chat-template-file, or the built-in ChatML for a model
 * without one), rendered over the whole conversation each turn. The conversation's tokens stay
 * in the context and each turn prefills only from where the new rendering departs from them
 * (moe_ctx_seq_reuse). The trap: a template may render earlier turns differently once the
 * conversation grows (Qwen3 drops old reasoning), so the reusable prefix can end before the last
 * reply; the context is cut back to it rather than assumed to extend. */
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/chat/chat.h"
#include "cli.h"
#include "generate.h"

#define CHAT_LINE_MAX 65536        /* one typed turn */
#define CHATML_END    "<|im_end|>" /* the built-in template's end of turn, when it is only text */

static moe_chat_template *chat_template(const moe_gen *g, const char *file, bool *builtin,
                                        moe_error *err) {
    *builtin = false;
    if (file) return moe_chat_template_load_file(file, err);
    moe_chat_template *t = moe_chat_template_from_gguf(g->model->gguf, NULL, err);
    if (t || err->code != MOE_ERR_NOT_FOUND) return t;
    *err = (moe_error){0};
    *builtin = true;
    return moe_chat_template_parse(moe_chat_template_chatml, strlen(moe_chat_template_chatml), err);
}

static void add_message(json_t *messages, const char *role, const char *content) {
    json_t *m = json_object();
    json_object_set_new(m, "role", json_string(role));
    json_object_set_new(m, "content", json_string(content));
    json_array_append_new(messages, m);
}

/* One turn: render the conversation, prefill what the cache lacks, generate the reply. */
static bool chat_turn(moe_gen *g, const moe_chat_template *t, json_t *messages, bool builtin,
                      bool verbose, moe_error *err) {
    char *msgs = json_dumps(messages, JSON_COMPACT);
    char *prompt = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    moe_status st = moe_chat_render_tokens(
        t, g->tok, msgs, NULL, "{\"add_generation_prompt\":true}", &prompt, NULL, &ids, &n, err);
    free(msgs);
    if (st != MOE_OK) return false;
    if (verbose) fprintf(stderr, "[prompt: %zu tokens]\n%s\n[/prompt]\n", n, prompt);
    free(prompt);
    /* the cache keeps what it can of the conversation so far (n - 1: the last prompt token
     * runs again for its logits) */
    uint32_t same = 0;
    bool ok = moe_ctx_seq_reuse(g->ctx, 0, ids, n ? (uint32_t)n - 1 : 0, &same, err) == MOE_OK &&
              moe_gen_prefill(g, ids + same, n - same, err) &&
              moe_gen_run(g, g->opt.n_predict, builtin ? CHATML_END : NULL, err);
    free(ids);
    if (!ok) return false;
    size_t len = g->reply_len, end = strlen(CHATML_END);
    if (builtin && len >= end && memcmp(g->reply + len - end, CHATML_END, end) == 0) len -= end;
    json_t *m = json_object();
    json_object_set_new(m, "role", json_string("assistant"));
    json_object_set_new(m, "content", json_stringn(g->reply, len));
    json_array_append_new(messages, m);
    return true;
}

typedef struct chat_args {
    const char *system, *template_file;
    bool verbose;
} chat_args;

static const moe_cli_option chat_options[] = {
    {"--system", NULL, "TEXT", "a system message first", MOE_OPT_STRING,
     MOE_OPT_FIELD(chat_args, system), 0, 0, NULL},
    {"--chat-template-file", NULL, "F.jinja",
     "render with this template (default: the model's, or built-in ChatML)", MOE_OPT_STRING,
     MOE_OPT_FIELD(chat_args, template_file), 0, 0, NULL},
    {"--verbose-prompt", NULL, NULL, "show each rendered prompt on stderr", MOE_OPT_SWITCH,
     MOE_OPT_FIELD(chat_args, verbose), 0, 0, NULL},
};
#define N_CHAT_OPTIONS (sizeof chat_options / sizeof chat_options[0])

static void chat_defaults(moe_gen_options *o) {
    moe_gen_options_default(o);
    o->n_predict = -1;
}

void moe_cmd_chat_options(FILE *out) {
    moe_gen_options d;
    chat_defaults(&d);
    moe_cli_options_print(out, chat_options, N_CHAT_OPTIONS, NULL);
    moe_gen_print_options(out, &d);
}

int moe_cmd_chat(int argc, char **argv) {
    moe_gen_options o;
    chat_defaults(&o);
    chat_args ca = {0};
    for (int i = 0; i < argc; i++) {
        int r = moe_gen_parse_option("chat", &o, argc, argv, &i);
        if (!r) r = moe_cli_option_parse("chat", chat_options, N_CHAT_OPTIONS, &ca, argc, argv, &i);
        if (r < 0) return 2;
        if (r > 0) continue;
        if (argv[i][0] == '-')
            return moe_cli_unknown_option("chat", argv[i]);
        else if (!o.model_path)
            o.model_path = argv[i];
        else
            return moe_cli_usage_error("chat", "unexpected argument '%s'", argv[i]);
    }
    const char *system = ca.system, *template_file = ca.template_file;
    const bool verbose = ca.verbose;
    moe_gen g;
    if (!moe_engine_args_check("chat", &o.engine)) return 2;
    if (!moe_gen_open(&g, &o, "chat")) return 1;
    moe_error err = {0};
    if (moe_dist_rank() != 0) {  /* under mpirun: rank 0 chats, this rank runs its steps */
        signal(SIGINT, SIG_IGN); /* Ctrl-C is rank 0's to read (mpirun hands it to every rank) */
        const moe_status st = moe_ctx_follow(g.ctx, &err);
        if (st != MOE_OK) fprintf(stderr, "moe chat: rank %d: %s\n", moe_dist_rank(), err.msg);
        moe_gen_close(&g);
        return st == MOE_OK ? 0 : 1;
    }
    moe_ctx_lead(g.ctx); /* with a split: the other ranks replay its calls; freeing stops them */
    bool builtin;
    moe_chat_template *t = chat_template(&g, template_file, &builtin, &err);
    if (!t) {
        fprintf(stderr, "moe chat: %s\n", err.msg);
        moe_gen_close(&g);
        return 1;
    }
    fprintf(stderr,
            "moe chat: ready (loaded in %.2f s), chat template %s; type a message and press "
            "enter; Ctrl-C stops a reply; an empty line, end of input or Ctrl-C at the prompt "
            "quits.\n",
            g.load_seconds,
            template_file ? template_file
            : builtin     ? "built-in ChatML"
                          : "from the model");
    json_t *messages = json_array();
    if (system) add_message(messages, "system", system);
    char *line = moe_xmalloc(CHAT_LINE_MAX);
    int rc = 0;
    moe_gen_catch_interrupt(); /* Ctrl-C: ends the reply being written; at the prompt, the chat */
    for (;;) {
        fprintf(stderr, "> ");
        moe_gen_interrupted = 0;
        if (!fgets(line, CHAT_LINE_MAX, stdin)) break;
        line[strcspn(line, "\n")] = '\0';
        if (!line[0]) break;
        add_message(messages, "user", line);
        if (!chat_turn(&g, t, messages, builtin, verbose, &err)) {
            fprintf(stderr, "\nmoe chat: %s\n", err.msg);
            rc = 1;
            break;
        }
        printf("\n");
        fflush(stdout);
        if (g.interrupted) fprintf(stderr, "[stopped: Ctrl-C again at the prompt quits]\n");
    }
    moe_gen_print_stats(&g);
    free(line);
    json_decref(messages);
    moe_chat_template_free(t);
    moe_gen_close(&g);
    return rc;
}
