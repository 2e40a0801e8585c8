/* internal.h: what the engine's files share -- the context struct and the layer blocks.
 *
 * Not a public header: only the engine's own .c files include it. Each block runs one part of a layer
 * over all rows of a batch, reading and writing the context's scratch; moe_ctx_decode() in
 * ctx.c strings them together per the model's config. */
#ifndef MOE_ENGINE_INTERNAL_H
#define MOE_ENGINE_INTERNAL_H

#include "engine.h"

struct moe_ctx {
    const moe_model *m;
    moe_ctx_params p;
    uint32_t *seq_len;        /* [n_seq] tokens held per sequence */
    /* KV cache: [n_seq][n_layer][n_ctx][n_head_kv * head_dim], f32 or f16 by p.kv_type */
    uint8_t *k_cache, *v_cache;
    uint64_t k_row_bytes, v_row_bytes; /* one position of one layer */
    /* scratch, [max_rows][width] floats each */
    float *x, *xn, *q, *k, *v, *att, *ff_gate, *ff_up;
    float *scores;            /* [n_threads][n_ctx] attention scores */
    /* mixture of experts */
    float *router;            /* [max_rows][n_expert] router logits */
    int32_t *expert_ids;      /* [max_rows][n_expert_used] */
    float *expert_w;          /* [max_rows][n_expert_used] */
    float *route_scratch;     /* [2 * n_expert] */
    moe_expert_scratch experts;
    moe_expert_stats stats;   /* of the last moe_ctx_decode */
    moe_pool *pool;
    void *mm_scratch;         /* activation rows converted for the dot kernels */
};

/* ==== KV cache ==== */

/* Start of the cache row of one sequence, layer and position. */
uint8_t *moe_kv_slot(const moe_ctx *c, uint8_t *cache, uint64_t row_bytes, int32_t seq,
                     uint32_t layer, uint32_t pos);
/* Store n floats into a cache row in the context's KV element type. */
void moe_kv_store(const moe_ctx *c, uint8_t *dst, const float *src, uint64_t n);

/* ==== Layer blocks: x (the residual, [n_rows][n_embd]) in, x + block(x) out ==== */

void moe_block_attention(moe_ctx *c, const moe_layer_weights *l, uint32_t layer,
                         const moe_row *rows, uint32_t n_rows);
void moe_block_ffn_dense(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows);
void moe_block_ffn_experts(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows);

#endif
