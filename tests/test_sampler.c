/* Suite "sampler": the properties a sampler must have, checked on synthetic logits --
 * greedy is the argmax, a seed fixes the sequence, log-probabilities are a normalised
 * log-softmax, truncations keep only what they promise, bias and penalties move what they
 * name, and draws follow the softmax at the given temperature. */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/engine/engine.h"

#define N_VOCAB 64

static void make_logits(float *l, uint32_t seed) {
    uint64_t s = seed * 2654435761u + 1;
    for (int i = 0; i < N_VOCAB; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        l[i] = (float)((double)(s >> 11) * 0x1p-53 * 8.0 - 4.0);
    }
}

static int argmax(const float *l) {
    int b = 0;
    for (int i = 1; i < N_VOCAB; i++)
        if (l[i] > l[b]) b = i;
    return b;
}

static void greedy_is_argmax_with_logprobs(void **state) {
    (void)state;
    float l[N_VOCAB];
    moe_sampler_params p = {.temperature = 0, .top_p = 1, .repeat_penalty = 1, .n_top_logprobs = 5};
    moe_sampler *s = moe_sampler_new(&p, N_VOCAB);
    for (uint32_t k = 0; k < 20; k++) {
        make_logits(l, k);
        moe_sample r = moe_sampler_sample(s, l);
        assert_int_equal(r.token, argmax(l));
        /* log-softmax by hand, in double */
        double m = -INFINITY, z = 0;
        for (int i = 0; i < N_VOCAB; i++) m = fmax(m, l[i]);
        for (int i = 0; i < N_VOCAB; i++) z += exp(l[i] - m);
        assert_float_equal(r.logprob, l[r.token] - m - log(z), 1e-5);
        assert_int_equal(r.n_top, 5);
        assert_int_equal(r.top_tokens[0], r.token);
        for (uint32_t i = 1; i < r.n_top; i++)
            assert_true(r.top_logprobs[i] <= r.top_logprobs[i - 1]);
    }
    moe_sampler_free(s);
}

static void seed_fixes_the_sequence(void **state) {
    (void)state;
    float l[N_VOCAB];
    moe_sampler_params p = {.temperature = 1.0f, .top_p = 1, .repeat_penalty = 1, .seed = 42};
    moe_sampler *a = moe_sampler_new(&p, N_VOCAB), *b = moe_sampler_new(&p, N_VOCAB);
    p.seed = 43;
    moe_sampler *c = moe_sampler_new(&p, N_VOCAB);
    int differ = 0;
    for (uint32_t k = 0; k < 200; k++) {
        make_logits(l, k % 3);
        const int32_t ta = moe_sampler_sample(a, l).token;
        assert_int_equal(ta, moe_sampler_sample(b, l).token);
        differ += ta != moe_sampler_sample(c, l).token;
    }
    assert_true(differ > 0);
    moe_sampler_reset(a);
    moe_sampler_reset(b);
    make_logits(l, 0);
    assert_int_equal(moe_sampler_sample(a, l).token, moe_sampler_sample(b, l).token);
    moe_sampler_free(a);
    moe_sampler_free(b);
    moe_sampler_free(c);
}

/* Empirical frequencies at temperature T against softmax(l / T): chi-square below a bound. */
static void draws_follow_the_softmax(void **state) {
    (void)state;
    float l[N_VOCAB];
    make_logits(l, 5);
    const float T = 1.5f;
    moe_sampler_params p = {.temperature = T, .top_p = 1, .repeat_penalty = 1, .seed = 9};
    moe_sampler *s = moe_sampler_new(&p, N_VOCAB);
    enum { DRAWS = 200000 };
    static uint32_t counts[N_VOCAB];
    memset(counts, 0, sizeof counts);
    for (int i = 0; i < DRAWS; i++) counts[moe_sampler_sample(s, l).token]++;
    double m = -INFINITY, z = 0, chi2 = 0;
    for (int i = 0; i < N_VOCAB; i++) m = fmax(m, l[i] / T);
    for (int i = 0; i < N_VOCAB; i++) z += exp(l[i] / T - m);
    for (int i = 0; i < N_VOCAB; i++) {
        const double e = DRAWS * exp(l[i] / T - m) / z;
        chi2 += (counts[i] - e) * (counts[i] - e) / e;
    }
    /* 63 degrees of freedom: the 0.9999 quantile is about 125 */
    print_message("chi-square %.1f over %d draws\n", chi2, DRAWS);
    assert_true(chi2 < 125.0);
    moe_sampler_free(s);
}

static void truncations_keep_what_they_promise(void **state) {
    (void)state;
    float l[N_VOCAB];
    make_logits(l, 11);
    int order[N_VOCAB];
    for (int i = 0; i < N_VOCAB; i++) order[i] = i;
    for (int i = 0; i < N_VOCAB; i++) /* selection sort, descending */
        for (int j = i + 1; j < N_VOCAB; j++)
            if (l[order[j]] > l[order[i]]) {
                int t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
    /* top-k = 3: only the three best ever come out */
    moe_sampler_params p = {
        .temperature = 5, .top_k = 3, .top_p = 1, .repeat_penalty = 1, .seed = 1};
    moe_sampler *s = moe_sampler_new(&p, N_VOCAB);
    for (int i = 0; i < 2000; i++) {
        const int32_t t = moe_sampler_sample(s, l).token;
        assert_true(t == order[0] || t == order[1] || t == order[2]);
    }
    moe_sampler_free(s);
    /* min-p = 1: only the best */
    p = (moe_sampler_params){
        .temperature = 5, .top_p = 1, .min_p = 1.0f, .repeat_penalty = 1, .seed = 1};
    s = moe_sampler_new(&p, N_VOCAB);
    for (int i = 0; i < 200; i++) assert_int_equal(moe_sampler_sample(s, l).token, order[0]);
    moe_sampler_free(s);
    /* top-p tiny: only the best */
    p = (moe_sampler_params){.temperature = 1, .top_p = 1e-6f, .repeat_penalty = 1, .seed = 1};
    s = moe_sampler_new(&p, N_VOCAB);
    for (int i = 0; i < 200; i++) assert_int_equal(moe_sampler_sample(s, l).token, order[0]);
    moe_sampler_free(s);
}

static void bias_and_penalties_move_tokens(void **state) {
    (void)state;
    float l[N_VOCAB];
    make_logits(l, 3);
    const int best = argmax(l);
    /* a -inf bias bans the best token; a large one crowns token 7 */
    int32_t bt[2] = {best, 7};
    float bv[2] = {-INFINITY, 0};
    moe_sampler_params p = {.temperature = 0,
                            .top_p = 1,
                            .repeat_penalty = 1,
                            .bias_tokens = bt,
                            .bias_values = bv,
                            .n_bias = 1};
    moe_sampler *s = moe_sampler_new(&p, N_VOCAB);
    assert_int_not_equal(moe_sampler_sample(s, l).token, best);
    moe_sampler_free(s);
    bv[1] = 100.0f;
    p.n_bias = 2;
    s = moe_sampler_new(&p, N_VOCAB);
    assert_int_equal(moe_sampler_sample(s, l).token, 7);
    moe_sampler_free(s);
    /* presence penalty: a token just seen loses enough to give way to the runner-up */
    float flat[N_VOCAB] = {0};
    flat[5] = 1.0f;
    flat[6] = 0.9f;
    p = (moe_sampler_params){.temperature = 0,
                             .top_p = 1,
                             .repeat_penalty = 1,
                             .presence_penalty = 0.5f,
                             .penalty_last_n = 8};
    s = moe_sampler_new(&p, N_VOCAB);
    assert_int_equal(moe_sampler_sample(s, flat).token, 5);
    assert_int_equal(moe_sampler_sample(s, flat).token, 6);
    moe_sampler_free(s);
    /* repetition penalty divides positive logits of recent tokens */
    p = (moe_sampler_params){
        .temperature = 0, .top_p = 1, .repeat_penalty = 2.0f, .penalty_last_n = 8};
    s = moe_sampler_new(&p, N_VOCAB);
    moe_sampler_accept(s, 5);
    assert_int_equal(moe_sampler_sample(s, flat).token, 6);
    moe_sampler_free(s);
}

int moe_suite_sampler(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(greedy_is_argmax_with_logprobs),
        cmocka_unit_test(seed_fixes_the_sequence),
        cmocka_unit_test(draws_follow_the_softmax),
        cmocka_unit_test(truncations_keep_what_they_promise),
        cmocka_unit_test(bias_and_penalties_move_tokens),
    };
    return cmocka_run_group_tests_name("sampler", tests, NULL, NULL);
}
