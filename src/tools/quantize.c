/* quantize.c: `moe quantize` -- a GGUF model requantized to a chosen type or mix, with an
 * optional importance matrix (llama.cpp's GGUF imatrix format), written tensor by tensor.
 *
 * Which tensors change: matrices whose name ends in ".weight" (2 or 3 dimensions), except norms,
 * routers (ffn_gate_inp) and the few small tensors llama.cpp also keeps; every other tensor is
 * copied byte for byte. A tensor's type is the first --rule whose regular expression matches
 * its name (searched, anchored only as written), else the preset's choice (llama.cpp's rules
 * for that mix, with per-layer bits from the layer index in the name), else --type. A row that
 * is not whole blocks of the chosen type falls back as llama.cpp does (IQ / Q2_K / Q3_K ->
 * IQ4_NL, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), else stays as it is. Tensors the model's
 * architecture reads as floats (its binder's declaration: routers, gates, indexer vectors)
 * are never quantized, so the file loads wherever the source did.
 *
 * Sources of any type are decoded to f32 row by row (F32 / F16 / BF16 / Q8_0 exactly; other
 * quantized sources are requantized, which compounds errors: a warning says so). The output is
 * produced while the file is written (deferred tensors), one tensor at a time, so memory holds
 * one tensor's output plus a chunk of rows, not the model. The trap: with an importance matrix,
 * a 3-D expert tensor [n_in, n_out, n_expert] takes the matrix's per-expert vectors (n_expert
 * x n_in values), each expert's rows its own. */
#include "tools.h"

#include "../model/model.h"

#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define QUANTIZE_CHUNK_ROWS 512 /* rows decoded to f32 and quantized per pool call */
#define GGML_QNT_VERSION    2   /* general.quantization_version, as llama.cpp writes it */

/* ==== Presets: llama.cpp's mixes ==== */

typedef enum {
    MIX_NONE,
    MIX_Q4_K_M,
    MIX_Q5_K_M,
    MIX_IQ4_XS,
    MIX_IQ3_XXS,
    MIX_IQ2_M,
    MIX_UD_IQ3_XXS,
} mix_id;

static const struct {
    const char *name;
    mix_id id;
    moe_type base;  /* the type of every tensor the mix does not single out */
    uint32_t ftype; /* general.file_type: llama.cpp's LLAMA_FTYPE_MOSTLY_* */
} mixes[] = {
    {"Q4_K_M", MIX_Q4_K_M, MOE_TYPE_Q4_K, 15},
    {"Q5_K_M", MIX_Q5_K_M, MOE_TYPE_Q5_K, 17},
    {"IQ4_XS", MIX_IQ4_XS, MOE_TYPE_IQ4_XS, 30},
    {"IQ3_XXS", MIX_IQ3_XXS, MOE_TYPE_IQ3_XXS, 23},
    {"IQ2_M", MIX_IQ2_M, MOE_TYPE_IQ2_S, 29},
    {"ud-iq3_xxs", MIX_UD_IQ3_XXS, MOE_TYPE_IQ3_XXS, 23},
};

const char *moe_quantize_preset_names(void) {
    return "Q4_K_M, Q5_K_M, IQ4_XS, IQ3_XXS, IQ2_M, ud-iq3_xxs";
}

/* What the mix decides from the model as a whole. */
typedef struct mix_model {
    int n_layer;      /* <arch>.block_count */
    int n_expert;     /* <arch>.expert_count (0 dense) */
    int n_gqa;        /* heads / kv heads (0 unknown) */
    bool has_output;  /* output.weight present (else token_embd doubles as the head) */
    bool has_imatrix; /* an importance matrix was given */
    int n_attn_v, i_attn_v;
} mix_model;

/* llama.cpp's use_more_bits: the first and last eighth of the layers and every third between. */
static bool more_bits(int i, int n) {
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

static int layer_of(const char *name) {
    int l = -1;
    return sscanf(name, "blk.%d.", &l) == 1 ? l : -1;
}

/* The mix's type for a tensor (base for the ones it does not single out); llama.cpp's
 * llama_tensor_get_type for these ftypes. */
static moe_type mix_type(mix_id mix, moe_type base, const char *name, mix_model *m) {
    const bool is_iq2 = mix == MIX_IQ2_M;
    const int layer = layer_of(name), n_layer = m->n_layer > 0 ? m->n_layer : 1;
    const bool head = strcmp(name, "output.weight") == 0 ||
                      (!m->has_output && !strcmp(name, "token_embd.weight"));
    if (head)
        return is_iq2 || mix == MIX_IQ3_XXS || mix == MIX_UD_IQ3_XXS ? MOE_TYPE_Q5_K
                                                                     : MOE_TYPE_Q6_K;
    if (!strcmp(name, "token_embd.weight"))
        return is_iq2 || mix == MIX_IQ3_XXS || mix == MIX_UD_IQ3_XXS ? MOE_TYPE_IQ3_S : base;
    if (mix == MIX_UD_IQ3_XXS) { /* Unsloth's expert map: gate/up IQ2_S, down IQ3_S */
        if (strstr(name, "ffn_gate_exps") || strstr(name, "ffn_up_exps")) return MOE_TYPE_IQ2_S;
        if (strstr(name, "ffn_down_exps")) return MOE_TYPE_IQ3_S;
    }
    if (strstr(name, "attn_v.weight")) {
        const int i = m->i_attn_v++;
        if (is_iq2) return m->n_gqa >= 4 || m->n_expert >= 4 ? MOE_TYPE_Q4_K : MOE_TYPE_IQ3_S;
        moe_type t = base;
        if (mix == MIX_IQ3_XXS || mix == MIX_UD_IQ3_XXS)
            t = m->n_gqa >= 4 ? MOE_TYPE_Q4_K : !m->has_imatrix ? MOE_TYPE_IQ3_S : MOE_TYPE_IQ3_XXS;
        else if (mix == MIX_IQ4_XS && m->n_gqa >= 4)
            t = MOE_TYPE_Q5_K;
        else if ((mix == MIX_Q4_K_M || mix == MIX_Q5_K_M) && more_bits(i, m->n_attn_v))
            t = MOE_TYPE_Q6_K;
        return m->n_expert == 8 ? MOE_TYPE_Q8_0 : t;
    }
    if (strstr(name, "attn_k.weight")) {
        if (m->n_expert == 8 && !is_iq2) return MOE_TYPE_Q8_0;
        if (is_iq2 && m->n_expert == 8) return MOE_TYPE_Q4_K;
        return mix == MIX_IQ3_XXS || mix == MIX_UD_IQ3_XXS ? MOE_TYPE_IQ2_S : base;
    }
    if (strstr(name, "attn_q.weight"))
        return mix == MIX_IQ3_XXS || mix == MIX_UD_IQ3_XXS ? MOE_TYPE_IQ2_S : base;
    if (strstr(name, "ffn_down")) {
        if (is_iq2) return layer >= 0 && layer < n_layer / 8 ? MOE_TYPE_IQ3_S : base;
        if ((mix == MIX_IQ3_XXS || mix == MIX_UD_IQ3_XXS) && !m->has_imatrix)
            return layer < n_layer / 8 ? MOE_TYPE_Q4_K : MOE_TYPE_Q3_K;
        if ((mix == MIX_Q4_K_M || mix == MIX_Q5_K_M) && more_bits(layer, n_layer))
            return MOE_TYPE_Q6_K;
        if (mix == MIX_IQ4_XS && !m->has_imatrix && layer < n_layer / 8) return MOE_TYPE_Q5_K;
        return base;
    }
    if (strstr(name, "attn_output.weight")) {
        if (m->n_expert == 8) return mix == MIX_Q5_K_M ? base : MOE_TYPE_Q5_K;
        return is_iq2 || mix == MIX_IQ3_XXS || mix == MIX_UD_IQ3_XXS ? MOE_TYPE_IQ3_S : base;
    }
    if (strstr(name, "attn_qkv.weight"))
        return mix == MIX_Q4_K_M ? MOE_TYPE_Q5_K : mix == MIX_Q5_K_M ? MOE_TYPE_Q6_K : base;
    return base;
}

/* ==== Which tensors are quantized ==== */

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* llama.cpp's rule: 2-D or 3-D ".weight" tensors, not norms, routers or the small tensors it
 * keeps in float. */
static bool quantizable(const moe_tensor *t, const char *name) {
    static const char *const keep[] = {
        "_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d", "ssm_a",     "ssm_d",      "pos_embd",
        "token_types",  "exp_probs_b",         "attn_sinks", "time_mix_", "norm.weight"};
    if (t->n_dims < 2 || !ends_with(name, ".weight")) return false;
    for (size_t i = 0; i < sizeof keep / sizeof keep[0]; i++)
        if (strstr(name, keep[i])) return false;
    return true;
}

/* The type a row of n values can take when `want` cannot (llama.cpp's fallbacks); MOE_TYPE_COUNT
 * when none can (llama.cpp then writes F16; moe keeps the tensor as it is, which the engine
 * reads whenever it read the source). */
static moe_type fit_row(moe_type want, int64_t n) {
    if (moe_type_row_bytes(want, n)) return want;
    moe_type f;
    switch (want) {
    case MOE_TYPE_Q4_K:
        f = MOE_TYPE_Q5_0;
        break;
    case MOE_TYPE_Q5_K:
        f = MOE_TYPE_Q5_1;
        break;
    case MOE_TYPE_Q6_K:
        f = MOE_TYPE_Q8_0;
        break;
    case MOE_TYPE_F32:
    case MOE_TYPE_F16:
    case MOE_TYPE_BF16:
        return want;
    default:
        f = MOE_TYPE_IQ4_NL;
        break;
    }
    return moe_type_row_bytes(f, n) ? f : MOE_TYPE_COUNT; /* none: the tensor stays as it is */
}

/* ==== The conversion ==== */

typedef struct quantizer {
    const moe_quantize_params *p;
    moe_gguf *in;
    moe_imatrix *im;
    regex_t *rules;
    moe_pool *pool;
    char **f32; /* tensors the architecture reads as floats: never quantized */
    size_t n_f32;
    /* progress */
    uint64_t bytes_total, bytes_done;
    uint32_t tensors_total, tensors_done;
    double t0;
    bool tty;
} quantizer;

typedef struct out_tensor {
    quantizer *q;
    const moe_tensor *src;
    moe_type type;
    bool copy; /* bytes as they are */
    const moe_imatrix_entry *im;
} out_tensor;

static void progress(quantizer *q, const char *name, moe_type type) {
    if (!q->p->progress) return;
    const double el = moe_now() - q->t0;
    const double frac = q->bytes_total ? (double)q->bytes_done / (double)q->bytes_total : 1.0;
    const double eta = frac > 0 ? el / frac - el : 0;
    if (q->tty) {
        char bar[31];
        const int fill = (int)(frac * 30);
        for (int i = 0; i < 30; i++) bar[i] = i < fill ? '#' : '.';
        bar[30] = '\0';
        fprintf(stderr, "\r[%s] %u/%u tensors  %.2f/%.2f GiB  ETA %.0fs  %-40.40s %-7s", bar,
                q->tensors_done, q->tensors_total, (double)q->bytes_done / (1 << 30),
                (double)q->bytes_total / (1 << 30), eta, name, moe_type_name(type));
        if (q->tensors_done == q->tensors_total) fputc('\n', stderr);
    } else {
        fprintf(stderr, "quantize: %u/%u %s %s (%.1f%% of bytes, ETA %.0fs)\n", q->tensors_done,
                q->tensors_total, name, moe_type_name(type), 100 * frac, eta);
    }
}

typedef struct chunk_job {
    const moe_tensor *src;
    const moe_type_traits *from;
    float *f32;
    int64_t row0;
} chunk_job;

/* Decode rows [row0 + begin, row0 + end) of the source to f32 (the pool's threads). */
static void decode_rows(void *arg, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const chunk_job *j = arg;
    const int64_t n = j->src->ne[0];
    const uint64_t rb = moe_type_row_bytes(j->src->type, n);
    for (int64_t r = begin; r < end; r++)
        j->from->to_float(j->src->data + (uint64_t)(j->row0 + r) * rb, j->f32 + r * n, n);
}

static moe_status fill_tensor(void *ctx, const char *name, void *out, uint64_t n_bytes,
                              moe_error *err) {
    out_tensor *o = ctx;
    quantizer *q = o->q;
    const moe_tensor *s = o->src;
    if (!s->data) return moe_error_set(err, MOE_ERR_IO, "tensor '%s': data not mapped", name);
    if (o->copy) {
        memcpy(out, s->data, (size_t)n_bytes);
    } else {
        const int64_t n = s->ne[0], rows = (int64_t)(s->n_values / (uint64_t)n);
        const int64_t rows_per_mat = s->ne[1];
        const uint64_t orb = moe_type_row_bytes(o->type, n);
        float *f32 = malloc((size_t)(QUANTIZE_CHUNK_ROWS * n) * sizeof(float));
        if (!f32) return moe_error_set(err, MOE_ERR_NOMEM, "tensor '%s': out of memory", name);
        chunk_job j = {.src = s, .from = moe_type_traits_get(s->type), .f32 = f32};
        for (int64_t r0 = 0; r0 < rows;) {
            /* a chunk never straddles two matrices: each expert has its own importance */
            const int64_t mat = r0 / rows_per_mat, mat_end = (mat + 1) * rows_per_mat;
            int64_t r1 = r0 + QUANTIZE_CHUNK_ROWS;
            if (r1 > mat_end) r1 = mat_end;
            if (r1 > rows) r1 = rows;
            j.row0 = r0;
            moe_pool_for(q->pool, r1 - r0, 16, decode_rows, &j);
            for (int64_t k = 0; k < (r1 - r0) * n; k++)
                if (!isfinite(f32[k])) {
                    const bool is_nan = isnan(f32[k]);
                    free(f32);
                    return moe_error_set(err, MOE_ERR_FORMAT,
                                         "tensor '%s' row %lld column %lld is %s: refusing to "
                                         "quantize it",
                                         name, (long long)(r0 + k / n), (long long)(k % n),
                                         is_nan ? "NaN" : "infinite");
                }
            const float *imv = o->im ? moe_imatrix_values(o->im, mat) : NULL;
            moe_quantize_rows(o->type, f32, (uint8_t *)out + (uint64_t)r0 * orb, r1 - r0, n, imv,
                              q->pool);
            r0 = r1;
        }
        free(f32);
    }
    q->bytes_done += n_bytes;
    q->tensors_done++;
    progress(q, name, o->type);
    return MOE_OK;
}

/* The output type of one tensor (and why, for the report). */
static bool declared_f32(const quantizer *q, const char *name) {
    for (size_t i = 0; i < q->n_f32; i++)
        if (!strcmp(q->f32[i], name)) return true;
    return false;
}

static moe_type choose_type(quantizer *q, const moe_tensor *t, const char *name, mix_model *mm,
                            bool *copy) {
    *copy = !quantizable(t, name) || declared_f32(q, name);
    if (*copy) return t->type;
    const moe_quantize_params *p = q->p;
    moe_type want = p->type;
    /* the mix first, always: its per-tensor counters advance as llama.cpp's do, rules or not */
    for (size_t i = 0; p->preset && i < sizeof mixes / sizeof mixes[0]; i++)
        if (!strcmp(mixes[i].name, p->preset)) want = mix_type(mixes[i].id, p->type, name, mm);
    for (uint32_t i = 0; i < p->n_rules; i++)
        if (regexec(&q->rules[i], name, 0, NULL, 0) == 0) {
            want = p->rules[i].type;
            break;
        }
    const moe_type got = fit_row(want, t->ne[0]);
    if (got != want)
        moe_log(MOE_LOG_WARN, "quantize: '%s' rows of %lld values are not whole %s blocks: %s",
                name, (long long)t->ne[0], moe_type_name(want),
                got == MOE_TYPE_COUNT ? "kept as it is" : moe_type_name(got));
    if (got == MOE_TYPE_COUNT) {
        *copy = true;
        return t->type;
    }
    if (got == t->type && !moe_type_traits_get(t->type)->is_quantized) {
        *copy = true; /* a float tensor kept in its own type */
    }
    return got;
}

static bool key_is(const moe_gguf_kv *kv, const char *key) {
    return kv->key.len == strlen(key) && !memcmp(kv->key.ptr, key, kv->key.len);
}

static bool note_f32(void *ctx, const moe_tensor_decl *d) {
    quantizer *q = ctx;
    if (d->f32) {
        q->f32 = moe_xrealloc(q->f32, (q->n_f32 + 1) * sizeof *q->f32);
        q->f32[q->n_f32++] = moe_xstrdup(d->name);
    }
    return true;
}

/* The tensors the model's architecture reads as floats (routers, norms, small vectors), from its
 * own binder: quantizing them would make a file moe cannot load. An architecture moe does not
 * run adds none (the name rules still keep norms and routers). */
static void read_f32_tensors(quantizer *q) {
    const char *arch = moe_gguf_get_str(q->in, "general.architecture");
    moe_model_config c;
    moe_error e = {0};
    if (!arch || !moe_arch_find(arch) || moe_model_config_read(q->in, q->p->in, &c, &e) != MOE_OK)
        return;
    if (!c.n_vocab) {
        const moe_tensor *emb = moe_gguf_tensor_find(q->in, "token_embd.weight");
        c.n_vocab = emb ? (uint32_t)emb->ne[1] : 0;
    }
    moe_model_declare(&c, note_f32, q, &e);
    moe_model_config_free(&c);
}

/* The model-wide facts a mix needs. */
static void read_mix_model(quantizer *q, mix_model *mm) {
    memset(mm, 0, sizeof *mm);
    const char *arch = moe_gguf_get_str(q->in, "general.architecture");
    char key[160];
    uint64_t v = 0, heads = 0, kv = 0;
    if (arch) {
        snprintf(key, sizeof key, "%s.block_count", arch);
        if (moe_gguf_get_u64(q->in, key, &v)) mm->n_layer = (int)v;
        snprintf(key, sizeof key, "%s.expert_count", arch);
        if (moe_gguf_get_u64(q->in, key, &v)) mm->n_expert = (int)v;
        snprintf(key, sizeof key, "%s.attention.head_count", arch);
        if (moe_gguf_get_u64(q->in, key, &heads)) {
            snprintf(key, sizeof key, "%s.attention.head_count_kv", arch);
            if (moe_gguf_get_u64(q->in, key, &kv) && kv) mm->n_gqa = (int)(heads / kv);
        }
    }
    mm->has_output = moe_gguf_tensor_find(q->in, "output.weight") != NULL;
    mm->has_imatrix = q->im != NULL;
    const uint64_t nt = moe_gguf_n_tensors(q->in);
    for (uint64_t i = 0; i < nt; i++) {
        const moe_tensor *t = moe_gguf_tensor_get(q->in, i);
        const char *at = memmem(t->name.ptr, t->name.len, "attn_v.weight", 13);
        mm->n_attn_v += at != NULL;
    }
    if (mm->n_layer <= 0) mm->n_layer = 1;
}

moe_status moe_quantize_model(const moe_quantize_params *p, moe_quantize_report *r,
                              moe_error *err) {
    memset(r, 0, sizeof *r);
    quantizer q = {.p = p, .tty = isatty(2)};
    q.rules = moe_xcalloc(p->n_rules ? p->n_rules : 1, sizeof(regex_t));
    uint32_t compiled = 0;
    out_tensor *outs = NULL;
    moe_gguf_writer *w = NULL;
    for (; compiled < p->n_rules; compiled++)
        if (regcomp(&q.rules[compiled], p->rules[compiled].pattern, REG_EXTENDED | REG_NOSUB)) {
            moe_error_set(err, MOE_ERR_ARG,
                          "--rule pattern '%s' is not a valid regular "
                          "expression",
                          p->rules[compiled].pattern);
            goto done;
        }
    if (p->preset) {
        bool known = false;
        for (size_t i = 0; i < sizeof mixes / sizeof mixes[0]; i++)
            known |= !strcmp(mixes[i].name, p->preset);
        if (!known) {
            moe_error_set(err, MOE_ERR_ARG, "unknown preset '%s' (known: %s)", p->preset,
                          moe_quantize_preset_names());
            goto done;
        }
    }
    if (p->imatrix_path && !(q.im = moe_imatrix_load(p->imatrix_path, err))) goto done;
    q.in = moe_gguf_open_model(p->in, err);
    if (!q.in) goto done;
    q.pool = moe_pool_new(p->n_threads > 0 ? p->n_threads : 1);
    mix_model mm;
    read_mix_model(&q, &mm);
    read_f32_tensors(&q);

    /* every tensor's type first: refuse before writing anything */
    const uint64_t nt = moe_gguf_n_tensors(q.in);
    outs = moe_xcalloc(nt ? nt : 1, sizeof *outs);
    bool warned_requant = false;
    for (uint64_t i = 0; i < nt && !err->code; i++) {
        const moe_tensor *t = moe_gguf_tensor_get(q.in, i);
        char *name = moe_xstrndup(t->name.ptr, t->name.len);
        out_tensor *o = &outs[i];
        o->q = &q, o->src = t;
        o->type = choose_type(&q, t, name, &mm, &o->copy);
        if (!o->copy) {
            const moe_type_traits *from = moe_type_traits_get(t->type);
            if (!from || !from->to_float)
                moe_error_set(err, MOE_ERR_UNSUPPORTED,
                              "tensor '%s' is %s, which moe "
                              "cannot decode",
                              name, moe_type_name(t->type));
            else if (!moe_type_can_quantize(o->type))
                moe_error_set(err, MOE_ERR_UNSUPPORTED,
                              "tensor '%s': moe has no "
                              "quantizer for %s",
                              name, moe_type_name(o->type));
            o->im = q.im ? moe_imatrix_find(q.im, name) : NULL;
            if (o->im && (o->im->n_in != t->ne[0] ||
                          (o->im->n_mat != 1 && o->im->n_mat != (t->n_dims > 2 ? t->ne[2] : 1))))
                moe_error_set(err, MOE_ERR_FORMAT,
                              "--imatrix entry '%s' is %lld x %lld, the tensor has rows "
                              "of %lld and %lld matrices",
                              name, (long long)o->im->n_in, (long long)o->im->n_mat,
                              (long long)t->ne[0], (long long)(t->n_dims > 2 ? t->ne[2] : 1));
            if (!err->code && moe_type_needs_imatrix(o->type) && !o->im)
                moe_error_set(err, MOE_ERR_ARG,
                              "tensor '%s' would be %s, which needs an importance matrix "
                              "(--imatrix): at 1.5-2.5 bits a weight, the bits must go to the "
                              "columns that matter, and llama.cpp refuses these types without one "
                              "too%s",
                              name, moe_type_name(o->type),
                              q.im ? " (the given matrix has no entry for this tensor)" : "");
            const bool exact_source = t->type == MOE_TYPE_F32 || t->type == MOE_TYPE_F16 ||
                                      t->type == MOE_TYPE_BF16 || t->type == MOE_TYPE_Q8_0;
            if (!err->code && !exact_source && !warned_requant) {
                moe_log(MOE_LOG_WARN,
                        "quantize: '%s' is already %s: requantizing through f32 adds this "
                        "quantization's error to the new one (quantize from F32/F16/BF16/Q8_0 "
                        "where you can)",
                        name, moe_type_name(t->type));
                warned_requant = true;
            }
        }
        if (!err->code) {
            r->bytes_in += t->n_bytes;
            r->bytes_out +=
                t->n_values / (uint64_t)t->ne[0] * moe_type_row_bytes(o->type, t->ne[0]);
            r->tensors_by_type[o->type]++;
            r->n_tensors++;
            r->n_quantized += !o->copy;
        }
        free(name);
    }
    if (err->code) goto done;

    /* the keys as they were, then llama.cpp's quantization keys */
    w = moe_gguf_writer_new();
    for (uint64_t i = 0; i < moe_gguf_n_kv(q.in); i++) {
        const moe_gguf_kv *kv = moe_gguf_kv_get(q.in, i);
        if (kv->key.len >= 6 && !memcmp(kv->key.ptr, "split.", 6)) continue;
        if (key_is(kv, "general.file_type") || key_is(kv, "general.quantization_version") ||
            (kv->key.len >= 17 && !memcmp(kv->key.ptr, "quantize.imatrix.", 17)))
            continue;
        char *key = moe_xstrndup(kv->key.ptr, kv->key.len);
        moe_gguf_writer_set_value(w, key, &kv->value);
        free(key);
    }
    moe_gguf_writer_set_u32(w, "general.quantization_version", GGML_QNT_VERSION);
    if (q.im) { /* what llama-quantize records of the importance matrix it used */
        moe_gguf_writer_set_str(w, "quantize.imatrix.file", p->imatrix_path);
        if (moe_imatrix_dataset(q.im))
            moe_gguf_writer_set_str(w, "quantize.imatrix.dataset", moe_imatrix_dataset(q.im));
        moe_gguf_writer_set_i32(w, "quantize.imatrix.entries_count",
                                (int32_t)moe_imatrix_count(q.im));
        moe_gguf_writer_set_i32(w, "quantize.imatrix.chunks_count",
                                (int32_t)moe_imatrix_chunks(q.im));
    }
    uint32_t ftype = 0;
    bool have_ftype = false;
    for (size_t i = 0; p->preset && i < sizeof mixes / sizeof mixes[0]; i++)
        if (!strcmp(mixes[i].name, p->preset)) ftype = mixes[i].ftype, have_ftype = true;
    if (!have_ftype) have_ftype = moe_gguf_file_type_of(p->type, &ftype);
    if (have_ftype) moe_gguf_writer_set_u32(w, "general.file_type", ftype);
    r->file_type = have_ftype ? (int)ftype : -1;
    for (uint64_t i = 0; i < nt && !err->code; i++) {
        const moe_tensor *t = outs[i].src;
        char *name = moe_xstrndup(t->name.ptr, t->name.len);
        moe_gguf_writer_add_tensor_deferred(w, name, outs[i].type, t->n_dims, t->ne, fill_tensor,
                                            &outs[i], err);
        free(name);
    }
    if (err->code) goto done;
    q.bytes_total = r->bytes_out;
    q.tensors_total = (uint32_t)nt;
    q.t0 = moe_now();
    if (moe_gguf_writer_write(w, p->out, p->split_max_tensors, err) != MOE_OK &&
        !p->split_max_tensors)
        unlink(p->out); /* no half-written model left behind */
    r->seconds = moe_now() - q.t0;
done:
    moe_gguf_writer_free(w);
    free(outs);
    if (q.in) moe_gguf_close(q.in);
    moe_pool_free(q.pool);
    moe_imatrix_free(q.im);
    for (size_t i = 0; i < q.n_f32; i++) free(q.f32[i]);
    free(q.f32);
    for (uint32_t i = 0; i < compiled; i++) regfree(&q.rules[i]);
    free(q.rules);
    return err->code;
}

bool moe_quantize_preset_base(const char *preset, moe_type *base) {
    for (size_t i = 0; i < sizeof mixes / sizeof mixes[0]; i++)
        if (!strcmp(mixes[i].name, preset)) {
            *base = mixes[i].base;
            return true;
        }
    return false;
}
