/* imatrix.c: importance matrices in llama.cpp's GGUF imatrix format, read for `moe quantize
 * --imatrix` and `moe audit --ladder --imatrix`.
 *
 * The format (llama.cpp's tools/imatrix): general.type "imatrix"; per weight matrix W two F32
 * tensors, "<W name>.in_sum2" [n_in, n_mat] -- the sum over calibration tokens of each input
 * column's squared activation, per expert for a 3-D expert tensor -- and "<W name>.counts"
 * [1, n_mat] -- how many tokens reached each matrix. The importance is their quotient; a matrix
 * no token reached gets ones, as llama-quantize does. The trap: a count of 0 is normal for an
 * expert the calibration text never routed to. */
#include "tools.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct moe_imatrix {
    moe_imatrix_entry *e;
    size_t n;
};

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

void moe_imatrix_free(moe_imatrix *m) {
    if (!m) return;
    for (size_t i = 0; i < m->n; i++) free(m->e[i].name), free(m->e[i].values);
    free(m->e);
    free(m);
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
