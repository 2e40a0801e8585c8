/* imatrix.c: importance matrices in llama.cpp's GGUF imatrix format: collected by `moe imatrix`
 * (running a model over a text), read by `moe quantize --imatrix` and `moe audit --ladder`.
 *
 * The format (llama.cpp's tools/imatrix): general.type "imatrix"; per weight matrix W two F32
 * tensors, "<W name>.in_sum2" [n_in, n_mat] -- the sum over calibration tokens of each input
 * column's squared activation, per expert for a 3-D expert tensor -- and "<W name>.counts"
 * [1, n_mat] -- how many tokens reached each matrix. The importance is their quotient; a matrix
 * no token reached gets ones, as llama-quantize does. The trap: a count of 0 is normal for an
 * expert the calibration text never routed to. */
#include "tools.h"

#include "../engine/engine.h"
#include "../model/model.h"
#include "../ops/ops.h"
#include "../text/text.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct moe_imatrix {
    moe_imatrix_entry *e;
    size_t n;
    char *dataset;        /* imatrix.datasets[0], or NULL */
    uint32_t chunk_count; /* imatrix.chunk_count, or 0 */
};

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

void moe_imatrix_free(moe_imatrix *m) {
    if (!m) return;
    for (size_t i = 0; i < m->n; i++) free(m->e[i].name), free(m->e[i].values);
    free(m->e);
    free(m->dataset);
    free(m);
}

const char *moe_imatrix_dataset(const moe_imatrix *m) {
    return m ? m->dataset : NULL;
}

uint32_t moe_imatrix_chunks(const moe_imatrix *m) {
    return m ? m->chunk_count : 0;
}

const moe_imatrix_entry *moe_imatrix_find(const moe_imatrix *m, const char *name) {
    for (size_t i = 0; m && i < m->n; i++)
        if (!strcmp(m->e[i].name, name)) return &m->e[i];
    return NULL;
}

size_t moe_imatrix_count(const moe_imatrix *m) {
    return m ? m->n : 0;
}

moe_imatrix *moe_imatrix_load(const char *path, moe_error *err) {
    moe_gguf *g = moe_gguf_open(path, err);
    if (!g) {
        moe_error_prefix(err, "--imatrix %s (llama.cpp's GGUF imatrix format is read): ", path);
        return NULL;
    }
    moe_imatrix *m = moe_xcalloc(1, sizeof *m);
    const moe_gguf_value *ds = moe_gguf_find(g, "imatrix.datasets");
    if (ds && ds->type == MOE_GGUF_ARRAY && ds->arr.elem_type == MOE_GGUF_STRING && ds->arr.n) {
        const moe_str *s0 = ds->arr.data;
        m->dataset = moe_xstrndup(s0->ptr, s0->len);
    }
    uint64_t chunks;
    if (moe_gguf_get_u64(g, "imatrix.chunk_count", &chunks) && chunks <= UINT32_MAX)
        m->chunk_count = (uint32_t)chunks;
    const uint64_t nt = moe_gguf_n_tensors(g);
    for (uint64_t i = 0; i < nt && !err->code; i++) {
        const moe_tensor *s = moe_gguf_tensor_get(g, i);
        char *name = moe_xstrndup(s->name.ptr, s->name.len);
        if (!ends_with(name, ".in_sum2")) {
            free(name);
            continue;
        }
        name[strlen(name) - strlen(".in_sum2")] = '\0';
        char *cname = moe_xmalloc(strlen(name) + 8);
        sprintf(cname, "%s.counts", name);
        const moe_tensor *c = moe_gguf_tensor_find(g, cname);
        free(cname);
        const int64_t n_in = s->ne[0], n_mat = s->ne[1];
        if (s->type != MOE_TYPE_F32 || !c || c->type != MOE_TYPE_F32 ||
            (int64_t)c->n_values != n_mat || s->n_dims > 2 || !s->data || !c->data) {
            moe_error_set(err, MOE_ERR_FORMAT,
                          "--imatrix %s: '%s.in_sum2' needs an F32 [n_in, n_mat] tensor and an F32 "
                          "'%s.counts' of n_mat values",
                          path, name, name);
            free(name);
            break;
        }
        moe_imatrix_entry e = {.name = name, .n_in = n_in, .n_mat = n_mat};
        e.values = moe_xmalloc((size_t)(n_in * n_mat) * sizeof(float));
        const float *sums = (const float *)s->data, *counts = (const float *)c->data;
        for (int64_t k = 0; k < n_mat; k++)
            for (int64_t j = 0; j < n_in; j++)
                e.values[k * n_in + j] = counts[k] > 0 ? sums[k * n_in + j] / counts[k] : 1.0f;
        m->e = moe_xrealloc(m->e, (m->n + 1) * sizeof *m->e);
        m->e[m->n++] = e;
    }
    moe_gguf_close(g);
    if (!err->code && !m->n)
        moe_error_set(err, MOE_ERR_FORMAT, "--imatrix %s: no '<tensor>.in_sum2' entries", path);
    if (err->code) {
        moe_imatrix_free(m);
        return NULL;
    }
    return m;
}

const float *moe_imatrix_values(const moe_imatrix_entry *e, int64_t mat) {
    return e->values + (e->n_mat > 1 ? mat : 0) * e->n_in;
}

/* ==== Collecting one (moe imatrix) ====
 *
 * As llama.cpp's llama-imatrix: the text is tokenized once (BOS added where the vocabulary adds
 * one), cut into chunks of n_ctx tokens, each chunk's first token replaced by BOS (where there
 * is one), and each chunk decoded as a fresh sequence in one call. Every matmul's input rows
 * are seen through the ops observer: per weight and matrix (expert), the sum over rows of each
 * column's square, and the row count. The output head is left out unless asked for (llama.cpp's
 * --process-output), as its rows are the logits' inputs. */

typedef struct collect_entry {
    const moe_tensor *w;
    int64_t n_in, n_mat;
    double *sums;   /* [n_mat][n_in] */
    double *counts; /* [n_mat] */
} collect_entry;

typedef struct collector {
    collect_entry *e;
    size_t n;
    const moe_tensor *head; /* skipped unless process_output */
    bool process_output;
} collector;

static void observe(void *ctx, const moe_tensor *w, int64_t matrix, const float *x,
                    int64_t n_rows) {
    collector *c = ctx;
    if (w == c->head && !c->process_output) return;
    collect_entry *e = NULL;
    for (size_t i = 0; i < c->n && !e; i++)
        if (c->e[i].w == w) e = &c->e[i];
    if (!e) {
        c->e = moe_xrealloc(c->e, (c->n + 1) * sizeof *c->e);
        e = &c->e[c->n++];
        e->w = w;
        e->n_in = w->ne[0];
        e->n_mat = w->n_dims > 2 ? w->ne[2] : 1;
        e->sums = moe_xcalloc((size_t)(e->n_in * e->n_mat), sizeof(double));
        e->counts = moe_xcalloc((size_t)e->n_mat, sizeof(double));
    }
    if (matrix < 0 || matrix >= e->n_mat) return;
    double *s = e->sums + matrix * e->n_in;
    for (int64_t r = 0; r < n_rows; r++) {
        const float *xr = x + r * e->n_in;
        for (int64_t j = 0; j < e->n_in; j++) s[j] += (double)xr[j] * xr[j];
    }
    e->counts[matrix] += (double)n_rows;
}

static int entry_cmp(const void *a, const void *b) {
    const collect_entry *l = a, *r = b;
    return strcmp(l->w->name.ptr, r->w->name.ptr);
}

moe_status moe_imatrix_collect(const moe_imatrix_params *p, moe_imatrix_report *r, moe_error *err) {
    memset(r, 0, sizeof *r);
    uint8_t *text = NULL;
    size_t text_len = 0;
    if (moe_file_read(p->text_path, &text, &text_len, err) != MOE_OK) return err->code;
    moe_model *m = moe_model_load(p->model_path, err);
    moe_tokenizer *tok = m ? moe_tokenizer_from_gguf(m->gguf, err) : NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    collector col = {.head = m ? m->output : NULL, .process_output = p->process_output};
    moe_ctx *ctx = NULL;
    moe_row *rows = NULL;
    float *logits = NULL;
    moe_gguf_writer *w = NULL;
    const uint32_t n_ctx = p->n_ctx ? p->n_ctx : 512;
    if (tok && moe_tokenizer_encode(tok, (const char *)text, text_len, MOE_ENCODE_ADD_SPECIAL, &ids,
                                    &n_ids, err) != MOE_OK)
        goto done;
    if (!tok) goto done;
    uint64_t n_chunks = n_ids / n_ctx;
    if (p->max_chunks && n_chunks > p->max_chunks) n_chunks = p->max_chunks;
    if (!n_chunks) {
        moe_error_set(err, MOE_ERR_ARG,
                      "imatrix: %s has %zu tokens, fewer than one chunk of %u (--ctx)",
                      p->text_path, n_ids, n_ctx);
        goto done;
    }
    moe_ctx_params cp = {.n_ctx = n_ctx,
                         .n_seq = 1,
                         .max_rows = n_ctx,
                         .n_threads = p->n_threads > 0 ? p->n_threads : 1};
    ctx = moe_ctx_new(m, &cp, err);
    if (!ctx) goto done;
    rows = moe_xcalloc(n_ctx, sizeof *rows);
    logits = moe_xmalloc(sizeof(float) * m->cfg.n_vocab);
    const int32_t bos = moe_tokenizer_bos(tok);
    const bool add_bos = moe_tokenizer_adds_bos(tok) && bos != MOE_TOKEN_NONE;
    moe_matmul_set_observer(observe, &col);
    const double t0 = moe_now();
    for (uint64_t c = 0; c < n_chunks; c++) {
        for (uint32_t i = 0; i < n_ctx; i++)
            rows[i] = (moe_row){.seq = 0,
                                .pos = (int32_t)i,
                                .token = i == 0 && add_bos ? bos : ids[c * n_ctx + i],
                                .logits = i + 1 == n_ctx};
        if (moe_ctx_seq_truncate(ctx, 0, 0, err) != MOE_OK ||
            moe_ctx_decode(ctx, rows, n_ctx, logits, err) != MOE_OK)
            break;
        r->chunks++;
        if (p->progress)
            fprintf(stderr, "imatrix: chunk %llu/%llu (%.1f s)\n", (unsigned long long)(c + 1),
                    (unsigned long long)n_chunks, moe_now() - t0);
    }
    moe_matmul_set_observer(NULL, NULL);
    if (err->code) goto done;

    /* llama.cpp's GGUF imatrix: keys, then <name>.in_sum2 / <name>.counts per weight */
    qsort(col.e, col.n, sizeof *col.e, entry_cmp);
    w = moe_gguf_writer_new();
    moe_gguf_writer_set_str(w, "general.type", "imatrix");
    const char *dataset = p->text_path;
    moe_gguf_writer_set_arr(w, "imatrix.datasets", MOE_GGUF_STRING, &dataset, 1);
    moe_gguf_writer_set_u32(w, "imatrix.chunk_count", (uint32_t)r->chunks);
    moe_gguf_writer_set_u32(w, "imatrix.chunk_size", n_ctx);
    for (size_t i = 0; i < col.n && !err->code; i++) {
        const collect_entry *e = &col.e[i];
        float *sums = moe_xmalloc((size_t)(e->n_in * e->n_mat) * sizeof(float));
        float *counts = moe_xmalloc((size_t)e->n_mat * sizeof(float));
        for (int64_t k = 0; k < e->n_in * e->n_mat; k++) sums[k] = (float)e->sums[k];
        for (int64_t k = 0; k < e->n_mat; k++) counts[k] = (float)e->counts[k];
        char *name = moe_xmalloc(e->w->name.len + 16);
        const int64_t ne_s[2] = {e->n_in, e->n_mat}, ne_c[2] = {1, e->n_mat};
        sprintf(name, "%.*s.in_sum2", (int)e->w->name.len, e->w->name.ptr);
        moe_gguf_writer_add_tensor(w, name, MOE_TYPE_F32, 2, ne_s, sums, false, err);
        sprintf(name, "%.*s.counts", (int)e->w->name.len, e->w->name.ptr);
        if (!err->code)
            moe_gguf_writer_add_tensor(w, name, MOE_TYPE_F32, 2, ne_c, counts, false, err);
        free(name), free(sums), free(counts);
    }
    r->entries = col.n;
    r->tokens = r->chunks * n_ctx;
    if (!err->code) moe_gguf_writer_write(w, p->out_path, 0, err);
done:
    moe_gguf_writer_free(w);
    for (size_t i = 0; i < col.n; i++) free(col.e[i].sums), free(col.e[i].counts);
    free(col.e);
    free(rows), free(logits), free(ids), free(text);
    moe_ctx_free(ctx);
    moe_tokenizer_free(tok);
    moe_model_free(m);
    return err->code;
}
