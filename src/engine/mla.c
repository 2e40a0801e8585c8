/* mla.c: multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache.
 *
 * Each position caches one row per layer: the normed kv latent [n_lora_kv] followed by the
 * roped key part [rope_dims], shared by all heads; the cache is never expanded to per-head K/V.
 * Each head's query is absorbed into latent space: its no-rope part goes through attn_k_b
 * (q_nope -> [n_lora_kv]) and its roped part is appended, so scores are plain dot products
 * with cache rows (MQA over the latent, llama.cpp's absorbed path). The attended latent goes
 * through attn_v_b per head, then attn_output. Prefill and decode take the same path.
 * The trap: attn_k_b / attn_v_b are [.., .., n_head] stacks of per-head matrices, so each is
 * applied head by head to that head's slice of every row (gathered, multiplied, scattered). */
#include "engine_internal.h"

#include <string.h>

/* For every head h: dst[r] + h dst_head [0..n_out) = matrix h of w times src[r] + h src_head
 * [0..n_in) for every row, where row r's slices of a head sit src_stride / dst_stride floats
 * apart. One row (decode, MTP): the heads' slices are the matmuls' rows as they lie, all heads
 * one pass of the pool (DeepSeek-V3's 128 heads x 61 layers were 15,616 hand-outs a token); more
 * rows: each head's rows gathered, multiplied, scattered. */
static void per_head_matmul(moe_ctx *c, const moe_tensor *w, const float *src, int64_t src_head,
                            int64_t src_stride, float *dst, int64_t dst_head, int64_t dst_stride,
                            uint32_t n_rows) {
    const int64_t n_in = w->ne[0], n_out = w->ne[1], n_head = w->ne[2];
    if (n_rows == 1) {
        moe_matmul_task t[MOE_MATMUL_MANY_MAX];
        const uint64_t scratch = moe_matmul_scratch_bytes(w, 1);
        for (int64_t h0 = 0; h0 < n_head; h0 += MOE_MATMUL_MANY_MAX) {
            const int n =
                (int)(n_head - h0 < MOE_MATMUL_MANY_MAX ? n_head - h0 : MOE_MATMUL_MANY_MAX);
            for (int i = 0; i < n; i++)
                t[i] = (moe_matmul_task){w,
                                         h0 + i,
                                         src + (h0 + i) * src_head,
                                         1,
                                         dst + (h0 + i) * dst_head,
                                         (uint8_t *)c->mm_scratch + (uint64_t)i * scratch};
            moe_matmul_many(c->pool, t, n);
        }
        return;
    }
    for (int64_t h = 0; h < n_head; h++) {
        for (uint32_t r = 0; r < n_rows; r++)
            memcpy(c->mla_in + r * n_in, src + h * src_head + r * src_stride,
                   sizeof(float) * (size_t)n_in);
        moe_matmul(c->pool, w, h, c->mla_in, n_rows, c->mla_out, c->mm_scratch);
        for (uint32_t r = 0; r < n_rows; r++)
            memcpy(dst + h * dst_head + r * dst_stride, c->mla_out + r * n_out,
                   sizeof(float) * (size_t)n_out);
    }
}

void moe_block_attention_mla(moe_ctx *c, const moe_layer_weights *l, uint32_t il,
                             const moe_row *rows, uint32_t n_rows) {
    const moe_model_config *cfg = &c->m->cfg;
    const moe_mla_weights *w = &l->mla;
    const int64_t n_head = cfg->n_head;
    const int64_t n_lora_kv = cfg->n_lora_kv, n_rot = cfg->rope_dims;
    const int64_t hd_q = cfg->head_dim_k_mla, nope = hd_q - n_rot, hd_v = cfg->head_dim_v_mla;
    const int64_t lat_w = n_lora_kv + n_rot; /* a cache row; also one absorbed query head */
    const int64_t q_w = n_head * hd_q;
    const moe_rope_params rope = moe_rope_params_from_config(cfg);
    const moe_attn_shape shape = {.n_head = (int)n_head,
                                  .n_head_kv = 1,
                                  .head_dim_k = (int)lat_w,
                                  .head_dim_v = (int)n_lora_kv,
                                  .scale = cfg->kq_scale,
                                  .kv_type = c->p.kv_type};

    /* queries: through the q LoRA (a, norm, b) or a plain projection */
    if (w->wq_a) {
        const float *qa_norm = (const float *)w->q_a_norm->data;
        moe_matmul(c->pool, w->wq_a, 0, c->xn, n_rows, c->mla_qa, c->mm_scratch);
        for (uint32_t r = 0; r < n_rows; r++)
            moe_rmsnorm(c->mla_qa + r * cfg->n_lora_q, c->mla_qa + r * cfg->n_lora_q, qa_norm,
                        cfg->n_lora_q, cfg->rms_eps);
        moe_matmul(c->pool, w->wq_b, 0, c->mla_qa, n_rows, c->mla_q, c->mm_scratch);
    } else {
        moe_matmul(c->pool, w->wq, 0, c->xn, n_rows, c->mla_q, c->mm_scratch);
    }

    /* the latent and the shared key's rope part; both go into the cache as one row */
    const float *kv_norm = (const float *)w->kv_a_norm->data;
    moe_matmul(c->pool, w->wkv_a_mqa, 0, c->xn, n_rows, c->k, c->mm_scratch);
    for (uint32_t r = 0; r < n_rows; r++) {
        float *kv = c->k + r * lat_w, *q = c->mla_q + r * q_w;
        moe_rmsnorm(kv, kv, kv_norm, n_lora_kv, cfg->rms_eps);
        moe_rope(kv + n_lora_kv, 1, (int)lat_w, rows[r].pos, &rope);
        const moe_kv_span k = moe_kv_span_of(c, false, rows[r].seq, il);
        moe_kv_store(c, k.at + (uint64_t)rows[r].pos * k.stride, kv, (uint64_t)lat_w);
        moe_rope(q + nope, (int)n_head, (int)hd_q, rows[r].pos, &rope);
        for (int64_t h = 0; h < n_head; h++) /* absorbed query head: [latent | rope] */
            memcpy(c->q + (r * n_head + h) * lat_w + n_lora_kv, q + h * hd_q + nope,
                   sizeof(float) * (size_t)n_rot);
    }
    /* absorb attn_k_b: q_nope of head h -> its latent-space query */
    per_head_matmul(c, w->wk_b, c->mla_q, hd_q, q_w, c->q, lat_w, n_head * lat_w, n_rows);

    if (l->plan.indexed) {
        if (!l->plan.index_shared) moe_indexer_update(c, l, il, rows, n_rows);
        moe_attend_rows_indexed(c, &shape, l, il, rows, n_rows);
    } else {
        moe_attend_rows(c, &shape, il, rows, n_rows, 0, true);
    }

    /* decompress each head's attended latent with attn_v_b, then the output projection */
    per_head_matmul(c, w->wv_b, c->att, n_lora_kv, n_head * n_lora_kv, c->mla_o, hd_v,
                    n_head * hd_v, n_rows);
    moe_matmul(c->pool, w->wo, 0, c->mla_o, n_rows, c->y, c->mm_scratch);
}
