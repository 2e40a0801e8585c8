/* rows.c: what a rank holds of the routed experts under `--split rows` -- its slice of every
 * expert's intermediate (moe_split_rows_range): those rows of gate and up, those input columns of
 * down, those values of the gate / up biases -- and with `--split-dense` its rows of every dense
 * FFN's and shared expert's gate, up and down, read from the model file into memory of its own,
 * so a rank keeps resident only its slices whether the rest of the model is mapped or read into
 * memory (the stacked tensors' own pages are never touched). The MoE block (ffn.c) runs every
 * routed expert on these slices and sums the ranks' partial outputs; a dense block joins the
 * ranks' slices of its intermediate, then of its output.
 *
 * The trap: a row of down runs along the intermediate in quant blocks, so a rank's columns of
 * down are whole blocks at the same place in every row; they are read a whole expert at a time
 * (one read, then the slices picked out of it) rather than a read per row. */
#include "engine_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { SLICE_GATE, SLICE_UP, SLICE_GATE_UP, SLICE_DOWN, SLICE_GATE_B, SLICE_UP_B, SLICE_COUNT };

/* The slice's tensor k: src's name and type with the shape ne, its bytes at base + *at (*at
 * advanced past them; base NULL: only sized). */
static const moe_tensor *slice_tensor(moe_rows_slice *s, int k, const moe_tensor *src, int64_t ne0,
                                      int64_t ne1, int64_t ne2, uint8_t *base, uint64_t *at) {
    moe_tensor *t = &s->t[k];
    *t = (moe_tensor){.name = src->name, .type = src->type, .n_dims = src->n_dims};
    for (int d = 0; d < MOE_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    t->ne[0] = ne0, t->ne[1] = ne1, t->ne[2] = ne2;
    t->n_values = (uint64_t)ne0 * (uint64_t)ne1 * (uint64_t)ne2;
    t->n_bytes = moe_type_row_bytes(src->type, ne0) * (uint64_t)ne1 * (uint64_t)ne2;
    t->data = base ? base + *at : NULL;
    *at += t->n_bytes;
    s->bytes += t->n_bytes;
    return t;
}

typedef struct rows_reader {
    const moe_gguf *g;
    int *fd;         /* [shards], opened on first use (-1: not yet) */
    uint8_t *bounce; /* one expert's (or dense FFN's) down matrix */
} rows_reader;

static moe_status read_at(rows_reader *r, const moe_tensor *t, uint64_t at, uint64_t n, void *dst,
                          moe_error *err) {
    const moe_gguf_shard *sh = moe_gguf_shard_get(r->g, t->shard);
    if (r->fd[t->shard] < 0) {
        r->fd[t->shard] = open(sh->path, O_RDONLY | O_CLOEXEC);
        if (r->fd[t->shard] < 0)
            return moe_error_set(err, MOE_ERR_IO, "%s: %s (reading this rank's slice of %s)",
                                 sh->path, strerror(errno), t->name.ptr);
    }
    return moe_file_pread(r->fd[t->shard], sh->path, t->file_offset + at, n, dst, t->name.ptr, err);
}

/* Rows [begin, begin + n) of every expert of the stacked matrix t into dst (expert after
 * expert); `halves` 2: the same rows of both halves of a fused [gate; up] (each half n_ff rows). */
static moe_status read_rows(rows_reader *r, const moe_tensor *t, int64_t n_ff, int halves,
                            moe_split_range ff, uint8_t *dst, moe_error *err) {
    const uint64_t row = moe_type_row_bytes(t->type, t->ne[0]), n = (uint64_t)(ff.end - ff.begin);
    for (int64_t e = 0; e < t->ne[2]; e++)
        for (int h = 0; h < halves; h++) {
            const uint64_t first =
                (uint64_t)e * (uint64_t)t->ne[1] + (uint64_t)(h * n_ff + ff.begin);
            if (read_at(r, t, first * row, n * row, dst, err) != MOE_OK) return err->code;
            dst += n * row;
        }
    return MOE_OK;
}

/* Columns [ff.begin, ff.end) of every row of every expert of down into dst. */
static moe_status read_columns(rows_reader *r, const moe_tensor *t, moe_split_range ff,
                               uint8_t *dst, moe_error *err) {
    const uint64_t row = moe_type_row_bytes(t->type, t->ne[0]),
                   skip = moe_type_row_bytes(t->type, ff.begin),
                   n = moe_type_row_bytes(t->type, ff.end - ff.begin),
                   matrix = row * (uint64_t)t->ne[1];
    for (int64_t e = 0; e < t->ne[2]; e++) {
        if (read_at(r, t, (uint64_t)e * matrix, matrix, r->bounce, err) != MOE_OK) return err->code;
        for (int64_t i = 0; i < t->ne[1]; i++, dst += n)
            memcpy(dst, r->bounce + (uint64_t)i * row + skip, n);
    }
    return MOE_OK;
}

/* The slice of a [n_ff, n_expert] f32 bias (bound as floats, so in memory). */
static void copy_bias(const moe_tensor *t, moe_split_range ff, float *dst) {
    const float *b = (const float *)t->data;
    const int64_t n = ff.end - ff.begin;
    for (int64_t e = 0; e < t->ne[1]; e++)
        memcpy(dst + e * n, b + e * t->ne[0] + ff.begin, sizeof(float) * (size_t)n);
}

/* The slice of a gated FFN (a dense one, or the shared expert beside routed ones) into s: its
 * rows of gate and up (intermediate values) and of down (output values), whole rows split as
 * evenly as they go; sized only with base NULL. */
static void slice_ffn(moe_rows_slice *s, const moe_ffn_weights *w, int rank, int n_ranks,
                      uint8_t *base, uint64_t *at) {
    const int64_t n_ff = w->down->ne[0], n_embd = w->down->ne[1];
    s->ff = moe_split_rows_range(n_ff, 1, rank, n_ranks);
    s->out = moe_split_rows_range(n_embd, 1, rank, n_ranks);
    s->bytes = 0;
    const int64_t n = s->ff.end - s->ff.begin;
    s->gate = slice_tensor(s, SLICE_GATE, w->gate, w->gate->ne[0], n, 1, base, at);
    s->up = slice_tensor(s, SLICE_UP, w->up, w->up->ne[0], n, 1, base, at);
    s->down = slice_tensor(s, SLICE_DOWN, w->down, n_ff, s->out.end - s->out.begin, 1, base, at);
}

/* The gated FFN of layer il this context splits (--split-dense), or NULL. */
static const moe_ffn_weights *dense_ffn(const moe_layer_weights *l) {
    const moe_ffn_weights *w = l->plan.ffn == MOE_FFN_EXPERTS ? &l->experts.shared : &l->ffn;
    return w->gate && w->up && w->down ? w : NULL;
}

moe_status moe_rows_load(moe_ctx *c, uint32_t n_layer_run, moe_error *err) {
    const moe_model *m = c->m;
    const int rank = moe_dist_rank(), n_ranks = moe_dist_size();
    if (c->p.split == MOE_SPLIT_ROWS)
        c->rows_slice = moe_xcalloc(n_layer_run, sizeof *c->rows_slice);
    if (c->p.split_dense) c->dense_slice = moe_xcalloc(n_layer_run, sizeof *c->dense_slice);
    /* the shapes first (one allocation for every slice), then the reads */
    uint64_t at = 0, bounce = 0;
    for (int pass = 0; pass < 2; pass++, at = 0) {
        for (uint32_t il = 0; il < n_layer_run; il++) {
            const moe_expert_weights *w = &m->layers[il].experts;
            const moe_ffn_weights *dense = dense_ffn(&m->layers[il]);
            if (c->dense_slice && dense)
                slice_ffn(&c->dense_slice[il], dense, rank, n_ranks, c->rows_mem, &at);
            if (!c->rows_slice || m->layers[il].plan.ffn != MOE_FFN_EXPERTS) continue;
            moe_rows_slice *s = &c->rows_slice[il];
            const int64_t n_ff = w->down->ne[0], n_embd = w->down->ne[1], E = w->down->ne[2];
            s->ff = moe_split_rows_range(n_ff, moe_type_traits_get(w->down->type)->block_values,
                                         rank, n_ranks);
            s->bytes = 0;
            const int64_t n = s->ff.end - s->ff.begin;
            if (w->gate)
                s->gate =
                    slice_tensor(s, SLICE_GATE, w->gate, w->gate->ne[0], n, E, c->rows_mem, &at);
            if (w->up)
                s->up = slice_tensor(s, SLICE_UP, w->up, w->up->ne[0], n, E, c->rows_mem, &at);
            if (w->gate_up)
                s->gate_up = slice_tensor(s, SLICE_GATE_UP, w->gate_up, w->gate_up->ne[0], 2 * n, E,
                                          c->rows_mem, &at);
            s->down = slice_tensor(s, SLICE_DOWN, w->down, n, n_embd, E, c->rows_mem, &at);
            if (w->gate_b)
                s->gate_b = slice_tensor(s, SLICE_GATE_B, w->gate_b, n, E, 1, c->rows_mem, &at);
            if (w->up_b) s->up_b = slice_tensor(s, SLICE_UP_B, w->up_b, n, E, 1, c->rows_mem, &at);
            const uint64_t matrix = moe_type_row_bytes(w->down->type, n_ff) * (uint64_t)n_embd;
            if (matrix > bounce) bounce = matrix;
        }
        if (pass == 0) c->rows_mem = moe_xmalloc(at ? at : 1);
    }
    const uint32_t n_shards = moe_gguf_n_shards(m->gguf);
    rows_reader r = {.g = m->gguf,
                     .fd = moe_xmalloc(sizeof(int) * n_shards),
                     .bounce = moe_xmalloc(bounce ? bounce : 1)};
    for (uint32_t i = 0; i < n_shards; i++) r.fd[i] = -1;
    moe_status st = MOE_OK;
    for (uint32_t il = 0; il < n_layer_run && st == MOE_OK; il++) {
        const moe_ffn_weights *dense = dense_ffn(&m->layers[il]);
        const moe_rows_slice *d = c->dense_slice ? &c->dense_slice[il] : NULL;
        if (d && dense) {
            const int64_t n_ff = dense->down->ne[0];
            st = read_rows(&r, dense->gate, n_ff, 1, d->ff, (uint8_t *)d->gate->data, err);
            if (st == MOE_OK)
                st = read_rows(&r, dense->up, n_ff, 1, d->ff, (uint8_t *)d->up->data, err);
            if (st == MOE_OK)
                st = read_rows(&r, dense->down, n_ff, 1, d->out, (uint8_t *)d->down->data, err);
        }
        const moe_expert_weights *w = &m->layers[il].experts;
        const moe_rows_slice *s = c->rows_slice ? &c->rows_slice[il] : NULL;
        if (!s || st != MOE_OK || m->layers[il].plan.ffn != MOE_FFN_EXPERTS ||
            s->ff.end == s->ff.begin)
            continue;
        const int64_t n_ff = w->down->ne[0];
        if (s->gate) st = read_rows(&r, w->gate, n_ff, 1, s->ff, (uint8_t *)s->gate->data, err);
        if (s->up && st == MOE_OK)
            st = read_rows(&r, w->up, n_ff, 1, s->ff, (uint8_t *)s->up->data, err);
        if (s->gate_up && st == MOE_OK)
            st = read_rows(&r, w->gate_up, n_ff, 2, s->ff, (uint8_t *)s->gate_up->data, err);
        if (st == MOE_OK) st = read_columns(&r, w->down, s->ff, (uint8_t *)s->down->data, err);
        if (s->gate_b) copy_bias(w->gate_b, s->ff, (float *)s->gate_b->data);
        if (s->up_b) copy_bias(w->up_b, s->ff, (float *)s->up_b->data);
    }
    for (uint32_t i = 0; i < n_shards; i++)
        if (r.fd[i] >= 0) close(r.fd[i]);
    free(r.fd);
    free(r.bounce);
    return st;
}
