/* sched.c: the engine thread -- the one owner of the model, the context and every sequence.
 *
 * Each step: take newly submitted requests (up to `parallel` streams run at once), drop the
 * cancelled ones, then build ONE batch of rows: one decode row per running stream plus up to
 * SERVE_PREFILL_CHUNK prompt rows of streams still prefilling, and run it with one
 * moe_ctx_decode. Each row with logits is sampled; tokens go through the stream detokenizer and
 * the stop-string matcher, and out to the request's event queue.
 *
 * Sequences (slots) outlive their requests: a finished sequence stays resident (the engine
 * remembers its tokens), and a new request takes the slot that can give the longest prefix of
 * its prompt, else an empty one, else the least recently used resident one. The engine's
 * moe_ctx_seq_reuse then makes the slot hold the longest prefix it can reproduce exactly, from
 * any slot or snapshot, and only the rest is prefilled (at least the last prompt token is
 * always run again: its logits are needed). On a hybrid model (linear-attention layers) a
 * sequence's recurrent state cannot be cut back, so a prefix is reusable only as a whole
 * sequence or at a snapshot: each prompt is prefilled up to its last token, snapshotted there,
 * and the last token runs in the next step, so the same prompt again (or one that extends it)
 * reuses all but its last token. A request never runs on state holding tokens it did not send.
 * A request for prompt log-probabilities (echo) reuses nothing: every prompt row runs with
 * logits (at most SERVE_PROMPT_LOGPROB_ROWS of them per step) and each gives the next prompt
 * token's log-probability as an event before the first sample.
 * A reply with a reasoning budget (serve_gen.think_budget) has its reasoning tokens counted
 * between the template's tags; once the budget is spent inside a block, the closing tag's
 * tokens take the place of the next samples, and the answer is sampled after them.
 * With speculation (--spec ngram|mtp), each decoding stream's row is followed by its drafts
 * (prompt lookup over its own tokens, or its MTP head's) and all of them run in one verify step
 * (moe_ctx_verify; prompt rows then run in a plain call of their own, as a verify step takes back
 * at most n_draft + 1 rows of a sequence). Each stream's sampler picks from its rows in turn
 * exactly as it would step by step; a draft is kept while it equals the pick, and the sequence
 * keeps the rows up to the first one that differs (moe_ctx_seq_accept: KV rows past it dropped,
 * recurrent state from that row's checkpoint), so the output is the one plain decoding makes, at
 * any temperature. The MTP head's cache is the engine's, per sequence; what the slot adds is the
 * hidden states the head has not taken (the step's rows' states are copied out before the head
 * runs: it overwrites them) and where its cache starts after a prefix hit (mtp_reuse).
 *
 * With --cache-dir, finished sequences also go to the engine's disk prefix cache (whole; on a
 * hybrid also at the prompt's snapshot), written by its own thread while the slot stays as it
 * is; a request whose prompt the disk can give more of than RAM gets its slot LOADING: the
 * cache's thread reads the prefix into it while the other streams go on, and the stream starts
 * at the first step after (the engine thread is woken for it).
 * Under mpirun the other ranks replay the engine calls (moe_ctx_lead); a rank found gone ends
 * serving: every request fails naming it (503), new ones and /health get 503 for
 * SERVE_RANK_LOST_LINGER_S, then the process signals itself to stop.
 * The trap: a sampled token joins the sequence only when it is fed as a row, so a finished
 * stream's last token is not there. */
#include "serve_internal.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../model/model.h"

/* LOADING: admitted, its prefix coming from the disk cache (the cache's thread writes its rows);
 * it runs once the load is done. */
typedef enum slot_state { SLOT_EMPTY, SLOT_RESIDENT, SLOT_LOADING, SLOT_ACTIVE } slot_state;

typedef struct slot {
    slot_state state;
    uint64_t last_used; /* step counter at the last use (LRU) */
    /* the running stream (SLOT_ACTIVE) */
    serve_req *req;
    bool decoding; /* prompt done: the next row feeds next_token */
    bool snapped;  /* hybrid: the prompt's state before its last token is snapshotted */
    int32_t next_token;
    int32_t drafts[MOE_SPEC_MAX_DRAFT]; /* this step: the drafts fed after next_token */
    uint32_t n_draft;
    /* picking from a verify step's rows: a stream that ends meanwhile is saved to disk only
     * once its sequence has dropped the refused rows (its prompt length kept for that) */
    bool in_verify, save_pending;
    uint32_t save_n_prompt;
    int32_t logits_row;    /* this step: index of its logits row, or -1 */
    uint32_t row0, n_rows; /* this step: its first row in the batch, and how many it has */
    int32_t lp_row;        /* prompt_logprobs, this step: first of its prompt rows' logits rows */
    uint32_t lp_pos, lp_n; /* ... the position of the first of them, and how many */
    moe_sampler *sampler;
    moe_detok *detok;
    moe_strbuf hold; /* text held back: it may be the start of a stop string */
    uint32_t n_generated;
    uint32_t ram_reuse; /* LOADING: the prefix RAM gave, before the disk's */
    /* --spec mtp: the MTP head's cache holds entries for trunk positions mtp_off.. (entry q: the
     * hidden state of position mtp_off + q and the token after it); the hidden states of the
     * positions after those, up to the sequence's end, wait in mtp_h: mtp_pending of them, the
     * last one's follower not known yet (it is the token fed next). So, between steps,
     * mtp_off + the head's entries + mtp_pending = the sequence's length. */
    uint32_t mtp_off, mtp_pending;
    float *mtp_h;     /* [n_draft + 1][n_embd] */
    int32_t *mtp_tok; /* [n_draft + 1] the token after each of them */
    /* reasoning: inside a block?, its tokens so far, the closing tag's tokens still to force
     * (budget spent), and the last generated tokens and bytes (to see a tag complete) */
    bool in_think;
    uint32_t n_think, n_forcing;
    int32_t tail[SERVE_MAX_THINK_TAG];
    uint32_t n_tail;
    char ttail[SERVE_MAX_THINK_TEXT];
    size_t n_ttail;
} slot;

struct serve_sched {
    moe_serve_params p;
    serve_metrics *metrics;
    pthread_t thread;
    pthread_mutex_t mu; /* guards the waiting list, stop, load state */
    pthread_cond_t cv;
    serve_req *wait_head, *wait_tail;
    uint32_t n_waiting;
    bool stop, loaded, load_failed;
    bool disk_loaded; /* a disk cache load finished: the engine thread has work */
    char load_error[MOE_ERROR_MSG_MAX];
    /* engine-thread state (read-only for others once loaded: model, tok, n_ctx) */
    moe_model *model;
    moe_tokenizer *tok;
    moe_grammar_vocab *grammar_vocab; /* the tokenizer's byte trie, for constrained decoding */
    moe_ctx *ctx;
    moe_disk_cache *disk; /* --cache-dir, or NULL */
    uint32_t n_ctx, n_slots, n_vocab;
    bool hybrid; /* recurrent layers: prefixes come back only whole or from snapshots */
    slot *slots;
    moe_row *rows;            /* [parallel + SERVE_PREFILL_CHUNK] */
    int32_t *row_slot;        /* [same] which slot each row belongs to */
    uint32_t decode_rows_max; /* parallel x (1 + drafts per step) */
    float *logits;            /* [decode_rows_max + SERVE_PROMPT_LOGPROB_ROWS][n_vocab] */
    serve_rank *ranks;        /* [n_ranks] what each rank of an mpirun job holds (rank 0) */
    int n_ranks;
    int lost_rank;         /* a rank found gone, or -1 (under mu) */
    char lost_msg[256];    /* naming it, as a request's error (under mu) */
    double rank_looked_at; /* when the engine thread last looked for one */
    int32_t *hist;         /* [n_ctx + 1] --spec ngram: a stream's tokens and the one to feed */
    float *hidden;         /* --spec mtp: [max_rows][n_embd] the step's hidden states, by row */
    float *mtp_logits;     /* --spec mtp: [n_vocab] the head's scratch */
    uint64_t step;
};

const char *serve_cache_source_name(serve_cache_source src) {
    return src == SERVE_CACHE_DISK ? "disk" : src == SERVE_CACHE_RAM ? "ram" : "none";
}

double serve_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ==== Requests ==== */

void serve_gen_free(serve_gen *g) {
    free(g->prompt);
    free(g->bias_tokens);
    free(g->bias_values);
    moe_grammar_free(g->grammar);
    for (uint32_t i = 0; i < g->n_stop; i++) free(g->stop[i]);
    memset(g, 0, sizeof *g);
}

serve_req *serve_req_new(void) {
    serve_req *r = moe_xcalloc(1, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->refs = 1;
    r->stop_index = -1;
    r->gen.max_tokens = -1;
    r->gen.think_budget = -1;
    atomic_init(&r->cancel, false);
    return r;
}

void serve_req_notify(serve_req *r) {
    pthread_cond_broadcast(&r->cv);
    if (r->wake) r->wake(r->wake_ud);
}

void serve_req_release(serve_req *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    const int left = --r->refs;
    pthread_mutex_unlock(&r->mu);
    if (left > 0) return;
    serve_gen_free(&r->gen);
    free(r->events);
    moe_strbuf_free(&r->text);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

void serve_req_cancel(serve_req *r) {
    pthread_mutex_lock(&r->mu);
    if (!atomic_load(&r->cancel)) r->generated_at_cancel = r->n_generated;
    atomic_store(&r->cancel, true);
    pthread_mutex_unlock(&r->mu);
    serve_sched *s = r->sched;
    if (s) {
        pthread_mutex_lock(&s->mu);
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
}

bool serve_req_take(serve_req *r, serve_taken *t, double timeout_s) {
    t->n_events = 0;
    t->text.len = 0;
    pthread_mutex_lock(&r->mu);
    const bool was_admitted = t->admitted;
    if (r->n_events == 0 && !r->done && r->admitted == was_admitted && timeout_s > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        const double until = (double)ts.tv_nsec * 1e-9 + timeout_s;
        ts.tv_sec += (time_t)until;
        ts.tv_nsec = (long)((until - (double)(time_t)until) * 1e9);
        while (r->n_events == 0 && !r->done && r->admitted == was_admitted)
            if (pthread_cond_timedwait(&r->cv, &r->mu, &ts) == ETIMEDOUT) break;
    }
    if (r->n_events) {
        if (t->cap_events < r->n_events) {
            t->cap_events = r->n_events * 2;
            t->events = moe_xrealloc(t->events, t->cap_events * sizeof *t->events);
        }
        memcpy(t->events, r->events, r->n_events * sizeof *r->events);
        t->n_events = r->n_events;
        moe_strbuf_put(&t->text, r->text.s ? r->text.s : "", r->text.len);
        r->n_events = 0;
        r->text.len = 0;
    }
    t->admitted = r->admitted;
    const bool changed = t->n_events || r->done != t->done || t->admitted != was_admitted;
    t->done = r->done && r->n_events == 0;
    pthread_mutex_unlock(&r->mu);
    return changed;
}

void serve_taken_free(serve_taken *t) {
    free(t->events);
    moe_strbuf_free(&t->text);
    memset(t, 0, sizeof *t);
}

/* engine side: append an event (and its text) and wake the HTTP thread */
static void emit(serve_req *r, serve_event_kind kind, const char *text, size_t len,
                 const moe_sample *sample) {
    pthread_mutex_lock(&r->mu);
    if (r->n_events == r->cap_events) {
        r->cap_events = r->cap_events ? r->cap_events * 2 : 16;
        r->events = moe_xrealloc(r->events, r->cap_events * sizeof *r->events);
    }
    serve_event *e = &r->events[r->n_events++];
    e->kind = kind;
    e->text_off = r->text.len;
    e->text_len = len;
    if (sample)
        e->sample = *sample;
    else
        memset(&e->sample, 0, sizeof e->sample);
    moe_strbuf_put(&r->text, text, len);
    serve_req_notify(r);
    pthread_mutex_unlock(&r->mu);
}

/* ==== Slots ==== */

/* Tokens the slot's sequence holds (its next position). */
static uint32_t slot_len(const serve_sched *s, int idx) {
    return moe_ctx_seq_len(s->ctx, idx);
}

/* The slot for a prompt. A resident sequence that can give a prefix covering at least half of
 * what it holds is reused; otherwise an empty slot is taken, and only when none is left is a
 * resident one evicted: the best-prefix one if it can give anything, else the least recently
 * used. (The engine may still copy a prefix into the chosen slot from another one.) */
static int slot_choose(serve_sched *s, const serve_gen *g) {
    int best = -1, empty = -1, lru = -1, saving = -1;
    uint32_t best_n = 0;
    for (uint32_t i = 0; i < s->n_slots; i++) {
        slot *sl = &s->slots[i];
        if (sl->state == SLOT_ACTIVE || sl->state == SLOT_LOADING) continue;
        /* a resident sequence the disk cache is still saving stays as it is */
        if (sl->state == SLOT_RESIDENT && s->disk && moe_disk_cache_busy(s->disk, (int32_t)i)) {
            if (saving < 0 || sl->last_used < s->slots[saving].last_used) saving = (int)i;
            continue;
        }
        if (sl->state == SLOT_EMPTY) {
            if (empty < 0) empty = (int)i;
            continue;
        }
        if (lru < 0 || sl->last_used < s->slots[lru].last_used) lru = (int)i;
        const uint32_t n = moe_ctx_seq_prefix(s->ctx, (int32_t)i, g->prompt, g->n_prompt - 1);
        if (n > best_n || (n == best_n && n > 0 && sl->last_used < s->slots[best].last_used)) {
            best = (int)i;
            best_n = n;
        }
    }
    int pick;
    if (best >= 0 && best_n > 0 && (2 * (uint64_t)best_n >= slot_len(s, best) || empty < 0))
        pick = best;
    else
        pick = empty >= 0 ? empty : lru;
    if (pick < 0 && saving >= 0) { /* every other slot is busy: wait for the oldest save */
        moe_disk_cache_wait(s->disk, (int32_t)saving);
        pick = saving;
    }
    return pick;
}

/* ==== The MTP head per slot (--spec mtp) ==== */

/* Feed stream idx's head n entries: h[i] (a trunk hidden state, [n_embd]) with tok[i], the token
 * after it. */
static bool mtp_feed(serve_sched *s, int idx, const float *h, const int32_t *tok, uint32_t n,
                     moe_error *err) {
    if (n) moe_draft_mtp(s->ctx, idx, h, tok, n, 0, NULL, s->mtp_logits, err);
    return !err->code;
}

/* Rows row0.. of this step fed ids[0..n) to stream idx: their hidden states join the waiting
 * ones. feed: all but the last go to the head now (a prompt chunk is more than a slot keeps);
 * else they wait for the stream's next drafts, which feed them in the same call of the head. */
static bool mtp_take(serve_sched *s, int idx, uint32_t row0, const int32_t *ids, uint32_t n,
                     bool feed, moe_error *err) {
    slot *sl = &s->slots[idx];
    const size_t n_embd = s->model->cfg.n_embd;
    const float *h = s->hidden + row0 * n_embd;
    if (sl->mtp_pending) sl->mtp_tok[sl->mtp_pending - 1] = ids[0];
    if (feed) {
        if (!mtp_feed(s, idx, sl->mtp_h, sl->mtp_tok, sl->mtp_pending, err) ||
            !mtp_feed(s, idx, h, ids + 1, n - 1, err))
            return false;
        sl->mtp_pending = 0;
        h += (n - 1) * n_embd;
        ids += n - 1;
        n = 1;
    }
    MOE_CHECK(sl->mtp_pending + n <= s->p.n_draft + 1);
    memcpy(sl->mtp_h + sl->mtp_pending * n_embd, h, sizeof(float) * n * n_embd);
    for (uint32_t i = 0; i + 1 < n; i++) sl->mtp_tok[sl->mtp_pending + i] = ids[i + 1];
    sl->mtp_pending += n;
    /* every position of the sequence is in the head's cache or waits for it, once */
    MOE_CHECK(sl->mtp_off + moe_ctx_mtp_len(s->ctx, idx) + sl->mtp_pending == slot_len(s, idx));
    return true;
}

/* Stream idx's sequence was len_before tokens with its head at trunk position head_before
 * (mtp_off + its entries) and now holds the first `held` tokens of a prompt, reused from itself
 * (self) or from elsewhere. The head goes on where it was when its entries and the hidden states
 * kept reach position held - 1 (every entry's follower inside the prefix). Otherwise -- a prefix
 * from another sequence, from the disk cache, or from a snapshot before the head's position:
 * their hidden states are not kept -- its cache is emptied and starts again at position held,
 * the first one the prompt's prefill computes; drafts right after such a hit see only the new
 * tokens (lower acceptance for a while), and the output never depends on them. */
static void mtp_reuse(serve_sched *s, int idx, bool self, uint32_t len_before, uint32_t head_before,
                      uint32_t held) {
    slot *sl = &s->slots[idx];
    if (self && head_before < held && head_before + sl->mtp_pending == len_before) {
        sl->mtp_pending = held - head_before; /* the engine kept the head's entries (< held - 1) */
        return;
    }
    moe_ctx_mtp_rewind(s->ctx, idx, 0);
    sl->mtp_off = held;
    sl->mtp_pending = 0;
}

/* The disk cache can give more of the first n prompt tokens than RAM did (reuse tokens in the
 * slot): start loading it; false when there is nothing to load (or it could not start). */
static bool disk_load_begin(serve_sched *s, int idx, const serve_gen *g, uint32_t n,
                            uint32_t reuse) {
    moe_disk_hit hit;
    if (!s->disk || moe_disk_cache_find(s->disk, g->prompt, n, &hit) <= reuse) return false;
    moe_error err = {0};
    if (moe_disk_cache_load_begin(s->disk, idx, &hit, g->prompt, n, &err) == MOE_OK) return true;
    moe_log(MOE_LOG_WARN, "serve: prefix not taken from disk: %s", err.msg);
    return false;
}

/* The disk cache's thread finished a load: wake the engine thread. */
static void disk_loaded(void *arg) {
    serve_sched *s = arg;
    pthread_mutex_lock(&s->mu);
    s->disk_loaded = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* A finished sequence to the disk cache: all of it, and on a hybrid also the prompt's
 * snapshot (the point a conversation's next turn or a retry can come back to). */
static void disk_save(serve_sched *s, int idx, uint32_t n_prompt) {
    const uint32_t len = slot_len(s, idx);
    if (!s->disk || !len) return;
    moe_disk_cache_save(s->disk, idx, len);
    if (s->hybrid && n_prompt >= 2 && n_prompt - 1 < len)
        moe_disk_cache_save(s->disk, idx, n_prompt - 1);
}

/* The slot's sequence holds `reuse` tokens of the prompt (ram of them from RAM, the rest from
 * disk): the stream starts, and the request learns it has one. */
static void admit_finish(serve_sched *s, int idx, serve_req *r, uint32_t reuse, uint32_t ram) {
    slot *sl = &s->slots[idx];
    sl->state = SLOT_ACTIVE;
    sl->snapped = !s->hybrid || r->gen.n_prompt < 2;
    sl->req = r;
    sl->decoding = false;
    sl->n_generated = 0;
    sl->hold.len = 0;
    sl->in_think = r->gen.n_think_close && r->gen.think_at_start;
    sl->n_think = sl->n_forcing = sl->n_tail = 0;
    sl->n_ttail = 0;
    sl->last_used = s->step;
    r->gen.sampling.bias_tokens = r->gen.bias_tokens;
    r->gen.sampling.bias_values = r->gen.bias_values;
    r->gen.sampling.n_top_logprobs =
        r->gen.logprobs || r->gen.prompt_logprobs ? r->gen.sampling.n_top_logprobs : 0;
    r->gen.sampling.grammar = r->gen.grammar;
    r->gen.sampling.grammar_vocab = r->gen.grammar ? s->grammar_vocab : NULL;
    sl->sampler = moe_sampler_new(&r->gen.sampling, s->n_vocab);
    for (uint32_t i = 0; i < r->gen.n_prompt; i++)
        moe_sampler_accept(sl->sampler, r->gen.prompt[i]);
    /* SentencePiece's dummy-prefix space belongs to the prompt, not to the answer */
    sl->detok = moe_detok_new(s->tok, MOE_DECODE_SKIP_SPECIAL | MOE_DECODE_STRIP_PREFIX_SPACE);
    pthread_mutex_lock(&r->mu);
    r->admitted = true;
    r->n_cached = reuse;
    r->cached_from = reuse > ram ? SERVE_CACHE_DISK : reuse ? SERVE_CACHE_RAM : SERVE_CACHE_NONE;
    serve_req_notify(r);
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&s->metrics->mu);
    if (reuse) s->metrics->prefix_hits++;
    s->metrics->cached_tokens += reuse;
    if (reuse > ram) {
        s->metrics->disk_hits++;
        s->metrics->disk_tokens += reuse;
    }
    pthread_mutex_unlock(&s->metrics->mu);
}

static void admit(serve_sched *s, serve_req *r) {
    const int idx = slot_choose(s, &r->gen);
    MOE_CHECK(idx >= 0);
    slot *sl = &s->slots[idx];
    /* prompts are never empty (the HTTP layer refuses them); leave the last token to run */
    uint32_t reuse = 0;
    moe_error err = {0};
    /* prompt log-probabilities need the logits of every prompt row: nothing is reused */
    const uint32_t n_reusable = r->gen.prompt_logprobs ? 0 : r->gen.n_prompt - 1;
    const bool mtp = s->p.spec == MOE_SPEC_MTP;
    const uint32_t len_before = slot_len(s, idx),
                   head_before = mtp ? sl->mtp_off + moe_ctx_mtp_len(s->ctx, idx) : 0,
                   own = mtp ? moe_ctx_seq_prefix(s->ctx, idx, r->gen.prompt, n_reusable) : 0;
    MOE_CHECK(moe_ctx_seq_reuse(s->ctx, idx, r->gen.prompt, n_reusable, &reuse, &err) == MOE_OK);
    /* the sequence itself wins ties: as much as it could give means it gave it */
    if (mtp) mtp_reuse(s, idx, reuse == own, len_before, head_before, reuse);
    if (disk_load_begin(s, idx, &r->gen, n_reusable, reuse)) { /* admit_finish once it is in */
        sl->state = SLOT_LOADING;
        sl->req = r;
        sl->ram_reuse = reuse;
        sl->last_used = s->step;
        return;
    }
    admit_finish(s, idx, r, reuse, reuse);
}

/* Slots whose disk load is done start their streams (with RAM's prefix when it failed). wait:
 * wait for every load (shutting down). */
static void disk_loads_end(serve_sched *s, bool wait) {
    for (uint32_t i = 0; i < s->n_slots; i++) {
        slot *sl = &s->slots[i];
        if (sl->state != SLOT_LOADING) continue;
        if (wait) moe_disk_cache_wait(s->disk, (int32_t)i);
        moe_error err = {0};
        if (!moe_disk_cache_load_end(s->disk, (int32_t)i, &err)) continue;
        if (err.code) moe_log(MOE_LOG_WARN, "serve: prefix not taken from disk: %s", err.msg);
        if (s->p.spec == MOE_SPEC_MTP && slot_len(s, (int)i) > sl->ram_reuse)
            mtp_reuse(s, (int)i, false, 0, 0, slot_len(s, (int)i));
        admit_finish(s, (int)i, sl->req, slot_len(s, (int)i), sl->ram_reuse);
    }
}

/* The stream is over: release held text, report, free per-stream state, keep the sequence. */
static void finish(serve_sched *s, int idx, serve_finish why, int stop_index, const char *error) {
    slot *sl = &s->slots[idx];
    serve_req *r = sl->req;
    if (why != SERVE_FINISH_STOP && why != SERVE_FINISH_CANCELLED && why != SERVE_FINISH_ERROR) {
        size_t len;
        const char *rest = moe_detok_flush(sl->detok, &len);
        moe_strbuf_put(&sl->hold, rest, len);
        if (sl->hold.len) emit(r, SERVE_EV_TEXT, sl->hold.s, sl->hold.len, NULL);
    }
    sl->hold.len = 0;
    moe_sampler_free(sl->sampler);
    moe_detok_free(sl->detok);
    sl->sampler = NULL;
    sl->detok = NULL;
    sl->req = NULL;
    sl->state = slot_len(s, idx) ? SLOT_RESIDENT : SLOT_EMPTY;
    if (why == SERVE_FINISH_ERROR) {
        moe_error err = {0};
        MOE_CHECK(moe_ctx_seq_truncate(s->ctx, idx, 0, &err) == MOE_OK); /* 0 always works */
        sl->state = SLOT_EMPTY;
    } else if (sl->in_verify) { /* on_decoded saves it after taking refused rows back */
        sl->save_pending = true;
        sl->save_n_prompt = r->gen.n_prompt;
    } else {
        disk_save(s, idx, r->gen.n_prompt);
    }
    sl->last_used = s->step;
    pthread_mutex_lock(&r->mu);
    r->finish = why;
    r->stop_index = stop_index;
    if (error) snprintf(r->error, sizeof r->error, "%s", error);
    r->done = true;
    const uint32_t after_cancel = r->n_generated - r->generated_at_cancel;
    serve_req_notify(r);
    pthread_mutex_unlock(&r->mu);
    if (why == SERVE_FINISH_CANCELLED) {
        pthread_mutex_lock(&s->metrics->mu);
        s->metrics->cancelled++;
        if (atomic_load(&r->cancel)) {
            s->metrics->tokens_after_cancel += after_cancel;
            if (after_cancel > s->metrics->tokens_after_cancel_max)
                s->metrics->tokens_after_cancel_max = after_cancel;
        }
        pthread_mutex_unlock(&s->metrics->mu);
    }
    serve_req_release(r);
}

/* A request that never got a slot (cancelled while waiting). */
static void finish_waiting(serve_sched *s, serve_req *r) {
    pthread_mutex_lock(&r->mu);
    r->finish = SERVE_FINISH_CANCELLED;
    r->done = true;
    serve_req_notify(r);
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&s->metrics->mu);
    s->metrics->cancelled++;
    pthread_mutex_unlock(&s->metrics->mu);
    serve_req_release(r);
}

/* ==== A rank of the job gone ==== */

/* The request fails with error, answered 503 (the server cannot go on). */
static void mark_unavailable(serve_req *r) {
    pthread_mutex_lock(&r->mu);
    r->unavailable = true;
    pthread_mutex_unlock(&r->mu);
}

/* Under mpirun: whether a rank of the job is gone (looked for at most every SERVE_RANK_WATCH_S,
 * or found by the last step's waits). The first time, every stream and waiting request fails
 * naming it, and submits are refused from then on. */
static bool rank_loss(serve_sched *s) {
    if (s->n_ranks <= 1) return false;
    if (s->lost_rank >= 0) return true; /* only this thread writes it */
    const double now = serve_now();
    const bool look = now - s->rank_looked_at >= SERVE_RANK_WATCH_S;
    if (look) s->rank_looked_at = now;
    moe_error err = {0};
    const int lost = moe_dist_lost(look, &err);
    if (lost < 0) return false;
    moe_log(MOE_LOG_ERROR, "serve: %s: failing every request, stopping in %.0f s", err.msg,
            SERVE_RANK_LOST_LINGER_S);
    pthread_mutex_lock(&s->mu);
    s->lost_rank = lost;
    snprintf(s->lost_msg, sizeof s->lost_msg, "%.200s: this server is stopping", err.msg);
    serve_req *w = s->wait_head;
    s->wait_head = s->wait_tail = NULL;
    s->n_waiting = 0;
    pthread_mutex_unlock(&s->mu);
    for (uint32_t i = 0; i < s->n_slots; i++)
        if (s->slots[i].state == SLOT_ACTIVE) {
            mark_unavailable(s->slots[i].req);
            finish(s, (int)i, SERVE_FINISH_ERROR, -1, s->lost_msg);
        }
    while (w) {
        serve_req *next = w->next;
        mark_unavailable(w);
        pthread_mutex_lock(&w->mu);
        w->finish = SERVE_FINISH_ERROR;
        snprintf(w->error, sizeof w->error, "%s", s->lost_msg);
        w->done = true;
        serve_req_notify(w);
        pthread_mutex_unlock(&w->mu);
        serve_req_release(w);
        w = next;
    }
    return true;
}

/* After a loss: answer 503 for SERVE_RANK_LOST_LINGER_S (unless stopped first), then signal the
 * process to stop (moe_serve_run's sigwait), which ends the job. */
static void rank_loss_linger(serve_sched *s) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)SERVE_RANK_LOST_LINGER_S;
    pthread_mutex_lock(&s->mu);
    while (!s->stop && pthread_cond_timedwait(&s->cv, &s->mu, &until) != ETIMEDOUT) {
    }
    const bool stopped = s->stop;
    pthread_mutex_unlock(&s->mu);
    if (!stopped) kill(getpid(), SIGTERM);
}

/* ==== Stop strings ==== */

/* Longest suffix of text that is a proper prefix of some stop string. */
static size_t stop_partial(const serve_gen *g, const char *text, size_t len) {
    size_t best = 0;
    for (uint32_t i = 0; i < g->n_stop; i++) {
        const size_t sl = strlen(g->stop[i]);
        for (size_t k = sl - 1 < len ? sl - 1 : len; k > best; k--)
            if (memcmp(text + len - k, g->stop[i], k) == 0) {
                best = k;
                break;
            }
    }
    return best;
}

/* Feed new text through the stop matcher: emits what is safe; returns the stop index or -1. */
static int stop_feed(slot *sl, const moe_sample *sample, const char *text, size_t len) {
    const serve_gen *g = &sl->req->gen;
    if (g->n_stop == 0) {
        emit(sl->req, SERVE_EV_TOKEN, text, len, sample);
        return -1;
    }
    moe_strbuf_put(&sl->hold, text, len);
    size_t first = SIZE_MAX;
    int which = -1;
    for (uint32_t i = 0; i < g->n_stop; i++) {
        const char *at = memmem(sl->hold.s, sl->hold.len, g->stop[i], strlen(g->stop[i]));
        if (at && (size_t)(at - sl->hold.s) < first) {
            first = (size_t)(at - sl->hold.s);
            which = (int)i;
        }
    }
    if (which >= 0) {
        emit(sl->req, SERVE_EV_TOKEN, sl->hold.s, first, sample);
        sl->hold.len = 0;
        return which;
    }
    const size_t keep = stop_partial(g, sl->hold.s, sl->hold.len);
    const size_t out = sl->hold.len - keep;
    emit(sl->req, SERVE_EV_TOKEN, sl->hold.s, out, sample);
    memmove(sl->hold.s, sl->hold.s + out, keep);
    sl->hold.len = keep;
    return -1;
}

/* ==== Reasoning budget ==== */

static bool tail_ends_with(const slot *sl, const int32_t *tag, uint32_t n) {
    if (!n || sl->n_tail < n) return false;
    return memcmp(sl->tail + sl->n_tail - n, tag, n * sizeof *tag) == 0;
}

/* The next token: sampled, or -- once the budget is spent inside a block -- the closing tag's
 * next token, scored (its logprob) and remembered for the penalties like a sampled one. */
static moe_sample next_token(slot *sl, const float *logits) {
    const serve_gen *g = &sl->req->gen;
    if (!sl->n_forcing && sl->in_think && g->think_budget >= 0 && sl->n_think >= g->think_budget)
        sl->n_forcing = g->n_think_close;
    if (!sl->n_forcing) return moe_sampler_sample(sl->sampler, logits);
    const int32_t token = g->think_close[g->n_think_close - sl->n_forcing--];
    moe_sample smp = moe_sampler_score(sl->sampler, logits, token);
    moe_sampler_accept(sl->sampler, token);
    moe_grammar_state *grammar = moe_sampler_grammar(sl->sampler);
    if (grammar) moe_grammar_state_accept(grammar, token); /* a grammar follows the text too */
    return smp;
}

static bool text_ends_with(const slot *sl, const char *tag) {
    const size_t n = strlen(tag);
    return n && sl->n_ttail >= n && memcmp(sl->ttail + sl->n_ttail - n, tag, n) == 0;
}

/* Keep the last SERVE_MAX_THINK_TAG ids and SERVE_MAX_THINK_TEXT - 1 bytes generated. */
static void tails_push(slot *sl, int32_t token, const char *text, size_t len) {
    if (sl->n_tail == SERVE_MAX_THINK_TAG) {
        memmove(sl->tail, sl->tail + 1, (SERVE_MAX_THINK_TAG - 1) * sizeof *sl->tail);
        sl->n_tail--;
    }
    sl->tail[sl->n_tail++] = token;
    const size_t cap = SERVE_MAX_THINK_TEXT - 1;
    if (len >= cap) {
        memcpy(sl->ttail, text + len - cap, cap);
        sl->n_ttail = cap;
        return;
    }
    if (sl->n_ttail + len > cap) {
        const size_t drop = sl->n_ttail + len - cap;
        memmove(sl->ttail, sl->ttail + drop, sl->n_ttail - drop);
        sl->n_ttail -= drop;
    }
    memcpy(sl->ttail + sl->n_ttail, text, len);
    sl->n_ttail += len;
}

/* A generated token and the text it released: counts inside a block; a tag completed -- as the
 * tag's own tokens, or as its text however the model spelled it in tokens -- opens or closes
 * one (and clears the tails, so that it is not seen twice). */
static void track_reasoning(slot *sl, int32_t token, const char *text, size_t len) {
    const serve_gen *g = &sl->req->gen;
    if (!g->n_think_close) return;
    tails_push(sl, token, text, len);
    bool flip;
    if (sl->in_think) {
        sl->n_think++;
        flip = tail_ends_with(sl, g->think_close, g->n_think_close) ||
               text_ends_with(sl, g->think_close_text);
    } else {
        flip = tail_ends_with(sl, g->think_open, g->n_think_open) ||
               text_ends_with(sl, g->think_open_text);
    }
    if (flip) {
        sl->in_think = !sl->in_think;
        sl->n_tail = sl->n_ttail = 0;
    }
}

/* ==== The step ==== */

/* A logits row of stream idx, whose sequence then holds `held` tokens: the next token. */
static void on_logits(serve_sched *s, int idx, const float *logits, uint32_t held) {
    slot *sl = &s->slots[idx];
    serve_req *r = sl->req;
    if (r->gen.max_tokens == 0) { /* echo of the prompt alone */
        finish(s, idx, SERVE_FINISH_LENGTH, -1, NULL);
        return;
    }
    const moe_sample smp = next_token(sl, logits);
    if (sl->n_generated == 0) {
        const double now = serve_now();
        pthread_mutex_lock(&r->mu);
        r->t_first_token = now;
        pthread_mutex_unlock(&r->mu);
        const double ttft = now - r->t_submit;
        pthread_mutex_lock(&s->metrics->mu);
        int b = 0;
        while (b < SERVE_TTFT_BUCKETS && ttft > serve_ttft_bounds[b]) b++;
        s->metrics->ttft_buckets[b]++;
        s->metrics->ttft_count++;
        s->metrics->ttft_sum += ttft;
        pthread_mutex_unlock(&s->metrics->mu);
    }
    if (moe_tokenizer_is_eog(s->tok, smp.token) && !r->gen.ignore_eos) {
        finish(s, idx, SERVE_FINISH_EOG, -1, NULL);
        return;
    }
    sl->n_generated++;
    pthread_mutex_lock(&s->metrics->mu);
    s->metrics->generated_tokens++;
    pthread_mutex_unlock(&s->metrics->mu);
    const char *text = "";
    size_t len = 0;
    moe_error err = {0};
    if (moe_detok_push(sl->detok, smp.token, &text, &len, &err) != MOE_OK) {
        finish(s, idx, SERVE_FINISH_ERROR, -1, err.msg);
        return;
    }
    track_reasoning(sl, smp.token, text, len);
    pthread_mutex_lock(&r->mu);
    r->n_generated = sl->n_generated;
    r->n_reasoning = sl->n_think;
    pthread_mutex_unlock(&r->mu);
    const int stop = stop_feed(sl, &smp, text, len);
    if (stop >= 0)
        finish(s, idx, SERVE_FINISH_STOP, stop, NULL);
    else if (r->gen.max_tokens >= 0 && sl->n_generated >= (uint64_t)r->gen.max_tokens)
        finish(s, idx, SERVE_FINISH_LENGTH, -1, NULL);
    else if (held >= s->n_ctx)
        finish(s, idx, SERVE_FINISH_LENGTH, -1, NULL);
    else {
        sl->decoding = true;
        sl->next_token = smp.token;
    }
}

/* Stream idx's rows this step: its next token, then its drafts. The sampler picks from each
 * row in turn as it would step by step; a draft is kept while it equals the pick, and the
 * sequence keeps the rows up to the first pick that differs (or that ended the stream). */
static void on_decoded(serve_sched *s, int idx, const float *logits) {
    slot *sl = &s->slots[idx];
    const uint32_t n_draft = sl->n_draft, before = sl->n_generated;
    int32_t fed[MOE_SPEC_MAX_DRAFT + 1]; /* the rows' tokens: next_token, then the drafts */
    fed[0] = sl->next_token;
    memcpy(fed + 1, sl->drafts, sizeof(int32_t) * n_draft);
    const uint32_t held = slot_len(s, idx) - n_draft; /* without the drafts */
    uint32_t kept = 0;
    uint64_t drafted[MOE_SPEC_MAX_DRAFT] = {0}, accepted[MOE_SPEC_MAX_DRAFT] = {0};
    sl->in_verify = n_draft > 0;
    sl->save_pending = false;
    for (;;) {
        on_logits(s, idx, logits + (size_t)kept * s->n_vocab, held + kept);
        if (kept == n_draft || sl->state != SLOT_ACTIVE) break;
        drafted[kept]++;
        if (sl->next_token != sl->drafts[kept]) break;
        accepted[kept++]++;
    }
    moe_error err = {0};
    if (kept < n_draft && moe_ctx_seq_accept(s->ctx, idx, kept + 1, &err) != MOE_OK) {
        if (sl->state == SLOT_ACTIVE)
            finish(s, idx, SERVE_FINISH_ERROR, -1, err.msg);
        else if (sl->state == SLOT_RESIDENT) { /* never keep a sequence holding refused drafts */
            MOE_CHECK(moe_ctx_seq_truncate(s->ctx, idx, 0, &err) == MOE_OK);
            sl->state = SLOT_EMPTY;
        }
    }
    sl->in_verify = false;
    /* --spec mtp: the kept rows' hidden states wait for the stream's next drafts */
    if (s->p.spec == MOE_SPEC_MTP && sl->state != SLOT_EMPTY)
        mtp_take(s, idx, sl->row0, fed, kept + 1, false, &err);
    if (sl->save_pending && sl->state == SLOT_RESIDENT) disk_save(s, idx, sl->save_n_prompt);
    sl->save_pending = false;
    pthread_mutex_lock(&s->metrics->mu);
    for (uint32_t k = 0; k < n_draft; k++) {
        s->metrics->spec_drafted[k] += drafted[k];
        s->metrics->spec_accepted[k] += accepted[k];
    }
    s->metrics->stream_steps++;
    s->metrics->stream_step_tokens += sl->n_generated - before;
    pthread_mutex_unlock(&s->metrics->mu);
}

/* With --spec: the drafts to feed after stream idx's next token this step (sl->n_draft of
 * them), as many as --draft, the context and max_tokens leave room for; prompt lookup, or the
 * MTP head once it has caught up with the stream's waiting hidden states (it catches up even
 * when there is no room to draft). False on an error of the head. */
static bool draft(serve_sched *s, int idx, moe_error *err) {
    slot *sl = &s->slots[idx];
    const serve_gen *g = &sl->req->gen;
    const uint32_t len = slot_len(s, idx);
    uint32_t want = s->p.spec ? s->p.n_draft : 0;
    if (want > s->n_ctx - len - 1) want = s->n_ctx - len - 1; /* each draft takes a position */
    if (g->max_tokens >= 0 && want >= (uint64_t)g->max_tokens - sl->n_generated)
        want = (uint32_t)((uint64_t)g->max_tokens - sl->n_generated - 1); /* its pick: a token */
    sl->n_draft = 0;
    if (s->p.spec == MOE_SPEC_MTP) {
        if (!sl->mtp_pending) return true;
        sl->mtp_tok[sl->mtp_pending - 1] = sl->next_token;
        sl->n_draft = moe_draft_mtp(s->ctx, idx, sl->mtp_h, sl->mtp_tok, sl->mtp_pending, want,
                                    sl->drafts, s->mtp_logits, err);
        sl->mtp_pending = 0;
        return !err->code;
    }
    if (!want) return true;
    memcpy(s->hist, moe_ctx_seq_tokens(s->ctx, idx), sizeof(int32_t) * len);
    s->hist[len] = sl->next_token;
    sl->n_draft = moe_draft_ngram(s->hist, len + 1, want, sl->drafts);
    return true;
}

/* --spec mtp: keep the last forward call's hidden states as the step's rows from `at` on. */
static void hidden_keep(serve_sched *s, uint32_t at) {
    if (!s->hidden) return;
    const size_t n_embd = s->model->cfg.n_embd;
    uint32_t n;
    const float *h = moe_ctx_hidden(s->ctx, &n);
    memcpy(s->hidden + at * n_embd, h, sizeof(float) * n * n_embd);
}

/* The prompt rows this step ran with logits: each scores the prompt token after it. */
static void prompt_logprobs(serve_sched *s, slot *sl) {
    const serve_gen *g = &sl->req->gen;
    for (uint32_t k = 0; k < sl->lp_n; k++) {
        const uint32_t pos = sl->lp_pos + k;
        if (pos + 1 >= g->n_prompt) break;
        const float *row = s->logits + (size_t)(sl->lp_row + (int32_t)k) * s->n_vocab;
        const moe_sample smp = moe_sampler_score(sl->sampler, row, g->prompt[pos + 1]);
        emit(sl->req, SERVE_EV_PROMPT, "", 0, &smp);
    }
    sl->lp_n = 0;
}

/* One forward step over every active stream; false when there was nothing to do. */
static bool step(serve_sched *s) {
    uint32_t n_rows = 0, n_logits = 0, n_decode = 0, n_drafts = 0, n_streams = 0, n_drafting = 0;
    /* hybrid: snapshot each prompt that reached its last token, before that token runs */
    for (uint32_t i = 0; i < s->n_slots; i++) {
        slot *sl = &s->slots[i];
        if (sl->state != SLOT_ACTIVE || sl->decoding || sl->snapped ||
            slot_len(s, (int)i) + 1 != sl->req->gen.n_prompt)
            continue;
        moe_error err = {0};
        sl->snapped = true; /* a failure only costs later reuse */
        if (moe_ctx_seq_snapshot(s->ctx, (int32_t)i, &err) < 0)
            moe_log(MOE_LOG_WARN, "serve: no prompt snapshot: %s", err.msg);
    }
    /* decode rows first: one per running stream, each followed by its drafts */
    for (uint32_t i = 0; i < s->n_slots; i++) {
        slot *sl = &s->slots[i];
        sl->logits_row = -1;
        sl->lp_n = 0;
        sl->n_draft = 0;
        sl->n_rows = 0;
        if (sl->state != SLOT_ACTIVE || !sl->decoding) continue;
        moe_error err = {0};
        if (!draft(s, (int)i, &err)) {
            finish(s, (int)i, SERVE_FINISH_ERROR, -1, err.msg);
            continue;
        }
        const uint32_t len = slot_len(s, (int)i);
        sl->logits_row = (int32_t)n_logits;
        sl->row0 = n_rows;
        sl->n_rows = 1 + sl->n_draft;
        for (uint32_t k = 0; k <= sl->n_draft; k++) {
            s->rows[n_rows] = (moe_row){.seq = (int32_t)i,
                                        .pos = (int32_t)(len + k),
                                        .token = k ? sl->drafts[k - 1] : sl->next_token,
                                        .logits = true};
            s->row_slot[n_rows++] = (int32_t)i;
            n_logits++;
        }
        n_decode += 1 + sl->n_draft;
        n_drafts += sl->n_draft;
        n_drafting += sl->n_draft > 0;
        n_streams++;
    }
    /* then prompt rows, oldest request first, up to the chunk budget */
    uint32_t budget = SERVE_PREFILL_CHUNK, lp_budget = SERVE_PROMPT_LOGPROB_ROWS;
    while (budget) {
        int pick = -1;
        for (uint32_t i = 0; i < s->n_slots; i++) {
            slot *sl = &s->slots[i];
            /* logits_row != -1: it has rows in this batch already */
            if (sl->state != SLOT_ACTIVE || sl->decoding || sl->logits_row != -1) continue;
            if (pick < 0 || sl->req->t_submit < s->slots[pick].req->t_submit) pick = (int)i;
        }
        if (pick < 0) break;
        slot *sl = &s->slots[pick];
        const serve_gen *g = &sl->req->gen;
        const uint32_t len = slot_len(s, pick);
        /* not yet snapshotted: stop before the last prompt token (the next step takes it) */
        uint32_t n = g->n_prompt - len - (sl->snapped ? 0 : 1);
        if (n > budget) n = budget;
        if (g->prompt_logprobs) {
            if (n > lp_budget) n = lp_budget;
            lp_budget -= n;
            sl->lp_row = (int32_t)n_logits;
            sl->lp_pos = len;
            sl->lp_n = n;
        }
        sl->row0 = n_rows;
        sl->n_rows = n;
        for (uint32_t k = 0; k < n; k++) {
            const uint32_t pos = len + k;
            const bool last = pos + 1 == g->n_prompt;
            s->rows[n_rows] = (moe_row){.seq = pick,
                                        .pos = (int32_t)pos,
                                        .token = g->prompt[pos],
                                        .logits = last || g->prompt_logprobs};
            s->row_slot[n_rows++] = pick;
            if (last) sl->logits_row = (int32_t)n_logits;
            if (last || g->prompt_logprobs) n_logits++;
        }
        budget -= n;
        if (sl->logits_row < 0) sl->logits_row = -2; /* has rows this step, no logits yet */
    }
    if (!n_rows) return false;
    const double t0 = serve_now();
    moe_error err = {0};
    moe_status st;
    if (n_drafts) { /* the decode rows may be taken back; the prompt rows in a call of their own */
        st = moe_ctx_verify(s->ctx, s->rows, n_decode, s->logits, &err);
        if (st == MOE_OK) hidden_keep(s, 0);
        if (st == MOE_OK && n_rows > n_decode)
            st = moe_ctx_decode(s->ctx, s->rows + n_decode, n_rows - n_decode,
                                s->logits + (size_t)n_decode * s->n_vocab, &err);
        if (st == MOE_OK && n_rows > n_decode) hidden_keep(s, n_decode);
    } else {
        st = moe_ctx_decode(s->ctx, s->rows, n_rows, s->logits, &err);
        if (st == MOE_OK) hidden_keep(s, 0);
    }
    if (st != MOE_OK && rank_loss(s)) return true; /* its streams failed naming the rank */
    const double dt = serve_now() - t0;
    pthread_mutex_lock(&s->metrics->mu);
    const uint32_t n_prefill = n_rows - n_decode;
    s->metrics->prompt_tokens += n_prefill;
    s->metrics->prefill_rows += n_prefill;
    s->metrics->decode_rows += n_decode;
    s->metrics->prefill_seconds += dt * n_prefill / n_rows;
    s->metrics->decode_seconds += dt * n_decode / n_rows;
    if (n_prefill) s->metrics->prefill_tps = n_prefill / (dt * n_prefill / n_rows);
    if (n_decode) s->metrics->decode_tps = n_decode / (dt * n_decode / n_rows);
    if (n_streams > s->metrics->decode_batch_max) s->metrics->decode_batch_max = n_streams;
    if (n_drafting > s->metrics->spec_streams_max) s->metrics->spec_streams_max = n_drafting;
    pthread_mutex_unlock(&s->metrics->mu);
    for (uint32_t i = 0; i < s->n_slots; i++) {
        slot *sl = &s->slots[i];
        if (sl->state != SLOT_ACTIVE || sl->logits_row == -1) continue;
        if (st != MOE_OK) {
            finish(s, (int)i, SERVE_FINISH_ERROR, -1, err.msg);
            continue;
        }
        prompt_logprobs(s, sl);
        moe_error head_err = {0}; /* --spec mtp: prompt rows' hidden states go to the head */
        if (s->hidden && !sl->decoding && sl->n_rows &&
            !mtp_take(s, (int)i, sl->row0, sl->req->gen.prompt + slot_len(s, (int)i) - sl->n_rows,
                      sl->n_rows, true, &head_err)) {
            finish(s, (int)i, SERVE_FINISH_ERROR, -1, head_err.msg);
            continue;
        }
        if (sl->logits_row < 0) continue;
        const float *row = s->logits + (size_t)sl->logits_row * s->n_vocab;
        if (sl->decoding)
            on_decoded(s, (int)i, row);
        else
            on_logits(s, (int)i, row, slot_len(s, (int)i));
    }
    if (st != MOE_OK) moe_log(MOE_LOG_ERROR, "serve: forward step failed: %s", err.msg);
    s->step++;
    return true;
}

static void update_gauges(serve_sched *s) {
    uint32_t active = 0, resident = 0;
    for (uint32_t i = 0; i < s->n_slots; i++) {
        active += s->slots[i].state == SLOT_ACTIVE || s->slots[i].state == SLOT_LOADING;
        resident += s->slots[i].state == SLOT_RESIDENT;
    }
    pthread_mutex_lock(&s->mu);
    const uint32_t waiting = s->n_waiting;
    pthread_mutex_unlock(&s->mu);
    moe_disk_cache_stats disk = {0};
    if (s->disk) moe_disk_cache_get_stats(s->disk, &disk);
    const moe_expert_cache_stats cache = moe_ctx_expert_cache_stats(s->ctx);
    pthread_mutex_lock(&s->metrics->mu);
    s->metrics->expert_cache = cache;
    s->metrics->active = active;
    s->metrics->resident = resident;
    s->metrics->waiting = waiting;
    s->metrics->disk_cache = s->disk != NULL;
    s->metrics->disk_stats = disk;
    pthread_mutex_unlock(&s->metrics->mu);
}

/* ==== Metrics of the prefix cache ==== */

void serve_metrics_write_prefix_cache(const serve_metrics *m, moe_strbuf *o) {
    const struct {
        const char *name, *help;
        uint64_t ram, disk;
    } by_source[] = {
        {"moe_prefix_cache_hits_total", "Requests that reused a prefix, by where it came from.",
         m->prefix_hits - m->disk_hits, m->disk_hits},
        {"moe_prefix_cache_tokens_total", "Prompt tokens reused instead of recomputed, by source.",
         m->cached_tokens - m->disk_tokens, m->disk_tokens},
    };
    for (size_t i = 0; i < sizeof by_source / sizeof by_source[0]; i++)
        moe_strbuf_printf(o,
                          "# HELP %s %s\n# TYPE %s counter\n%s{source=\"ram\"} %llu\n"
                          "%s{source=\"disk\"} %llu\n",
                          by_source[i].name, by_source[i].help, by_source[i].name,
                          by_source[i].name, (unsigned long long)by_source[i].ram,
                          by_source[i].name, (unsigned long long)by_source[i].disk);
    if (!m->disk_cache) return;
    const moe_disk_cache_stats *d = &m->disk_stats;
    const struct {
        const char *name, *type, *help;
        uint64_t v;
    } disk[] = {
        {"moe_disk_cache_entries", "gauge", "Entries in the cache directory.", d->entries},
        {"moe_disk_cache_bytes", "gauge", "Bytes of the entries in the cache directory.", d->bytes},
        {"moe_disk_cache_limit_bytes", "gauge", "--cache-disk-size.", d->max_bytes},
        {"moe_disk_cache_writes_total", "counter", "Entries written.", d->writes},
        {"moe_disk_cache_write_bytes_total", "counter", "Bytes written.", d->write_bytes},
        {"moe_disk_cache_evictions_total", "counter",
         "Entries removed for the size limit or superseded by a longer one.", d->evicted},
        {"moe_disk_cache_corrupt_total", "counter",
         "Damaged or truncated entries found, removed and not used.", d->corrupt},
        {"moe_disk_cache_write_errors_total", "counter", "Entries that could not be written.",
         d->write_errors},
    };
    for (size_t i = 0; i < sizeof disk / sizeof disk[0]; i++)
        moe_strbuf_printf(o, "# HELP %s %s\n# TYPE %s %s\n%s %llu\n", disk[i].name, disk[i].help,
                          disk[i].name, disk[i].type, disk[i].name, (unsigned long long)disk[i].v);
}

/* ==== The thread ==== */

bool serve_spec_resolve(moe_serve_params *p, const moe_model *m, moe_error *err) {
    if (!p->spec_given && m->n_layer_mtp) p->spec = MOE_SPEC_MTP; /* as run and chat */
    if (p->spec == MOE_SPEC_MTP && !m->n_layer_mtp)
        moe_error_set(err, MOE_ERR_UNSUPPORTED,
                      "--spec mtp: %s has no multi-token-prediction layer moe can run (--spec "
                      "ngram drafts without one)",
                      p->model_path);
    return !err->code;
}

/* The model and context s->p asks for (every rank of a split job opens the same); false with
 * err set. */
static bool open_engine(serve_sched *s, moe_error *err) {
    const char *path = s->p.model_path;
    s->model = moe_model_load(path, err);
    moe_pool *readers = moe_pool_new(s->p.n_threads); /* the weights are read on every thread */
    if (s->model && !s->p.use_mmap) {
        moe_gguf_set_progress(s->model->gguf, "moe serve");
        moe_gguf_to_memory_except(s->model->gguf, readers,
                                  s->p.expert_cache_bytes || s->p.split == MOE_SPLIT_ROWS
                                      ? moe_model_is_routed /* read apart, or not at all */
                                      : NULL,
                                  s->model, NULL, err);
    }
    moe_layout_report repack = {0};
    if (!err->code && !s->p.use_mmap && !s->p.no_repack) /* --mmap: the mapping stays as it is */
        moe_model_repack(s->model, !s->p.expert_cache_bytes && s->p.split == MOE_SPLIT_NONE,
                         readers, &repack, err);
    moe_pool_free(readers);
    if (err->code) return false;
    moe_layout_report_print("moe serve", &repack);
    if (!serve_spec_resolve(&s->p, s->model, err)) return false;
    if (s->p.split != MOE_SPLIT_NONE && s->p.cache_dir) {
        moe_error_set(err, MOE_ERR_UNSUPPORTED,
                      "--cache-dir is not supported under mpirun (--split) yet: the disk cache "
                      "would restore rank 0's state alone");
        return false;
    }
    s->n_slots = (uint32_t)(s->p.parallel + serve_cache_slots(&s->p));
    const uint32_t n_verify = s->p.spec ? s->p.n_draft + 1 : 0;
    s->decode_rows_max = (uint32_t)s->p.parallel * (n_verify ? n_verify : 1);
    const moe_ctx_params cp = {.n_ctx = s->p.n_ctx,
                               .n_seq = s->n_slots,
                               .max_rows = s->decode_rows_max + SERVE_PREFILL_CHUNK,
                               .kv_type = s->p.kv_type,
                               .n_threads = s->p.n_threads,
                               .expert_cache_bytes = s->p.expert_cache_bytes,
                               .expert_stats = s->p.expert_stats,
                               .pin_experts = s->p.pin_experts,
                               .n_verify = n_verify,
                               .split = s->p.split,
                               .split_dense = s->p.split_dense};
    s->ctx = moe_ctx_new(s->model, &cp, err);
    if (!s->ctx) return false;
    /* what each rank holds, for /health: gathered once, on every rank */
    serve_rank mine = {.rank = moe_dist_rank(),
                       .pid = (int32_t)getpid(),
                       .routed_bytes = moe_ctx_routed_bytes(s->ctx),
                       .rss_bytes = moe_rss_bytes()};
    gethostname(mine.host, sizeof mine.host - 1);
    s->n_ranks = moe_dist_size();
    if (moe_dist_rank() == 0) s->ranks = moe_xcalloc((size_t)s->n_ranks, sizeof *s->ranks);
    moe_dist_gather(&mine, sizeof mine, s->ranks);
    return true;
}

static bool load(serve_sched *s) {
    moe_error err = {0};
    const char *path = s->p.model_path;
    if (!open_engine(s, &err)) goto fail;
    s->tok = moe_tokenizer_from_gguf(s->model->gguf, &err);
    if (s->tok && moe_tokenizer_n_vocab(s->tok) != s->model->cfg.n_vocab)
        moe_error_set(&err, MOE_ERR_FORMAT, "%s: the vocabulary has %u tokens but the model %u",
                      path, moe_tokenizer_n_vocab(s->tok), s->model->cfg.n_vocab);
    if (err.code) goto fail;
    moe_ctx_lead(s->ctx);    /* with a split: the other ranks replay its calls */
    moe_dist_outlive_loss(); /* a rank gone: answer 503, then stop (rank_loss) */
    const uint32_t max_rows = s->decode_rows_max + SERVE_PREFILL_CHUNK;
    if (s->p.cache_dir) {
        const uint64_t limit =
            s->p.cache_disk_bytes ? s->p.cache_disk_bytes : SERVE_CACHE_DISK_DEFAULT;
        s->disk = moe_disk_cache_open(s->ctx, s->p.cache_dir, limit, &err);
        if (!s->disk) goto fail;
        moe_disk_cache_on_load(s->disk, disk_loaded, s);
        moe_disk_cache_stats st;
        moe_disk_cache_get_stats(s->disk, &st);
        moe_log(MOE_LOG_INFO, "serve: disk cache %s: %llu entries, %.1f of %.1f MiB",
                s->p.cache_dir, (unsigned long long)st.entries, (double)st.bytes / (1 << 20),
                (double)limit / (1 << 20));
    }
    s->n_ctx = moe_ctx_n_ctx(s->ctx);
    s->n_vocab = s->model->cfg.n_vocab;
    s->grammar_vocab = moe_chat_grammar_vocab(s->tok, true); /* once: every grammar walks it */
    s->hybrid = s->model->cfg.n_layer_linear > 0;
    s->slots = moe_xcalloc(s->n_slots, sizeof *s->slots);
    s->rows = moe_xmalloc(sizeof(moe_row) * max_rows);
    s->row_slot = moe_xmalloc(sizeof(int32_t) * max_rows);
    s->logits = moe_xmalloc(sizeof(float) * (size_t)s->n_vocab *
                            ((size_t)s->decode_rows_max + SERVE_PROMPT_LOGPROB_ROWS));
    s->hist = moe_xmalloc(sizeof(int32_t) * ((size_t)s->n_ctx + 1));
    if (s->p.spec == MOE_SPEC_MTP) {
        const size_t n_embd = s->model->cfg.n_embd, keep = s->p.n_draft + 1;
        s->hidden = moe_xmalloc(sizeof(float) * max_rows * n_embd);
        s->mtp_logits = moe_xmalloc(sizeof(float) * s->n_vocab);
        for (uint32_t i = 0; i < s->n_slots; i++) {
            s->slots[i].mtp_h = moe_xmalloc(sizeof(float) * keep * n_embd);
            s->slots[i].mtp_tok = moe_xmalloc(sizeof(int32_t) * keep);
        }
    }
    return true;
fail:
    snprintf(s->load_error, sizeof s->load_error, "%s", err.msg);
    return false;
}

static void *engine_main(void *arg) {
    serve_sched *s = arg;
    const bool ok = load(s);
    if (ok) update_gauges(s); /* /metrics has the disk cache's figures from the start */
    pthread_mutex_lock(&s->mu);
    s->loaded = ok;
    s->load_failed = !ok;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (!ok) return NULL;
    serve_req *batch[64];
    for (;;) {
        if (rank_loss(s)) {
            rank_loss_linger(s);
            break;
        }
        /* admit: waiting requests into free streams, dropping the cancelled */
        uint32_t active = 0;
        for (uint32_t i = 0; i < s->n_slots; i++)
            active += s->slots[i].state == SLOT_ACTIVE || s->slots[i].state == SLOT_LOADING;
        uint32_t n_new = 0, n_dropped = 0;
        serve_req *dropped[64];
        pthread_mutex_lock(&s->mu);
        if (s->stop) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        s->disk_loaded = false; /* looked at below */
        for (serve_req **pp = &s->wait_head; *pp && n_dropped < 64;) {
            serve_req *r = *pp;
            if (atomic_load(&r->cancel)) {
                *pp = r->next;
                if (s->wait_tail == r) s->wait_tail = NULL;
                s->n_waiting--;
                dropped[n_dropped++] = r;
            } else {
                pp = &r->next;
            }
        }
        if (!s->wait_head)
            s->wait_tail = NULL;
        else {
            serve_req *t = s->wait_head;
            while (t->next) t = t->next;
            s->wait_tail = t;
        }
        while (s->wait_head && active + n_new < (uint32_t)s->p.parallel && n_new < 64) {
            serve_req *r = s->wait_head;
            s->wait_head = r->next;
            if (!s->wait_head) s->wait_tail = NULL;
            r->next = NULL;
            s->n_waiting--;
            batch[n_new++] = r;
        }
        pthread_mutex_unlock(&s->mu);
        for (uint32_t i = 0; i < n_dropped; i++) finish_waiting(s, dropped[i]);
        for (uint32_t i = 0; i < n_new; i++) admit(s, batch[i]);
        if (s->disk) disk_loads_end(s, false);
        /* cancel streams whose client went away */
        for (uint32_t i = 0; i < s->n_slots; i++)
            if (s->slots[i].state == SLOT_ACTIVE && atomic_load(&s->slots[i].req->cancel))
                finish(s, (int)i, SERVE_FINISH_CANCELLED, -1, NULL);
        update_gauges(s);
        if (step(s)) {
            update_gauges(s);
            if (s->p.step_delay_ms > 0) {
                struct timespec d = {.tv_sec = s->p.step_delay_ms / 1000,
                                     .tv_nsec = (long)(s->p.step_delay_ms % 1000) * 1000000L};
                nanosleep(&d, NULL);
            }
            continue;
        }
        /* nothing to run: sleep until a submit, a cancel or stop (under mpirun: at most until
         * it is time to look for lost ranks again) */
        pthread_mutex_lock(&s->mu);
        if (!s->stop && !s->wait_head && !s->disk_loaded) {
            if (s->n_ranks > 1) {
                struct timespec until;
                clock_gettime(CLOCK_REALTIME, &until);
                until.tv_nsec += (long)(SERVE_RANK_WATCH_S * 1e9);
                until.tv_sec += until.tv_nsec / 1000000000L;
                until.tv_nsec %= 1000000000L;
                pthread_cond_timedwait(&s->cv, &s->mu, &until);
            } else {
                pthread_cond_wait(&s->cv, &s->mu);
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
    /* shutting down: end every stream and waiting request */
    if (s->disk) disk_loads_end(s, true);
    for (uint32_t i = 0; i < s->n_slots; i++)
        if (s->slots[i].state == SLOT_ACTIVE) finish(s, (int)i, SERVE_FINISH_CANCELLED, -1, NULL);
    pthread_mutex_lock(&s->mu);
    serve_req *w = s->wait_head;
    s->wait_head = s->wait_tail = NULL;
    pthread_mutex_unlock(&s->mu);
    while (w) {
        serve_req *next = w->next;
        finish_waiting(s, w);
        w = next;
    }
    moe_disk_cache_close(s->disk); /* the queued saves are written first */
    s->disk = NULL;
    update_gauges(s);
    return NULL;
}

serve_sched *serve_sched_start(const moe_serve_params *p, serve_metrics *metrics) {
    serve_sched *s = moe_xcalloc(1, sizeof *s);
    s->p = *p;
    s->lost_rank = -1;
    s->metrics = metrics;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->thread, NULL, engine_main, s) != 0)
        moe_die("cannot start the engine thread");
    return s;
}

serve_sched *serve_sched_offline(moe_tokenizer *tok, uint32_t n_ctx) {
    serve_sched *s = moe_xcalloc(1, sizeof *s);
    s->lost_rank = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->tok = tok;
    s->n_ctx = n_ctx;
    s->n_vocab = moe_tokenizer_n_vocab(tok);
    return s; /* not loaded: every submit answers SERVE_SUBMIT_NOT_READY */
}

bool serve_sched_wait_loaded(serve_sched *s, char *err, size_t err_size) {
    pthread_mutex_lock(&s->mu);
    while (!s->loaded && !s->load_failed) pthread_cond_wait(&s->cv, &s->mu);
    const bool ok = s->loaded;
    if (!ok) snprintf(err, err_size, "%s", s->load_error);
    pthread_mutex_unlock(&s->mu);
    return ok;
}

bool serve_sched_ready(serve_sched *s) {
    pthread_mutex_lock(&s->mu);
    const bool ok = s->loaded && !s->stop;
    pthread_mutex_unlock(&s->mu);
    return ok;
}

void serve_sched_stop(serve_sched *s) {
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
}

void serve_sched_free(serve_sched *s) {
    if (s->slots)
        for (uint32_t i = 0; i < s->n_slots; i++) {
            moe_strbuf_free(&s->slots[i].hold);
            free(s->slots[i].mtp_h);
            free(s->slots[i].mtp_tok);
        }
    free(s->slots);
    free(s->rows);
    free(s->row_slot);
    free(s->logits);
    free(s->hist);
    free(s->hidden);
    free(s->mtp_logits);
    free(s->ranks);
    moe_ctx_free(s->ctx); /* a leading context stops the other ranks */
    moe_grammar_vocab_free(s->grammar_vocab);
    moe_tokenizer_free(s->tok);
    moe_model_free(s->model);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

serve_submit_result serve_sched_submit(serve_sched *s, serve_req *r) {
    pthread_mutex_lock(&s->mu);
    if (s->lost_rank >= 0) {
        pthread_mutex_unlock(&s->mu);
        return SERVE_SUBMIT_RANK_LOST;
    }
    if (!s->loaded || s->stop) {
        pthread_mutex_unlock(&s->mu);
        return SERVE_SUBMIT_NOT_READY;
    }
    if (s->n_waiting >= (uint32_t)s->p.queue_limit) {
        pthread_mutex_unlock(&s->mu);
        return SERVE_SUBMIT_QUEUE_FULL;
    }
    pthread_mutex_lock(&r->mu);
    r->refs++; /* the engine's reference, dropped when it finishes the request */
    pthread_mutex_unlock(&r->mu);
    r->t_submit = serve_now();
    r->sched = s;
    r->next = NULL;
    if (s->wait_tail)
        s->wait_tail->next = r;
    else
        s->wait_head = r;
    s->wait_tail = r;
    s->n_waiting++;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return SERVE_SUBMIT_OK;
}

const serve_rank *serve_sched_ranks(serve_sched *s, int *n) {
    *n = s->ranks ? s->n_ranks : 0;
    return s->ranks;
}

int serve_sched_lost(serve_sched *s, char *msg, size_t size) {
    pthread_mutex_lock(&s->mu);
    const int lost = s->lost_rank;
    if (lost >= 0) snprintf(msg, size, "%s", s->lost_msg);
    pthread_mutex_unlock(&s->mu);
    return lost;
}

int serve_cache_slots(const moe_serve_params *p) {
    return p->cache_slots < 0 ? p->parallel : p->cache_slots;
}

int moe_serve_follow(const moe_serve_params *p) {
    /* mpirun hands a SIGTERM / SIGINT to every rank: rank 0 stops the server, then this rank */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    serve_sched s = {.p = *p};
    moe_error err = {0};
    const bool ok = open_engine(&s, &err) && moe_ctx_follow(s.ctx, &err) == MOE_OK;
    if (!ok) fprintf(stderr, "moe serve: rank %d: %s\n", moe_dist_rank(), err.msg);
    moe_ctx_free(s.ctx);
    moe_model_free(s.model);
    return ok ? 0 : 1;
}

const moe_tokenizer *serve_sched_tokenizer(serve_sched *s) {
    return s->tok;
}
const moe_model *serve_sched_model(serve_sched *s) {
    return s->model;
}
uint32_t serve_sched_n_ctx(serve_sched *s) {
    return s->n_ctx;
}
