/* spec.c: drafts for speculative decoding that cost no forward pass -- n-gram (prompt-lookup)
 * drafts from the tokens a sequence already holds.
 *
 * Agents resend and quote: the tokens after the last time the current suffix occurred are a
 * good guess at what comes next. The drafter only proposes; the verify step (moe_ctx_verify)
 * and the caller's sampler decide, so a bad draft costs a little compute and never a token. */
#include "engine_internal.h"

#include <string.h>

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
