/* synth.c: `moe synth -o FILE [--preset P] [shape flags] [--type 'REGEX=TYPE' ...] [--types NAME]
 * [--header-only]` -- write a GGUF model with seeded random weights, or only its header (see
 * src/tools/synth.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/tools/tools.h"
#include "args.h"
#include "cli.h"

#define SYNTH_MAX_RULES 64 /* --type flags on one command line */

int moe_cmd_synth(int argc, char **argv) {
    moe_synth_params p;
    MOE_CHECK(moe_synth_preset("tiny", &p));
    const char *out = NULL, *preset = NULL;
    moe_synth_rule rules[SYNTH_MAX_RULES];
    char *patterns[SYNTH_MAX_RULES];
    uint32_t n_rules = 0;
    const moe_synth_rule *set_rules = NULL; /* --types NAME: after the --type rules */
    uint32_t n_set_rules = 0;
    /* the preset first, so shape flags override it wherever they stand */
    for (int i = 0; i + 1 < argc; i++)
        if (strcmp(argv[i], "--preset") == 0) preset = argv[i + 1];
    if (preset && !moe_synth_preset(preset, &p))
        return moe_cli_usage_error("synth", "unknown preset '%s' (known: %s)", preset,
                                   moe_synth_preset_names());
    int rc = 2;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long long n;
        const struct {
            const char *flag;
            uint32_t *dst;
            long long min;
        } shape[] = {
            {"--layers", &p.n_layer, 1},     {"--embd", &p.n_embd, 32},
            {"--heads", &p.n_head, 1},       {"--heads-kv", &p.n_head_kv, 1},
            {"--head-dim", &p.head_dim, 2},  {"--ff", &p.n_ff, 1},
            {"--experts", &p.n_expert, 0},   {"--experts-used", &p.n_expert_used, 1},
            {"--expert-ff", &p.n_ff_exp, 1}, {"--vocab", &p.n_vocab, 260},
            {"--ctx", &p.n_ctx, 16},
        };
        bool taken = false;
        for (size_t k = 0; k < sizeof shape / sizeof shape[0] && !taken; k++) {
            if (strcmp(a, shape[k].flag) != 0) continue;
            if (!moe_arg_int("synth", a, v, shape[k].min, 1 << 24, &n)) goto done;
            *shape[k].dst = (uint32_t)n;
            taken = true;
            i++;
        }
        if (taken) continue;
        if (strcmp(a, "--preset") == 0 && v) {
            i++;
        } else if ((strcmp(a, "-o") == 0 || strcmp(a, "--out") == 0) && v) {
            out = argv[++i];
        } else if (strcmp(a, "--arch") == 0 && v) {
            p.arch = argv[++i];
        } else if (strcmp(a, "--seed") == 0) {
            if (!moe_arg_int("synth", a, v, 0, INT64_MAX, &n)) goto done;
            p.seed = (uint64_t)n;
            i++;
        } else if (strcmp(a, "--random-blocks") == 0) {
            p.random_blocks = true;
        } else if (strcmp(a, "--header-only") == 0) {
            p.header_only = true;
        } else if (strcmp(a, "--types") == 0 && v) {
            if (!moe_synth_rule_set(v, &set_rules, &n_set_rules)) {
                moe_cli_usage_error("synth", "unknown --types '%s' (known: %s)", v,
                                    moe_synth_rule_set_names());
                goto done;
            }
            i++;
        } else if (strcmp(a, "--type") == 0 && v) {
            moe_type t;
            if (n_rules == SYNTH_MAX_RULES) {
                moe_cli_usage_error("synth", "at most %d --type rules", SYNTH_MAX_RULES);
                goto done;
            }
            if (!moe_arg_type_rule("synth", a, v, &patterns[n_rules], &t)) goto done;
            rules[n_rules] = (moe_synth_rule){patterns[n_rules], t};
            n_rules++;
            i++;
        } else if (a[0] == '-') {
            moe_cli_unknown_option("synth", a);
            goto done;
        } else {
            moe_cli_usage_error("synth", "unexpected argument '%s'", a);
            goto done;
        }
    }
    if (!out) {
        moe_cli_usage_error("synth", "an output file is required (-o FILE)");
        goto done;
    }
    if (n_rules + n_set_rules > SYNTH_MAX_RULES) {
        moe_cli_usage_error("synth", "at most %d --type rules with --types", SYNTH_MAX_RULES);
        goto done;
    }
    for (uint32_t k = 0; k < n_set_rules; k++) rules[n_rules + k] = set_rules[k];
    p.rules = rules;
    p.n_rules = n_rules + n_set_rules;
    moe_error err = {0};
    if (moe_synth_write(&p, out, &err) != MOE_OK) {
        fprintf(stderr, "moe synth: %s\n", err.msg);
        rc = 1;
        goto done;
    }
    printf(
        "wrote %s: %s, %u layers, embd %u, %u experts (%u used), vocab %u, seed %llu; %s\n", out,
        p.arch, p.n_layer, p.n_embd, p.n_expert, p.n_expert_used, p.n_vocab,
        (unsigned long long)p.seed,
        p.header_only
            ? "header only (the tensor data is a hole that reads as zeros: for inspect and budget)"
        : p.random_blocks ? "weights are random (quantized tensors: random valid blocks)"
                          : "weights are random");
    rc = 0;
done:
    for (uint32_t i = 0; i < n_rules; i++) free(patterns[i]);
    return rc;
}
