/* generate.c: load + prefill + sample + stream, shared by `moe run` and `moe chat`. */
#include "generate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "args.h"
#include "cli.h"

#define PREFILL_CHUNK 256 /* rows per prefill forward call: bounds scratch, keeps batches big */

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void moe_gen_options_default(moe_gen_options *o) {
    memset(o, 0, sizeof *o);
    o->n_predict = 128;
    o->engine = (moe_engine_args){.n_threads = 1, .kv_type = MOE_TYPE_F16};
    o->sampling = (moe_sampler_params){.temperature = 0.8f,
                                       .top_k = 40,
                                       .top_p = 0.95f,
                                       .min_p = 0.05f,
                                       .repeat_penalty = 1.0f,
                                       .penalty_last_n = 64,
                                       .seed = 0xC0FFEE};
}

int moe_gen_parse_option(const char *cmd, moe_gen_options *o, int argc, char **argv, int *i) {
    const char *a = argv[*i];
    const char *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    long long n;
    double f;
#define TAKE_INT(flag, lo, hi, dst)                                                                \
    if (strcmp(a, flag) == 0) {                                                                    \
        if (!moe_arg_int(cmd, flag, v, lo, hi, &n)) return -1;                                     \
        dst = n;                                                                                   \
        ++*i;                                                                                      \
        return 1;                                                                                  \
    }
#define TAKE_FLOAT(flag, lo, hi, dst)                                                              \
    if (strcmp(a, flag) == 0) {                                                                    \
        if (!moe_arg_float(cmd, flag, v, lo, hi, &f)) return -1;                                   \
        dst = (float)f;                                                                            \
        ++*i;                                                                                      \
        return 1;                                                                                  \
    }
    TAKE_INT("-n", -1, 1 << 30, o->n_predict)
    TAKE_INT("--top-k", 0, 1 << 30, o->sampling.top_k)
    TAKE_INT("--repeat-last-n", 0, 8192, o->sampling.penalty_last_n)
    TAKE_INT("--seed", 0, INT64_MAX, o->sampling.seed)
    TAKE_FLOAT("--temp", 0, 100, o->sampling.temperature)
    TAKE_FLOAT("--top-p", 0, 1, o->sampling.top_p)
    TAKE_FLOAT("--min-p", 0, 1, o->sampling.min_p)
    TAKE_FLOAT("--repeat-penalty", 0, 100, o->sampling.repeat_penalty)
    TAKE_FLOAT("--presence-penalty", -2, 2, o->sampling.presence_penalty)
    TAKE_FLOAT("--frequency-penalty", -2, 2, o->sampling.frequency_penalty)
#undef TAKE_INT
#undef TAKE_FLOAT
    const int engine = moe_engine_args_parse(cmd, &o->engine, argc, argv, i);
    if (engine) return engine;
    if (strcmp(a, "--print-ids") == 0) return o->print_ids = true, 1;
    if (strcmp(a, "--ignore-eos") == 0) return o->ignore_eos = true, 1;
    return 0;
}

bool moe_gen_open(moe_gen *g, const moe_gen_options *o, const char *cmd) {
    memset(g, 0, sizeof *g);
    g->opt = *o;
    moe_error err = {0};
    const double t0 = now_seconds();
    char *path = moe_arg_model_path(cmd, o->model_path);
    if (!path) return false;
    g->model = moe_model_load(path, &err);
    if (g->model) g->tok = moe_tokenizer_from_gguf(g->model->gguf, &err);
    if (g->tok && moe_tokenizer_n_vocab(g->tok) != g->model->cfg.n_vocab)
        moe_error_set(&err, MOE_ERR_FORMAT, "%s: the vocabulary has %u tokens but the model %u",
                      path, moe_tokenizer_n_vocab(g->tok), g->model->cfg.n_vocab);
    if (!err.code) {
        moe_ctx_params cp = {.n_ctx = o->engine.n_ctx,
                             .n_seq = 1,
                             .max_rows = PREFILL_CHUNK,
                             .kv_type = o->engine.kv_type,
                             .n_threads = o->engine.n_threads};
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
    free(path);
    if (err.code) {
        fprintf(stderr, "moe %s: %s\n", cmd, err.msg);
        moe_gen_close(g);
        return false;
    }
    const uint32_t n_vocab = g->model->cfg.n_vocab;
    g->sampler = moe_sampler_new(&o->sampling, n_vocab);
    g->logits = moe_xmalloc(sizeof(float) * n_vocab);
    g->rows = moe_xmalloc(sizeof(moe_row) * PREFILL_CHUNK);
    g->load_seconds = now_seconds() - t0;
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
    moe_ctx_free(g->ctx);
    moe_tokenizer_free(g->tok);
    moe_model_free(g->model);
    free(g->logits);
    free(g->rows);
    memset(g, 0, sizeof *g);
}

bool moe_gen_prefill(moe_gen *g, const int32_t *ids, size_t n, moe_error *err) {
    const double t0 = now_seconds();
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
        done += chunk;
    }
    g->n_prompt += n;
    g->prompt_seconds += now_seconds() - t0;
    return true;
}

bool moe_gen_run(moe_gen *g, int64_t n_predict, const char *stop, moe_error *err) {
    const double t0 = now_seconds();
    /* the first piece after BOS carries SentencePiece's dummy-prefix space: drop it */
    moe_detok *detok = moe_detok_new(
        g->tok, MOE_DECODE_SKIP_SPECIAL | (g->text_started ? 0 : MOE_DECODE_STRIP_PREFIX_SPACE));
    g->text_started = true;
    g->reply_len = 0;
    reply_put(g, "", 0);
    const size_t stop_len = stop ? strlen(stop) : 0;
    char tail[256] = {0}; /* the last bytes of output, to match `stop` across pieces */
    size_t tail_len = 0;
    bool ok = true;
    for (int64_t i = 0; n_predict < 0 || i < n_predict; i++) {
        if (moe_ctx_seq_len(g->ctx, 0) >= moe_ctx_n_ctx(g->ctx)) {
            fprintf(stderr, "\n[context full: %u tokens]\n", moe_ctx_n_ctx(g->ctx));
            break;
        }
        const moe_sample s = moe_sampler_sample(g->sampler, g->logits);
        const bool eog = moe_tokenizer_is_eog(g->tok, s.token);
        if (eog && !g->opt.ignore_eos) break;
        g->n_generated++;
        if (g->opt.print_ids) {
            printf(",%d", s.token);
        } else {
            const char *text;
            size_t len;
            if (moe_detok_push(detok, s.token, &text, &len, err) != MOE_OK) {
                ok = false;
                break;
            }
            fwrite(text, 1, len, stdout);
            reply_put(g, text, len);
            if (stop_len && stop_len < sizeof tail) {
                for (size_t k = 0; k < len; k++) {
                    if (tail_len == sizeof tail - 1) memmove(tail, tail + 1, --tail_len);
                    tail[tail_len++] = text[k];
                }
                if (tail_len >= stop_len &&
                    memcmp(tail + tail_len - stop_len, stop, stop_len) == 0) {
                    fflush(stdout);
                    break;
                }
            }
        }
        fflush(stdout);
        moe_row row = {
            .seq = 0, .pos = (int32_t)moe_ctx_seq_len(g->ctx, 0), .token = s.token, .logits = true};
        if (moe_ctx_decode(g->ctx, &row, 1, g->logits, err) != MOE_OK) {
            ok = false;
            break;
        }
    }
    if (!g->opt.print_ids) {
        size_t len;
        const char *rest = moe_detok_flush(detok, &len);
        fwrite(rest, 1, len, stdout);
        reply_put(g, rest, len);
    }
    fflush(stdout);
    moe_detok_free(detok);
    g->gen_seconds += now_seconds() - t0;
    return ok;
}

void moe_gen_print_stats(const moe_gen *g) {
    fprintf(
        stderr,
        "\nprompt: %llu tokens, %.1f tok/s | generated: %llu tokens, %.1f tok/s | load: %.0f ms\n",
        (unsigned long long)g->n_prompt,
        g->prompt_seconds > 0 ? (double)g->n_prompt / g->prompt_seconds : 0.0,
        (unsigned long long)g->n_generated,
        g->gen_seconds > 0 ? (double)g->n_generated / g->gen_seconds : 0.0, g->load_seconds * 1e3);
}
