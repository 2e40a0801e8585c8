/* state.c: what a sequence holds and how it goes back -- truncation, recurrent-state snapshots
 * and prefix reuse (the rules are in engine.h).
 *
 * A sequence is its length, its token ids, its K/V rows (attention layers) and, in a hybrid
 * model, one recurrent state per linear layer. The invariant kept here: a sequence's recurrent
 * state always covers exactly its first seq_len tokens, and a snapshot (seq, pos) exists only
 * while seq still holds the tokens it was taken on. Every path that shortens or replaces a
 * sequence goes through become(), which keeps both. The trap: K/V rows past seq_len are stale
 * garbage, never read; recurrent state has no such slack, so it is copied, never truncated. */
#include "engine_internal.h"

#include <stdio.h>
#include <string.h>

static moe_status check_seq(const moe_ctx *c, int32_t seq, moe_error *err) {
    if (seq < 0 || (uint32_t)seq >= c->p.n_seq)
        return moe_error_set(err, MOE_ERR_ARG, "sequence %d out of range 0..%u", seq,
                             c->p.n_seq - 1);
    return MOE_OK;
}

static bool hybrid(const moe_ctx *c) {
    return c->lin.n_layer > 0;
}

static uint64_t state_bytes(const moe_ctx *c) {
    return (uint64_t)c->lin.n_layer * c->lin.layer_floats * sizeof(float);
}

static float *snap_state(const moe_ctx *c, int32_t slot) {
    return c->snap_state + (uint64_t)slot * c->lin.n_layer * c->lin.layer_floats;
}

static int32_t *seq_tokens(const moe_ctx *c, int32_t seq) {
    return c->tokens + (uint64_t)seq * c->p.n_ctx;
}

/* Drop the snapshots of seq taken past position `keep`. */
static void drop_snapshots(moe_ctx *c, int32_t seq, uint32_t keep) {
    for (uint32_t i = 0; i < c->p.n_snapshots; i++)
        if (c->snaps[i].seq == seq && c->snaps[i].pos > keep) c->snaps[i].seq = -1;
}

/* Make seq hold the first n tokens of src (seq itself or another sequence), with the recurrent
 * state `state` (NULL: all zeros; ignored when the model has no linear layers; may be seq's own
 * live state, then nothing is copied). */
static void become(moe_ctx *c, int32_t seq, int32_t src, uint32_t n, const float *state) {
    if (src != seq && n > 0) {
        for (uint32_t l = 0; l < c->m->cfg.n_layer; l++) {
            if (!moe_layer_state_of(&c->m->cfg, l).k_values) continue; /* a linear layer */
            for (int v = 0; v < 2; v++) { /* each head's first n positions */
                const moe_kv_span to = moe_kv_span_of(c, v, seq, l),
                                  from = moe_kv_span_of(c, v, src, l);
                for (uint32_t h = 0; h < from.n_head; h++)
                    memcpy(to.at + h * to.head, from.at + h * from.head, n * from.stride);
            }
            const uint64_t index_values = moe_layer_state_of(&c->m->cfg, l).index_values;
            if (index_values) /* the indexer's rows and pools beside the latent */
                memcpy(moe_indexer_row(c, seq, l, 0), moe_indexer_row(c, src, l, 0),
                       n * index_values * sizeof(float));
        }
        memcpy(seq_tokens(c, seq), seq_tokens(c, src), n * sizeof(int32_t));
    }
    drop_snapshots(c, seq, src == seq ? n : 0);
    c->seq_len[seq] = n;
    c->verify_rows[seq] = 0;
    /* the MTP cache's entry q pairs trunk position q with token q + 1: it keeps what the trunk
     * keeps, and nothing of another sequence (it is not copied) */
    const uint32_t mtp_keep = n ? n - 1 : 0;
    if (src != seq || c->mtp_len[seq] > mtp_keep) c->mtp_len[seq] = src == seq ? mtp_keep : 0;
    float *live = moe_linear_seq_state(c, seq);
    if (!hybrid(c) || state == live) return;
    if (state)
        memcpy(live, state, state_bytes(c));
    else
        memset(live, 0, state_bytes(c));
}

/* ==== Verify steps ==== */

moe_status moe_ctx_seq_accept(moe_ctx *c, int32_t seq, uint32_t n_keep, moe_error *err) {
    moe_ctx_dist_op(c, MOE_OP_ACCEPT, seq, n_keep);
    if (seq < 0 || (uint32_t)seq >= c->p.n_seq)
        return moe_error_set(err, MOE_ERR_ARG, "accept: sequence %d out of range 0..%u", seq,
                             c->p.n_seq - 1);
    const uint32_t rows = c->verify_rows[seq];
    if (n_keep == 0 || n_keep > rows)
        return moe_error_set(err, MOE_ERR_ARG,
                             "accept: sequence %d keeps %u rows, its last verify step ran %u", seq,
                             n_keep, rows);
    if (n_keep < rows)
        become(c, seq, seq, c->verify_base[seq] + n_keep,
               hybrid(c) ? moe_linear_checkpoint(c, seq, n_keep - 1) : NULL);
    c->verify_rows[seq] = 0;
    return MOE_OK;
}

/* ==== Truncation ==== */

moe_status moe_ctx_seq_truncate(moe_ctx *c, int32_t seq, uint32_t n, moe_error *err) {
    moe_ctx_dist_op(c, MOE_OP_TRUNCATE, seq, n);
    if (check_seq(c, seq, err) != MOE_OK) return err->code;
    if (n >= c->seq_len[seq]) return MOE_OK;
    if (!hybrid(c) || n == 0) {
        become(c, seq, seq, n, NULL);
        return MOE_OK;
    }
    char have[160] = "";
    size_t used = 0;
    for (uint32_t i = 0; i < c->p.n_snapshots; i++) {
        if (c->snaps[i].seq != seq) continue;
        if (c->snaps[i].pos == n) {
            c->snaps[i].used = ++c->snap_clock;
            become(c, seq, seq, n, snap_state(c, (int32_t)i));
            return MOE_OK;
        }
        if (used < sizeof have - 12)
            used += (size_t)snprintf(have + used, sizeof have - used, " %u", c->snaps[i].pos);
    }
    return moe_error_set(err, MOE_ERR_ARG,
                         "sequence %d: cannot rewind from %u to %u tokens: linear-attention state "
                         "cannot be cut back and there is no snapshot at %u (snapshots at:%s)",
                         seq, c->seq_len[seq], n, n, used ? have : " none");
}

/* ==== Snapshots ==== */

int32_t moe_ctx_seq_snapshot(moe_ctx *c, int32_t seq, moe_error *err) {
    moe_ctx_dist_op(c, MOE_OP_SNAPSHOT, seq, 0);
    if (check_seq(c, seq, err) != MOE_OK) return -1;
    if (c->p.n_snapshots == 0) {
        moe_error_set(err, MOE_ERR_ARG, "this context holds no snapshots (n_snapshots = 0)");
        return -1;
    }
    /* the same point again, else a free slot, else the least recently used */
    int32_t slot = -1;
    for (uint32_t i = 0; i < c->p.n_snapshots && slot < 0; i++)
        if (c->snaps[i].seq == seq && c->snaps[i].pos == c->seq_len[seq]) slot = (int32_t)i;
    for (uint32_t i = 0; i < c->p.n_snapshots && slot < 0; i++)
        if (c->snaps[i].seq < 0) slot = (int32_t)i;
    if (slot < 0) {
        slot = 0;
        for (uint32_t i = 1; i < c->p.n_snapshots; i++)
            if (c->snaps[i].used < c->snaps[slot].used) slot = (int32_t)i;
    }
    if (hybrid(c)) memcpy(snap_state(c, slot), moe_linear_seq_state(c, seq), state_bytes(c));
    c->snaps[slot] = (moe_snapshot){.seq = seq, .pos = c->seq_len[seq], .used = ++c->snap_clock};
    return slot;
}

static bool snapshot_valid(const moe_ctx *c, int32_t slot) {
    return slot >= 0 && (uint32_t)slot < c->p.n_snapshots && c->snaps[slot].seq >= 0;
}

moe_status moe_ctx_seq_restore(moe_ctx *c, int32_t seq, int32_t snapshot, moe_error *err) {
    moe_ctx_dist_op(c, MOE_OP_RESTORE, seq, (uint32_t)snapshot);
    if (check_seq(c, seq, err) != MOE_OK) return err->code;
    if (!snapshot_valid(c, snapshot))
        return moe_error_set(err, MOE_ERR_ARG,
                             "snapshot %d is empty (never taken, dropped, or "
                             "its sequence was cut back below it)",
                             snapshot);
    moe_snapshot *s = &c->snaps[snapshot];
    s->used = ++c->snap_clock;
    become(c, seq, s->seq, s->pos, snap_state(c, snapshot));
    return MOE_OK;
}

void moe_ctx_snapshot_drop(moe_ctx *c, int32_t snapshot) {
    moe_ctx_dist_op(c, MOE_OP_DROP, 0, (uint32_t)snapshot);
    if (snapshot_valid(c, snapshot)) c->snaps[snapshot].seq = -1;
}

bool moe_ctx_snapshot_info(const moe_ctx *c, int32_t snapshot, int32_t *seq, uint32_t *pos) {
    if (!snapshot_valid(c, snapshot)) return false;
    *seq = c->snaps[snapshot].seq;
    *pos = c->snaps[snapshot].pos;
    return true;
}

/* ==== Prefix reuse ==== */

static uint32_t common_prefix(const int32_t *a, const int32_t *b, uint32_t n) {
    uint32_t i = 0;
    while (i < n && a[i] == b[i]) i++;
    return i;
}

/* The longest prefix of tokens[0..n) sequence s can give: any common prefix of its live
 * tokens without linear layers, all of them or nothing with them, or the position of one of its
 * snapshots that the tokens extend. *snap: the snapshot to restore, -1 for the live state. */
static uint32_t usable_prefix(const moe_ctx *c, int32_t s, const int32_t *tokens, uint32_t n,
                              int32_t *snap) {
    const uint32_t len = c->seq_len[s];
    const uint32_t lcp = common_prefix(tokens, seq_tokens(c, s), n < len ? n : len);
    uint32_t best = !hybrid(c) ? lcp : lcp == len ? len : 0;
    *snap = -1;
    for (uint32_t i = 0; i < c->p.n_snapshots; i++) {
        const moe_snapshot *sn = &c->snaps[i];
        /* a snapshot of s holds s's first pos tokens: usable when they are within the lcp */
        if (sn->seq == s && sn->pos <= lcp && sn->pos > best) {
            best = sn->pos;
            *snap = (int32_t)i;
        }
    }
    return best;
}

uint32_t moe_ctx_seq_prefix(const moe_ctx *c, int32_t seq, const int32_t *tokens, uint32_t n) {
    int32_t snap;
    return seq >= 0 && (uint32_t)seq < c->p.n_seq ? usable_prefix(c, seq, tokens, n, &snap) : 0;
}

moe_status moe_ctx_seq_reuse(moe_ctx *c, int32_t seq, const int32_t *tokens, uint32_t n,
                             uint32_t *reused, moe_error *err) {
    moe_ctx_dist_op(c, MOE_OP_REUSE, seq, n);
    if (c->replicate && n > c->p.n_ctx) {
        fprintf(stderr, "moe: prefix reuse of %u tokens, the context holds %u: ending the job\n", n,
                c->p.n_ctx);
        moe_dist_abort(1);
    }
    tokens = moe_ctx_dist_payload(c, tokens, c->follow_tokens, sizeof(int32_t) * n);
    *reused = 0;
    if (check_seq(c, seq, err) != MOE_OK) return err->code;
    /* the best source over every sequence and its snapshots; seq itself wins ties */
    uint32_t best = 0;
    int32_t best_seq = seq, best_snap = -1;
    for (uint32_t s = 0; s < c->p.n_seq; s++) {
        int32_t snap;
        const uint32_t usable = usable_prefix(c, (int32_t)s, tokens, n, &snap);
        if (usable > best || (usable == best && usable && (int32_t)s == seq)) {
            best = usable;
            best_seq = (int32_t)s;
            best_snap = snap;
        }
    }
    if (best == 0) {
        become(c, seq, seq, 0, NULL);
    } else if (best_snap >= 0) {
        c->snaps[best_snap].used = ++c->snap_clock;
        become(c, seq, best_seq, best, snap_state(c, best_snap));
    } else {
        become(c, seq, best_seq, best, moe_linear_seq_state(c, best_seq));
    }
    *reused = best;
    return MOE_OK;
}

const int32_t *moe_ctx_seq_tokens(const moe_ctx *c, int32_t seq) {
    return seq >= 0 && (uint32_t)seq < c->p.n_seq ? seq_tokens(c, seq) : NULL;
}
