/* engine: model state and the batched forward pass; works in token ids only (never text).
 *
 * A moe_ctx owns a model's KV cache for up to n_seq sequences and the scratch for batches of
 * up to max_rows rows, all allocated when it is created: the token loop does not allocate.
 * moe_ctx_decode() runs one forward pass over a batch of rows, each (sequence, position,
 * token); prefill of one prompt and decode of many streams are the same call. The trap: a
 * row's position must be the next position of its sequence (rows of one sequence in order);
 * to go back, truncate the sequence first. */
#ifndef MOE_ENGINE_H
#define MOE_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "../model/model.h"
#include "../ops/ops.h"

typedef struct moe_row {
    int32_t seq;   /* sequence index, < n_seq */
    int32_t pos;   /* position in that sequence */
    int32_t token; /* token id, < n_vocab */
    bool logits;   /* compute this row's logits */
} moe_row;

typedef enum moe_kv_type { MOE_KV_F32, MOE_KV_F16 } moe_kv_type;

typedef struct moe_ctx_params {
    uint32_t n_ctx;    /* positions per sequence (0: the model's training context, capped) */
    uint32_t n_seq;    /* sequences held at once */
    uint32_t max_rows; /* rows per forward call */
    moe_kv_type kv_type;
    int n_threads;     /* threads for the forward pass, including the caller (0: 1) */
} moe_ctx_params;

typedef struct moe_ctx moe_ctx;

moe_ctx *moe_ctx_new(const moe_model *m, const moe_ctx_params *p, moe_error *err);
void moe_ctx_free(moe_ctx *c);
const moe_model *moe_ctx_model(const moe_ctx *c);
uint32_t moe_ctx_n_ctx(const moe_ctx *c);

/* Run the rows; logits gets one [n_vocab] row per row with .logits set, in batch order. */
moe_status moe_ctx_decode(moe_ctx *c, const moe_row *rows, uint32_t n_rows, float *logits,
                          moe_error *err);
/* Expert dispatch counters of the last moe_ctx_decode, summed over its MoE layers. */
moe_expert_stats moe_ctx_expert_stats(const moe_ctx *c);
/* Tokens held for a sequence (its next position). */
uint32_t moe_ctx_seq_len(const moe_ctx *c, int32_t seq);
/* Forget positions >= n of a sequence (0 clears it). */
void moe_ctx_seq_truncate(moe_ctx *c, int32_t seq, uint32_t n);

/* ==== Sampling ==== */

typedef struct moe_sampler_params {
    float temperature;        /* <= 0: greedy */
    int32_t top_k;            /* <= 0: off */
    float top_p;              /* >= 1: off */
    float min_p;              /* <= 0: off */
    float repeat_penalty;     /* 1: off; divides positive / multiplies negative logits */
    float presence_penalty;   /* subtracted once from every token seen in the window */
    float frequency_penalty;  /* subtracted per occurrence in the window */
    int32_t penalty_last_n;   /* window of recent tokens the penalties look at */
    uint64_t seed;
    const int32_t *bias_tokens; /* logit_bias: tokens ... */
    const float *bias_values;   /* ... and what is added to their logits (-inf bans) */
    uint32_t n_bias;
    uint32_t n_top_logprobs;  /* alternatives reported per step (<= MOE_SAMPLER_MAX_TOP) */
} moe_sampler_params;

#define MOE_SAMPLER_MAX_TOP 20 /* OpenAI's top_logprobs maximum */

typedef struct moe_sample {
    int32_t token;
    float logprob;                          /* of the chosen token, under the full softmax */
    uint32_t n_top;
    int32_t top_tokens[MOE_SAMPLER_MAX_TOP]; /* most likely first */
    float top_logprobs[MOE_SAMPLER_MAX_TOP];
} moe_sample;

typedef struct moe_sampler moe_sampler;

moe_sampler *moe_sampler_new(const moe_sampler_params *p, uint32_t n_vocab);
void moe_sampler_free(moe_sampler *s);
/* Pick the next token from one logits row (not modified); remembers it for the penalties. */
moe_sample moe_sampler_sample(moe_sampler *s, const float *logits);
/* Tell the sampler about prompt tokens (they count for the penalties). */
void moe_sampler_accept(moe_sampler *s, int32_t token);
void moe_sampler_reset(moe_sampler *s);

#endif
