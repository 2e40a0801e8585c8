/* sampler.c: next-token choice from a logits row -- penalties, bias, temperature, top-k,
 * top-p, min-p, a seeded generator, and the log-probabilities the server reports.
 *
 * The order is llama.cpp's default chain: logit bias, penalties, then top-k, top-p, min-p on
 * the untempered distribution, then the temperature over the survivors and a draw. Ranking is
 * a bounded heap over the vocabulary, never a full sort unless nothing truncates it.
 * Log-probabilities are reported from the raw logits (after bias and penalties, before temperature
 * and truncation), as OpenAI's API does. A grammar, when given, masks the tokens it does not
 * allow after bias and penalties, before anything else looks at the logits. The trap: every buffer
 * is allocated once at creation; sample() must not allocate. */
#include "engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../ops/ops.h"

#define MOE_PENALTY_WINDOW_MAX 8192 /* recent tokens kept for penalties */

struct moe_sampler {
    moe_sampler_params p;
    uint32_t n_vocab;
    float *work;    /* [n_vocab] adjusted logits */
    int32_t *order; /* [n_vocab] candidate ids, sorted by work[] descending */
    float *probs;   /* [n_vocab] */
    int32_t *bias_tokens;
    float *bias_values;
    int32_t *recent; /* ring of the last penalty_last_n tokens */
    uint32_t n_recent, recent_head, window;
    uint32_t *counts; /* [n_vocab] occurrences within the window */
    uint64_t rng;
    moe_grammar_state *grammar; /* NULL: unconstrained */
    /* how often the grammar took the first draw lately (halved every 64 tries): the first draw
     * is tried while it pays, and every 16th step otherwise, to notice when it pays again */
    uint32_t first_tries, first_hits, grammar_steps;
};

moe_sampler *moe_sampler_new(const moe_sampler_params *p, uint32_t n_vocab) {
    moe_sampler *s = moe_xcalloc(1, sizeof *s);
    s->p = *p;
    s->n_vocab = n_vocab;
    s->work = moe_xmalloc(sizeof(float) * n_vocab);
    s->order = moe_xmalloc(sizeof(int32_t) * n_vocab);
    s->probs = moe_xmalloc(sizeof(float) * n_vocab);
    s->counts = moe_xcalloc(n_vocab, sizeof(uint32_t));
    s->window = p->penalty_last_n < 0 ? 0 : (uint32_t)p->penalty_last_n;
    if (s->window > MOE_PENALTY_WINDOW_MAX) s->window = MOE_PENALTY_WINDOW_MAX;
    s->recent = moe_xcalloc(s->window ? s->window : 1, sizeof(int32_t));
    if (p->n_bias) {
        s->bias_tokens = moe_xmalloc(sizeof(int32_t) * p->n_bias);
        s->bias_values = moe_xmalloc(sizeof(float) * p->n_bias);
        memcpy(s->bias_tokens, p->bias_tokens, sizeof(int32_t) * p->n_bias);
        memcpy(s->bias_values, p->bias_values, sizeof(float) * p->n_bias);
    }
    s->p.bias_tokens = s->bias_tokens;
    s->p.bias_values = s->bias_values;
    if (s->p.n_top_logprobs > MOE_SAMPLER_MAX_TOP) s->p.n_top_logprobs = MOE_SAMPLER_MAX_TOP;
    s->rng = p->seed;
    if (p->grammar && p->grammar_vocab)
        s->grammar = moe_grammar_state_new(p->grammar, p->grammar_vocab);
    return s;
}

void moe_sampler_free(moe_sampler *s) {
    if (!s) return;
    free(s->work);
    free(s->order);
    free(s->probs);
    free(s->counts);
    free(s->recent);
    free(s->bias_tokens);
    free(s->bias_values);
    moe_grammar_state_free(s->grammar);
    free(s);
}

void moe_sampler_reset(moe_sampler *s) {
    memset(s->counts, 0, sizeof(uint32_t) * s->n_vocab);
    s->n_recent = s->recent_head = 0;
    s->rng = s->p.seed;
    if (s->grammar) moe_grammar_state_reset(s->grammar);
    s->first_tries = s->first_hits = s->grammar_steps = 0;
}

moe_grammar_state *moe_sampler_grammar(moe_sampler *s) {
    return s->grammar;
}

void moe_sampler_accept(moe_sampler *s, int32_t token) {
    if (!s->window || token < 0 || (uint32_t)token >= s->n_vocab) return;
    if (s->n_recent == s->window) {
        s->counts[s->recent[s->recent_head]]--;
    } else {
        s->n_recent++;
    }
    s->recent[s->recent_head] = token;
    s->recent_head = (s->recent_head + 1) % s->window;
    s->counts[token]++;
}

/* ==== Selecting the best candidates (by value descending, then id ascending) ==== */

static bool better(const float *v, int32_t a, int32_t b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
}

static int by_value_desc(const void *a, const void *b, void *keys) {
    const int32_t ia = *(const int32_t *)a, ib = *(const int32_t *)b;
    return better(keys, ia, ib) ? -1 : better(keys, ib, ia) ? 1 : 0;
}

/* Min-heap by `better`: the worst of the kept candidates at the root. */
static void sift_down(const float *v, int32_t *h, uint32_t k, uint32_t i) {
    for (;;) {
        uint32_t worst = i, l = 2 * i + 1, r = l + 1;
        if (l < k && better(v, h[worst], h[l])) worst = l;
        if (r < k && better(v, h[worst], h[r])) worst = r;
        if (worst == i) return;
        const int32_t t = h[i];
        h[i] = h[worst];
        h[worst] = t;
        i = worst;
    }
}

/* order[0..k) = the k best of all n candidates, best first: O(n log k), not a full sort. */
static void select_top(moe_sampler *s, uint32_t n, uint32_t k) {
    int32_t *h = s->order;
    const float *v = s->work;
    for (uint32_t i = 0; i < k; i++) h[i] = (int32_t)i;
    for (uint32_t i = k / 2; i-- > 0;) sift_down(v, h, k, i);
    for (uint32_t i = k; i < n; i++) {
        if (!better(v, (int32_t)i, h[0])) continue;
        h[0] = (int32_t)i;
        sift_down(v, h, k, 0);
    }
    qsort_r(h, k, sizeof(int32_t), by_value_desc, s->work);
}

/* max and log(sum exp(l - max)) of a logits row, the sum in double (-inf entries add 0) */
static double log_partition(const float *logits, uint32_t n, float *max_out) {
    float max = -INFINITY;
    for (uint32_t i = 0; i < n; i++) max = logits[i] > max ? logits[i] : max;
    double z = 0.0;
    for (uint32_t i = 0; i < n; i++)
        z += logits[i] == -INFINITY ? 0.0 : exp((double)logits[i] - (double)max);
    *max_out = max;
    return log(z);
}

double moe_logprob(const float *logits, uint32_t n_vocab, int32_t token) {
    float max;
    const double log_z = log_partition(logits, n_vocab, &max);
    return (double)logits[token] - (double)max - log_z;
}

moe_sample moe_sampler_score(moe_sampler *s, const float *logits, int32_t token) {
    const uint32_t n = s->n_vocab;
    memcpy(s->work, logits, sizeof(float) * n);
    float max;
    const double log_z = log_partition(logits, n, &max);
    moe_sample out = {.token = token};
    out.logprob = (float)((double)logits[token] - (double)max - log_z);
    out.n_top = s->p.n_top_logprobs < n ? s->p.n_top_logprobs : n;
    if (out.n_top) select_top(s, n, out.n_top);
    for (uint32_t i = 0; i < out.n_top; i++) {
        out.top_tokens[i] = s->order[i];
        out.top_logprobs[i] = (float)((double)logits[s->order[i]] - (double)max - log_z);
    }
    return out;
}

/* A draw at temperature t among order[0..keep) (max: the largest of their values). */
static int32_t draw(moe_sampler *s, uint32_t keep, float max, float t) {
    double total = 0.0;
    for (uint32_t i = 0; i < keep; i++) {
        const float v = s->work[s->order[i]];
        s->probs[i] = v == -INFINITY ? 0.0f : (float)exp((double)(v - max) / t);
        total += s->probs[i];
    }
    double r = moe_rng_uniform(&s->rng) * total;
    uint32_t pick = keep - 1;
    for (uint32_t i = 0; i < keep; i++) {
        r -= s->probs[i];
        if (r < 0) {
            pick = i;
            break;
        }
    }
    return s->order[pick];
}

/* The same over every token, in id order. */
static int32_t draw_all(moe_sampler *s, uint32_t n, float max, float t) {
    for (uint32_t i = 0; i < n; i++) s->order[i] = (int32_t)i;
    return draw(s, n, max, t);
}

moe_sample moe_sampler_sample(moe_sampler *s, const float *logits) {
    const uint32_t n = s->n_vocab;
    const moe_sampler_params *p = &s->p;
    memcpy(s->work, logits, sizeof(float) * n);
    for (uint32_t i = 0; i < p->n_bias; i++) {
        const int32_t t = p->bias_tokens[i];
        if (t >= 0 && (uint32_t)t < n) s->work[t] += p->bias_values[i];
    }
    if (s->n_recent) {
        for (uint32_t i = 0; i < s->n_recent; i++) {
            const int32_t t = s->recent[i];
            const uint32_t cnt = s->counts[t];
            if (!cnt || (cnt & 0x80000000u)) continue;
            float *v = &s->work[t];
            if (p->repeat_penalty != 0.0f && p->repeat_penalty != 1.0f) {
                if (*v > 0)
                    *v /= p->repeat_penalty;
                else
                    *v *= p->repeat_penalty;
            }
            *v -= (float)cnt * p->frequency_penalty + p->presence_penalty;
            s->counts[t] = cnt | 0x80000000u; /* applied: skip its other occurrences */
        }
        for (uint32_t i = 0; i < s->n_recent; i++) s->counts[s->recent[i]] &= 0x7fffffffu;
    }
    /* log-softmax of the adjusted logits, for the reported log-probabilities (before a grammar's
     * mask, as before truncation) */
    float max = -INFINITY;
    for (uint32_t i = 0; i < n; i++) max = s->work[i] > max ? s->work[i] : max;
    double z = 0.0;
    for (uint32_t i = 0; i < n; i++)
        z += s->work[i] == -INFINITY ? 0.0 : exp((double)(s->work[i] - max));
    const float log_z = max + (float)log(z);

    moe_sample out = {0};
    const uint32_t n_top = p->n_top_logprobs < n ? p->n_top_logprobs : n;
    if (s->grammar) {
        /* Without truncation, a draw from all tokens that the grammar allows is a draw from the
         * allowed ones (greedy: the same argmax; sampling: rejection, then the masked draw), so
         * the mask -- a walk over the vocabulary -- is needed only when the first draw is
         * refused. Truncation (top-k, top-p, min-p) ranks the allowed tokens, so it masks first. */
        const bool plain = p->temperature <= 0.0f || ((p->top_k <= 0 || (uint32_t)p->top_k >= n) &&
                                                      p->top_p >= 1.0f && p->min_p <= 0.0f);
        const bool pays = s->first_hits * 2 >= s->first_tries || s->grammar_steps++ % 16 == 0;
        if (plain && !n_top && pays) {
            const int32_t first = p->temperature <= 0.0f ? moe_argmax(s->work, n)
                                                         : draw_all(s, n, max, p->temperature);
            const bool taken = moe_grammar_state_can_take(s->grammar, first);
            s->first_hits += taken;
            if (++s->first_tries == 64) {
                s->first_tries /= 2;
                s->first_hits /= 2;
            }
            if (taken) {
                out.token = first;
                goto chosen;
            }
        }
        if (!moe_grammar_state_apply(s->grammar, s->work)) {
            /* nothing can continue the grammar: end the generation */
            out.token = moe_grammar_vocab_eog(p->grammar_vocab);
            if (out.token < 0) out.token = 0;
            out.logprob = -INFINITY;
            return out;
        }
        /* the draw below runs over the allowed tokens (z: top-p's normaliser) */
        max = -INFINITY;
        for (uint32_t i = 0; i < n; i++) max = s->work[i] > max ? s->work[i] : max;
        z = 0.0;
        if (p->top_p < 1.0f)
            for (uint32_t i = 0; i < n; i++)
                z += s->work[i] == -INFINITY ? 0.0 : exp((double)(s->work[i] - max));
    }
    if (p->temperature <= 0.0f) {
        out.token = moe_argmax(s->work, n);
        if (n_top) select_top(s, n, n_top);
    } else {
        /* llama.cpp's order: top-k, top-p, min-p on the untempered distribution, then the
         * temperature over what is left. Each cut keeps a prefix of the ranking, so only the
         * shortest prefix needs ranking. */
        uint32_t keep = p->top_k > 0 && (uint32_t)p->top_k < n ? (uint32_t)p->top_k : n;
        const float min_p_floor = p->min_p > 0.0f ? max + logf(p->min_p) : -INFINITY;
        if (p->min_p > 0.0f) {
            uint32_t above = 0;
            for (uint32_t i = 0; i < n; i++) above += s->work[i] >= min_p_floor;
            if (above < keep) keep = above ? above : 1;
        }
        const bool truncated = keep < n || p->top_p < 1.0f;
        if (truncated) {
            select_top(s, n, keep);
            if (p->top_p < 1.0f) {
                /* probabilities over the top-k set (all candidates: the full softmax) */
                double norm = 0.0;
                if (p->top_k > 0 && (uint32_t)p->top_k < n)
                    for (uint32_t i = 0; i < (uint32_t)p->top_k && i < keep; i++)
                        norm += exp((double)(s->work[s->order[i]] - max));
                else
                    norm = z;
                double cum = 0.0;
                for (uint32_t i = 0; i < keep; i++) {
                    cum += exp((double)(s->work[s->order[i]] - max)) / norm;
                    if (cum >= p->top_p) {
                        keep = i + 1;
                        break;
                    }
                }
            }
            out.token = draw(s, keep, max, p->temperature);
        } else {
            out.token = draw_all(s, n, max, p->temperature);
        }
        if (n_top && (!truncated || keep < n_top)) select_top(s, n, n_top);
    }
chosen:
    out.logprob = s->work[out.token] - log_z;
    out.n_top = n_top;
    for (uint32_t i = 0; i < out.n_top; i++) {
        out.top_tokens[i] = s->order[i];
        out.top_logprobs[i] = s->work[s->order[i]] - log_z;
    }
    moe_sampler_accept(s, out.token);
    if (s->grammar) moe_grammar_state_accept(s->grammar, out.token);
    return out;
}
