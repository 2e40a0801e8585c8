/* arch_glm_dsa.c: GLM-5 / 5.1 / 5.2 (744B-A40B): DeepSeek-V3 with DeepSeek-V3.2's per-token
 * lightning indexer.
 *
 * Every layer is MLA (q LoRA, latent cache with a roped key, YaRN magnitude in the attention
 * scale) whose queries attend only to the top_k cached positions its indexer scores highest
 * (dense while a sequence holds no more than top_k). The indexer's queries come from the q
 * latent and its keys from a LayerNorm'd projection of the layer input -- at epsilon 0: llama.cpp
 * reads no epsilon for it -- both roped on their first rope dims (NORM). attention.indexer.types
 * marks each layer "full" (scores with its own indexer) or "shared" (reuses the last full layer's
 * choice, GLM-5.2); without the key GLM-5 / 5.1 (context below 1M) have every layer full and
 * GLM-5.2 the pattern of its config (layers 0, 1, then every 4th from 2). Then DeepSeek-V3
 * routing (sigmoid unless the file says otherwise, exp_probs_b, normalised and scaled) with a
 * shared expert after the leading dense layers. The NextN layers are not run. */
#include "model_internal.h"

#include <stdio.h>
#include <stdlib.h>

/* GLM-5.2's indexer layers when the file does not list them (its config.json). */
static bool glm52_full_indexer(uint32_t il) {
    return il < 2 || (il - 2) % 4 == 0;
}

static bool glm_dsa_config(moe_meta *r, moe_model_config *c) {
    if (!moe_config_transformer(r, c, MOE_ROPE_NORM, false) || !moe_config_mla(r, c) ||
        !moe_config_rope(r, c, true) ||
        !moe_config_experts(r, c, MOE_GATING_SIGMOID, false, MOE_ACT_SILU,
                            "expert_feed_forward_length") ||
        !moe_config_indexer(r, c))
        return false;
    if (c->idx_kpool != 1)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s.attention.indexer.block_size %u: this indexer scores positions, "
                             "not pools",
                             r->arch, c->idx_kpool);
    if (c->rope_dims > c->idx_head_dim || c->n_lora_q == 0)
        return moe_meta_fail(r, MOE_ERR_FORMAT,
                             "%s: the indexer needs a q LoRA and at least the %u rope dims in its "
                             "key_length %u",
                             r->arch, c->rope_dims, c->idx_head_dim);
    c->idx_norm_eps = 0.0f;
    c->idx_rope = true;
    const uint32_t n = c->n_layer;
    uint32_t *full = moe_xcalloc(n, sizeof *full);
    for (uint32_t il = 0; il < n; il++)
        full[il] = c->n_ctx_train < 1048576 || glm52_full_indexer(il);
    char key[128];
    snprintf(key, sizeof key, "%s.attention.indexer.types", r->arch);
    bool ok = !moe_gguf_find(r->g, key) ||
              moe_meta_u32_per_layer(r, "attention.indexer.types", 1, n, full);
    if (ok && !full[0])
        ok = moe_meta_fail(r, MOE_ERR_FORMAT,
                           "%s.attention.indexer.types: layer 0 shares the selection of no layer",
                           r->arch);
    for (uint32_t il = 0; ok && il < moe_config_n_planned(c); il++) {
        moe_config_plan_mixer(c, il, MOE_MIXER_MLA);
        c->layer[il].indexed = il < n;
        c->layer[il].index_shared = il < n && !full[il];
    }
    free(full);
    return ok;
}

static void glm_dsa_bind_layer(moe_binder *b, uint32_t il, moe_layer_weights *l) {
    l->attn_norm = moe_bind_norm(b, il, "attn_norm");
    moe_bind_mla(b, il, &l->mla);
    if (l->plan.indexed && !l->plan.index_shared) moe_bind_indexer(b, il, &l->mla);
    l->ffn_norm = moe_bind_norm(b, il, "ffn_norm");
    moe_bind_ffn(b, il, l);
}

const moe_arch_desc moe_arch_glm_dsa = {
    .name = "glm-dsa",
    .config = glm_dsa_config,
    .bind_layer = glm_dsa_bind_layer,
};
