/* inspect.c: the facts behind `moe inspect` -- types histogram, bytes by role and by layer,
 * the formats each role uses per layer, and the byte reconciliation with the file size.
 *
 * Owns analysis only; cli/inspect.c prints. Everything is computed from the reader's tensor
 * directory (no tensor data is touched), so inspecting a 400 GB model costs its header. The
 * trap: the reconciliation re-adds the reader's per-shard numbers and compares with the file
 * size; it is a check of the reader, so do not "fix" a mismatch here. */
#include "tools.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/model.h"

/* ==== Roles ==== */

static const char *const role_names[MOE_ROLE_COUNT] = {
    [MOE_ROLE_ROUTED_EXPERTS] = "routed experts",
    [MOE_ROLE_SHARED_EXPERTS] = "shared experts",
    [MOE_ROLE_ATTENTION] = "attention",
    [MOE_ROLE_DENSE_FFN] = "dense FFN",
    [MOE_ROLE_HYPER] = "hyper-connections",
    [MOE_ROLE_EMBEDDINGS] = "embeddings/output",
    [MOE_ROLE_OTHER] = "norms/other",
};
static const char *const role_ids[MOE_ROLE_COUNT] = {
    [MOE_ROLE_ROUTED_EXPERTS] = "routed_experts",
    [MOE_ROLE_SHARED_EXPERTS] = "shared_experts",
    [MOE_ROLE_ATTENTION] = "attention",
    [MOE_ROLE_DENSE_FFN] = "dense_ffn",
    [MOE_ROLE_HYPER] = "hyper_connections",
    [MOE_ROLE_EMBEDDINGS] = "embeddings_output",
    [MOE_ROLE_OTHER] = "norms_other",
};

const char *moe_role_name(moe_role role) {
    return (unsigned)role < MOE_ROLE_COUNT ? role_names[role] : "unknown";
}
const char *moe_role_id(moe_role role) {
    return (unsigned)role < MOE_ROLE_COUNT ? role_ids[role] : "unknown";
}

/* p at "N.<rest>": <rest>, with N in *layer; `name` (and *layer -1) when p does not hold that. */
static const char *layer_number(const char *name, const char *p, int64_t *layer) {
    *layer = -1;
    int64_t n = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9' && digits < 18) n = n * 10 + (*p++ - '0'), digits++;
    if (digits == 0 || *p != '.') return name;
    *layer = n;
    return p + 1;
}

/* The name after "blk.N.", with N in *layer (-1 when there is no such prefix). */
static const char *after_layer(const char *name, int64_t *layer) {
    *layer = -1;
    if (strncmp(name, "blk.", 4) != 0) return name;
    return layer_number(name, name + 4, layer);
}

const char *moe_tensor_layer_part(const char *name, int64_t *layer) {
    return after_layer(name, layer);
}

int64_t moe_tensor_layer(const char *name) {
    int64_t layer;
    after_layer(name, &layer);
    return layer;
}

static bool starts(const char *s, const char *prefix) {
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

moe_role moe_tensor_role(const char *name) {
    int64_t layer;
    const char *b = after_layer(name, &layer);
    if (strstr(b, "_exps")) return MOE_ROLE_ROUTED_EXPERTS;
    if (strstr(b, "_shexp")) return MOE_ROLE_SHARED_EXPERTS;
    if (layer >= 0 && starts(b, "hc_")) return MOE_ROLE_HYPER;
    if (strstr(b, "norm")) return MOE_ROLE_OTHER;
    if (starts(b, "attn_") || starts(b, "ssm_") || starts(b, "indexer")) return MOE_ROLE_ATTENTION;
    if (starts(b, "ffn_gate.") || starts(b, "ffn_up.") || starts(b, "ffn_down.") ||
        starts(b, "ffn_gate_up."))
        return MOE_ROLE_DENSE_FFN;
    if (layer < 0 && (starts(b, "token_embd.") || starts(b, "output.") || !strcmp(b, "output")))
        return MOE_ROLE_EMBEDDINGS;
    return MOE_ROLE_OTHER;
}

/* HF (safetensors) names: "model.layers.N.<rest>" (any prefix before "layers.N."). */
static const char *hf_after_layer(const char *name, int64_t *layer) {
    *layer = -1;
    const char *p = strstr(name, "layers.");
    while (p && p != name && p[-1] != '.') p = strstr(p + 1, "layers.");
    return p ? layer_number(name, p + 7, layer) : name;
}

int64_t moe_hf_tensor_layer(const char *name) {
    int64_t layer;
    if (strstr(name, "vision") || strstr(name, "audio") || strstr(name, "visual"))
        return -1; /* a tower's own layers are not the model's */
    hf_after_layer(name, &layer);
    return layer;
}

moe_role moe_hf_tensor_role(const char *name) {
    if (strstr(name, "vision") || strstr(name, "audio") || strstr(name, "visual"))
        return MOE_ROLE_OTHER;
    if (strstr(name, "shared_expert")) return MOE_ROLE_SHARED_EXPERTS;
    if (strstr(name, "experts.")) return MOE_ROLE_ROUTED_EXPERTS;
    if (strstr(name, "norm") || strstr(name, "router") || strstr(name, "mlp.gate."))
        return MOE_ROLE_OTHER;
    if (strstr(name, "self_attn.") || strstr(name, "linear_attn.") || strstr(name, "attention."))
        return MOE_ROLE_ATTENTION;
    if (strstr(name, "mlp.")) return MOE_ROLE_DENSE_FFN;
    if (strstr(name, "embed_tokens") || strstr(name, "lm_head")) return MOE_ROLE_EMBEDDINGS;
    return MOE_ROLE_OTHER;
}

/* The short name a format line uses: "gate" for blk.3.ffn_gate_exps.weight, "kv_a_mqa" for
 * blk.0.attn_kv_a_mqa.weight, "gate.bias" for a bias. */
static void part_name(const char *name, moe_role role, bool hf, char *out, size_t cap) {
    int64_t layer;
    const char *b = hf ? hf_after_layer(name, &layer) : after_layer(name, &layer);
    if (hf && moe_hf_tensor_layer(name) < 0) b = name; /* outside the layers: the whole name */
    if (hf) { /* "self_attn.q_proj", "experts.*.gate_proj.weight_packed": experts collapse */
        const char *e = strstr(b, "experts.");
        const char *d = e ? e + 8 : NULL;
        if (d && *d >= '0' && *d <= '9') {
            while (*d >= '0' && *d <= '9') d++;
            snprintf(out, cap, "%.*s*%s", (int)(e + 8 - b), b, d);
        } else {
            snprintf(out, cap, "%s", b);
        }
        size_t n = strlen(out);
        if (n > 7 && strcmp(out + n - 7, ".weight") == 0) out[n - 7] = '\0';
        return;
    }
    if ((role == MOE_ROLE_ATTENTION && starts(b, "attn_")) ||
        (role != MOE_ROLE_ATTENTION && role != MOE_ROLE_OTHER && starts(b, "ffn_")))
        b += role == MOE_ROLE_ATTENTION ? 5 : 4;
    snprintf(out, cap, "%s", b);
    size_t n = strlen(out);
    if (n > 7 && strcmp(out + n - 7, ".weight") == 0) out[n - 7] = '\0';
    static const char *const cut[] = {"_exps", "_shexp"};
    for (size_t c = 0; c < 2; c++) {
        char *p = strstr(out, cut[c]);
        if (p) memmove(p, p + strlen(cut[c]), strlen(p + strlen(cut[c])) + 1);
    }
}

/* ==== Analysis ==== */

/* One tensor as the analysis sees it, whatever the file format. */
typedef struct item {
    const char *name;
    uint32_t type; /* moe_type for GGUF, moe_st_dtype for safetensors */
    uint64_t n_bytes;
} item;

typedef struct source {
    const item *items;
    uint64_t n;
    bool hf;                              /* HF names (safetensors), else llama.cpp names */
    const char *(*type_name)(uint32_t t); /* names the `type` of an item */
} source;

static const char *gguf_type_name(uint32_t t) {
    return moe_type_name(t);
}
static const char *st_type_name(uint32_t t) {
    return moe_st_dtype_name((moe_st_dtype)t);
}

typedef struct entry {
    moe_role role;
    int64_t layer;
    uint64_t index;
} entry;

static int cmp_entry(const void *a, const void *b) {
    const entry *x = a, *y = b;
    if (x->role != y->role) return x->role < y->role ? -1 : 1;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

static int cmp_type_bytes(const void *a, const void *b) {
    const moe_inspect_type *x = a, *y = b;
    if (x->bytes != y->bytes) return x->bytes > y->bytes ? -1 : 1;
    return x->type < y->type ? -1 : x->type > y->type;
}

/* "gate/up IQ2_S, down IQ3_S" for the tensors e[0..n) (one role, one layer, file order); a part
 * named twice (HF experts, one module each) is listed once. */
static char *signature(const source *src, const entry *e, size_t n) {
    moe_strbuf b = {0};
    bool *done = moe_xcalloc(n, sizeof *done);
    for (size_t i = 0; i < n; i++) {
        if (done[i]) continue;
        uint32_t type = src->items[e[i].index].type;
        if (b.len) moe_strbuf_printf(&b, ", ");
        size_t start = b.len;
        for (size_t k = i, first = 1; k < n; k++) {
            const item *t = &src->items[e[k].index];
            if (done[k] || t->type != type) continue;
            done[k] = true;
            char part[160], listed[168];
            part_name(t->name, e[k].role, src->hf, part, sizeof part);
            snprintf(listed, sizeof listed, "/%s/", part);
            char *so_far = moe_xmalloc(b.len - start + 3);
            snprintf(so_far, b.len - start + 3, "/%s/", b.len > start ? b.s + start : "");
            bool dup = strstr(so_far, listed) != NULL;
            free(so_far);
            if (dup) continue;
            moe_strbuf_printf(&b, "%s%s", first ? "" : "/", part);
            first = 0;
        }
        moe_strbuf_printf(&b, " %s", src->type_name(type));
    }
    free(done);
    return moe_strbuf_take(&b);
}

/* Layers in ascending order as "0-38,40". */
static char *layer_ranges(const int64_t *layers, size_t n) {
    moe_strbuf b = {0};
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j + 1 < n && layers[j + 1] == layers[j] + 1) j++;
        if (j == i)
            moe_strbuf_printf(&b, "%s%lld", b.len ? "," : "", (long long)layers[i]);
        else
            moe_strbuf_printf(&b, "%s%lld-%lld", b.len ? "," : "", (long long)layers[i],
                              (long long)layers[j]);
        i = j + 1;
    }
    return moe_strbuf_take(&b);
}

/* The plan the architecture's descriptor reads, or why there is none. */
static void read_plan(const moe_gguf *g, moe_inspect_plan *p) {
    moe_model_config c;
    moe_error err = {0};
    const moe_gguf_shard *s0 = moe_gguf_shard_get(g, 0);
    if (moe_model_config_read(g, s0 ? s0->path : "model", &c, &err) != MOE_OK) {
        snprintf(p->note, sizeof p->note, "%s", err.msg);
        return;
    }
    p->known = true;
    p->n_layer = c.n_layer;
    p->n_layer_nextn = c.n_layer_nextn;
    p->n_expert = c.n_expert;
    p->n_expert_used = c.n_expert_used;
    for (uint32_t il = 0; il < c.n_layer; il++) {
        const moe_layer_state s = moe_layer_state_of(&c, il);
        p->kind_count[moe_layer_kind_of(&c.layer[il])]++;
        if (c.layer[il].ffn == MOE_FFN_EXPERTS)
            p->n_expert_ffn++;
        else
            p->n_dense_ffn++;
        p->kv_values_per_token += s.k_values + s.v_values;
        p->state_values_per_seq += s.state_values;
        p->index_values_per_token += s.index_values;
    }
    moe_model_config_free(&c);
}

/* The analysis common to both formats; the caller fills the file totals and the plan. */
static moe_inspect_report *analyze(const source *src) {
    moe_inspect_report *r = moe_xcalloc(1, sizeof *r);
    uint64_t n = src->n;
    r->n_tensors = n;
    /* types histogram and role totals */
    enum {
        N_TYPES = (int)MOE_TYPE_COUNT > (int)MOE_ST_DTYPE_COUNT ? (int)MOE_TYPE_COUNT
                                                                : (int)MOE_ST_DTYPE_COUNT
    };
    uint64_t type_count[N_TYPES] = {0}, type_bytes[N_TYPES] = {0};
    entry *e = moe_xcalloc((size_t)n + 1, sizeof *e);
    for (uint64_t i = 0; i < n; i++) {
        const item *t = &src->items[i];
        MOE_CHECK(t->type < N_TYPES); /* both readers admit only known types */
        type_count[t->type]++;
        type_bytes[t->type] += t->n_bytes;
        r->tensor_bytes += t->n_bytes;
        e[i] = src->hf ? (entry){moe_hf_tensor_role(t->name), moe_hf_tensor_layer(t->name), i}
                       : (entry){moe_tensor_role(t->name), moe_tensor_layer(t->name), i};
        r->role_count[e[i].role]++;
        r->role_bytes[e[i].role] += t->n_bytes;
    }
    r->types = moe_xcalloc(N_TYPES, sizeof *r->types);
    for (uint32_t t = 0; t < N_TYPES; t++)
        if (type_count[t])
            r->types[r->n_types++] =
                (moe_inspect_type){t, src->type_name(t), type_count[t], type_bytes[t]};
    qsort(r->types, r->n_types, sizeof *r->types, cmp_type_bytes);

    /* per layer: sort (layer, index) once; entries of one layer are then adjacent */
    entry *by_layer = moe_xcalloc((size_t)n + 1, sizeof *by_layer);
    memcpy(by_layer, e, (size_t)n * sizeof *e);
    for (uint64_t i = 0; i < n; i++) by_layer[i].role = 0;
    qsort(by_layer, (size_t)n, sizeof *by_layer, cmp_entry);
    r->layers = moe_xcalloc((size_t)n + 1, sizeof *r->layers);
    for (uint64_t i = 0; i < n; i++) {
        if (by_layer[i].layer < 0) continue;
        if (!r->n_layers || r->layers[r->n_layers - 1].layer != by_layer[i].layer)
            r->layers[r->n_layers++].layer = by_layer[i].layer;
        moe_inspect_layer *l = &r->layers[r->n_layers - 1];
        const item *t = &src->items[by_layer[i].index];
        l->count++;
        l->bytes += t->n_bytes;
        l->role_bytes[e[by_layer[i].index].role] += t->n_bytes;
    }
    free(by_layer);

    /* formats: one signature per (role, layer); layers with the same signature group */
    qsort(e, (size_t)n, sizeof *e, cmp_entry);
    typedef struct run {
        moe_role role;
        int64_t layer;
        char *sig;
        bool used;
    } run;
    run *runs = moe_xcalloc((size_t)n + 1, sizeof *runs);
    size_t n_runs = 0;
    for (uint64_t i = 0; i < n;) {
        uint64_t j = i;
        while (j < n && e[j].role == e[i].role && e[j].layer == e[i].layer) j++;
        runs[n_runs++] =
            (run){e[i].role, e[i].layer, signature(src, e + i, (size_t)(j - i)), false};
        i = j;
    }
    r->formats = moe_xcalloc(n_runs + 1, sizeof *r->formats);
    int64_t *layers = moe_xcalloc(n_runs + 1, sizeof *layers);
    for (size_t i = 0; i < n_runs; i++) {
        if (runs[i].used) continue;
        size_t nl = 0;
        for (size_t k = i; k < n_runs && runs[k].role == runs[i].role; k++) {
            if (runs[k].used || strcmp(runs[k].sig, runs[i].sig) != 0) continue;
            runs[k].used = true;
            if (runs[k].layer >= 0) layers[nl++] = runs[k].layer;
        }
        moe_inspect_format *f = &r->formats[r->n_formats++];
        f->role = runs[i].role;
        f->formats = moe_xstrdup(runs[i].sig);
        f->layers = layer_ranges(layers, nl);
        f->n_layers = (uint32_t)nl;
    }
    for (size_t i = 0; i < n_runs; i++) free(runs[i].sig);
    free(runs);
    free(layers);
    free(e);
    return r;
}

moe_inspect_report *moe_inspect_analyze(const moe_gguf *g) {
    uint64_t n = moe_gguf_n_tensors(g);
    item *items = moe_xcalloc((size_t)n + 1, sizeof *items);
    for (uint64_t i = 0; i < n; i++) {
        const moe_tensor *t = moe_gguf_tensor_get(g, i);
        items[i] = (item){t->name.ptr, t->type, t->n_bytes};
    }
    moe_inspect_report *r = analyze(&(source){items, n, false, gguf_type_name});
    free(items);
    for (uint32_t s = 0; s < moe_gguf_n_shards(g); s++) {
        const moe_gguf_shard *sh = moe_gguf_shard_get(g, s);
        r->file_bytes += sh->file_size;
        r->header_bytes += sh->header_bytes;
        r->padding_bytes += sh->padding_bytes;
    }
    r->reconciles = r->tensor_bytes + r->header_bytes + r->padding_bytes == r->file_bytes;
    read_plan(g, &r->plan);
    for (size_t i = 0; r->plan.known && i < r->n_layers; i++) { /* the trunk and its NextN */
        const moe_inspect_layer *l = &r->layers[i];
        if (l->layer < (int64_t)r->plan.n_layer)
            r->plan.trunk_routed_bytes += l->role_bytes[MOE_ROLE_ROUTED_EXPERTS];
        else if (l->layer < (int64_t)(r->plan.n_layer + r->plan.n_layer_nextn))
            r->plan.nextn_bytes += l->bytes;
    }
    return r;
}

moe_inspect_report *moe_inspect_analyze_st(const moe_st *s) {
    uint64_t n = moe_st_n_tensors(s);
    item *items = moe_xcalloc((size_t)n + 1, sizeof *items);
    for (uint64_t i = 0; i < n; i++) {
        const moe_st_tensor *t = moe_st_tensor_get(s, i);
        items[i] = (item){t->name, t->dtype, t->n_bytes};
    }
    moe_inspect_report *r = analyze(&(source){items, n, true, st_type_name});
    free(items);
    for (uint32_t f = 0; f < moe_st_n_files(s); f++) {
        const moe_st_file *sf = moe_st_file_get(s, f);
        r->file_bytes += sf->file_size;
        r->header_bytes += sf->header_bytes;
        /* the reader refuses gaps, so a safetensors file has no padding but its header's */
    }
    r->reconciles = r->tensor_bytes + r->header_bytes + r->padding_bytes == r->file_bytes;
    snprintf(r->plan.note, sizeof r->plan.note,
             "a safetensors checkpoint: the architecture descriptors read GGUF metadata, not "
             "config.json");
    return r;
}

void moe_inspect_report_free(moe_inspect_report *r) {
    if (!r) return;
    for (size_t i = 0; i < r->n_formats; i++) {
        free(r->formats[i].formats);
        free(r->formats[i].layers);
    }
    free(r->formats);
    free(r->types);
    free(r->layers);
    free(r);
}
