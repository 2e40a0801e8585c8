/* repack.c: `moe repack` -- a quantization-aware-trained (QAT) bf16 checkpoint (safetensors, HF
 * layout) rewritten as a Q4_0 GGUF or as a compressed-tensors W4A16 checkpoint, and
 * `moe repack --verify`, which rereads both from disk and checks every group and copied tensor.
 *
 * Owns the choice of what is quantized, the HF -> GGUF names and metadata (gemma4), the
 * streaming (one tensor in memory at a time) and the report; the grid arithmetic is quant/'s
 * (grid.c) and the containers are format/'s. Two passes over the source: the first recovers
 * every group's grid and decides each tensor's output type (a tensor with any group off the
 * grid is kept whole at source precision), so the output header can be written before any data;
 * the second recovers again and streams the bytes. Recovery is cheap next to reading the
 * weights, which the page cache holds between the passes for models that fit in memory.
 * The trap: "copied byte for byte" holds for the W4A16 output; GGUF stores 1-D tensors, norms
 * and the router as F32 (as llama.cpp's converter does), which widens bf16 exactly -- so
 * verify compares those by value, and everything else by bytes. */
#include "tools.h"
#include "../text/text.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Mismatches described in full by verify before it only counts them. */
#define VERIFY_MAX_REPORTED MOE_REPACK_MAX_MESSAGES

/* ==== What is quantized ==== */

static bool is_float(moe_st_dtype d) {
    return d == MOE_ST_BF16 || d == MOE_ST_F16 || d == MOE_ST_F32;
}
static moe_type src_type(moe_st_dtype d) {
    return d == MOE_ST_BF16 ? MOE_TYPE_BF16 : d == MOE_ST_F16 ? MOE_TYPE_F16 : MOE_TYPE_F32;
}
static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* A linear layer's weight of the language model: 2-D [out, in] or 3-D [experts, out, in]
 * floats with in % 32 == 0, named like a projection; never embeddings, the LM head, routers,
 * norms, or the vision / audio towers (those are copied). */
static bool quantizable(const moe_st_tensor *t) {
    if (!is_float(t->dtype) || t->n_dims < 2 || t->n_dims > 3) return false;
    if (t->shape[t->n_dims - 1] % MOE_GRID_GROUP != 0 || t->n_values == 0) return false;
    static const char *const never[] = {
        "embed", "lm_head", "router",      "norm",         "vision",
        "audio", "visual",  "multi_modal", ".gate.weight", "shared_expert_gate"};
    for (size_t i = 0; i < sizeof never / sizeof never[0]; i++)
        if (strstr(t->name, never[i])) return false;
    if (t->n_dims == 3) return ends_with(t->name, "_proj") || ends_with(t->name, "_proj.weight");
    return ends_with(t->name, "_proj.weight");
}

/* ==== Recovering every group of a tensor (on the pool) ==== */

#define MAX_THREADS 512

typedef struct group_job {
    const moe_st_tensor *t;
    moe_type scale_type, src;
    uint8_t *q4_0;                 /* [n_groups * 18] Q4_0 blocks, or NULL */
    uint8_t *packed;               /* [n_groups * 16] int4 words (4 per group), or NULL */
    uint16_t *scales;              /* [n_groups] stored scale bits, or NULL */
    uint64_t by_m[MAX_THREADS][9]; /* groups per m (0: all-zero) per thread */
    uint64_t off[MAX_THREADS];     /* off-grid groups per thread */
    int64_t first_off[MAX_THREADS];
} group_job;

static void decode_group(const moe_st_tensor *t, int64_t g, float *w) {
    unsigned es = moe_st_dtype_size(t->dtype);
    const uint8_t *p = t->data + (uint64_t)g * MOE_GRID_GROUP * es;
    for (int i = 0; i < MOE_GRID_GROUP; i++, p += es) {
        if (t->dtype == MOE_ST_BF16)
            w[i] = moe_bf16_to_f32((uint16_t)(p[0] | p[1] << 8));
        else if (t->dtype == MOE_ST_F16)
            w[i] = moe_fp16_to_f32((uint16_t)(p[0] | p[1] << 8));
        else
            memcpy(&w[i], p, 4);
    }
}

static void group_fn(void *arg, int64_t begin, int64_t end, int thread) {
    group_job *j = arg;
    float w[MOE_GRID_GROUP];
    int8_t q[MOE_GRID_GROUP];
    for (int64_t g = begin; g < end; g++) {
        decode_group(j->t, g, w);
        uint16_t scale = 0;
        int m = moe_grid_recover(w, MOE_GRID_GROUP, j->scale_type, j->src, &scale, q);
        if (m < 0) {
            if (!j->off[thread] || g < j->first_off[thread]) j->first_off[thread] = g;
            j->off[thread]++;
            memset(q, 0, sizeof q);
            scale = 0;
        } else {
            j->by_m[thread][m]++;
        }
        if (j->q4_0) moe_grid_q4_0_block(scale, q, j->q4_0 + g * 18);
        if (j->packed) moe_grid_pack_int4(q, MOE_GRID_GROUP, j->packed + g * 16);
        if (j->scales) j->scales[g] = scale;
    }
}

/* Recover the tensor's groups; counts into by_m / *off (first off-grid group in *first_off). */
static void recover_tensor(moe_pool *pool, group_job *j, uint64_t by_m[9], uint64_t *off,
                           int64_t *first_off) {
    int nt = moe_pool_n_threads(pool);
    memset(j->by_m, 0, sizeof j->by_m[0] * (size_t)nt);
    memset(j->off, 0, sizeof j->off[0] * (size_t)nt);
    int64_t n_groups = (int64_t)(j->t->n_values / MOE_GRID_GROUP);
    moe_pool_for(pool, n_groups, 4096, group_fn, j);
    *off = 0;
    *first_off = -1;
    memset(by_m, 0, 9 * sizeof *by_m);
    for (int t = 0; t < nt; t++) {
        for (int m = 0; m < 9; m++) by_m[m] += j->by_m[t][m];
        if (j->off[t] && (*first_off < 0 || j->first_off[t] < *first_off))
            *first_off = j->first_off[t];
        *off += j->off[t];
    }
}

/* ==== Progress ==== */

typedef struct progress {
    bool on, tty;
    uint64_t total, done;
    int last; /* last percentage printed */
    double t0;
    const char *what;
} progress;

static void progress_step(progress *p, uint64_t bytes) {
    p->done += bytes;
    if (!p->on || !p->total) return;
    int pct = (int)(100.0 * (double)p->done / (double)p->total);
    if (pct == p->last) return;
    if (!p->tty && pct / 10 == p->last / 10 && pct != 100) return;
    p->last = pct;
    double dt = moe_now() - p->t0;
    if (p->tty) {
        char bar[41];
        int fill = pct * 40 / 100;
        for (int i = 0; i < 40; i++) bar[i] = i < fill ? '#' : '.';
        bar[40] = 0;
        fprintf(stderr, "\r%s [%s] %3d%% %6.1f GB %5.1f s", p->what, bar, pct,
                (double)p->done / 1e9, dt);
        if (pct == 100) fputc('\n', stderr);
    } else {
        fprintf(stderr, "%s: %d%% (%.1f GB, %.1f s)\n", p->what, pct, (double)p->done / 1e9, dt);
    }
}

static void progress_start(progress *p, bool on, const char *what, uint64_t total) {
    *p = (progress){
        .on = on, .tty = isatty(2), .total = total, .last = -1, .t0 = moe_now(), .what = what};
}

/* ==== The plan: one entry per source tensor ==== */

typedef enum plan_kind {
    PLAN_QUANT,   /* every group on the grid: Q4_0 / W4A16 */
    PLAN_OFFGRID, /* quantizable, but a group is off the grid: kept at source precision */
    PLAN_COPY,    /* not quantized: copied */
    PLAN_SKIP,    /* not in the output (GGUF: vision / audio, which go to an mmproj file) */
} plan_kind;

typedef struct plan_entry {
    const moe_st_tensor *t;
    plan_kind kind;
    char out_name[256]; /* GGUF name (GGUF output) */
    moe_type out_type;  /* GGUF type */
    int64_t layer;      /* for the GGUF order */
    uint64_t off_groups;
    int64_t first_off;
    int64_t keep_rows; /* GGUF: the first rows only (token_embd trimmed to the vocabulary), or -1 */
} plan_entry;

static void report_add_offgrid(moe_repack_report *r, const plan_entry *e) {
    r->offgrid = moe_xrealloc(r->offgrid, (r->n_offgrid + 1) * sizeof *r->offgrid);
    moe_repack_offgrid *o = &r->offgrid[r->n_offgrid++];
    snprintf(o->name, sizeof o->name, "%s", e->t->name);
    o->groups = e->off_groups;
    o->first_group = e->first_off;
}

void moe_repack_report_free(moe_repack_report *r) {
    free(r->offgrid);
    memset(r, 0, sizeof *r);
}

/* GGUF ne[] of an HF shape (reversed; a scalar is [1]). */
static uint32_t gguf_ne(const moe_st_tensor *t, int64_t *ne) {
    if (t->n_dims == 0) {
        ne[0] = 1;
        return 1;
    }
    for (uint32_t d = 0; d < t->n_dims; d++) ne[d] = t->shape[t->n_dims - 1 - d];
    return t->n_dims;
}

static int cmp_gguf_order(const void *a, const void *b) {
    const plan_entry *x = *(plan_entry *const *)a, *y = *(plan_entry *const *)b;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    return strcmp(x->out_name, y->out_name);
}

/* Analysis pass: each entry's kind (and GGUF name / type), and the report's group counts. */
static moe_status plan_build(const moe_st *s, moe_repack_target to, moe_pool *pool,
                             bool show_progress, plan_entry *plan, moe_repack_report *r,
                             moe_error *err) {
    uint64_t n = moe_st_n_tensors(s);
    group_job *job = moe_xcalloc(1, sizeof *job);
    progress pr;
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++) total += moe_st_tensor_get(s, i)->n_bytes;
    progress_start(&pr, show_progress, "repack: checking groups", total);
    moe_status st = MOE_OK;
    for (uint64_t i = 0; i < n && st == MOE_OK; i++) {
        plan_entry *e = &plan[i];
        e->t = moe_st_tensor_get(s, i);
        e->kind = quantizable(e->t) ? PLAN_QUANT : PLAN_COPY;
        e->layer = -1;
        if (to == MOE_REPACK_Q4_0_GGUF) {
            int k = moe_hf_gguf_name(e->t->name, e->out_name, sizeof e->out_name);
            if (k == 1) {
                e->kind = PLAN_SKIP;
            } else if (k < 0) {
                st = moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                   "tensor '%s': no GGUF name for it (moe repack maps gemma4's HF "
                                   "names)",
                                   e->t->name);
                break;
            }
            e->layer = moe_tensor_layer(e->out_name);
            e->keep_rows = -1;
            if (strcmp(e->out_name, "token_embd.weight") == 0 && e->t->n_dims == 2) {
                int64_t rows = moe_hf_vocab_rows(moe_st_dir(s));
                if (rows >= 0 && rows < e->t->shape[0]) {
                    e->keep_rows = rows;
                    r->embd_rows_dropped = (uint64_t)(e->t->shape[0] - rows);
                }
            }
        }
        if (e->kind == PLAN_QUANT) {
            job->t = e->t;
            job->src = src_type(e->t->dtype);
            job->scale_type = to == MOE_REPACK_Q4_0_GGUF ? MOE_TYPE_F16 : MOE_TYPE_BF16;
            job->q4_0 = job->packed = NULL;
            job->scales = NULL;
            uint64_t by_m[9];
            recover_tensor(pool, job, by_m, &e->off_groups, &e->first_off);
            r->groups += e->t->n_values / MOE_GRID_GROUP;
            for (int m = 0; m < 9; m++) r->groups_by_m[m] += by_m[m];
            r->offgrid_groups += e->off_groups;
            if (e->off_groups) {
                e->kind = PLAN_OFFGRID;
                report_add_offgrid(r, e);
            }
        }
        if (to == MOE_REPACK_Q4_0_GGUF) {
            if (e->kind == PLAN_QUANT) {
                e->out_type = MOE_TYPE_Q4_0;
            } else if (e->kind != PLAN_SKIP && !moe_hf_copy_type(e->t, e->out_name, &e->out_type)) {
                st = moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                   "tensor '%s': dtype %s has no GGUF type", e->t->name,
                                   moe_st_dtype_name(e->t->dtype));
            }
        }
        r->n_quantized += e->kind == PLAN_QUANT;
        r->n_copied += e->kind == PLAN_COPY || e->kind == PLAN_OFFGRID;
        r->n_skipped += e->kind == PLAN_SKIP;
        if (e->kind == PLAN_COPY || e->kind == PLAN_OFFGRID) r->copied_bytes += e->t->n_bytes;
        moe_st_tensor_release(s, e->t);
        progress_step(&pr, e->t->n_bytes);
    }
    free(job);
    return st;
}

/* ==== Writing a Q4_0 GGUF ==== */

/* The tokenizer.* keys of a llama.cpp-made GGUF of the same model (the converter builds them
 * from tokenizer.json with gguf-py's vocab classes, which moe does not reimplement), checked to
 * name as many tokens as token_embd has rows. */
static moe_status copy_vocab(moe_gguf_writer *w, const char *path, int64_t embd_rows,
                             moe_error *err) {
    moe_gguf *g = moe_gguf_open(path, err);
    if (!g) return err->code;
    moe_status st = MOE_OK;
    const moe_gguf_value *tokens = moe_gguf_find(g, "tokenizer.ggml.tokens");
    if (!tokens || tokens->type != MOE_GGUF_ARRAY)
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: no tokenizer.ggml.tokens array", path);
    else if (embd_rows >= 0 && tokens->arr.n != (uint64_t)embd_rows)
        st = moe_error_set(err, MOE_ERR_FORMAT,
                           "%s: %llu tokens, but token_embd has %lld rows: not this model's "
                           "vocabulary",
                           path, (unsigned long long)tokens->arr.n, (long long)embd_rows);
    for (uint64_t i = 0; i < moe_gguf_n_kv(g) && st == MOE_OK; i++) {
        const moe_gguf_kv *kv = moe_gguf_kv_get(g, i);
        if (strncmp(kv->key.ptr, "tokenizer.", 10) == 0)
            moe_gguf_writer_set_value(w, kv->key.ptr, &kv->value);
    }
    moe_gguf_close(g);
    return st;
}

/* The tokenizer.* keys built from DIR/tokenizer.json (byte-level BPE, or Gemma's
 * SentencePiece-style BPE as tokenizer.ggml.model gemma4; see text/load_json.c), checked to name
 * as many tokens as token_embd has rows. A checkpoint without one, or with one moe does not read,
 * gets no tokenizer keys: a warning says so and --vocab-from gives them. */
static moe_status vocab_from_json(moe_gguf_writer *w, const char *dir, int64_t embd_rows,
                                  moe_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (access(path, F_OK) != 0) return MOE_OK;
    moe_error why = {0};
    moe_tokenizer *tok = moe_tokenizer_from_json_file(path, &why);
    moe_status st = MOE_OK;
    if (tok && embd_rows >= 0 && moe_tokenizer_n_vocab(tok) != (uint64_t)embd_rows)
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: %u tokens, but token_embd has %lld rows", path,
                           moe_tokenizer_n_vocab(tok), (long long)embd_rows);
    if (tok && st == MOE_OK && moe_tokenizer_write_gguf(tok, w, &why) != MOE_OK) {
        moe_tokenizer_free(tok);
        tok = NULL;
    }
    if (!tok && st == MOE_OK)
        fprintf(stderr,
                "repack: no tokenizer keys written (%s); --vocab-from F.gguf copies them from a "
                "llama.cpp conversion\n",
                why.msg);
    moe_tokenizer_free(tok);
    return st;
}

static moe_status write_gguf(const moe_st *s, json_t *config, plan_entry *plan, moe_pool *pool,
                             const char *out, const moe_repack_options *o, moe_repack_report *r,
                             moe_error *err) {
    bool show_progress = o->progress;
    uint64_t n = moe_st_n_tensors(s);
    moe_gguf_writer *w = moe_gguf_writer_new();
    moe_status st = moe_hf_write_metadata(w, config, moe_st_dir(s), err);
    int64_t rows = -1;
    for (uint64_t i = 0; i < n; i++)
        if (plan[i].kind != PLAN_SKIP && strcmp(plan[i].out_name, "token_embd.weight") == 0)
            rows = plan[i].keep_rows >= 0 ? plan[i].keep_rows : plan[i].t->shape[0];
    if (st == MOE_OK) moe_hf_write_chat_template(w, moe_st_dir(s));
    if (st == MOE_OK)
        st = o->vocab_from ? copy_vocab(w, o->vocab_from, rows, err)
                           : vocab_from_json(w, moe_st_dir(s), rows, err);
    int64_t n_freqs = 0;
    float *freqs = st == MOE_OK ? moe_hf_rope_freqs(config, &n_freqs) : NULL;
    /* the output order: tensors outside the layers, then layer by layer, names sorted */
    plan_entry **order = moe_xcalloc((size_t)n + 1, sizeof *order);
    size_t n_out = 0;
    for (uint64_t i = 0; i < n; i++)
        if (plan[i].kind != PLAN_SKIP) order[n_out++] = &plan[i];
    plan_entry rope = {.kind = PLAN_COPY, .out_type = MOE_TYPE_F32, .layer = -1};
    snprintf(rope.out_name, sizeof rope.out_name, "rope_freqs.weight");
    if (freqs) order[n_out++] = &rope;
    qsort(order, n_out, sizeof *order, cmp_gguf_order);
    for (size_t i = 0; i < n_out && st == MOE_OK; i++) {
        int64_t ne[MOE_ST_MAX_DIMS];
        uint32_t nd = order[i] == &rope ? (ne[0] = n_freqs, 1) : gguf_ne(order[i]->t, ne);
        if (order[i] != &rope && order[i]->keep_rows >= 0) ne[1] = order[i]->keep_rows;
        if (nd > MOE_GGUF_MAX_DIMS)
            st = moe_error_set(err, MOE_ERR_UNSUPPORTED, "tensor '%s': %u dimensions",
                               order[i]->t->name, nd);
        else
            st = moe_gguf_writer_add_tensor(w, order[i]->out_name, order[i]->out_type, nd, ne, NULL,
                                            true, err);
    }
    if (st == MOE_OK) moe_gguf_writer_set_file_type(w);
    if (st == MOE_OK) st = moe_gguf_writer_stream_begin(w, out, err);
    group_job *job = moe_xcalloc(1, sizeof *job);
    progress pr;
    progress_start(&pr, show_progress, "repack: writing", r->bytes_in);
    for (size_t i = 0; i < n_out && st == MOE_OK; i++) {
        plan_entry *e = order[i];
        if (e == &rope) {
            st = moe_gguf_writer_stream_tensor(w, freqs, err);
            r->bytes_out += (uint64_t)n_freqs * 4;
            continue;
        }
        const moe_st_tensor *t = e->t;
        if (e->kind == PLAN_QUANT) {
            uint64_t n_groups = t->n_values / MOE_GRID_GROUP, by_m[9], off;
            int64_t first;
            job->t = t;
            job->src = src_type(t->dtype);
            job->scale_type = MOE_TYPE_F16;
            job->q4_0 = moe_xmalloc((size_t)n_groups * 18);
            job->packed = NULL;
            job->scales = NULL;
            recover_tensor(pool, job, by_m, &off, &first);
            if (off) /* the first pass saw these groups on the grid: the arithmetic is pure */
                moe_die("tensor %s: %" PRIu64 " groups off the grid on the second pass", t->name,
                        off);
            st = moe_gguf_writer_stream_tensor(w, job->q4_0, err);
            r->bytes_out += n_groups * 18;
            free(job->q4_0);
        } else if (e->out_type == MOE_TYPE_F32 && t->dtype != MOE_ST_F32) {
            float *f = moe_xmalloc((size_t)t->n_values * sizeof *f + 1);
            st = moe_st_to_f32(t, 0, t->n_values, f, err);
            if (st == MOE_OK) st = moe_gguf_writer_stream_tensor(w, f, err);
            r->bytes_out += t->n_values * 4;
            free(f);
        } else { /* the writer takes the declared bytes: a trimmed tensor's first rows */
            st = moe_gguf_writer_stream_tensor(w, t->data, err);
            r->bytes_out += e->keep_rows >= 0
                                ? (uint64_t)e->keep_rows * (t->n_bytes / (uint64_t)t->shape[0])
                                : t->n_bytes;
        }
        moe_st_tensor_release(s, t);
        progress_step(&pr, t->n_bytes);
    }
    if (st == MOE_OK) st = moe_gguf_writer_stream_finish(w, err);
    free(job);
    free(order);
    free(freqs);
    moe_gguf_writer_free(w);
    return st;
}

/* ==== Writing a compressed-tensors W4A16 checkpoint ==== */

/* The output modules of a quantized source tensor: 2-D "X.weight" -> module X; 3-D fused experts
 * "P.experts.gate_up_proj" [E, 2F, in] -> P.experts.e.gate_proj (rows 0..F) and .up_proj (rows
 * F..2F); "P.experts.down_proj" -> P.experts.e.down_proj; any other 3-D "X" -> X.e. */
typedef struct w4_module {
    char name[300];
    int64_t first_row, rows, cols; /* rows of the source tensor viewed as [E * R, in] */
} w4_module;

static size_t w4_modules(const moe_st_tensor *t, w4_module *out, size_t cap) {
    int64_t cols = t->shape[t->n_dims - 1];
    if (t->n_dims == 2) {
        if (cap < 1) return 0;
        size_t len = strlen(t->name) - (ends_with(t->name, ".weight") ? 7 : 0);
        snprintf(out[0].name, sizeof out[0].name, "%.*s", (int)len, t->name);
        out[0].first_row = 0;
        out[0].rows = t->shape[0];
        out[0].cols = cols;
        return 1;
    }
    int64_t E = t->shape[0], R = t->shape[1];
    bool gate_up = ends_with(t->name, "experts.gate_up_proj") && R % 2 == 0;
    bool fused = gate_up || ends_with(t->name, "experts.down_proj");
    size_t stem = strlen(t->name) - (fused ? strlen(gate_up ? "gate_up_proj" : "down_proj") + 1
                                           : (ends_with(t->name, ".weight") ? 7 : 0));
    size_t n = 0;
    for (int64_t e = 0; e < E; e++)
        for (int part = 0; part < (gate_up ? 2 : 1); part++) {
            if (n >= cap) return 0;
            w4_module *m = &out[n++];
            const char *what = gate_up ? (part ? "up_proj" : "gate_proj") : "down_proj";
            if (fused)
                snprintf(m->name, sizeof m->name, "%.*s.%lld.%s", (int)stem, t->name, (long long)e,
                         what);
            else
                snprintf(m->name, sizeof m->name, "%.*s.%lld", (int)stem, t->name, (long long)e);
            int64_t rows = gate_up ? R / 2 : R;
            m->first_row = e * R + part * rows;
            m->rows = rows;
            m->cols = cols;
        }
    return n;
}

static size_t w4_n_modules(const moe_st_tensor *t) {
    if (t->n_dims == 2) return 1;
    bool gate_up = ends_with(t->name, "experts.gate_up_proj") && t->shape[1] % 2 == 0;
    return (size_t)t->shape[0] * (gate_up ? 2 : 1);
}

/* The W4A16 output as shards of at most max_bytes of data each (a larger tensor gets a shard
 * of its own), named as transformers names them, with model.safetensors.index.json; one file
 * model.safetensors when it all fits. Tensors are declared in data order, then written in
 * that order: each shard's header goes out when its first byte does. */
typedef struct shard_out {
    moe_st_writer **w; /* [n] */
    size_t n, cur;     /* shards; the one being written */
    uint64_t max_bytes, last_bytes, total;
    json_t *where; /* tensor name -> shard index */
    const char *dir;
} shard_out;

static moe_status so_declare(shard_out *so, const char *name, moe_st_dtype dtype, uint32_t n_dims,
                             const int64_t *shape, moe_error *err) {
    uint64_t bytes = moe_st_dtype_size(dtype);
    for (uint32_t d = 0; d < n_dims; d++) bytes *= (uint64_t)shape[d];
    if (!so->n || (so->last_bytes && so->last_bytes + bytes > so->max_bytes)) {
        so->w = moe_xrealloc(so->w, (so->n + 1) * sizeof *so->w);
        so->w[so->n] = moe_st_writer_new();
        moe_st_writer_set_meta(so->w[so->n++], "format", "pt");
        so->last_bytes = 0;
    }
    so->last_bytes += bytes;
    so->total += bytes;
    json_object_set_new(so->where, name, json_integer((json_int_t)so->n - 1));
    return moe_st_writer_declare(so->w[so->n - 1], name, dtype, n_dims, shape, err);
}

static void so_path(const shard_out *so, size_t i, char *path, size_t cap) {
    if (so->n == 1)
        snprintf(path, cap, "%s/model.safetensors", so->dir);
    else
        snprintf(path, cap, "%s/model-%05zu-of-%05zu.safetensors", so->dir, i + 1, so->n);
}

/* Finish the shards that are complete and begin the next; at the start, begin the first. */
static moe_status so_advance(shard_out *so, bool start, moe_error *err) {
    char path[4096];
    moe_status st = MOE_OK;
    if (start && so->n) {
        so_path(so, 0, path, sizeof path);
        st = moe_st_writer_begin(so->w[0], path, err);
    }
    while (st == MOE_OK && so->cur < so->n && moe_st_writer_remaining(so->w[so->cur]) == 0) {
        st = moe_st_writer_finish(so->w[so->cur], err);
        if (st == MOE_OK && ++so->cur < so->n) {
            so_path(so, so->cur, path, sizeof path);
            st = moe_st_writer_begin(so->w[so->cur], path, err);
        }
    }
    return st;
}

static moe_status so_write(shard_out *so, const void *data, size_t n, moe_error *err) {
    if (so->cur >= so->n) return moe_error_set(err, MOE_ERR_ARG, "%s: all shards written", so->dir);
    moe_status st = moe_st_writer_write(so->w[so->cur], data, n, err);
    return st == MOE_OK ? so_advance(so, false, err) : st;
}

/* After the last write: every shard complete; the index when there are several. */
static moe_status so_finish(shard_out *so, moe_error *err) {
    if (so->cur != so->n)
        return moe_error_set(err, MOE_ERR_ARG, "%s: shard %zu of %zu not complete", so->dir,
                             so->cur + 1, so->n);
    /* a previous run's files of the other layout would shadow or contradict these */
    char stale[4096];
    snprintf(stale, sizeof stale, "%s/%s", so->dir,
             so->n < 2 ? "model.safetensors.index.json" : "model.safetensors");
    unlink(stale);
    if (so->n < 2) return MOE_OK;
    json_t *map = json_object();
    const char *key;
    json_t *v;
    json_object_foreach(so->where, key, v) {
        char path[4096];
        so_path(so, (size_t)json_integer_value(v), path, sizeof path);
        json_object_set_new(map, key, json_string(strrchr(path, '/') + 1));
    }
    json_t *index = json_pack("{s:{s:I}, s:o}", "metadata", "total_size", (json_int_t)so->total,
                              "weight_map", map);
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", so->dir);
    int rc = json_dump_file(index, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(index);
    return rc == 0 ? MOE_OK : moe_error_set(err, MOE_ERR_IO, "%s: cannot write", path);
}

static void so_free(shard_out *so) {
    for (size_t i = 0; i < so->n; i++) moe_st_writer_free(so->w[i]);
    free(so->w);
    json_decref(so->where);
}

static moe_status declare_module(shard_out *w, const w4_module *m, moe_error *err) {
    char name[340];
    snprintf(name, sizeof name, "%s.weight_packed", m->name);
    moe_status st = so_declare(w, name, MOE_ST_I32, 2, (int64_t[]){m->rows, m->cols / 8}, err);
    snprintf(name, sizeof name, "%s.weight_scale", m->name);
    if (st == MOE_OK)
        st = so_declare(w, name, MOE_ST_BF16, 2, (int64_t[]){m->rows, m->cols / MOE_GRID_GROUP},
                        err);
    /* int64, as compressed-tensors writes it (torch.tensor(weight.shape)) */
    snprintf(name, sizeof name, "%s.weight_shape", m->name);
    if (st == MOE_OK) st = so_declare(w, name, MOE_ST_I64, 1, (int64_t[]){2}, err);
    return st;
}

/* config.json with compressed-tensors' quantization_config (pack-quantized, symmetric int4,
 * group 32): the modules kept at source precision are listed in "ignore". */
static moe_status write_w4a16_config(json_t *config, const plan_entry *plan, uint64_t n,
                                     const char *dir, moe_error *err) {
    json_t *c = json_deep_copy(config);
    json_t *weights =
        json_pack("{s:i, s:s, s:b, s:i, s:s, s:b, s:n, s:n, s:s}", "num_bits", 4, "type", "int",
                  "symmetric", 1, "group_size", MOE_GRID_GROUP, "strategy", "group", "dynamic", 0,
                  "actorder", "block_structure", "observer", "minmax");
    json_t *group =
        json_pack("{s:[s], s:o, s:n, s:n, s:s}", "targets", "Linear", "weights", weights,
                  "input_activations", "output_activations", "format", "pack-quantized");
    json_t *ignore = json_array();
    for (uint64_t i = 0; i < n; i++) {
        if (plan[i].kind == PLAN_QUANT || plan[i].kind == PLAN_SKIP) continue;
        if (plan[i].t->n_dims < 2) continue; /* norms and scales are not modules */
        const char *name = plan[i].t->name;
        size_t len = strlen(name) - (ends_with(name, ".weight") ? 7 : 0);
        char *mod = moe_xstrndup(name, len);
        json_array_append_new(ignore, json_string(mod));
        free(mod);
    }
    json_t *q = json_pack("{s:{s:o}, s:s, s:o, s:s, s:s, s:n, s:n}", "config_groups", "group_0",
                          group, "format", "pack-quantized", "ignore", ignore, "quant_method",
                          "compressed-tensors", "quantization_status", "compressed",
                          "kv_cache_scheme", "global_compression_ratio");
    if (!q) moe_die("json_pack of quantization_config failed");
    json_object_set_new(c, "quantization_config", q);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    int rc = json_dump_file(c, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(c);
    if (rc != 0) return moe_error_set(err, MOE_ERR_IO, "%s: cannot write", path);
    return MOE_OK;
}

/* Files a serving stack needs besides the weights, copied when the source has them. */
static void copy_side_files(const char *src_dir, const char *dir) {
    static const char *const files[] = {
        "tokenizer.json",           "tokenizer_config.json", "generation_config.json",
        "special_tokens_map.json",  "chat_template.jinja",   "chat_template.json",
        "preprocessor_config.json", "processor_config.json", "tokenizer.model"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char a[4096], b[4096];
        snprintf(a, sizeof a, "%s/%s", src_dir, files[i]);
        snprintf(b, sizeof b, "%s/%s", dir, files[i]);
        uint8_t *data;
        size_t size;
        moe_error e = {0};
        if (moe_file_read(a, &data, &size, &e) != MOE_OK) continue;
        moe_file_write(b, data, size, &e);
        free(data);
    }
}

static moe_status write_w4a16(const moe_st *s, json_t *config, plan_entry *plan, moe_pool *pool,
                              const char *dir, const moe_repack_options *o, moe_repack_report *r,
                              moe_error *err) {
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return moe_error_set(err, MOE_ERR_IO, "%s: cannot create the directory", dir);
    uint64_t n = moe_st_n_tensors(s);
    bool show_progress = o->progress;
    shard_out so = {.max_bytes = o->max_shard_bytes ? o->max_shard_bytes : UINT64_MAX,
                    .where = json_object(),
                    .dir = dir};
    shard_out *w = &so;
    moe_status st = MOE_OK;
    size_t cap = 0;
    w4_module *mods = NULL;
    for (uint64_t i = 0; i < n && st == MOE_OK; i++) {
        const plan_entry *e = &plan[i];
        if (e->kind == PLAN_QUANT) {
            size_t k = w4_n_modules(e->t);
            if (k > cap) mods = moe_xrealloc(mods, (cap = k) * sizeof *mods);
            k = w4_modules(e->t, mods, cap);
            for (size_t m = 0; m < k && st == MOE_OK; m++) st = declare_module(w, &mods[m], err);
        } else {
            st = so_declare(w, e->t->name, e->t->dtype, e->t->n_dims, e->t->shape, err);
        }
    }
    if (st == MOE_OK) st = so_advance(w, true, err);
    group_job *job = moe_xcalloc(1, sizeof *job);
    progress pr;
    progress_start(&pr, show_progress, "repack: writing", r->bytes_in);
    for (uint64_t i = 0; i < n && st == MOE_OK; i++) {
        const plan_entry *e = &plan[i];
        const moe_st_tensor *t = e->t;
        if (e->kind != PLAN_QUANT) {
            st = so_write(w, t->data, (size_t)t->n_bytes, err);
            r->bytes_out += t->n_bytes;
            moe_st_tensor_release(s, t);
            progress_step(&pr, t->n_bytes);
            continue;
        }
        uint64_t n_groups = t->n_values / MOE_GRID_GROUP, by_m[9], off;
        int64_t first;
        job->t = t;
        job->src = src_type(t->dtype);
        job->scale_type = MOE_TYPE_BF16;
        job->q4_0 = NULL;
        job->packed = moe_xmalloc((size_t)n_groups * 16);
        job->scales = moe_xmalloc((size_t)n_groups * sizeof *job->scales);
        recover_tensor(pool, job, by_m, &off, &first);
        if (off) moe_die("tensor %s: groups off the grid on the second pass", t->name);
        size_t k = w4_modules(t, mods, cap);
        for (size_t m = 0; m < k && st == MOE_OK; m++) {
            int64_t g0 = mods[m].first_row * (mods[m].cols / MOE_GRID_GROUP);
            int64_t ng = mods[m].rows * (mods[m].cols / MOE_GRID_GROUP);
            uint8_t shape[16];
            for (int b = 0; b < 8; b++) {
                shape[b] = (uint8_t)((uint64_t)mods[m].rows >> (8 * b));
                shape[8 + b] = (uint8_t)((uint64_t)mods[m].cols >> (8 * b));
            }
            uint8_t *sc = moe_xmalloc((size_t)ng * 2 + 1);
            for (int64_t g = 0; g < ng; g++) {
                sc[2 * g] = (uint8_t)job->scales[g0 + g];
                sc[2 * g + 1] = (uint8_t)(job->scales[g0 + g] >> 8);
            }
            st = so_write(w, job->packed + g0 * 16, (size_t)ng * 16, err);
            if (st == MOE_OK) st = so_write(w, sc, (size_t)ng * 2, err);
            if (st == MOE_OK) st = so_write(w, shape, 16, err);
            r->bytes_out += (uint64_t)ng * 18 + 16;
            free(sc);
        }
        free(job->packed);
        free(job->scales);
        moe_st_tensor_release(s, t);
        progress_step(&pr, t->n_bytes);
    }
    if (st == MOE_OK) st = so_finish(w, err);
    so_free(w);
    free(job);
    free(mods);
    if (st == MOE_OK) st = write_w4a16_config(config, plan, n, dir, err);
    if (st == MOE_OK) copy_side_files(moe_st_dir(s), dir);
    return st;
}

/* ==== moe repack ==== */

moe_status moe_repack(const char *src, const char *out, const moe_repack_options *o,
                      moe_repack_report *r, moe_error *err) {
    memset(r, 0, sizeof *r);
    double t0 = moe_now();
    moe_st *s = moe_st_open(src, err);
    if (!s) return err->code;
    json_t *config = moe_hf_read_config(moe_st_dir(s), err);
    if (!config) {
        moe_st_close(s);
        return err->code;
    }
    uint64_t n = moe_st_n_tensors(s);
    for (uint64_t i = 0; i < n; i++) r->bytes_in += moe_st_tensor_get(s, i)->n_bytes;
    int threads = o->workers > 0 ? o->workers : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    moe_pool *pool = moe_pool_new(threads);
    plan_entry *plan = moe_xcalloc((size_t)n + 1, sizeof *plan);
    moe_status st = MOE_OK;
    const char *model_type = moe_hf_model_type(config);
    if (o->to == MOE_REPACK_Q4_0_GGUF && (!model_type || strncmp(model_type, "gemma4", 6) != 0))
        st = moe_error_set(err, MOE_ERR_UNSUPPORTED,
                           "%s/config.json: model_type '%s': --to q4_0-gguf maps the HF names and "
                           "metadata of gemma4 only (--to w4a16 takes any architecture)",
                           moe_st_dir(s), model_type ? model_type : "(none)");
    if (st == MOE_OK) st = plan_build(s, o->to, pool, o->progress, plan, r, err);
    if (st == MOE_OK)
        st = o->to == MOE_REPACK_Q4_0_GGUF ? write_gguf(s, config, plan, pool, out, o, r, err)
                                           : write_w4a16(s, config, plan, pool, out, o, r, err);
    r->seconds = moe_now() - t0;
    free(plan);
    moe_pool_free(pool);
    json_decref(config);
    moe_st_close(s);
    return st;
}

/* ==== moe repack --verify ==== */

/* One tensor's stored groups against its source: stored group g of the output is source group
 * g0 + g. Exactly one of q4_0 / packed (+ scales) is set. */
typedef struct verify_job {
    const moe_st_tensor *t;
    int64_t g0;
    moe_type scale_type, src;
    const uint8_t *q4_0;   /* Q4_0 blocks */
    const uint8_t *packed; /* int4 words, 16 bytes per group */
    const uint8_t *scales; /* bf16 per group, little-endian */
    uint64_t bad[MAX_THREADS];
    int64_t first_bad[MAX_THREADS], first_index[MAX_THREADS];
    double worst[MAX_THREADS]; /* |stored scale - least-squares step| / |step| */
} verify_job;

static void verify_fn(void *arg, int64_t begin, int64_t end, int thread) {
    verify_job *j = arg;
    float w[MOE_GRID_GROUP];
    int8_t q[MOE_GRID_GROUP];
    for (int64_t g = begin; g < end; g++) {
        decode_group(j->t, j->g0 + g, w);
        uint16_t scale;
        if (j->q4_0) {
            moe_grid_q4_0_levels(j->q4_0 + g * 18, &scale, q);
        } else {
            moe_grid_unpack_int4(j->packed + g * 16, MOE_GRID_GROUP, q);
            scale = (uint16_t)(j->scales[2 * g] | j->scales[2 * g + 1] << 8);
        }
        int i = moe_grid_check(w, MOE_GRID_GROUP, j->scale_type, j->src, scale, q);
        if (i >= 0) {
            if (!j->bad[thread] || g < j->first_bad[thread]) {
                j->first_bad[thread] = g;
                j->first_index[thread] = i;
            }
            j->bad[thread]++;
            continue;
        }
        double num = 0, den = 0;
        for (int k = 0; k < MOE_GRID_GROUP; k++)
            num += (double)w[k] * q[k], den += (double)q[k] * q[k];
        float d = j->scale_type == MOE_TYPE_F16 ? moe_fp16_to_f32(scale) : moe_bf16_to_f32(scale);
        if (den > 0) {
            double rel = fabs(d - num / den) / fabs(num / den);
            if (rel > j->worst[thread]) j->worst[thread] = rel;
        }
    }
}

typedef struct verifier {
    moe_repack_check *v;
    moe_pool *pool;
    verify_job *job;
} verifier;

static void mismatch(moe_repack_check *v, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void mismatch(moe_repack_check *v, const char *fmt, ...) {
    v->mismatches++;
    if (v->n_messages >= VERIFY_MAX_REPORTED) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(v->messages[v->n_messages++], sizeof v->messages[0], fmt, ap);
    va_end(ap);
}

/* Check `n_groups` stored groups (job set up by the caller) of source tensor t starting at its
 * group g0; `what` names the output tensor in messages. */
static void verify_groups(verifier *vf, const char *what, int64_t n_groups) {
    verify_job *j = vf->job;
    int nt = moe_pool_n_threads(vf->pool);
    memset(j->bad, 0, sizeof j->bad[0] * (size_t)nt);
    memset(j->worst, 0, sizeof j->worst[0] * (size_t)nt);
    moe_pool_for(vf->pool, n_groups, 4096, verify_fn, j);
    uint64_t bad = 0;
    int64_t first = -1, index = 0;
    for (int t = 0; t < nt; t++) {
        if (j->bad[t] && (first < 0 || j->first_bad[t] < first)) {
            first = j->first_bad[t];
            index = j->first_index[t];
        }
        bad += j->bad[t];
        if (j->worst[t] > vf->v->worst_scale_rel) {
            vf->v->worst_scale_rel = j->worst[t];
            snprintf(vf->v->worst_scale_tensor, sizeof vf->v->worst_scale_tensor, "%s", what);
        }
    }
    vf->v->groups += (uint64_t)n_groups;
    vf->v->bad_groups += bad;
    if (bad) {
        int64_t cols = j->t->shape[j->t->n_dims - 1], g = j->g0 + first;
        int64_t row = g * MOE_GRID_GROUP / cols, col = g * MOE_GRID_GROUP % cols;
        float w[MOE_GRID_GROUP];
        decode_group(j->t, g, w);
        mismatch(vf->v,
                 "tensor '%s' group %lld (source '%s' row %lld, columns %lld..%lld): value %d "
                 "(%g) is not on the stored grid; %llu bad group%s in this tensor",
                 what, (long long)first, j->t->name, (long long)row, (long long)col,
                 (long long)col + MOE_GRID_GROUP - 1, (int)index, (double)w[index],
                 (unsigned long long)bad, bad > 1 ? "s" : "");
        vf->v->mismatches += bad - 1;
    }
}

/* A copied tensor: identical bytes, or (widened) identical values as f32. */
static void verify_copy(moe_repack_check *v, const moe_st_tensor *t, const char *what,
                        const uint8_t *data, bool widened, uint64_t n_values) {
    uint64_t n_bytes = n_values * moe_st_dtype_size(t->dtype);
    v->tensors_copied++;
    v->copied_bytes += n_bytes;
    if (!widened) {
        for (uint64_t i = 0; i < n_bytes; i++)
            if (data[i] != t->data[i]) {
                mismatch(v, "tensor '%s' (copy of '%s'): byte %llu (value %llu) differs", what,
                         t->name, (unsigned long long)i,
                         (unsigned long long)(i / moe_st_dtype_size(t->dtype)));
                return;
            }
        return;
    }
    for (uint64_t i = 0; i < n_values; i++) {
        float a, b;
        moe_error e = {0};
        moe_st_to_f32(t, i, 1, &a, &e);
        memcpy(&b, data + 4 * i, 4);
        if (memcmp(&a, &b, 4) != 0) {
            mismatch(v, "tensor '%s' (F32 of '%s'): value %llu is %g, the source holds %g", what,
                     t->name, (unsigned long long)i, (double)b, (double)a);
            return;
        }
    }
}

static bool same_shape_gguf(const moe_st_tensor *t, const moe_tensor *g, int64_t keep_rows) {
    int64_t ne[MOE_ST_MAX_DIMS];
    uint32_t nd = gguf_ne(t, ne);
    if (keep_rows >= 0 && nd == 2) ne[1] = keep_rows;
    if (nd != g->n_dims) return false;
    for (uint32_t d = 0; d < nd; d++)
        if (ne[d] != g->ne[d]) return false;
    return true;
}

static void verify_gguf(verifier *vf, const moe_st *s, json_t *config, const moe_gguf *g) {
    moe_repack_check *v = vf->v;
    uint64_t n = moe_st_n_tensors(s), used = 0;
    for (uint64_t i = 0; i < n; i++) {
        const moe_st_tensor *t = moe_st_tensor_get(s, i);
        char name[256];
        int k = moe_hf_gguf_name(t->name, name, sizeof name);
        if (k == 1) {
            v->skipped++;
            continue;
        }
        const moe_tensor *o = k == 0 ? moe_gguf_tensor_find(g, name) : NULL;
        if (!o) {
            mismatch(v, "source tensor '%s': no tensor '%s' in the GGUF", t->name,
                     k == 0 ? name : "(no GGUF name)");
            continue;
        }
        used++;
        int64_t keep = -1; /* token_embd: the rows the converter keeps */
        if (strcmp(name, "token_embd.weight") == 0 && t->n_dims == 2) {
            keep = moe_hf_vocab_rows(moe_st_dir(s));
            if (keep >= t->shape[0]) keep = -1;
        }
        if (!same_shape_gguf(t, o, keep)) {
            mismatch(v, "tensor '%s': its shape is not the source's ('%s')", name, t->name);
            continue;
        }
        if (o->type == MOE_TYPE_Q4_0 && quantizable(t)) {
            /* (the source's pages are released after the check, below) */
            v->tensors_quantized++;
            *vf->job = (verify_job){
                .t = t, .scale_type = MOE_TYPE_F16, .src = src_type(t->dtype), .q4_0 = o->data};
            verify_groups(vf, name, (int64_t)(t->n_values / MOE_GRID_GROUP));
        } else if (o->type == MOE_TYPE_F32 && t->dtype != MOE_ST_F32 && is_float(t->dtype)) {
            verify_copy(v, t, name, o->data, true, t->n_values);
        } else if (o->type != MOE_TYPE_Q4_0 &&
                   o->n_bytes == (keep >= 0 ? (uint64_t)keep * (t->n_bytes / (uint64_t)t->shape[0])
                                            : t->n_bytes)) {
            verify_copy(v, t, name, o->data, false, o->n_values);
        } else {
            mismatch(v, "tensor '%s': type %s does not hold source '%s' (%s)", name,
                     moe_type_name(o->type), t->name, moe_st_dtype_name(t->dtype));
        }
        moe_st_tensor_release(s, t);
    }
    /* the one tensor the converter makes: rope_freqs from the config */
    int64_t n_freqs = 0;
    float *freqs = moe_hf_rope_freqs(config, &n_freqs);
    const moe_tensor *rf = moe_gguf_tensor_find(g, "rope_freqs.weight");
    if (freqs && rf) {
        used++;
        if (rf->type != MOE_TYPE_F32 || rf->n_values != (uint64_t)n_freqs ||
            memcmp(rf->data, freqs, (size_t)n_freqs * 4) != 0)
            mismatch(v, "tensor 'rope_freqs.weight' is not what config.json gives");
    } else if (freqs) {
        mismatch(v, "no tensor 'rope_freqs.weight' in the GGUF");
    }
    free(freqs);
    if (used != moe_gguf_n_tensors(g))
        mismatch(v, "the GGUF holds %llu tensors, %llu of them from the source",
                 (unsigned long long)moe_gguf_n_tensors(g), (unsigned long long)used);
}

static void verify_w4a16(verifier *vf, const moe_st *s, const moe_st *o) {
    moe_repack_check *v = vf->v;
    uint64_t n = moe_st_n_tensors(s), used = 0;
    w4_module *mods = NULL;
    size_t cap = 0;
    for (uint64_t i = 0; i < n; i++) {
        const moe_st_tensor *t = moe_st_tensor_get(s, i);
        const moe_st_tensor *c = moe_st_tensor_find(o, t->name);
        if (c) {
            used++;
            bool same = c->dtype == t->dtype && c->n_dims == t->n_dims &&
                        memcmp(c->shape, t->shape, t->n_dims * sizeof t->shape[0]) == 0;
            if (!same)
                mismatch(v, "tensor '%s': dtype or shape differs from the source", t->name);
            else
                verify_copy(v, t, t->name, c->data, false, t->n_values);
            continue;
        }
        if (!quantizable(t)) {
            mismatch(v, "source tensor '%s' is not in the output", t->name);
            continue;
        }
        size_t k = w4_n_modules(t);
        if (k > cap) mods = moe_xrealloc(mods, (cap = k) * sizeof *mods);
        k = w4_modules(t, mods, cap);
        v->tensors_quantized++;
        for (size_t m = 0; m < k; m++) {
            moe_w4a16_module wm;
            moe_error e = {0};
            if (moe_w4a16_module_find(o, mods[m].name, &wm, &e) != MOE_OK) {
                mismatch(v, "module '%s' (of '%s'): %s", mods[m].name, t->name, e.msg);
                continue;
            }
            used += 3;
            int64_t ng = mods[m].rows * (mods[m].cols / MOE_GRID_GROUP);
            if (wm.rows != mods[m].rows || wm.cols != mods[m].cols ||
                wm.scale->dtype != MOE_ST_BF16) {
                mismatch(v,
                         "module '%s': [%lld, %lld] with %s scales, the source gives [%lld, %lld]",
                         mods[m].name, (long long)wm.rows, (long long)wm.cols,
                         moe_st_dtype_name(wm.scale->dtype), (long long)mods[m].rows,
                         (long long)mods[m].cols);
                continue;
            }
            *vf->job = (verify_job){.t = t,
                                    .g0 = mods[m].first_row * (mods[m].cols / MOE_GRID_GROUP),
                                    .scale_type = MOE_TYPE_BF16,
                                    .src = src_type(t->dtype),
                                    .packed = wm.packed->data,
                                    .scales = wm.scale->data};
            char what[340];
            snprintf(what, sizeof what, "%s.weight_packed", mods[m].name);
            verify_groups(vf, what, ng);
            moe_st_tensor_release(o, wm.packed);
        }
        moe_st_tensor_release(s, t);
    }
    free(mods);
    if (used != moe_st_n_tensors(o))
        mismatch(v, "the output holds %llu tensors, %llu of them accounted for by the source",
                 (unsigned long long)moe_st_n_tensors(o), (unsigned long long)used);
}

moe_status moe_repack_verify(const char *src, const char *out, int workers, moe_repack_check *v,
                             moe_error *err) {
    memset(v, 0, sizeof *v);
    double t0 = moe_now();
    moe_st *s = moe_st_open(src, err);
    if (!s) return err->code;
    int threads = workers > 0 ? workers : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    verifier vf = {v, moe_pool_new(threads), moe_xcalloc(1, sizeof(verify_job))};
    moe_status st = MOE_OK;
    FILE *f = fopen(out, "rb");
    char magic[4] = {0};
    bool is_gguf = f && fread(magic, 1, 4, f) == 4 && memcmp(magic, "GGUF", 4) == 0;
    if (f) fclose(f);
    if (is_gguf) {
        json_t *config = moe_hf_read_config(moe_st_dir(s), err);
        moe_gguf *g = config ? moe_gguf_open(out, err) : NULL;
        if (g) {
            verify_gguf(&vf, s, config, g);
            moe_gguf_close(g);
        } else {
            st = err->code;
        }
        json_decref(config);
    } else {
        moe_st *o = moe_st_open(out, err);
        if (o) {
            verify_w4a16(&vf, s, o);
            moe_st_close(o);
        } else {
            st = err->code;
        }
    }
    v->seconds = moe_now() - t0;
    free(vf.job);
    moe_pool_free(vf.pool);
    moe_st_close(s);
    return st;
}
