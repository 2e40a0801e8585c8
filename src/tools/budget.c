/* budget.c: the facts behind `moe budget` -- what a model needs in memory per device.
 *
 * Owns the model's memory facts (weights by part from the tensor directory; per-layer KV and
 * recurrent-state shapes from the architecture's metadata) and the plan for a configuration.
 * cli/budget.c prints. Per layer, by kind:
 *   full attention   K: n_kv(l) * key_length, V: n_kv(l) * value_length values per token
 *   sliding window   the same, for at most `window` tokens of each stream
 *   MLA              kv_lora_rank + rope dims per token (one latent row; V is read from it),
 *                    and with a lightning indexer its f32 rows (their own part)
 *   linear attention no per-token growth; a per-stream f32 state (conv tail + recurrent matrix)
 * Weights of the NextN / MTP layers after the trunk are their own part (a model serves without
 * them; speculative decoding drafts with them); their routed experts shard like the others.
 * The KV type sets the bytes of a row (Q8_0 rounds each row up to 32-value blocks); recurrent
 * state stays f32. Scratch is an estimate (one prefill step of MOE_BUDGET_PREFILL_ROWS rows,
 * tiled attention, the logits of every stream), documented where it is computed.
 * The layer kinds and their widths come from the architecture's own config reader and plan
 * (src/model/arch_<name>.c), the one the engine loads with. An architecture moe does not run is
 * planned from the keys every transformer has, all layers full attention: that over-counts a
 * hybrid but never under-counts one. */
#include "tools.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/model.h"

static const char *const part_names[MOE_PART_COUNT] = {
    [MOE_PART_MTP] = "NextN/MTP layers",  [MOE_PART_VISION] = "vision tower",
    [MOE_PART_KV] = "KV cache",           [MOE_PART_INDEX] = "indexer cache",
    [MOE_PART_STATE] = "recurrent state", [MOE_PART_SCRATCH] = "scratch (estimate)",
};
static const char *const part_ids[MOE_PART_COUNT] = {
    [MOE_PART_MTP] = "mtp_layers",        [MOE_PART_VISION] = "vision",
    [MOE_PART_KV] = "kv_cache",           [MOE_PART_INDEX] = "indexer_cache",
    [MOE_PART_STATE] = "recurrent_state", [MOE_PART_SCRATCH] = "scratch",
};

const char *moe_budget_part_name(moe_budget_part p) {
    if ((int)p < MOE_ROLE_COUNT) return moe_role_name((moe_role)p);
    return (unsigned)p < MOE_PART_COUNT ? part_names[p] : "unknown";
}
const char *moe_budget_part_id(moe_budget_part p) {
    if ((int)p < MOE_ROLE_COUNT) return moe_role_id((moe_role)p);
    return (unsigned)p < MOE_PART_COUNT ? part_ids[p] : "unknown";
}

const char *moe_layer_kind_name(moe_layer_kind k) {
    static const char *const names[MOE_LAYER_KIND_COUNT] = {"full attention", "sliding window",
                                                            "MLA", "linear attention"};
    return (unsigned)k < MOE_LAYER_KIND_COUNT ? names[k] : "unknown";
}

/* ==== Metadata ==== */

/* "<arch>.vocab_size" for a header without token_embd (0: unknown). */
static uint64_t vocab_size_key(const moe_gguf *g, const char *arch) {
    char key[256];
    snprintf(key, sizeof key, "%s.vocab_size", arch);
    uint64_t v = 0;
    return moe_gguf_get_u64(g, key, &v) ? v : 0;
}

moe_layer_kind moe_layer_kind_of(const moe_layer_plan *p) {
    switch (p->mixer) {
    case MOE_MIXER_ATTENTION:
        return p->window ? MOE_LAYER_SLIDING : MOE_LAYER_FULL;
    case MOE_MIXER_MLA:
        return MOE_LAYER_MLA;
    default:
        return MOE_LAYER_LINEAR;
    }
}

static bool is_vision_tensor(const char *name) {
    return strncmp(name, "v.", 2) == 0 || strncmp(name, "mm.", 3) == 0;
}

static void add_tensor(moe_budget_model *m, const moe_tensor *t, bool vision) {
    moe_role role = moe_tensor_role(t->name.ptr);
    int64_t layer;
    const char *part_name = moe_tensor_layer_part(t->name.ptr, &layer);
    const bool mtp = !vision && m->n_layer_nextn && layer >= (int64_t)m->n_layer &&
                     layer < (int64_t)m->n_layer + m->n_layer_nextn;
    int part = vision ? MOE_PART_VISION : mtp ? MOE_PART_MTP : (int)role;
    m->weights[part] += t->n_bytes;
    m->params[part] += t->n_values;
    m->n_params += t->n_values;
    if (vision || role != MOE_ROLE_ROUTED_EXPERTS) return;
    if (mtp) m->mtp_sharded_bytes += t->n_bytes;
    moe_budget_sharded s = {
        .rows = t->n_dims >= 2 ? (uint64_t)t->ne[1] : 1,
        .slices = (uint64_t)t->ne[2] * (uint64_t)t->ne[3],
        .row_bytes = moe_type_row_bytes(t->type, t->ne[0]),
        .per_expert = t->n_dims < 3,
        .mtp = mtp,
        .layer = layer,
        .type = t->type,
    };
    if (!strcmp(part_name, "ffn_gate_exps.weight") || !strcmp(part_name, "ffn_up_exps.weight"))
        s.ff_dim = MOE_BUDGET_FF_ROWS;
    else if (!strcmp(part_name, "ffn_gate_up_exps.weight"))
        s.ff_dim = MOE_BUDGET_FF_FUSED;
    else if (!strcmp(part_name, "ffn_down_exps.weight") ||
             !strcmp(part_name, "ffn_gate_exps.bias") || !strcmp(part_name, "ffn_up_exps.bias"))
        s.ff_dim = MOE_BUDGET_FF_COLUMNS;
    else
        s.ff_dim = MOE_BUDGET_FF_WHOLE;
    if (!strcmp(part_name, "ffn_down_exps.weight")) { /* the layer's intermediate and its blocks */
        const moe_type_traits *tr = moe_type_traits_get(t->type);
        s.ff = t->ne[0];
        s.ff_block = tr ? tr->block_values : 0;
    }
    m->sharded = moe_xrealloc(m->sharded, (m->n_sharded + 1) * sizeof *m->sharded);
    m->sharded[m->n_sharded++] = s;
}

moe_status moe_budget_model_init(moe_budget_model *m, const moe_gguf *g, const char *name,
                                 moe_error *err) {
    memset(m, 0, sizeof *m);
    m->name = moe_xstrdup(name);
    const char *arch = moe_gguf_get_str(g, "general.architecture");
    m->arch = moe_xstrdup(arch ? arch : "unknown");
    for (uint32_t s = 0; s < moe_gguf_n_shards(g); s++)
        m->file_bytes += moe_gguf_shard_get(g, s)->file_size;
    if (!arch) return moe_error_set(err, MOE_ERR_FORMAT, "%s: no general.architecture", name);
    moe_model_config c;
    moe_status st = moe_model_config_read(g, name, &c, err);
    if (st == MOE_ERR_UNSUPPORTED && !moe_arch_find(arch)) {
        *err = (moe_error){0};
        st = moe_model_config_read_generic(g, name, &c, err);
    }
    if (st != MOE_OK) return st;
    m->n_layer = c.n_layer;
    m->n_layer_nextn = c.n_layer_nextn;
    for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++) { /* by part: needs the trunk's depth */
        const moe_tensor *t = moe_gguf_tensor_get(g, i);
        add_tensor(m, t, is_vision_tensor(t->name.ptr));
    }
    for (size_t i = 0; i < m->n_sharded; i++) /* every layer's tensors take its down's slice */
        for (size_t j = 0; j < m->n_sharded && !m->sharded[i].ff_block; j++)
            if (m->sharded[j].layer == m->sharded[i].layer && m->sharded[j].ff_block) {
                m->sharded[i].ff = m->sharded[j].ff;
                m->sharded[i].ff_block = m->sharded[j].ff_block;
            }
    m->n_embd = c.n_embd;
    m->n_head = c.n_head;
    m->ctx_train = c.n_ctx_train;
    m->n_expert = c.n_expert;
    m->n_expert_used = c.n_expert_used;
    const moe_tensor *embd = moe_gguf_tensor_find(g, "token_embd.weight");
    m->n_vocab = embd && embd->n_dims >= 2 ? (uint64_t)embd->ne[1] : vocab_size_key(g, arch);
    const uint64_t moe_ff = (uint64_t)c.n_expert_used * c.n_ff_exp + c.n_ff_shexp;
    m->ff_active = c.n_ff > moe_ff ? c.n_ff : moe_ff;
    m->kind = moe_xcalloc(m->n_layer, sizeof *m->kind);
    m->k_values = moe_xcalloc(m->n_layer, sizeof *m->k_values);
    m->v_values = moe_xcalloc(m->n_layer, sizeof *m->v_values);
    m->state_values = moe_xcalloc(m->n_layer, sizeof *m->state_values);
    m->index_values = moe_xcalloc(m->n_layer, sizeof *m->index_values);
    for (uint32_t l = 0; l < m->n_layer; l++) {
        const moe_layer_state ls = moe_layer_state_of(&c, l);
        m->kind[l] = moe_layer_kind_of(&c.layer[l]);
        m->k_values[l] = ls.k_values;
        m->v_values[l] = ls.v_values;
        m->state_values[l] = ls.state_values;
        m->index_values[l] = ls.index_values;
        if (c.layer[l].window) m->window = c.layer[l].window;
    }
    moe_model_config_free(&c);
    return MOE_OK;
}

void moe_budget_model_add_vision(moe_budget_model *m, const moe_gguf *g) {
    for (uint64_t i = 0; i < moe_gguf_n_tensors(g); i++)
        add_tensor(m, moe_gguf_tensor_get(g, i), true);
    for (uint32_t s = 0; s < moe_gguf_n_shards(g); s++)
        m->file_bytes += moe_gguf_shard_get(g, s)->file_size;
}

void moe_budget_model_free(moe_budget_model *m) {
    free(m->name);
    free(m->arch);
    free(m->sharded);
    free(m->kind);
    free(m->k_values);
    free(m->v_values);
    free(m->state_values);
    free(m->index_values);
    memset(m, 0, sizeof *m);
}

/* ==== The plan ==== */

/* Saturating arithmetic: the searches try contexts and stream counts up to 2^30 each. */
static uint64_t sat_mul(uint64_t a, uint64_t b) {
    uint64_t r;
    return moe_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}
static uint64_t sat_add(uint64_t a, uint64_t b) {
    uint64_t r;
    return moe_add_overflow(a, b, &r) ? UINT64_MAX : r;
}

/* Bytes of a cache row of n values. */
static uint64_t kv_row_bytes(moe_type t, uint64_t n) {
    if (n == 0) return 0;
    if (t == MOE_TYPE_Q8_0) return (n + 31) / 32 * 34;
    return n * (t == MOE_TYPE_F32 ? 4 : 2);
}

static void kv_per_token(const moe_budget_model *m, moe_type t, uint64_t *full, uint64_t *swa) {
    *full = *swa = 0;
    for (uint32_t l = 0; l < m->n_layer; l++) {
        uint64_t b = kv_row_bytes(t, m->k_values[l]) + kv_row_bytes(t, m->v_values[l]);
        if (m->kind[l] == MOE_LAYER_SLIDING)
            *swa += b;
        else
            *full += b;
    }
}

const char *moe_budget_kv_name(moe_type kv_type) {
    return kv_type == MOE_TYPE_F32 ? "f32" : kv_type == MOE_TYPE_Q8_0 ? "q8_0" : "f16";
}

uint64_t moe_budget_kv_bytes(const moe_budget_model *m, moe_type kv_type, uint64_t ctx,
                             uint64_t streams) {
    uint64_t full, swa;
    kv_per_token(m, kv_type, &full, &swa);
    uint64_t swa_tokens = m->window && m->window < ctx ? m->window : ctx;
    return sat_mul(streams, sat_add(sat_mul(ctx, full), sat_mul(swa_tokens, swa)));
}

/* The indexer's rows are f32 whatever the KV type, and never windowed. */
static uint64_t index_per_token(const moe_budget_model *m) {
    uint64_t n = 0;
    for (uint32_t l = 0; l < m->n_layer; l++) n += m->index_values[l];
    return n * sizeof(float);
}

uint64_t moe_budget_index_bytes(const moe_budget_model *m, uint64_t ctx, uint64_t streams) {
    return sat_mul(streams, sat_mul(ctx, index_per_token(m)));
}

static uint64_t state_per_stream(const moe_budget_model *m) {
    uint64_t n = 0;
    for (uint32_t l = 0; l < m->n_layer; l++) n += m->state_values[l];
    return n * 4;
}

/* Scratch estimate, f32: one step of R = max(prefill rows, streams) rows through a layer
 * (6 * n_embd for residual, norm, attention in/out; 3 * ff_active for the gate, up and their
 * product), the scores of a tiled attention (n_head * min(prefill rows, ctx) * tile), and the
 * logits of every stream. */
static uint64_t scratch_bytes(const moe_budget_model *m, uint64_t ctx, uint64_t streams) {
    uint64_t prefill = ctx < MOE_BUDGET_PREFILL_ROWS ? ctx : MOE_BUDGET_PREFILL_ROWS;
    uint64_t rows = prefill > streams ? prefill : streams;
    uint64_t tile = ctx < MOE_BUDGET_ATTN_TILE ? ctx : MOE_BUDGET_ATTN_TILE;
    uint64_t values = sat_add(
        sat_add(sat_mul(rows, 6 * m->n_embd + 3 * m->ff_active), m->n_head * prefill * tile),
        sat_mul(streams, m->n_vocab));
    return sat_mul(4, values);
}

/* The fullest device's total for a context and stream count (weights fixed). */
static uint64_t device_max_total(const moe_budget_model *m, const moe_budget_config *c,
                                 uint64_t weights_max, uint64_t ctx, uint64_t streams) {
    uint64_t t = sat_add(weights_max, moe_budget_kv_bytes(m, c->kv_type, ctx, streams));
    t = sat_add(t, moe_budget_index_bytes(m, ctx, streams));
    t = sat_add(t, sat_mul(streams, state_per_stream(m)));
    return sat_add(t, scratch_bytes(m, ctx, streams));
}

/* Largest x in [1, hi] with total(x) <= mem (0 when even 1 does not fit); total is monotone. */
static uint64_t search(const moe_budget_model *m, const moe_budget_config *c, uint64_t weights_max,
                       bool over_ctx, uint64_t hi) {
    uint64_t lo = 0;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo + 1) / 2;
        uint64_t t = over_ctx ? device_max_total(m, c, weights_max, mid, c->streams)
                              : device_max_total(m, c, weights_max, c->ctx, mid);
        if (t <= c->mem_per_device)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

void moe_budget_plan_make(const moe_budget_model *m, const moe_budget_config *c,
                          moe_budget_plan *p) {
    memset(p, 0, sizeof *p);
    p->config = *c;
    uint32_t n = c->devices ? c->devices : 1;
    p->config.devices = n;
    p->device = moe_xcalloc((size_t)n * MOE_PART_COUNT, sizeof *p->device);
    kv_per_token(m, c->kv_type, &p->kv_bytes_per_token, &p->swa_kv_bytes_per_token);
    p->index_bytes_per_token = index_per_token(m);
    p->state_bytes_per_stream = state_per_stream(m);
    if (m->n_expert)
        p->expert_bytes_per_token =
            m->weights[MOE_ROLE_ROUTED_EXPERTS] / m->n_expert * m->n_expert_used;
    uint64_t kv = moe_budget_kv_bytes(m, c->kv_type, c->ctx, c->streams);
    uint64_t index = moe_budget_index_bytes(m, c->ctx, c->streams);
    uint64_t state = sat_mul(c->streams, p->state_bytes_per_stream);
    uint64_t scratch = scratch_bytes(m, c->ctx, c->streams);
    uint64_t weights_max = 0;
    for (uint32_t d = 0; d < n; d++) {
        uint64_t *dev = p->device + (size_t)d * MOE_PART_COUNT;
        for (int k = 0; k <= MOE_PART_VISION; k++)
            if (k != MOE_ROLE_ROUTED_EXPERTS && (k != MOE_PART_VISION || c->vision))
                dev[k] = m->weights[k];
        dev[MOE_PART_MTP] -= m->mtp_sharded_bytes; /* added back by rows below */
        /* rows of every expert matrix, split as evenly as rows allow: device d gets
         * rows/n, plus one of the remainder when d < rows % n; or whole experts, expert e on
         * device e % n: slices/n of them, plus one when d < slices % n */
        for (size_t i = 0; i < m->n_sharded; i++) {
            const moe_budget_sharded *s = &m->sharded[i];
            uint64_t *part = &dev[s->mtp ? MOE_PART_MTP : MOE_ROLE_ROUTED_EXPERTS];
            if (c->split_experts && s->per_expert) {
                *part += s->slices * s->rows * s->row_bytes;
            } else if (c->split_experts) {
                const uint64_t slices = s->slices / n + (d < s->slices % n);
                *part += slices * s->rows * s->row_bytes;
            } else if (s->ff_dim == MOE_BUDGET_FF_WHOLE) {
                *part += s->rows * s->slices * s->row_bytes;
            } else if (s->ff_block) {
                const moe_split_range r = moe_split_rows_range(s->ff, s->ff_block, (int)d, (int)n);
                const uint64_t ff = (uint64_t)(r.end - r.begin);
                if (s->ff_dim == MOE_BUDGET_FF_COLUMNS)
                    *part += s->rows * s->slices * moe_type_row_bytes(s->type, (int64_t)ff);
                else
                    *part +=
                        (s->ff_dim == MOE_BUDGET_FF_FUSED ? 2 : 1) * ff * s->slices * s->row_bytes;
            } else {
                const uint64_t rows = s->rows / n + (d < s->rows % n);
                *part += rows * s->slices * s->row_bytes;
            }
        }
        if (c->expert_cache && dev[MOE_ROLE_ROUTED_EXPERTS] > c->expert_cache)
            dev[MOE_ROLE_ROUTED_EXPERTS] = c->expert_cache; /* the rest stays in the file */
        dev[MOE_PART_KV] = kv;
        dev[MOE_PART_INDEX] = index;
        dev[MOE_PART_STATE] = state;
        dev[MOE_PART_SCRATCH] = scratch;
        uint64_t w = 0, total = 0;
        for (int k = 0; k < MOE_PART_COUNT; k++) {
            total = sat_add(total, dev[k]);
            if (k <= MOE_PART_VISION) w += dev[k];
        }
        if (total > p->device_total_max) p->device_total_max = total;
        if (w > weights_max) weights_max = w;
    }
    p->spare = p->device_total_max > INT64_MAX
                   ? INT64_MIN
                   : (int64_t)c->mem_per_device - (int64_t)p->device_total_max;
    p->fits = p->device_total_max <= c->mem_per_device;
    uint64_t ctx_hi = m->ctx_train ? m->ctx_train : MOE_BUDGET_SEARCH_MAX;
    p->max_ctx = c->streams ? search(m, &p->config, weights_max, true, ctx_hi) : 0;
    p->max_streams = c->ctx ? search(m, &p->config, weights_max, false, MOE_BUDGET_SEARCH_MAX) : 0;
}

void moe_budget_plan_free(moe_budget_plan *p) {
    free(p->device);
    p->device = NULL;
}
