/* eval.c: `moe eval` -- classification records scored by label probability (through the engine
 * or an OpenAI-compatible server), paired bootstrap comparisons of two result files, and the
 * KL divergence of one model's next-token distribution from a reference model's.
 *
 * Owns the records format, both scorers, the bootstrap and the KL statistics; the command line
 * and the printing live in cli/eval.c. The trap: both scorers must see the same token ids, so
 * prompt and label are tokenized separately (prompt with BOS, label without) -- never the
 * joined text, whose tokens may straddle the boundary -- and the server path asks the server's
 * own /tokenize for them. */
#include "tools.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../chat/chat.h"
#include "../engine/engine.h"
#include "../text/text.h"

/* ==== Records ==== */

static char *options_block(char **labels, char **options, uint32_t n, bool reversed) {
    moe_strbuf b = {0};
    for (uint32_t i = 0; i < n; i++) {
        const char *l = labels[i];
        size_t len = strlen(l);
        while (len && (*l == ' ' || *l == '\t' || *l == '\n')) l++, len--;
        while (len && (l[len - 1] == ' ' || l[len - 1] == '\t' || l[len - 1] == '\n')) len--;
        if (i) moe_strbuf_putc(&b, '\n');
        moe_strbuf_put(&b, l, len);
        moe_strbuf_puts(&b, ". ");
        moe_strbuf_puts(&b, options[reversed ? n - 1 - i : i]);
    }
    return moe_strbuf_take(&b);
}

/* text with every "{options}" replaced by block; *found counts them */
static char *fill_options(const char *text, const char *block, int *found) {
    static const char key[] = "{options}";
    moe_strbuf b = {0};
    const char *p = text, *at;
    while ((at = strstr(p, key))) {
        moe_strbuf_put(&b, p, (size_t)(at - p));
        moe_strbuf_puts(&b, block);
        p = at + sizeof key - 1;
        (*found)++;
    }
    moe_strbuf_puts(&b, p);
    return moe_strbuf_take(&b);
}

static void record_free(moe_eval_record *r) {
    free(r->id);
    free(r->prompt);
    free(r->messages);
    for (uint32_t i = 0; i < r->n_labels; i++) free(r->labels[i]);
    free(r->labels);
}

void moe_eval_records_free(moe_eval_record *r, size_t n) {
    for (size_t i = 0; i < n; i++) record_free(&r[i]);
    free(r);
}

/* The prompt or messages of a record with the options block filled in (reversed or not). */
static moe_status record_fill(moe_eval_record *r, json_t *obj, char **options, bool reversed,
                              const char *where, moe_error *err) {
    char *block = options ? options_block(r->labels, options, r->n_labels, reversed) : NULL;
    int found = 0;
    json_t *prompt = json_object_get(obj, "prompt");
    if (prompt) {
        r->prompt = block ? fill_options(json_string_value(prompt), block, &found)
                          : moe_xstrdup(json_string_value(prompt));
    } else {
        json_t *msgs = json_deep_copy(json_object_get(obj, "messages"));
        size_t i;
        json_t *m;
        json_array_foreach(msgs, i, m) {
            json_t *c = json_object_get(m, "content");
            if (!block || !json_is_string(c)) continue;
            char *filled = fill_options(json_string_value(c), block, &found);
            json_object_set_new(m, "content", json_string(filled));
            free(filled);
        }
        r->messages = json_dumps(msgs, JSON_COMPACT);
        json_decref(msgs);
    }
    free(block);
    if (options && !found)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: options: given, but the prompt holds no {options} to put "
                             "them in",
                             where);
    return MOE_OK;
}

/* One line's object into r (and, for a reversed copy, into rev). */
static moe_status record_parse(json_t *obj, const char *where, size_t line, moe_eval_record *r,
                               moe_eval_record *rev, bool *has_rev, moe_error *err) {
    *has_rev = false;
    if (!json_is_object(obj))
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: expected a JSON object", where);
    json_t *prompt = json_object_get(obj, "prompt"), *msgs = json_object_get(obj, "messages");
    if (!prompt == !msgs)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: expected either \"prompt\" (a string) or \"messages\" (an "
                             "array), not %s",
                             where, prompt ? "both" : "neither");
    if (prompt && !json_is_string(prompt))
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: prompt: expected a string", where);
    if (msgs && (!json_is_array(msgs) || json_array_size(msgs) == 0))
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: messages: expected a non-empty array of messages", where);
    json_t *labels = json_object_get(obj, "labels");
    if (!json_is_array(labels) || json_array_size(labels) < 2 ||
        json_array_size(labels) > MOE_EVAL_MAX_LABELS)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: labels: expected an array of 2..%d strings",
                             where, MOE_EVAL_MAX_LABELS);
    r->line = line;
    r->n_labels = (uint32_t)json_array_size(labels);
    r->labels = moe_xcalloc(r->n_labels, sizeof *r->labels);
    for (uint32_t i = 0; i < r->n_labels; i++) {
        json_t *l = json_array_get(labels, i);
        if (!json_is_string(l) || json_string_length(l) == 0 ||
            strlen(json_string_value(l)) != json_string_length(l))
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: labels[%u]: expected a non-empty string (without NUL)", where,
                                 i);
        r->labels[i] = moe_xstrdup(json_string_value(l));
    }
    json_t *id = json_object_get(obj, "id");
    char idbuf[64];
    if (json_is_string(id))
        r->id = moe_xstrdup(json_string_value(id));
    else if (json_is_integer(id)) {
        snprintf(idbuf, sizeof idbuf, "%lld", (long long)json_integer_value(id));
        r->id = moe_xstrdup(idbuf);
    } else if (!id || json_is_null(id)) {
        snprintf(idbuf, sizeof idbuf, "line %zu", line);
        r->id = moe_xstrdup(idbuf);
    } else {
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: id: expected a string or an integer", where);
    }
    json_t *ans = json_object_get(obj, "answer");
    r->answer = -1;
    if (json_is_integer(ans)) {
        if (json_integer_value(ans) < 0 || json_integer_value(ans) >= r->n_labels)
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: answer: %lld is not a label index (0..%u)", where,
                                 (long long)json_integer_value(ans), r->n_labels - 1);
        r->answer = (int32_t)json_integer_value(ans);
    } else if (json_is_string(ans)) {
        for (uint32_t i = 0; i < r->n_labels && r->answer < 0; i++)
            if (strcmp(r->labels[i], json_string_value(ans)) == 0) r->answer = (int32_t)i;
        if (r->answer < 0)
            return moe_error_set(err, MOE_ERR_FORMAT, "%s: answer: \"%s\" is not one of the labels",
                                 where, json_string_value(ans));
    } else if (ans && !json_is_null(ans)) {
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: answer: expected a label index or a label's text", where);
    }
    json_t *opts = json_object_get(obj, "options");
    char **options = NULL;
    if (opts && !json_is_null(opts)) {
        if (!json_is_array(opts) || json_array_size(opts) != r->n_labels)
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: options: expected an array of %u strings (one per label)",
                                 where, r->n_labels);
        options = moe_xcalloc(r->n_labels, sizeof *options);
        for (uint32_t i = 0; i < r->n_labels; i++) {
            json_t *o = json_array_get(opts, i);
            if (!json_is_string(o)) {
                free(options);
                return moe_error_set(err, MOE_ERR_FORMAT, "%s: options[%u]: expected a string",
                                     where, i);
            }
            options[i] = (char *)json_string_value(o);
        }
    }
    moe_status st = record_fill(r, obj, options, false, where, err);
    if (st == MOE_OK && rev && options && r->n_labels == 3) {
        *rev =
            (moe_eval_record){.id = moe_xstrdup(r->id),
                              .line = line,
                              .n_labels = r->n_labels,
                              .answer = r->answer < 0 ? -1 : (int32_t)r->n_labels - 1 - r->answer,
                              .reversed = true};
        rev->labels = moe_xcalloc(r->n_labels, sizeof *rev->labels);
        for (uint32_t i = 0; i < r->n_labels; i++) rev->labels[i] = moe_xstrdup(r->labels[i]);
        *has_rev = true;
        st = record_fill(rev, obj, options, true, where, err);
    }
    free(options);
    return st;
}

/* Every non-blank line of a JSON-lines file through fn (with "PATH:LINE" for its messages),
 * until fn fails. */
typedef moe_status (*jsonl_fn)(void *ud, json_t *obj, const char *where, size_t line,
                               moe_error *err);

static moe_status jsonl_each(const char *path, jsonl_fn fn, void *ud, moe_error *err) {
    FILE *f = fopen(path, "r");
    if (!f) return moe_error_set(err, MOE_ERR_IO, "%s: cannot open", path);
    char *line = NULL;
    size_t line_cap = 0, line_no = 0, n = 0;
    ssize_t len;
    moe_status st = MOE_OK;
    while (st == MOE_OK && (len = getline(&line, &line_cap, f)) >= 0) {
        line_no++;
        size_t l = (size_t)len;
        while (l && (line[l - 1] == '\n' || line[l - 1] == '\r' || line[l - 1] == ' ')) l--;
        if (l == 0) continue;
        char where[600];
        snprintf(where, sizeof where, "%s:%zu", path, line_no);
        json_error_t jerr;
        json_t *obj = NULL;
        if (l > MOE_EVAL_MAX_LINE)
            st = moe_error_set(err, MOE_ERR_RANGE, "%s: a line of %zu bytes (at most %u)", where, l,
                               MOE_EVAL_MAX_LINE);
        else if (++n > MOE_EVAL_MAX_RECORDS)
            st = moe_error_set(err, MOE_ERR_RANGE, "%s: more than %u lines", where,
                               MOE_EVAL_MAX_RECORDS);
        else if (!(obj = json_loadb(line, l, JSON_REJECT_DUPLICATES, &jerr)))
            st = moe_error_set(err, MOE_ERR_FORMAT, "%s:%d: %s", where, jerr.column, jerr.text);
        else
            st = fn(ud, obj, where, line_no, err);
        json_decref(obj);
    }
    free(line);
    fclose(f);
    return st;
}

typedef struct records_acc {
    moe_eval_record *recs;
    size_t n, cap;
    bool reverse_options;
} records_acc;

static moe_status records_add(void *ud, json_t *obj, const char *where, size_t line,
                              moe_error *err) {
    records_acc *a = ud;
    if (a->n + 2 > a->cap) {
        a->cap = a->cap ? a->cap * 2 : 64;
        a->recs = moe_xrealloc(a->recs, a->cap * sizeof *a->recs);
    }
    memset(&a->recs[a->n], 0, 2 * sizeof *a->recs);
    bool has_rev;
    const moe_status st =
        record_parse(obj, where, line, &a->recs[a->n],
                     a->reverse_options ? &a->recs[a->n + 1] : NULL, &has_rev, err);
    a->n += 1 + has_rev;
    if (st != MOE_OK && !has_rev) record_free(&a->recs[--a->n]);
    return st;
}

moe_status moe_eval_records_read(const char *path, bool reverse_options, moe_eval_record **out,
                                 size_t *n_out, moe_error *err) {
    records_acc a = {.reverse_options = reverse_options};
    moe_status st = jsonl_each(path, records_add, &a, err);
    if (st == MOE_OK && a.n == 0) st = moe_error_set(err, MOE_ERR_FORMAT, "%s: no records", path);
    if (st != MOE_OK) {
        moe_eval_records_free(a.recs, a.n);
        a.recs = NULL;
        a.n = 0;
    }
    *out = a.recs;
    *n_out = a.n;
    return st;
}

/* ==== Scorers ==== */

/* A record's ids, however they were obtained. */
typedef struct eval_ids {
    int32_t *prompt;
    size_t n_prompt;
    int32_t *label[MOE_EVAL_MAX_LABELS];
    size_t n_label[MOE_EVAL_MAX_LABELS];
} eval_ids;

static void eval_ids_free(eval_ids *t) {
    free(t->prompt);
    for (uint32_t i = 0; i < MOE_EVAL_MAX_LABELS; i++) free(t->label[i]);
    memset(t, 0, sizeof *t);
}

struct moe_eval_scorer {
    /* engine */
    moe_model *model;
    moe_tokenizer *tok;
    moe_chat_template *tmpl;
    moe_ctx *ctx;
    float *logits;  /* [MOE_EVAL_ROWS][n_vocab] */
    moe_row *rows;  /* [MOE_EVAL_ROWS] */
    int32_t *label; /* [MOE_EVAL_ROWS] which label each row's logits score */
    /* server */
    moe_http *http;
    char *base; /* the server's root URL, no trailing slash */
    char *api_key, *model_name;
    moe_strbuf reply;
};

void moe_eval_scorer_free(moe_eval_scorer *s) {
    if (!s) return;
    moe_ctx_free(s->ctx);
    moe_chat_template_free(s->tmpl);
    moe_tokenizer_free(s->tok);
    moe_model_free(s->model);
    free(s->logits);
    free(s->rows);
    free(s->label);
    moe_http_free(s->http);
    free(s->base);
    free(s->api_key);
    free(s->model_name);
    moe_strbuf_free(&s->reply);
    free(s);
}

/* The ids go to the score (the caller's to free) */
static void ids_to_score(eval_ids *t, moe_eval_score *out) {
    out->prompt_ids = t->prompt;
    for (uint32_t k = 0; k < MOE_EVAL_MAX_LABELS; k++) out->label_ids[k] = t->label[k];
    memset(t, 0, sizeof *t);
}

static moe_status check_ids(const moe_eval_record *r, const eval_ids *t, moe_error *err) {
    if (t->n_prompt == 0)
        return moe_error_set(err, MOE_ERR_FORMAT, "record %s (line %zu): the prompt has no tokens",
                             r->id, r->line);
    for (uint32_t k = 0; k < r->n_labels; k++)
        if (t->n_label[k] == 0)
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "record %s (line %zu): label %u (\"%s\") has no tokens", r->id,
                                 r->line, k, r->labels[k]);
    return MOE_OK;
}

/* ---- engine ---- */

static moe_status engine_ids(moe_eval_scorer *s, const moe_eval_record *r, eval_ids *t,
                             moe_error *err) {
    memset(t, 0, sizeof *t);
    moe_status st;
    if (r->prompt)
        st = moe_tokenizer_encode(s->tok, r->prompt, strlen(r->prompt),
                                  MOE_ENCODE_ADD_SPECIAL | MOE_ENCODE_PARSE_SPECIAL, &t->prompt,
                                  &t->n_prompt, err);
    else
        st = moe_chat_render_tokens(s->tmpl, s->tok, r->messages, NULL,
                                    "{\"add_generation_prompt\": true}", NULL, NULL, &t->prompt,
                                    &t->n_prompt, err);
    for (uint32_t k = 0; st == MOE_OK && k < r->n_labels; k++)
        st = moe_tokenizer_encode(s->tok, r->labels[k], strlen(r->labels[k]),
                                  MOE_ENCODE_PARSE_SPECIAL, &t->label[k], &t->n_label[k], err);
    if (st != MOE_OK) moe_error_prefix(err, "record %s (line %zu)", r->id, r->line);
    if (st == MOE_OK) st = check_ids(r, t, err);
    return st;
}

/* A model loaded for scoring, repacked for the active kernel table (on n_threads) unless
 * no_repack. */
static moe_model *eval_model_load(const char *path, bool no_repack, int n_threads, moe_error *err) {
    moe_model *m = moe_model_load(path, err);
    moe_layout_report r;
    if (!m || no_repack) return m;
    moe_pool *pool = moe_pool_new(n_threads);
    const moe_status st = moe_model_repack(m, true, pool, &r, err);
    moe_pool_free(pool);
    if (st != MOE_OK) {
        moe_model_free(m);
        return NULL;
    }
    moe_layout_report_print("moe eval", &r);
    return m;
}

moe_eval_scorer *moe_eval_scorer_engine(const char *model_path, const moe_eval_engine_params *p,
                                        const moe_eval_record *records, size_t n_records,
                                        moe_error *err) {
    moe_eval_scorer *s = moe_xcalloc(1, sizeof *s);
    s->model = eval_model_load(model_path, p->no_repack, p->n_threads, err);
    if (s->model) s->tok = moe_tokenizer_from_gguf(s->model->gguf, err);
    if (s->tok && moe_tokenizer_n_vocab(s->tok) != s->model->cfg.n_vocab)
        moe_error_set(err, MOE_ERR_FORMAT, "%s: the vocabulary has %u tokens but the model %u",
                      model_path, moe_tokenizer_n_vocab(s->tok), s->model->cfg.n_vocab);
    if (err->code) goto fail;
    bool chat = false;
    for (size_t i = 0; i < n_records; i++) chat |= records[i].messages != NULL;
    if (chat) {
        if (p->chat_template)
            s->tmpl = moe_chat_template_load_file(p->chat_template, err);
        else {
            s->tmpl = moe_chat_template_from_gguf(s->model->gguf, NULL, err);
            if (!s->tmpl && err->code == MOE_ERR_NOT_FOUND) {
                moe_error_clear(err);
                s->tmpl = moe_chat_template_parse(moe_chat_template_chatml,
                                                  strlen(moe_chat_template_chatml), err);
            }
        }
        if (!s->tmpl) goto fail;
    }
    /* the context: the longest prompt + label, a sequence per label and one for the prompt */
    uint64_t n_ctx = 0;
    uint32_t n_seq = 0;
    for (size_t i = 0; i < n_records; i++) {
        eval_ids t;
        if (engine_ids(s, &records[i], &t, err) != MOE_OK) {
            eval_ids_free(&t);
            goto fail;
        }
        for (uint32_t k = 0; k < records[i].n_labels; k++)
            if (t.n_prompt + t.n_label[k] > n_ctx) n_ctx = t.n_prompt + t.n_label[k];
        const uint32_t seqs =
            records[i].n_labels < MOE_EVAL_LABEL_SEQS ? records[i].n_labels : MOE_EVAL_LABEL_SEQS;
        if (seqs + 1 > n_seq) n_seq = seqs + 1;
        eval_ids_free(&t);
    }
    if (n_ctx > UINT32_MAX / 2) {
        moe_error_set(err, MOE_ERR_RANGE, "a record of %llu tokens", (unsigned long long)n_ctx);
        goto fail;
    }
    moe_ctx_params cp = {.n_ctx = (uint32_t)n_ctx,
                         .n_seq = n_seq,
                         .max_rows = MOE_EVAL_ROWS,
                         .kv_type = p->kv_type,
                         .n_threads = p->n_threads};
    s->ctx = moe_ctx_new(s->model, &cp, err);
    if (!s->ctx) goto fail;
    s->logits = moe_xmalloc(sizeof(float) * MOE_EVAL_ROWS * s->model->cfg.n_vocab);
    s->rows = moe_xmalloc(sizeof(moe_row) * MOE_EVAL_ROWS);
    s->label = moe_xmalloc(sizeof(int32_t) * MOE_EVAL_ROWS);
    return s;
fail:
    moe_eval_scorer_free(s);
    return NULL;
}

/* Run rows[0..n) and add each logits row's log-probability of the token after it to its label's
 * sum; next[i] is that token (-1: no logits wanted). */
static moe_status engine_flush(moe_eval_scorer *s, uint32_t n, const int32_t *next,
                               moe_eval_score *out, moe_error *err) {
    if (!n) return MOE_OK;
    if (moe_ctx_decode(s->ctx, s->rows, n, s->logits, err) != MOE_OK) return err->code;
    const uint32_t n_vocab = s->model->cfg.n_vocab;
    uint32_t row = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!s->rows[i].logits) continue;
        out->logprob[s->label[i]] +=
            moe_logprob(s->logits + (size_t)row * n_vocab, n_vocab, next[i]);
        row++;
    }
    return MOE_OK;
}

static moe_status engine_run(moe_eval_scorer *s, const moe_eval_record *r, moe_eval_score *out,
                             moe_error *err) {
    eval_ids t;
    moe_status st = engine_ids(s, r, &t, err);
    int32_t next[MOE_EVAL_ROWS];
    const uint32_t n_vocab = s->model->cfg.n_vocab;
    out->n_prompt = (uint32_t)t.n_prompt;
    /* the prompt once, on sequence 0, from the longest prefix the context still holds */
    uint32_t reused = 0;
    if (st == MOE_OK)
        st = moe_ctx_seq_reuse(s->ctx, 0, t.prompt, (uint32_t)t.n_prompt - 1, &reused, err);
    float *last = moe_xmalloc(sizeof(float) * n_vocab);
    for (uint32_t pos = reused; st == MOE_OK && pos < t.n_prompt;) {
        uint32_t n = 0;
        for (; n < MOE_EVAL_ROWS && pos < t.n_prompt; n++, pos++)
            s->rows[n] = (moe_row){.seq = 0,
                                   .pos = (int32_t)pos,
                                   .token = t.prompt[pos],
                                   .logits = pos + 1 == t.n_prompt};
        st = moe_ctx_decode(s->ctx, s->rows, n, s->logits, err);
        if (st == MOE_OK && pos == t.n_prompt) memcpy(last, s->logits, sizeof(float) * n_vocab);
    }
    /* a hybrid model's labels copy the prompt's recurrent state from a snapshot */
    if (st == MOE_OK && moe_ctx_seq_snapshot(s->ctx, 0, err) < 0) st = err->code;
    /* each label: its first token from the prompt's last logits, the rest from its own rows on
     * its own sequence, up to MOE_EVAL_LABEL_SEQS labels' rows in the same batches */
    uint32_t n = 0;
    for (uint32_t k = 0; st == MOE_OK && k < r->n_labels; k++) {
        out->n_tokens[k] = (uint32_t)t.n_label[k];
        out->logprob[k] = moe_logprob(last, n_vocab, t.label[k][0]);
        const int32_t seq = (int32_t)(k % MOE_EVAL_LABEL_SEQS) + 1;
        if (k && seq == 1) { /* the sequences are taken again: run what the last group left */
            st = engine_flush(s, n, next, out, err);
            n = 0;
            if (st != MOE_OK) break;
        }
        st = moe_ctx_seq_reuse(s->ctx, seq, t.prompt, (uint32_t)t.n_prompt, &reused, err);
        if (st == MOE_OK && reused != t.n_prompt)
            st = moe_error_set(err, MOE_ERR_UNSUPPORTED,
                               "record %s: the prompt's state could not be copied for label %u",
                               r->id, k);
        for (size_t j = 0; st == MOE_OK && j + 1 < t.n_label[k]; j++) {
            if (n == MOE_EVAL_ROWS) {
                st = engine_flush(s, n, next, out, err);
                n = 0;
            }
            s->rows[n] = (moe_row){.seq = seq,
                                   .pos = (int32_t)(t.n_prompt + j),
                                   .token = t.label[k][j],
                                   .logits = true};
            s->label[n] = (int32_t)k;
            next[n++] = t.label[k][j + 1];
        }
    }
    if (st == MOE_OK) st = engine_flush(s, n, next, out, err);
    free(last);
    ids_to_score(&t, out);
    return st;
}

/* ---- server ---- */

moe_eval_scorer *moe_eval_scorer_url(const char *url, const char *api_key, const char *model,
                                     moe_error *err) {
    (void)err;
    moe_eval_scorer *s = moe_xcalloc(1, sizeof *s);
    s->http = moe_http_new();
    size_t len = strlen(url);
    while (len && url[len - 1] == '/') len--;
    if (len >= 3 && strncmp(url + len - 3, "/v1", 3) == 0) len -= 3;
    s->base = moe_xstrndup(url, len);
    s->api_key = api_key ? moe_xstrdup(api_key) : NULL;
    s->model_name = moe_xstrdup(model ? model : "default");
    return s;
}

/* POST body (taken) to base + path; the reply parsed as a JSON object, or NULL with err set. */
static json_t *api_call(moe_eval_scorer *s, const char *path, json_t *body, moe_error *err) {
    char *text = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    moe_strbuf url = {0};
    moe_strbuf_printf(&url, "%s%s", s->base, path);
    long status = 0;
    json_t *reply = NULL;
    if (moe_http_post_json(s->http, url.s, text, strlen(text), s->api_key, &s->reply, &status,
                           err) == MOE_OK) {
        json_error_t jerr;
        reply = s->reply.len ? json_loadb(s->reply.s, s->reply.len, 0, &jerr) : NULL;
        if (status != 200 || !json_is_object(reply)) {
            json_t *msg = json_object_get(json_object_get(reply, "error"), "message");
            moe_error_set(err, MOE_ERR_IO, "%s: HTTP %ld%s%.300s", url.s, status,
                          msg || s->reply.len ? ": " : "",
                          json_is_string(msg) ? json_string_value(msg)
                                              : (s->reply.s ? s->reply.s : ""));
            json_decref(reply);
            reply = NULL;
        }
    }
    free(text);
    moe_strbuf_free(&url);
    return reply;
}

/* An array of token ids at reply[key] into *ids. */
static moe_status ids_from(json_t *arr, const char *what, int32_t **ids, size_t *n,
                           moe_error *err) {
    if (!json_is_array(arr))
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: the reply has no array of token ids", what);
    *n = json_array_size(arr);
    *ids = moe_xmalloc(sizeof(int32_t) * (*n ? *n : 1));
    for (size_t i = 0; i < *n; i++) {
        json_t *v = json_array_get(arr, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
            return moe_error_set(err, MOE_ERR_FORMAT, "%s: token %zu is not a token id", what, i);
        (*ids)[i] = (int32_t)json_integer_value(v);
    }
    return MOE_OK;
}

static moe_status url_tokenize(moe_eval_scorer *s, const char *text, bool add_special,
                               int32_t **ids, size_t *n, moe_error *err) {
    json_t *reply =
        api_call(s, "/tokenize",
                 /* llama-server's and moe's fields, and vLLM's */
                 json_pack("{s:s, s:b, s:b, s:s, s:b}", "content", text, "add_special", add_special,
                           "parse_special", 1, "prompt", text, "add_special_tokens", add_special),
                 err);
    if (!reply) return err->code;
    const moe_status st = ids_from(json_object_get(reply, "tokens"), "/tokenize", ids, n, err);
    json_decref(reply);
    return st;
}

static moe_status url_ids(moe_eval_scorer *s, const moe_eval_record *r, eval_ids *t,
                          moe_error *err) {
    memset(t, 0, sizeof *t);
    moe_status st;
    if (r->prompt) {
        st = url_tokenize(s, r->prompt, true, &t->prompt, &t->n_prompt, err);
    } else {
        json_error_t jerr;
        json_t *reply = api_call(s, "/apply-template",
                                 json_pack("{s:s, s:o}", "model", s->model_name, "messages",
                                           json_loads(r->messages, 0, &jerr)),
                                 err);
        if (!reply) {
            st = err->code;
        } else if (json_object_get(reply, "tokens")) {
            st = ids_from(json_object_get(reply, "tokens"), "/apply-template", &t->prompt,
                          &t->n_prompt, err);
        } else if (json_is_string(json_object_get(reply, "prompt"))) { /* llama-server's */
            st = url_tokenize(s, json_string_value(json_object_get(reply, "prompt")), true,
                              &t->prompt, &t->n_prompt, err);
        } else {
            st = moe_error_set(err, MOE_ERR_FORMAT, "/apply-template: no prompt in the reply");
        }
        json_decref(reply);
    }
    for (uint32_t k = 0; st == MOE_OK && k < r->n_labels; k++)
        st = url_tokenize(s, r->labels[k], false, &t->label[k], &t->n_label[k], err);
    if (st != MOE_OK) moe_error_prefix(err, "record %s (line %zu)", r->id, r->line);
    if (st == MOE_OK) st = check_ids(r, t, err);
    return st;
}

static moe_status url_run(moe_eval_scorer *s, const moe_eval_record *r, moe_eval_score *out,
                          moe_error *err) {
    eval_ids t;
    moe_status st = url_ids(s, r, &t, err);
    out->n_prompt = (uint32_t)t.n_prompt;
    for (uint32_t k = 0; st == MOE_OK && k < r->n_labels; k++) {
        json_t *prompt = json_array();
        for (size_t i = 0; i < t.n_prompt; i++)
            json_array_append_new(prompt, json_integer(t.prompt[i]));
        for (size_t i = 0; i < t.n_label[k]; i++)
            json_array_append_new(prompt, json_integer(t.label[k][i]));
        json_t *reply = api_call(s, "/v1/completions",
                                 json_pack("{s:s, s:o, s:i, s:b, s:i, s:f}", "model", s->model_name,
                                           "prompt", prompt, "max_tokens", 1, "echo", 1, "logprobs",
                                           0, "temperature", 0.0),
                                 err);
        if (!reply) {
            st = err->code;
            break;
        }
        json_t *lp = json_object_get(
            json_object_get(json_array_get(json_object_get(reply, "choices"), 0), "logprobs"),
            "token_logprobs");
        const size_t need = t.n_prompt + t.n_label[k];
        if (!json_is_array(lp) || json_array_size(lp) < need) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "record %s: /v1/completions did not echo the prompt's "
                               "log-probabilities (choices[0].logprobs.token_logprobs with at "
                               "least %zu entries); the server must support echo with logprobs",
                               r->id, need);
        }
        out->logprob[k] = 0;
        out->n_tokens[k] = (uint32_t)t.n_label[k];
        for (size_t i = t.n_prompt; st == MOE_OK && i < need; i++) {
            json_t *v = json_array_get(lp, i);
            if (!json_is_number(v))
                st = moe_error_set(err, MOE_ERR_FORMAT,
                                   "record %s: token_logprobs[%zu] is not a number", r->id, i);
            else
                out->logprob[k] += json_number_value(v);
        }
        json_decref(reply);
    }
    ids_to_score(&t, out);
    return st;
}

void moe_eval_score_free(moe_eval_score *s) {
    free(s->prompt_ids);
    for (uint32_t k = 0; k < MOE_EVAL_MAX_LABELS; k++) free(s->label_ids[k]);
    memset(s, 0, sizeof *s);
}

moe_status moe_eval_scorer_run(moe_eval_scorer *s, const moe_eval_record *r, moe_eval_score *out,
                               moe_error *err) {
    memset(out, 0, sizeof *out);
    const moe_status st = s->model ? engine_run(s, r, out, err) : url_run(s, r, out, err);
    if (st != MOE_OK) return st;
    out->pred = 0;
    for (uint32_t k = 1; k < r->n_labels; k++)
        if (out->logprob[k] > out->logprob[out->pred]) out->pred = (int32_t)k;
    return MOE_OK;
}

/* ==== Results and the paired bootstrap ==== */

void moe_eval_results_free(moe_eval_result *r, size_t n) {
    for (size_t i = 0; i < n; i++) free(r[i].id);
    free(r);
}

typedef struct results_acc {
    moe_eval_result *res;
    size_t n, cap;
} results_acc;

static moe_status results_add(void *ud, json_t *o, const char *where, size_t line, moe_error *err) {
    (void)line;
    results_acc *a = ud;
    json_t *id = json_object_get(o, "id"), *pred = json_object_get(o, "pred"),
           *ans = json_object_get(o, "answer"), *rev = json_object_get(o, "reversed");
    if (!json_is_string(id) || !json_is_integer(pred) ||
        !(json_is_integer(ans) || json_is_null(ans) || !ans) || !(json_is_boolean(rev) || !rev))
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: expected a result of `moe eval labels` (an object with \"id\" "
                             "string, \"pred\" integer, \"answer\" integer or null)",
                             where);
    if (a->n == a->cap) {
        a->cap = a->cap ? a->cap * 2 : 64;
        a->res = moe_xrealloc(a->res, a->cap * sizeof *a->res);
    }
    a->res[a->n++] =
        (moe_eval_result){.id = moe_xstrdup(json_string_value(id)),
                          .reversed = json_is_true(rev),
                          .pred = (int32_t)json_integer_value(pred),
                          .answer = json_is_integer(ans) ? (int32_t)json_integer_value(ans) : -1};
    return MOE_OK;
}

moe_status moe_eval_results_read(const char *path, moe_eval_result **out, size_t *n_out,
                                 moe_error *err) {
    results_acc a = {0};
    moe_status st = jsonl_each(path, results_add, &a, err);
    if (st == MOE_OK && a.n == 0) st = moe_error_set(err, MOE_ERR_FORMAT, "%s: no results", path);
    if (st != MOE_OK) {
        moe_eval_results_free(a.res, a.n);
        a.res = NULL;
        a.n = 0;
    }
    *out = a.res;
    *n_out = a.n;
    return st;
}

static int by_key(const void *a, const void *b) {
    const moe_eval_result *x = *(const moe_eval_result *const *)a,
                          *y = *(const moe_eval_result *const *)b;
    const int c = strcmp(x->id, y->id);
    return c ? c : (int)x->reversed - (int)y->reversed;
}

static int by_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double moe_eval_percentile(const double *sorted, size_t n, double q) {
    if (n == 0) return NAN;
    const double p = q * (double)(n - 1);
    const size_t i = (size_t)p;
    if (i + 1 >= n) return sorted[n - 1];
    const double f = p - (double)i;
    return sorted[i] + (sorted[i + 1] - sorted[i]) * f;
}

/* results sorted by (id, reversed), duplicates refused */
static moe_status sort_results(const moe_eval_result *r, size_t n, const char *which,
                               const moe_eval_result ***out, moe_error *err) {
    const moe_eval_result **p = moe_xmalloc(sizeof *p * (n ? n : 1));
    for (size_t i = 0; i < n; i++) p[i] = &r[i];
    qsort(p, n, sizeof *p, by_key);
    for (size_t i = 1; i < n; i++)
        if (by_key(&p[i - 1], &p[i]) == 0) {
            moe_error_set(err, MOE_ERR_FORMAT, "%s: record %s%s appears twice", which, p[i]->id,
                          p[i]->reversed ? " (reversed)" : "");
            free(p);
            return err->code;
        }
    *out = p;
    return MOE_OK;
}

moe_status moe_eval_compare_run(const moe_eval_result *a, size_t n_a, const moe_eval_result *b,
                                size_t n_b, uint32_t resamples, uint64_t seed,
                                moe_eval_compare *out, moe_error *err) {
    memset(out, 0, sizeof *out);
    out->resamples = resamples;
    out->seed = seed;
    const moe_eval_result **pa, **pb;
    if (sort_results(a, n_a, "A", &pa, err) != MOE_OK) return err->code;
    if (sort_results(b, n_b, "B", &pb, err) != MOE_OK) {
        free(pa);
        return err->code;
    }
    /* the pairs, in A's file order */
    size_t n_pairs = 0;
    uint8_t *ca = moe_xmalloc(n_a + 1), *cb = moe_xmalloc(n_a + 1);
    const moe_eval_result **pair_b = moe_xcalloc(n_a + 1, sizeof *pair_b);
    for (size_t i = 0; i < n_a; i++) {
        const moe_eval_result *key = &a[i], **hit = bsearch(&key, pb, n_b, sizeof *pb, by_key);
        pair_b[i] = hit ? *hit : NULL;
    }
    for (size_t i = 0; i < n_b; i++) {
        const moe_eval_result *key = &b[i];
        out->n_only_b += bsearch(&key, pa, n_a, sizeof *pa, by_key) == NULL;
    }
    for (size_t i = 0; i < n_a; i++) {
        const moe_eval_result *x = &a[i], *y = pair_b[i];
        if (!y) {
            out->n_only_a++;
            continue;
        }
        if (x->answer < 0 || y->answer < 0) continue;
        if (x->answer != y->answer) {
            moe_error_set(err, MOE_ERR_FORMAT,
                          "record %s%s: the files disagree on its answer (%d and %d): not the "
                          "same records",
                          x->id, x->reversed ? " (reversed)" : "", x->answer, y->answer);
            break;
        }
        ca[n_pairs] = x->pred == x->answer;
        cb[n_pairs] = y->pred == y->answer;
        out->correct_a += ca[n_pairs];
        out->correct_b += cb[n_pairs];
        out->pred_changed += x->pred != y->pred;
        if (ca[n_pairs] != cb[n_pairs]) {
            out->a_right_b_wrong += ca[n_pairs];
            out->a_wrong_b_right += cb[n_pairs];
            out->flipped = moe_xrealloc(out->flipped, (out->n_flipped + 1) * sizeof(char *));
            moe_strbuf name = {0};
            moe_strbuf_printf(&name, "%s%s", x->id, x->reversed ? " (reversed)" : "");
            out->flipped[out->n_flipped++] = moe_strbuf_take(&name);
        }
        n_pairs++;
    }
    free(pa);
    free(pb);
    free(pair_b);
    if (!err->code && n_pairs == 0)
        moe_error_set(err, MOE_ERR_FORMAT,
                      "no record is in both files with a known answer: nothing to compare");
    if (err->code) {
        free(ca);
        free(cb);
        return err->code;
    }
    out->n = n_pairs;
    out->acc_a = (double)out->correct_a / (double)n_pairs;
    out->acc_b = (double)out->correct_b / (double)n_pairs;
    out->diff = ((double)out->correct_b - (double)out->correct_a) / (double)n_pairs;
    double *diffs = moe_xmalloc(sizeof(double) * resamples);
    uint64_t state = seed;
    for (uint32_t r = 0; r < resamples; r++) {
        int64_t sum = 0;
        for (size_t i = 0; i < n_pairs; i++) {
            const size_t k = (size_t)(moe_rng_u64(&state) % n_pairs);
            sum += (int64_t)cb[k] - (int64_t)ca[k];
        }
        diffs[r] = (double)sum / (double)n_pairs;
    }
    qsort(diffs, resamples, sizeof(double), by_double);
    out->ci_low = moe_eval_percentile(diffs, resamples, 0.025);
    out->ci_high = moe_eval_percentile(diffs, resamples, 0.975);
    free(diffs);
    free(ca);
    free(cb);
    return MOE_OK;
}

void moe_eval_compare_free(moe_eval_compare *c) {
    for (size_t i = 0; i < c->n_flipped; i++) free(c->flipped[i]);
    free(c->flipped);
    memset(c, 0, sizeof *c);
}

/* ==== KL divergence against a reference model ==== */

typedef struct kl_side {
    moe_model *model;
    moe_tokenizer *tok;
    moe_ctx *ctx;
    float *logits; /* [MOE_EVAL_ROWS][n_vocab] */
} kl_side;

static void kl_side_free(kl_side *s) {
    moe_ctx_free(s->ctx);
    moe_tokenizer_free(s->tok);
    moe_model_free(s->model);
    free(s->logits);
}

static moe_status kl_side_open(kl_side *s, const char *path, const moe_eval_kl_params *p,
                               moe_error *err) {
    memset(s, 0, sizeof *s);
    s->model = eval_model_load(path, p->no_repack, p->n_threads, err);
    if (s->model) s->tok = moe_tokenizer_from_gguf(s->model->gguf, err);
    if (!s->tok) return err->code;
    moe_ctx_params cp = {.n_ctx = p->n_ctx,
                         .n_seq = 1,
                         .max_rows = MOE_EVAL_ROWS,
                         .kv_type = p->kv_type,
                         .n_threads = p->n_threads};
    s->ctx = moe_ctx_new(s->model, &cp, err);
    if (!s->ctx) return err->code;
    s->logits = moe_xmalloc(sizeof(float) * MOE_EVAL_ROWS * s->model->cfg.n_vocab);
    return MOE_OK;
}

/* log-softmax of a row into out (double), and its argmax (the first of equals) */
static int32_t log_softmax(const float *row, uint32_t n, double *out) {
    int32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (row[i] > row[best]) best = (int32_t)i;
    const double max = row[best];
    double z = 0.0;
    for (uint32_t i = 0; i < n; i++) z += exp((double)row[i] - max);
    const double log_z = log(z);
    for (uint32_t i = 0; i < n; i++) out[i] = (double)row[i] - max - log_z;
    return best;
}

static moe_status kl_tokens(const moe_eval_kl_params *p, const kl_side *m, const kl_side *r,
                            int32_t **ids, size_t *n, moe_error *err) {
    if (!p->text_path) {
        *ids = moe_xmalloc(sizeof(int32_t) * (p->n_tokens ? p->n_tokens : 1));
        memcpy(*ids, p->tokens, sizeof(int32_t) * p->n_tokens);
        *n = p->n_tokens;
        for (size_t i = 0; i < *n; i++)
            if ((*ids)[i] < 0 || (uint32_t)(*ids)[i] >= m->model->cfg.n_vocab)
                return moe_error_set(err, MOE_ERR_RANGE, "token %zu: id %d is not below %u", i,
                                     (*ids)[i], m->model->cfg.n_vocab);
        return MOE_OK;
    }
    uint8_t *text;
    size_t len;
    if (moe_file_read(p->text_path, &text, &len, err) != MOE_OK) return err->code;
    int32_t *ref_ids = NULL;
    size_t n_ref = 0;
    moe_status st =
        moe_tokenizer_encode(m->tok, (const char *)text, len, MOE_ENCODE_ADD_SPECIAL, ids, n, err);
    if (st == MOE_OK)
        st = moe_tokenizer_encode(r->tok, (const char *)text, len, MOE_ENCODE_ADD_SPECIAL, &ref_ids,
                                  &n_ref, err);
    if (st == MOE_OK) {
        size_t i = 0;
        while (i < *n && i < n_ref && (*ids)[i] == ref_ids[i]) i++;
        if (i != *n || i != n_ref)
            st = moe_error_set(err, MOE_ERR_ARG,
                               "%s: the two models tokenize the text differently (first at token "
                               "%zu of %zu and %zu): KL needs one vocabulary",
                               p->text_path, i, *n, n_ref);
    }
    free(ref_ids);
    free(text);
    return st;
}

moe_status moe_eval_kl_run(const moe_eval_kl_params *p, moe_eval_kl *out, moe_error *err) {
    memset(out, 0, sizeof *out);
    kl_side m, r;
    int32_t *ids = NULL;
    double *lm = NULL, *lr = NULL;
    size_t n_ids = 0;
    moe_status st = kl_side_open(&m, p->model, p, err);
    if (st == MOE_OK)
        st = kl_side_open(&r, p->ref, p, err);
    else
        memset(&r, 0, sizeof r);
    const uint32_t n_vocab = m.model ? m.model->cfg.n_vocab : 0;
    if (st == MOE_OK && r.model->cfg.n_vocab != n_vocab)
        st = moe_error_set(err, MOE_ERR_ARG, "%s has %u tokens in its vocabulary but %s %u",
                           p->model, n_vocab, p->ref, r.model->cfg.n_vocab);
    if (st == MOE_OK) st = kl_tokens(p, &m, &r, &ids, &n_ids, err);
    const uint32_t n_ctx = p->n_ctx;
    if (st == MOE_OK && (n_ctx < 4 || n_ids < n_ctx))
        st = moe_error_set(err, MOE_ERR_ARG,
                           "%zu tokens: fewer than one chunk of --ctx %u (at least 4); give a "
                           "longer text or a smaller --ctx",
                           n_ids, n_ctx);
    if (st != MOE_OK) goto done;
    out->n_text_tokens = n_ids;
    out->n_ctx = n_ctx;
    out->n_chunks = (uint32_t)(n_ids / n_ctx);
    const uint32_t first = n_ctx / 2, per_chunk = n_ctx - 1 - first;
    out->kl = moe_xmalloc(sizeof(double) * (size_t)per_chunk * out->n_chunks);
    lm = moe_xmalloc(sizeof(double) * n_vocab);
    lr = moe_xmalloc(sizeof(double) * n_vocab);
    const int32_t bos = moe_tokenizer_bos(m.tok);
    const bool add_bos = moe_tokenizer_adds_bos(m.tok) && bos != MOE_TOKEN_NONE;
    double nll = 0, nll_ref = 0;
    size_t same_top = 0;
    for (uint32_t c = 0; st == MOE_OK && c < out->n_chunks; c++) {
        int32_t *chunk = ids + (size_t)c * n_ctx;
        const int32_t saved = chunk[0];
        if (add_bos) chunk[0] = bos;
        kl_side *sides[2] = {&m, &r};
        for (int s = 0; s < 2 && st == MOE_OK; s++)
            st = moe_ctx_seq_truncate(sides[s]->ctx, 0, 0, err);
        for (uint32_t pos = 0; st == MOE_OK && pos < n_ctx;) {
            moe_row rows[MOE_EVAL_ROWS];
            uint32_t n = 0, n_logits = 0;
            const uint32_t pos0 = pos;
            for (; n < MOE_EVAL_ROWS && pos < n_ctx; n++, pos++) {
                const bool scored = pos >= first && pos + 1 < n_ctx;
                rows[n] =
                    (moe_row){.seq = 0, .pos = (int32_t)pos, .token = chunk[pos], .logits = scored};
                n_logits += scored;
            }
            for (int s = 0; s < 2 && st == MOE_OK; s++)
                st = moe_ctx_decode(sides[s]->ctx, rows, n, sides[s]->logits, err);
            uint32_t row = 0;
            for (uint32_t i = 0; st == MOE_OK && i < n; i++) {
                if (!rows[i].logits) continue;
                const int32_t next = chunk[pos0 + i + 1];
                const int32_t top_m = log_softmax(m.logits + (size_t)row * n_vocab, n_vocab, lm);
                const int32_t top_r = log_softmax(r.logits + (size_t)row * n_vocab, n_vocab, lr);
                double kl = 0;
                for (uint32_t v = 0; v < n_vocab; v++)
                    if (isfinite(lr[v])) kl += exp(lr[v]) * (lr[v] - lm[v]);
                out->kl[out->n_scored++] = kl;
                nll -= lm[next];
                nll_ref -= lr[next];
                same_top += top_m == top_r;
                row++;
            }
            (void)n_logits;
        }
        chunk[0] = saved;
    }
    if (st != MOE_OK) goto done;
    const size_t n = out->n_scored;
    double sum = 0;
    for (size_t i = 0; i < n; i++) sum += out->kl[i];
    qsort(out->kl, n, sizeof(double), by_double);
    out->kl_mean = sum / (double)n;
    out->kl_median = n % 2 ? out->kl[n / 2] : 0.5 * (out->kl[n / 2 - 1] + out->kl[n / 2]);
    out->kl_p90 = moe_eval_percentile(out->kl, n, 0.90);
    out->kl_p95 = moe_eval_percentile(out->kl, n, 0.95);
    out->kl_p99 = moe_eval_percentile(out->kl, n, 0.99);
    out->kl_p999 = moe_eval_percentile(out->kl, n, 0.999);
    out->kl_max = out->kl[n - 1];
    out->kl_min = out->kl[0];
    out->top1_agreement = (double)same_top / (double)n;
    out->ppl = exp(nll / (double)n);
    out->ppl_ref = exp(nll_ref / (double)n);
done:
    free(ids);
    free(lm);
    free(lr);
    kl_side_free(&m);
    kl_side_free(&r);
    if (st != MOE_OK) moe_eval_kl_free(out);
    return st;
}

void moe_eval_kl_free(moe_eval_kl *k) {
    free(k->kl);
    k->kl = NULL;
}
