/* generate.c: load + prefill + sample + stream, shared by `moe run` and `moe chat`. */
#include "generate.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../src/chat/chat.h"
#include "args.h"
#include "cli.h"

#define PREFILL_CHUNK 256 /* rows per prefill forward call: bounds scratch, keeps batches big */

void moe_gen_options_default(moe_gen_options *o) {
    memset(o, 0, sizeof *o);
    o->n_predict = 128;
    o->n_draft = 3;
    o->engine = (moe_engine_args){.n_threads = moe_cpu_cores(), .kv_type = MOE_TYPE_F16};
    o->sampling = (moe_sampler_params){.temperature = 0.8f,
                                       .top_k = 40,
                                       .top_p = 0.95f,
                                       .min_p = 0.05f,
                                       .repeat_penalty = 1.0f,
                                       .penalty_last_n = 64,
                                       .seed = 0xC0FFEE};
}

/* ==== The options of run and chat: one table, parsed and listed from the same rows ==== */

#define GEN(field) MOE_OPT_FIELD(moe_gen_options, field)
static const char *const spec_kinds[] = {
    [MOE_SPEC_NONE] = "none", [MOE_SPEC_NGRAM] = "ngram", [MOE_SPEC_MTP] = "mtp", NULL};
static const moe_cli_option gen_options[] = {
    {"--n-predict", "-n", "N", "tokens to generate (-1: until end of generation or context)",
     MOE_OPT_INT, GEN(n_predict), -1, 1 << 30, NULL},
    {"--temp", NULL, "T", "temperature (0: greedy)", MOE_OPT_FLOAT, GEN(sampling.temperature), 0,
     100, NULL},
    {"--top-k", NULL, "K", "sample among the K likeliest (0: off)", MOE_OPT_INT,
     GEN(sampling.top_k), 0, 1 << 30, NULL},
    {"--top-p", NULL, "P", "nucleus: the likeliest tokens up to mass P (1: off)", MOE_OPT_FLOAT,
     GEN(sampling.top_p), 0, 1, NULL},
    {"--min-p", NULL, "P", "drop tokens below P times the likeliest (0: off)", MOE_OPT_FLOAT,
     GEN(sampling.min_p), 0, 1, NULL},
    {"--repeat-penalty", NULL, "X", "divide recent tokens' positive logits by X (1: off)",
     MOE_OPT_FLOAT, GEN(sampling.repeat_penalty), 0, 100, NULL},
    {"--presence-penalty", NULL, "X", "subtract X once from every recent token's logit",
     MOE_OPT_FLOAT, GEN(sampling.presence_penalty), -2, 2, NULL},
    {"--frequency-penalty", NULL, "X", "subtract X per occurrence of a recent token", MOE_OPT_FLOAT,
     GEN(sampling.frequency_penalty), -2, 2, NULL},
    {"--repeat-last-n", NULL, "N", "the recent tokens the penalties look at", MOE_OPT_INT,
     GEN(sampling.penalty_last_n), 0, 8192, NULL},
    {"--seed", NULL, "S", "sampling seed", MOE_OPT_INT, GEN(sampling.seed), 0, INT64_MAX, NULL},
    {"--spec", NULL, "ngram|mtp|none",
     "speculative decoding: drafts from earlier text (ngram) or the model's MTP head",
     MOE_OPT_CHOICE, GEN(spec), 0, 0, spec_kinds},
    {"--draft", NULL, "N", "drafted tokens per step with --spec", MOE_OPT_INT, GEN(n_draft), 1,
     MOE_GEN_MAX_DRAFT, NULL},
    {"--print-ids", NULL, NULL, "show token ids instead of text", MOE_OPT_SWITCH, GEN(print_ids), 0,
     0, NULL},
    {"--ignore-eos", NULL, NULL, "keep going past end-of-generation tokens", MOE_OPT_SWITCH,
     GEN(ignore_eos), 0, 0, NULL},
    {"--grammar-file", NULL, "F.gbnf", "constrain the output to this GBNF grammar", MOE_OPT_STRING,
     GEN(grammar_file), 0, 0, NULL},
};
#undef GEN

int moe_gen_parse_option(const char *cmd, moe_gen_options *o, int argc, char **argv, int *i) {
    if (strcmp(argv[*i], "--spec") == 0) o->spec_given = true; /* else: mtp where there is one */
    const int r = moe_cli_option_parse(cmd, gen_options, sizeof gen_options / sizeof gen_options[0],
                                       o, argc, argv, i);
    return r ? r : moe_engine_args_parse(cmd, &o->engine, argc, argv, i);
}

void moe_gen_print_options(FILE *out, const moe_gen_options *defaults) {
    moe_cli_options_print(out, gen_options, sizeof gen_options / sizeof gen_options[0], defaults);
    moe_engine_args_print(out, &defaults->engine);
}

bool moe_gen_open(moe_gen *g, const moe_gen_options *o, const char *cmd) {
    memset(g, 0, sizeof *g);
    g->opt = *o;
    g->tty = isatty(1);
    moe_error err = {0};
    const double t0 = moe_now();
    char *path = moe_arg_model_path(cmd, o->model_path);
    if (!path) return false;
    g->model = moe_model_load(path, &err);
    static char label[48]; /* outlives the read: the progress lines' */
    snprintf(label, sizeof label, "moe %s", cmd);
    if (g->model) moe_gguf_set_progress(g->model->gguf, label);
    if (g->model && o->engine.expert_cache_bytes) /* the rest resident, the experts on demand */
        moe_gguf_to_memory_except(g->model->gguf, NULL, moe_model_is_routed, g->model, NULL, &err);
    if (g->model && !err.code && !moe_engine_args_repack(cmd, g->model, &o->engine))
        moe_error_set(&err, MOE_ERR_UNSUPPORTED, "cannot repack the weights (--no-repack)");
    if (g->model && !err.code) g->tok = moe_tokenizer_from_gguf(g->model->gguf, &err);
    if (g->tok && moe_tokenizer_n_vocab(g->tok) != g->model->cfg.n_vocab)
        moe_error_set(&err, MOE_ERR_FORMAT, "%s: the vocabulary has %u tokens but the model %u",
                      path, moe_tokenizer_n_vocab(g->tok), g->model->cfg.n_vocab);
    if (!err.code && !o->spec_given && g->model->n_layer_mtp) g->opt.spec = MOE_SPEC_MTP;
    if (!err.code) {
        moe_ctx_params cp = {.n_ctx = o->engine.n_ctx,
                             .n_seq = 1,
                             .max_rows = PREFILL_CHUNK,
                             .kv_type = o->engine.kv_type,
                             .expert_cache_bytes = o->engine.expert_cache_bytes,
                             .expert_stats = o->engine.expert_stats,
                             .pin_experts = o->engine.pin_experts,
                             .split = o->engine.split,
                             .split_dense = o->engine.split_dense,
                             .n_threads = o->engine.n_threads,
                             .n_verify = g->opt.spec ? o->n_draft + 1 : 0};
        g->ctx = moe_ctx_new(g->model, &cp, &err);
        moe_ctx_memory mem;
        if (g->ctx && moe_ctx_memory_plan(g->model, &cp, &mem, &err) == MOE_OK)
            fprintf(stderr,
                    "moe %s: state: KV %.2f MiB (%.1f KiB per token), recurrent %.2f MiB "
                    "(%.1f KiB per sequence), snapshots %.2f MiB\n",
                    cmd, mem.kv_bytes / 1048576.0, mem.kv_bytes_per_token / 1024.0,
                    mem.recurrent_bytes / 1048576.0, mem.recurrent_bytes_per_seq / 1024.0,
                    mem.snapshot_bytes / 1048576.0);
    }
    if (!err.code && g->opt.spec == MOE_SPEC_MTP && !g->model->n_layer_mtp)
        moe_error_set(&err, MOE_ERR_UNSUPPORTED,
                      "--spec mtp: %s has no multi-token-prediction layer moe can run "
                      "(--spec ngram drafts without one)",
                      path);
    free(path);
    if (err.code) {
        fprintf(stderr, "moe %s: %s\n", cmd, err.msg);
        moe_gen_close(g);
        return false;
    }
    const uint32_t n_vocab = g->model->cfg.n_vocab;
    moe_sampler_params sp = o->sampling;
    if (o->grammar_file) {
        char *src = moe_cli_read_grammar(cmd, o->grammar_file);
        if (src) g->grammar = moe_grammar_parse(src, strlen(src), NULL, &err);
        free(src);
        if (!g->grammar) {
            moe_gen_close(g);
            return false;
        }
        g->grammar_vocab = moe_chat_grammar_vocab(g->tok, false); /* follows the prompt */
        sp.grammar = g->grammar;
        sp.grammar_vocab = g->grammar_vocab;
    }
    g->sampler = moe_sampler_new(&sp, n_vocab);
    g->logits = moe_xmalloc(sizeof(float) * n_vocab);
    g->verify = moe_xmalloc(sizeof(float) * (o->n_draft + 1) * n_vocab);
    g->hist = moe_xmalloc(sizeof(int32_t) * (moe_ctx_n_ctx(g->ctx) + 1));
    g->rows = moe_xmalloc(sizeof(moe_row) * PREFILL_CHUNK);
    if (g->opt.spec == MOE_SPEC_MTP) {
        const uint32_t pending = PREFILL_CHUNK + o->n_draft + 1; /* a step's rows, then a chunk */
        g->mtp_h = moe_xmalloc(sizeof(float) * pending * g->model->cfg.n_embd);
        g->mtp_tok = moe_xmalloc(sizeof(int32_t) * pending);
        g->mtp_logits = moe_xmalloc(sizeof(float) * n_vocab);
    }
    g->load_seconds = moe_now() - t0;
    return true;
}

static void reply_put(moe_gen *g, const char *text, size_t len) {
    if (g->reply_cap - g->reply_len < len + 1) {
        g->reply_cap = 2 * (g->reply_len + len + 1);
        g->reply = moe_xrealloc(g->reply, g->reply_cap);
    }
    memcpy(g->reply + g->reply_len, text, len);
    g->reply_len += len;
    g->reply[g->reply_len] = '\0';
}

void moe_gen_close(moe_gen *g) {
    free(g->reply);
    moe_sampler_free(g->sampler);
    moe_grammar_free(g->grammar);
    moe_grammar_vocab_free(g->grammar_vocab);
    moe_ctx_free(g->ctx);
    moe_tokenizer_free(g->tok);
    moe_model_free(g->model);
    free(g->logits);
    free(g->verify);
    free(g->hist);
    free(g->rows);
    free(g->mtp_h);
    free(g->mtp_tok);
    free(g->mtp_logits);
    memset(g, 0, sizeof *g);
}

void moe_gen_reset(moe_gen *g) {
    moe_error err = {0};
    MOE_CHECK(moe_ctx_seq_truncate(g->ctx, 0, 0, &err) == MOE_OK); /* 0 always works */
    moe_sampler_reset(g->sampler);
    g->mtp_pending = 0;
    g->text_started = false;
    g->n_prompt = g->n_generated = g->n_steps = 0;
    memset(g->drafted, 0, sizeof g->drafted);
    memset(g->accepted, 0, sizeof g->accepted);
    g->prompt_seconds = g->gen_seconds = 0;
}

/* --spec mtp: the last call's first n rows (fed ids[0..n)) join the hidden states the MTP cache
 * lacks; all but the newest, whose follower is not known yet, are fed to it now. */
static bool mtp_take(moe_gen *g, const int32_t *ids, uint32_t n, moe_error *err) {
    const uint32_t n_embd = g->model->cfg.n_embd;
    uint32_t n_h;
    const float *h = moe_ctx_hidden(g->ctx, &n_h);
    if (g->mtp_pending) g->mtp_tok[g->mtp_pending - 1] = ids[0];
    memcpy(g->mtp_h + (size_t)g->mtp_pending * n_embd, h, sizeof(float) * n * n_embd);
    for (uint32_t i = 0; i + 1 < n; i++) g->mtp_tok[g->mtp_pending + i] = ids[i + 1];
    g->mtp_pending += n;
    const uint32_t ready = g->mtp_pending - 1;
    if (ready &&
        !moe_draft_mtp(g->ctx, 0, g->mtp_h, g->mtp_tok, ready, 0, NULL, g->mtp_logits, err) &&
        err->code)
        return false;
    memmove(g->mtp_h, g->mtp_h + (size_t)ready * n_embd, sizeof(float) * n_embd);
    g->mtp_pending = 1;
    return true;
}

bool moe_gen_prefill(moe_gen *g, const int32_t *ids, size_t n, moe_error *err) {
    const double t0 = moe_now();
    for (size_t done = 0; done < n;) {
        uint32_t chunk = n - done < PREFILL_CHUNK ? (uint32_t)(n - done) : PREFILL_CHUNK;
        const uint32_t base = moe_ctx_seq_len(g->ctx, 0);
        for (uint32_t r = 0; r < chunk; r++) {
            g->rows[r] = (moe_row){.seq = 0,
                                   .pos = (int32_t)(base + r),
                                   .token = ids[done + r],
                                   .logits = done + r + 1 == n};
            moe_sampler_accept(g->sampler, ids[done + r]);
        }
        if (moe_ctx_decode(g->ctx, g->rows, chunk, g->logits, err) != MOE_OK) return false;
        if (g->opt.spec == MOE_SPEC_MTP && !mtp_take(g, ids + done, chunk, err)) return false;
        done += chunk;
    }
    g->n_prompt += n;
    g->prompt_seconds += moe_now() - t0;
    return true;
}

/* ==== Ctrl-C and the terminal ==== */

volatile sig_atomic_t moe_gen_interrupted;

static void on_interrupt(int sig) {
    (void)sig;
    moe_gen_interrupted = 1;
}

void moe_gen_catch_interrupt(void) {
    struct sigaction sa = {.sa_handler = on_interrupt}; /* no SA_RESTART: a read at a prompt
                                                         * returns EINTR */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
}

/* Model text on stdout: on a terminal, control characters (but newline and tab) are shown as
 * \xNN, so a model cannot move the cursor, retitle the window or ring the bell; into a file or
 * pipe the bytes go as they are. */
static void show(const moe_gen *g, const char *text, size_t len) {
    if (g->opt.quiet) return;
    if (!g->tty) {
        fwrite(text, 1, len, stdout);
        return;
    }
    for (size_t i = 0; i < len; i++) {
        const unsigned char c = (unsigned char)text[i];
        if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f)
            printf("\\x%02x", c);
        else
            putchar(c);
    }
}

/* What became of a token the sampler chose. */
typedef enum { EMIT_ON, EMIT_END, EMIT_ERROR } emit_result;

typedef struct emitter {
    moe_detok *detok;
    const char *stop;
    size_t stop_len;
    char tail[256]; /* the last bytes of output, to match `stop` across pieces */
    size_t tail_len;
} emitter;

/* Show a chosen token; EMIT_END at end of generation or when the text now ends with `stop`. */
static emit_result emit(moe_gen *g, emitter *e, int32_t token, moe_error *err) {
    if (moe_tokenizer_is_eog(g->tok, token) && !g->opt.ignore_eos) return EMIT_END;
    g->n_generated++;
    if (g->opt.print_ids) {
        printf(",%d", token);
        fflush(stdout);
        return EMIT_ON;
    }
    const char *text;
    size_t len;
    if (moe_detok_push(e->detok, token, &text, &len, err) != MOE_OK) return EMIT_ERROR;
    show(g, text, len);
    fflush(stdout);
    reply_put(g, text, len);
    if (!e->stop_len || e->stop_len >= sizeof e->tail) return EMIT_ON;
    for (size_t k = 0; k < len; k++) {
        if (e->tail_len == sizeof e->tail - 1) memmove(e->tail, e->tail + 1, --e->tail_len);
        e->tail[e->tail_len++] = text[k];
    }
    return e->tail_len >= e->stop_len &&
                   memcmp(e->tail + e->tail_len - e->stop_len, e->stop, e->stop_len) == 0
               ? EMIT_END
               : EMIT_ON;
}

/* Feed `token` and, with --spec, the drafts that follow it, then choose what comes next.
 * The sampler picks from each verify row in turn exactly as it would one step at a time; a draft
 * is kept while it equals the pick (for a draft that is one token, not a distribution, this is
 * the accept/reject rule: the output is the one plain decoding makes, at any temperature). The
 * first pick that differs is returned in *next (the step it came from is kept), else *next is
 * -1 and g->logits is the row after the last draft. */
static emit_result step(moe_gen *g, emitter *e, int32_t token, int64_t budget, int32_t *next,
                        moe_error *err) {
    moe_ctx *c = g->ctx;
    const uint32_t len = moe_ctx_seq_len(c, 0), n_vocab = g->model->cfg.n_vocab;
    int32_t drafts[MOE_GEN_MAX_DRAFT];
    uint32_t n_draft = 0, room = moe_ctx_n_ctx(c) - len - 1;
    uint32_t want = g->opt.n_draft < room ? g->opt.n_draft : room;
    if (budget >= 0 && budget <= 1) want = 0;
    if (budget > 1 && (uint64_t)budget - 1 < want) want = (uint32_t)(budget - 1);
    if (g->opt.spec == MOE_SPEC_NGRAM && want) {
        memcpy(g->hist, moe_ctx_seq_tokens(c, 0), sizeof(int32_t) * len);
        g->hist[len] = token;
        n_draft = moe_draft_ngram(g->hist, len + 1, want, drafts);
    } else if (g->opt.spec == MOE_SPEC_MTP && g->mtp_pending && want) { /* catch up, draft */
        g->mtp_tok[g->mtp_pending - 1] = token;
        n_draft = moe_draft_mtp(c, 0, g->mtp_h, g->mtp_tok, g->mtp_pending, want, drafts,
                                g->mtp_logits, err);
        if (!n_draft && err->code) return EMIT_ERROR;
        g->mtp_pending = 0;
    }
    *next = -1;
    g->n_steps++;
    moe_row rows[MOE_GEN_MAX_DRAFT + 1];
    rows[0] = (moe_row){0, (int32_t)len, token, true};
    if (!n_draft) {
        if (moe_ctx_decode(c, rows, 1, g->logits, err) != MOE_OK) return EMIT_ERROR;
        return g->opt.spec != MOE_SPEC_MTP || mtp_take(g, &token, 1, err) ? EMIT_ON : EMIT_ERROR;
    }
    for (uint32_t i = 0; i < n_draft; i++)
        rows[i + 1] = (moe_row){0, (int32_t)(len + 1 + i), drafts[i], true};
    if (moe_ctx_verify(c, rows, n_draft + 1, g->verify, err) != MOE_OK) return EMIT_ERROR;
    uint32_t kept = 0; /* drafts kept */
    emit_result r = EMIT_ON;
    while (kept < n_draft) {
        g->drafted[kept]++;
        const int32_t pick =
            moe_sampler_sample(g->sampler, g->verify + (size_t)kept * n_vocab).token;
        if (pick != drafts[kept]) {
            *next = pick;
            break;
        }
        g->accepted[kept]++;
        r = emit(g, e, pick, err);
        if (r != EMIT_ON) break; /* as plain decoding, a token that ends generation is not fed */
        kept++;
    }
    if (g->opt.spec == MOE_SPEC_MTP) { /* the kept rows' states: fed to the head next step */
        const uint32_t n_embd = g->model->cfg.n_embd;
        uint32_t n_h;
        memcpy(g->mtp_h, moe_ctx_hidden(c, &n_h), sizeof(float) * (kept + 1) * n_embd);
        memcpy(g->mtp_tok, drafts, sizeof(int32_t) * kept);
        g->mtp_pending = kept + 1;
    }
    if (kept < n_draft && moe_ctx_seq_accept(c, 0, kept + 1, err) != MOE_OK) return EMIT_ERROR;
    if (kept == n_draft)
        memcpy(g->logits, g->verify + (size_t)n_draft * n_vocab, sizeof(float) * n_vocab);
    return r;
}

bool moe_gen_run(moe_gen *g, int64_t n_predict, const char *stop, moe_error *err) {
    const double t0 = moe_now();
    /* the first piece after BOS carries SentencePiece's dummy-prefix space: drop it */
    emitter e = {
        .detok = moe_detok_new(g->tok, MOE_DECODE_SKIP_SPECIAL |
                                           (g->text_started ? 0 : MOE_DECODE_STRIP_PREFIX_SPACE)),
        .stop = stop,
        .stop_len = stop ? strlen(stop) : 0};
    g->text_started = true;
    g->reply_len = 0;
    moe_grammar_state *grammar = moe_sampler_grammar(g->sampler);
    if (grammar) moe_grammar_state_reset(grammar); /* each reply is a sentence of its own */
    reply_put(g, "", 0);
    const uint64_t start = g->n_generated;
    int32_t next = -1; /* a token already picked by the last step */
    emit_result r = EMIT_ON;
    g->interrupted = false;
    while (r == EMIT_ON && (n_predict < 0 || (int64_t)(g->n_generated - start) < n_predict)) {
        if (moe_gen_interrupted) { /* Ctrl-C: this reply ends here */
            moe_gen_interrupted = 0;
            g->interrupted = true;
            break;
        }
        if (moe_ctx_seq_len(g->ctx, 0) >= moe_ctx_n_ctx(g->ctx)) {
            fprintf(stderr, "\n[context full: %u tokens]\n", moe_ctx_n_ctx(g->ctx));
            break;
        }
        const int32_t token = next >= 0 ? next : moe_sampler_sample(g->sampler, g->logits).token;
        r = emit(g, &e, token, err);
        if (r != EMIT_ON) break;
        const int64_t left = n_predict < 0 ? -1 : n_predict - (int64_t)(g->n_generated - start);
        r = step(g, &e, token, left, &next, err);
    }
    if (!g->opt.print_ids) {
        size_t len;
        const char *rest = moe_detok_flush(e.detok, &len);
        show(g, rest, len);
        reply_put(g, rest, len);
    }
    fflush(stdout);
    moe_detok_free(e.detok);
    g->gen_seconds += moe_now() - t0;
    return r != EMIT_ERROR;
}

void moe_gen_print_stats(const moe_gen *g) {
    fprintf(
        stderr,
        "\nprompt: %llu tokens, %.1f tok/s | generated: %llu tokens, %.1f tok/s | load: %.0f ms\n",
        (unsigned long long)g->n_prompt,
        g->prompt_seconds > 0 ? (double)g->n_prompt / g->prompt_seconds : 0.0,
        (unsigned long long)g->n_generated,
        g->gen_seconds > 0 ? (double)g->n_generated / g->gen_seconds : 0.0, g->load_seconds * 1e3);
    const moe_expert_cache_stats cs = moe_ctx_expert_cache_stats(g->ctx);
    if (cs.slots) {
        const uint64_t acquired = cs.hits + cs.misses, tokens = g->n_prompt + g->n_generated;
        fprintf(stderr,
                "expert cache: %u experts of %.2f MiB, hit rate %.1f%%, %.1f MiB read from disk "
                "(%.2f MiB per token) at %.0f MiB/s%s, %.0f ms waiting for it\n",
                cs.slots, (double)cs.slot_bytes / 1048576.0,
                acquired ? 100.0 * (double)cs.hits / (double)acquired : 0.0,
                (double)cs.bytes_read / 1048576.0,
                tokens ? (double)cs.bytes_read / 1048576.0 / (double)tokens : 0.0,
                cs.busy_seconds > 0 ? (double)cs.bytes_read / 1048576.0 / cs.busy_seconds : 0.0,
                cs.direct ? " (O_DIRECT)" : "", cs.read_seconds * 1e3);
    }
    if (!g->opt.spec || !g->n_steps) return;
    fprintf(stderr, "spec %s: %.2f tokens per step, drafts accepted by position:",
            g->opt.spec == MOE_SPEC_MTP ? "mtp" : "ngram",
            (double)g->n_generated / (double)g->n_steps);
    for (uint32_t i = 0; i < g->opt.n_draft && g->drafted[i]; i++)
        fprintf(stderr, " %.0f%% of %llu", 100.0 * (double)g->accepted[i] / (double)g->drafted[i],
                (unsigned long long)g->drafted[i]);
    fputc('\n', stderr);
}
