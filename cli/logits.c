/* logits.c: `moe logits MODEL --tokens ID,... [--mtp] [--out F]` -- run token ids as one prompt
 * and write every position's logits as float32 [n_tokens][n_vocab]; with --mtp, the MTP head's
 * instead: row t from the trunk's hidden state at t and the true token t + 1 ([n_tokens - 1]
 * rows). Without --out, print the top-5 of each row. The tool users and tests compare engines
 * with. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/engine/engine.h"
#include "args.h"
#include "cli.h"

static void print_top5(const float *row, uint32_t n_vocab, size_t pos, int32_t token) {
    int32_t best[5] = {-1, -1, -1, -1, -1};
    for (uint32_t i = 0; i < n_vocab; i++) {
        for (int k = 0; k < 5; k++) {
            if (best[k] < 0 || row[i] > row[best[k]]) {
                memmove(best + k + 1, best + k, sizeof(int32_t) * (size_t)(4 - k));
                best[k] = (int32_t)i;
                break;
            }
        }
    }
    printf("pos %3zu token %6d:", pos, token);
    for (int k = 0; k < 5 && best[k] >= 0; k++) printf("  %d (%.4f)", best[k], row[best[k]]);
    printf("\n");
}

int moe_cmd_logits(int argc, char **argv) {
    const char *model_path = NULL, *out_path = NULL, *tokens_arg = NULL;
    bool mtp = false;
    moe_engine_args engine = {.n_threads = moe_cpu_cores(), .kv_type = MOE_TYPE_F32};
    for (int i = 0; i < argc; i++) {
        const int taken = moe_engine_args_parse("logits", &engine, argc, argv, &i);
        if (taken < 0) return 2;
        if (taken) continue;
        if (strcmp(argv[i], "--tokens") == 0 && i + 1 < argc)
            tokens_arg = argv[++i];
        else if (strcmp(argv[i], "--out") == 0 && i + 1 < argc)
            out_path = argv[++i];
        else if (strcmp(argv[i], "--mtp") == 0)
            mtp = true;
        else if (argv[i][0] == '-')
            return moe_cli_unknown_option("logits", argv[i]);
        else if (!model_path)
            model_path = argv[i];
        else
            return moe_cli_usage_error("logits", "unexpected argument '%s'", argv[i]);
    }
    if (!model_path || !tokens_arg)
        return moe_cli_usage_error("logits", "a model and --tokens are required");
    int32_t *ids;
    size_t n;
    if (!moe_arg_token_list("logits", "--tokens", tokens_arg, &ids, &n)) return 2;
    if (mtp && n < 2) {
        free(ids);
        return moe_cli_usage_error("logits", "--mtp needs at least 2 tokens");
    }

    if (!moe_engine_args_check("logits", &engine)) return 2;
    moe_error err = {0};
    moe_model *m = moe_model_load(model_path, &err);
    if (m && engine.expert_cache_bytes && /* the rest resident, the experts on demand */
        moe_gguf_to_memory_except(m->gguf, NULL, moe_model_is_routed, m, NULL, &err) != MOE_OK) {
        moe_model_free(m);
        m = NULL;
    }
    if (!m) {
        fprintf(stderr, "moe logits: %s\n", err.msg);
        free(ids);
        return 1;
    }
    if (!moe_engine_args_repack("logits", m, &engine)) {
        moe_model_free(m);
        free(ids);
        return 1;
    }
    const uint32_t n_vocab = m->cfg.n_vocab;
    moe_ctx_params cp = {.n_ctx = engine.n_ctx ? engine.n_ctx : (uint32_t)n,
                         .n_seq = 1,
                         .max_rows = (uint32_t)n,
                         .kv_type = engine.kv_type,
                         .expert_cache_bytes = engine.expert_cache_bytes,
                         .expert_stats = engine.expert_stats,
                         .pin_experts = engine.pin_experts,
                         .split = engine.split,
                         .split_dense = engine.split_dense,
                         .n_threads = engine.n_threads};
    moe_ctx *ctx = n <= UINT32_MAX / 2 ? moe_ctx_new(m, &cp, &err) : NULL;
    moe_row *rows = moe_xcalloc(n, sizeof *rows);
    float *logits = moe_xmalloc(sizeof(float) * n * n_vocab);
    int rc = 1;
    for (size_t i = 0; i < n; i++)
        rows[i] = (moe_row){.seq = 0, .pos = (int32_t)i, .token = ids[i], .logits = true};
    bool ok = ctx && moe_ctx_decode(ctx, rows, (uint32_t)n, logits, &err) == MOE_OK;
    if (ok && mtp) {
        /* the MTP head at position t: the trunk's hidden state at t and the true token t + 1 */
        uint32_t n_h;
        const float *h = moe_ctx_hidden(ctx, &n_h);
        float *hidden = moe_xmalloc(sizeof(float) * n_h * m->cfg.n_embd);
        memcpy(hidden, h, sizeof(float) * n_h * m->cfg.n_embd);
        for (size_t i = 0; i + 1 < n; i++)
            rows[i] = (moe_row){.seq = 0, .pos = (int32_t)i, .token = ids[i + 1], .logits = true};
        n--;
        ok = moe_ctx_decode_mtp(ctx, rows, (uint32_t)n, hidden, logits, &err) == MOE_OK;
        free(hidden);
    }
    if (ok && engine.split != MOE_SPLIT_NONE) { /* what this rank's share was */
        const moe_expert_stats st = moe_ctx_expert_stats(ctx);
        uint64_t all;
        moe_split_expert_bytes(m, MOE_SPLIT_NONE, 0, 1, &all);
        const uint64_t held = moe_ctx_routed_bytes(ctx); /* split by rows: what it read */
        fprintf(stderr,
                "moe logits: rank %d of %d ran %llu experts (the step routed %llu (row, expert) "
                "pairs); holds %llu of %llu bytes of routed experts; RSS %.1f MiB\n",
                moe_dist_rank(), moe_dist_size(), (unsigned long long)st.experts,
                (unsigned long long)st.pairs, (unsigned long long)held, (unsigned long long)all,
                (double)moe_rss_bytes() / 1048576.0);
    }
    if (ok && moe_dist_rank() != 0) { /* split across ranks: rank 0 writes the result */
        rc = 0;
    } else if (ok) {
        if (out_path) {
            if (moe_file_write(out_path, logits, sizeof(float) * n * n_vocab, &err) == MOE_OK) {
                printf("wrote %zu x %u float32 logits to %s\n", n, n_vocab, out_path);
                rc = 0;
            }
        } else {
            for (size_t i = 0; i < n; i++)
                print_top5(logits + i * n_vocab, n_vocab, i, ids[mtp ? i + 1 : i]);
            rc = 0;
        }
    }
    if (rc) fprintf(stderr, "moe logits: %s\n", err.msg[0] ? err.msg : "failed");
    free(logits);
    free(rows);
    free(ids);
    moe_ctx_free(ctx);
    moe_model_free(m);
    return rc;
}
