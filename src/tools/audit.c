/* audit.c: the facts behind `moe audit QUANT REFERENCE` -- the error a quantization put into
 * chosen rows, against the floats it was made from.
 *
 * Owns selection (regex on names, experts of 3-D tensors, the first N rows), reading exactly
 * those rows' bytes (mapped locally, one range request per (tensor, expert) and file remotely),
 * dequantization through the reference to_float of quant/, and the three metrics in double
 * precision; and the ladder: one float source quantized at several types (moe's own quantizers,
 * optionally with an importance matrix) -- the audit of builds that do not exist yet.
 * cli/audit.c prints. The trap: a 3-D expert tensor [cols, rows, experts] keeps
 * expert e's rows at byte (e * ne[1] + r) * row_bytes -- rows are expert-major, so the first N
 * rows of an expert are one contiguous range, which is why `--rows` takes the first rows rather
 * than a spread. */
#include "tools.h"

#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== X: seeded standard normals ==== */

void moe_audit_normals(uint64_t seed, uint64_t cols, double *x) {
    uint64_t s = seed, n = cols * MOE_AUDIT_X_COLS;
    const double two_pi = 6.283185307179586;
    for (uint64_t i = 0; i < n; i += 2) {
        double u1 = (double)((moe_rng_u64(&s) >> 11) + 1) * 0x1p-53;
        double u2 = (double)((moe_rng_u64(&s) >> 11) + 1) * 0x1p-53;
        double r = sqrt(-2.0 * log(u1));
        x[i] = r * cos(two_pi * u2);
        if (i + 1 < n) x[i + 1] = r * sin(two_pi * u2);
    }
}

/* ==== One (tensor, expert) ==== */

/* Rows [0, rows) of expert e of t, dequantized into out[rows * ne0]. */
static moe_status read_rows(const moe_gguf *g, moe_http *h, const moe_tensor *t, int64_t e,
                            uint64_t rows, float *out, moe_error *err) {
    const moe_type_traits *tr = moe_type_traits_get(t->type);
    uint64_t row_bytes = moe_type_row_bytes(t->type, t->ne[0]);
    uint64_t first = (uint64_t)(e < 0 ? 0 : e) * (uint64_t)t->ne[1];
    uint8_t *buf = moe_xmalloc((size_t)(rows * row_bytes));
    moe_status s = moe_tensor_read(g, h, t, first * row_bytes, rows * row_bytes, buf, err);
    if (s == MOE_OK) tr->to_float(buf, out, (int64_t)(rows * (uint64_t)t->ne[0]));
    free(buf);
    return s;
}

static void metrics(const float *q, const float *w, const double *x, uint64_t rows, uint64_t cols,
                    moe_audit_row *r) {
    double ee = 0, ww = 0, qq = 0, qw = 0, ex2 = 0, wx2 = 0;
    double *ex = moe_xmalloc(MOE_AUDIT_X_COLS * sizeof *ex);
    double *wx = moe_xmalloc(MOE_AUDIT_X_COLS * sizeof *wx);
    for (uint64_t i = 0; i < rows; i++) {
        const float *qi = q + i * cols, *wi = w + i * cols;
        memset(ex, 0, MOE_AUDIT_X_COLS * sizeof *ex);
        memset(wx, 0, MOE_AUDIT_X_COLS * sizeof *wx);
        for (uint64_t c = 0; c < cols; c++) {
            double a = qi[c], b = wi[c], d = a - b;
            ee += d * d;
            ww += b * b;
            qq += a * a;
            qw += a * b;
            const double *xc = x + c * MOE_AUDIT_X_COLS;
            for (int j = 0; j < MOE_AUDIT_X_COLS; j++) {
                ex[j] += d * xc[j];
                wx[j] += b * xc[j];
            }
        }
        for (int j = 0; j < MOE_AUDIT_X_COLS; j++) {
            ex2 += ex[j] * ex[j];
            wx2 += wx[j] * wx[j];
        }
    }
    free(ex);
    free(wx);
    r->rel_fro = ww > 0 ? sqrt(ee / ww) : (ee > 0 ? INFINITY : 0);
    r->cosine = qq > 0 && ww > 0 ? qw / sqrt(qq * ww) : (qq == ww ? 1 : 0);
    r->matvec_rel = wx2 > 0 ? sqrt(ex2 / wx2) : (ex2 > 0 ? INFINITY : 0);
}

static bool is_reference_type(moe_type t) {
    return t == MOE_TYPE_F32 || t == MOE_TYPE_F16 || t == MOE_TYPE_BF16;
}

/* ==== The run ==== */

static void add_row(moe_audit_report *r, const moe_audit_row *row) {
    r->rows = moe_xrealloc(r->rows, (r->n_rows + 1) * sizeof *r->rows);
    r->rows[r->n_rows++] = *row;
}

/* The ladder for one (tensor, expert): f[rows * cols] quantized at every rung, dequantized into
 * q, and measured against f. */
static moe_status ladder_rows(const moe_tensor *t, int64_t e, const float *f, uint64_t rows,
                              uint64_t cols, const double *x, const moe_audit_options *o, float *q,
                              moe_audit_report *r, moe_error *err) {
    const moe_imatrix_entry *im = moe_imatrix_find(o->imatrix, t->name.ptr);
    if (im && (im->n_in != (int64_t)cols || (im->n_mat != 1 && e >= im->n_mat)))
        return moe_error_set(
            err, MOE_ERR_FORMAT, "--imatrix entry '%s' is %lld x %lld, the tensor has rows of %llu",
            t->name.ptr, (long long)im->n_in, (long long)im->n_mat, (unsigned long long)cols);
    const float *imv = im ? moe_imatrix_values(im, e < 0 ? 0 : e) : NULL;
    for (size_t k = 0; k < o->n_ladder; k++) {
        const moe_type type = o->ladder[k];
        const uint64_t rb = moe_type_row_bytes(type, (int64_t)cols);
        if (!rb) {
            r->n_skipped++;
            continue;
        }
        if (moe_type_needs_imatrix(type) && !imv)
            return moe_error_set(err, MOE_ERR_ARG,
                                 "%s at %s needs an importance matrix (--imatrix) with an entry "
                                 "for it: llama.cpp refuses these types without one",
                                 t->name.ptr, moe_type_name(type));
        uint8_t *blocks = moe_xmalloc((size_t)(rows * rb));
        moe_quantize_rows(type, f, blocks, (int64_t)rows, (int64_t)cols, imv, o->pool);
        moe_type_traits_get(type)->to_float(blocks, q, (int64_t)(rows * cols));
        free(blocks);
        const moe_type_traits *tr = moe_type_traits_get(type);
        moe_audit_row row = {
            .tensor = moe_xstrdup(t->name.ptr),
            .expert = e,
            .type = type,
            .ref_type = t->type,
            .bits_per_weight = 8.0 * (double)tr->block_bytes / (double)tr->block_values,
            .rows = rows,
            .cols = cols,
        };
        metrics(q, f, x, rows, cols, &row);
        add_row(r, &row);
    }
    return MOE_OK;
}

moe_status moe_audit_run(const moe_gguf *quant, moe_http *quant_http, const moe_gguf *ref,
                         moe_http *ref_http, const moe_audit_options *o, moe_audit_report *r,
                         moe_error *err) {
    memset(r, 0, sizeof *r);
    regex_t re;
    if (o->tensor_regex) {
        int rc = regcomp(&re, o->tensor_regex, REG_EXTENDED | REG_NOSUB);
        if (rc != 0) {
            char msg[256];
            regerror(rc, &re, msg, sizeof msg);
            return moe_error_set(err, MOE_ERR_ARG, "--tensor '%s': %s", o->tensor_regex, msg);
        }
    }
    static const int64_t expert0 = 0;
    const int64_t *experts = o->experts ? o->experts : &expert0;
    size_t n_experts = o->experts ? o->n_experts : 1;
    double *x = NULL;
    uint64_t x_cols = 0;
    moe_status s = MOE_OK;
    for (uint64_t i = 0; i < moe_gguf_n_tensors(quant) && s == MOE_OK; i++) {
        const moe_tensor *t = moe_gguf_tensor_get(quant, i);
        const moe_type_traits *tr = moe_type_traits_get(t->type);
        const bool selectable = o->n_ladder ? is_reference_type(t->type) : tr->is_quantized;
        if (!selectable || !tr->to_float || t->n_dims < 2) continue;
        if (o->tensor_regex && regexec(&re, t->name.ptr, 0, NULL, 0) != 0) continue;
        const moe_tensor *w = moe_gguf_tensor_find(ref, t->name.ptr);
        bool same = w && w->n_dims == t->n_dims && is_reference_type(w->type);
        for (int d = 0; same && d < MOE_GGUF_MAX_DIMS; d++) same = w->ne[d] == t->ne[d];
        if (!same) {
            r->n_skipped++;
            if (o->tensor_regex)
                moe_log(MOE_LOG_WARN, "audit: %s: %s", t->name.ptr,
                        !w                            ? "not in the reference"
                        : !is_reference_type(w->type) ? "the reference is not F32/F16/BF16"
                                                      : "the reference has another shape");
            continue;
        }
        uint64_t cols = (uint64_t)t->ne[0], n_slices = (uint64_t)t->ne[2] * (uint64_t)t->ne[3];
        uint64_t rows = o->rows && o->rows < (uint64_t)t->ne[1] ? o->rows : (uint64_t)t->ne[1];
        if (n_slices == 1 && t->n_dims == 2) {
            /* a matrix: rows over ne[1] */
        } else if (t->ne[3] != 1) {
            r->n_skipped++;
            continue;
        }
        if (cols != x_cols) {
            x = moe_xrealloc(x, (size_t)(cols * MOE_AUDIT_X_COLS) * sizeof *x);
            moe_audit_normals(o->seed, cols, x);
            x_cols = cols;
        }
        float *q = moe_xmalloc((size_t)(rows * cols) * sizeof *q);
        float *f = moe_xmalloc((size_t)(rows * cols) * sizeof *f);
        size_t n_e = t->n_dims >= 3 ? n_experts : 1;
        for (size_t k = 0; k < n_e && s == MOE_OK; k++) {
            int64_t e = t->n_dims >= 3 ? experts[k] : -1;
            if (e >= (int64_t)n_slices) {
                s = moe_error_set(err, MOE_ERR_RANGE, "%s: expert %lld, but it has %llu experts",
                                  t->name.ptr, (long long)e, (unsigned long long)n_slices);
                break;
            }
            if (o->n_ladder) {
                s = read_rows(ref, ref_http, w, e, rows, f, err);
                if (s == MOE_OK) s = ladder_rows(t, e, f, rows, cols, x, o, q, r, err);
                continue;
            }
            s = read_rows(quant, quant_http, t, e, rows, q, err);
            if (s == MOE_OK) s = read_rows(ref, ref_http, w, e, rows, f, err);
            if (s != MOE_OK) break;
            moe_audit_row row = {
                .tensor = moe_xstrdup(t->name.ptr),
                .expert = e,
                .type = t->type,
                .ref_type = w->type,
                .bits_per_weight = 8.0 * (double)tr->block_bytes / (double)tr->block_values,
                .rows = rows,
                .cols = cols,
            };
            metrics(q, f, x, rows, cols, &row);
            add_row(r, &row);
        }
        free(q);
        free(f);
    }
    free(x);
    if (o->tensor_regex) regfree(&re);
    return s;
}

void moe_audit_report_free(moe_audit_report *r) {
    for (size_t i = 0; i < r->n_rows; i++) free(r->rows[i].tensor);
    free(r->rows);
    memset(r, 0, sizeof *r);
}
