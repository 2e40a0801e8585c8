/* spec.c: drafts for speculative decoding -- n-gram (prompt-lookup) drafts from the tokens a
 * sequence already holds, which cost no forward pass, and drafts from the model's own MTP head.
 *
 * Agents resend and quote: the tokens after the last time the current suffix occurred are a
 * good guess at what comes next. An MTP head (Qwen3.8, GLM-5.3) predicts the token after next
 * from the trunk's last hidden state and the next token, one layer deep. Drafters only propose;
 * the verify step (moe_ctx_verify) and the caller's sampler decide, so a bad draft costs a
 * little compute and never a token. The trap of the MTP head: its cache must hold the trunk's
 * hidden states, so the entries a draft chain writes (from the head's own states) are taken back
 * and the accepted positions fed again from the verify step's states. */
#include "engine_internal.h"

#include <string.h>

#include "../ops/ops.h"

uint32_t moe_draft_ngram(const int32_t *hist, uint32_t n_hist, uint32_t max_draft, int32_t *out) {
    /* the longest suffix first: it predicts best; an earlier match only if none later */
    for (uint32_t len = MOE_NGRAM_MAX < n_hist ? MOE_NGRAM_MAX : n_hist; len >= 1; len--) {
        const int32_t *suffix = hist + n_hist - len;
        for (uint32_t at = n_hist - len; at-- > 0;) { /* the most recent earlier occurrence */
            if (memcmp(hist + at, suffix, sizeof(int32_t) * len) != 0) continue;
            uint32_t n = 0;
            for (uint32_t j = at + len; j < n_hist && n < max_draft; j++) out[n++] = hist[j];
            if (n) return n;
        }
    }
    return 0;
}

uint32_t moe_draft_mtp(moe_ctx *c, int32_t seq, const float *h, const int32_t *tokens,
                       uint32_t n_in, uint32_t n_draft, int32_t *drafts, float *logits,
                       moe_error *err) {
    const uint32_t n_vocab = c->m->cfg.n_vocab, n_embd = c->m->cfg.n_embd;
    if (n_in == 0) {
        moe_error_set(err, MOE_ERR_ARG, "MTP draft: no entry to draft from");
        return 0;
    }
    const uint32_t base = moe_ctx_mtp_len(c, seq), step = c->p.max_rows < 64 ? c->p.max_rows : 64;
    moe_row rows[64];
    for (uint32_t done = 0; done < n_in;) { /* the entries, in calls of at most `step` rows */
        const uint32_t k = n_in - done < step ? n_in - done : step;
        for (uint32_t i = 0; i < k; i++)
            rows[i] =
                (moe_row){seq, (int32_t)(base + done + i), tokens[done + i], done + i + 1 == n_in};
        if (moe_ctx_decode_mtp(c, rows, k, h + (size_t)done * n_embd, logits, err) != MOE_OK)
            return 0;
        done += k;
    }
    float *g = c->mtp_h;
    uint32_t n = 0;
    while (n < n_draft) {
        drafts[n] = moe_argmax(logits, n_vocab);
        if (++n == n_draft) break;
        uint32_t n_h;
        const float *last = moe_ctx_hidden(c, &n_h) + (size_t)(n_h - 1) * n_embd;
        memcpy(g, last, sizeof(float) * n_embd);
        const moe_row row = {seq, (int32_t)(base + n_in + n - 1), drafts[n - 1], true};
        if (moe_ctx_decode_mtp(c, &row, 1, g, logits, err) != MOE_OK) {
            n = 0;
            break;
        }
    }
    moe_ctx_mtp_rewind(c, seq, base + n_in);
    return n;
}
