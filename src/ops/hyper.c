/* hyper.c: the per-row arithmetic of hyper-connections (DeepSeek-V4 / GLM-5.3 mHC): from a row's
 * mixing logits to its pre, post and combination weights.
 *
 * The combination matrix is the part with a trap: it must be doubly stochastic (every stream
 * keeps unit mass), reached by Sinkhorn iterations whose epsilon sits in every denominator, and
 * the order -- columns (sum over sources) first, then rows then columns again -- changes the
 * result at the model's tolerance. */
#include "ops.h"

#include <math.h>

static float sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

/* Divide each column (sum over sources) or each row (sum over destinations) by its sum + eps. */
static void normalise(float *p, int n, bool columns, float eps) {
    const int step = columns ? n : 1, stride = columns ? 1 : n; /* along a line, between lines */
    for (int i = 0; i < n; i++) {
        float *line = p + i * stride, sum = 0.0f;
        for (int j = 0; j < n; j++) sum += line[j * step];
        const float inv = 1.0f / (sum + eps);
        for (int j = 0; j < n; j++) line[j * step] *= inv;
    }
}

void moe_hc_mix_weights(const float *m, const float *base, const float *scale, int n, int iters,
                        float eps, float *pre, float *post, float *comb) {
    for (int s = 0; s < n; s++) {
        pre[s] = sigmoid(m[s] * scale[0] + base[s]) + eps;
        post[s] = 2.0f * sigmoid(m[n + s] * scale[1] + base[n + s]);
    }
    const float *cm = m + 2 * n, *cb = base + 2 * n;
    for (int src = 0; src < n; src++) { /* softmax over destinations, + eps */
        float *row = comb + src * n, mx = -INFINITY, sum = 0.0f;
        for (int dst = 0; dst < n; dst++) {
            row[dst] = cm[src * n + dst] * scale[2] + cb[src * n + dst];
            mx = fmaxf(mx, row[dst]);
        }
        for (int dst = 0; dst < n; dst++) sum += row[dst] = expf(row[dst] - mx);
        for (int dst = 0; dst < n; dst++) row[dst] = row[dst] / sum + eps;
    }
    normalise(comb, n, true, eps);
    for (int it = 1; it < iters; it++) {
        normalise(comb, n, false, eps);
        normalise(comb, n, true, eps);
    }
}
