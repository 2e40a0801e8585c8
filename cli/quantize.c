/* quantize.c: `moe quantize IN OUT [--type TYPE|PRESET] [--rule 'REGEX=TYPE' ...] [--imatrix F]
 * [-t N] [--split-max-tensors N] [--quiet]` -- requantize a GGUF model (src/tools/quantize.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../src/tools/tools.h"
#include "args.h"
#include "cli.h"

#define QUANTIZE_MAX_RULES 64 /* --rule flags on one command line */

int moe_cmd_quantize(int argc, char **argv) {
    moe_quantize_params p = {
        .preset = "Q4_K_M", .type = MOE_TYPE_Q4_K, .n_threads = 0, .progress = true};
    const char *paths[2] = {NULL, NULL};
    int n_paths = 0;
    moe_synth_rule rules[QUANTIZE_MAX_RULES];
    char *patterns[QUANTIZE_MAX_RULES];
    uint32_t n_rules = 0;
    int rc = 2;
    long long n;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--type") && v) {
            i++;
            if (moe_quantize_preset_base(v, &p.type)) {
                p.preset = v;
            } else if (moe_type_from_name(v, &p.type) && moe_type_can_quantize(p.type)) {
                p.preset = NULL;
            } else {
                moe_cli_usage_error("quantize",
                                    "--type '%s' is neither a mix (%s) nor a type moe "
                                    "can write",
                                    v, moe_quantize_preset_names());
                goto done;
            }
        } else if (!strcmp(a, "--rule") && v) {
            if (n_rules == QUANTIZE_MAX_RULES) {
                moe_cli_usage_error("quantize", "at most %d --rule flags", QUANTIZE_MAX_RULES);
                goto done;
            }
            moe_type t;
            if (!moe_arg_type_rule("quantize", a, v, &patterns[n_rules], &t)) goto done;
            rules[n_rules] = (moe_synth_rule){patterns[n_rules], t};
            n_rules++;
            i++;
        } else if (!strcmp(a, "--imatrix") && v) {
            p.imatrix_path = argv[++i];
        } else if ((!strcmp(a, "-t") || !strcmp(a, "--threads")) && v) {
            if (!moe_arg_int("quantize", a, v, 1, 512, &n)) goto done;
            p.n_threads = (int)n;
            i++;
        } else if (!strcmp(a, "--split-max-tensors") && v) {
            if (!moe_arg_int("quantize", a, v, 1, 1 << 20, &n)) goto done;
            p.split_max_tensors = (uint32_t)n;
            i++;
        } else if (!strcmp(a, "--quiet")) {
            p.progress = false;
        } else if (a[0] == '-' && a[1]) {
            moe_cli_unknown_option("quantize", a);
            goto done;
        } else if (n_paths < 2) {
            paths[n_paths++] = a;
        } else {
            moe_cli_usage_error("quantize", "unexpected argument '%s' (IN and OUT are given)", a);
            goto done;
        }
    }
    if (n_paths != 2) {
        moe_cli_usage_error("quantize", "an input and an output file are required");
        goto done;
    }
    if (p.n_threads == 0) {
        const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        p.n_threads = cpus > 0 ? (int)(cpus < 512 ? cpus : 512) : 1;
    }
    p.in = paths[0], p.out = paths[1];
    p.rules = rules, p.n_rules = n_rules;
    moe_quantize_report r;
    moe_error err = {0};
    if (moe_quantize_model(&p, &r, &err) != MOE_OK) {
        fprintf(stderr, "moe quantize: %s\n", err.msg);
        rc = 1;
        goto done;
    }
    printf("wrote %s: %u tensors (%u quantized), %.2f MiB from %.2f MiB in %.1f s; ", p.out,
           r.n_tensors, r.n_quantized, (double)r.bytes_out / (1 << 20),
           (double)r.bytes_in / (1 << 20), r.seconds);
    if (r.file_type >= 0) printf("general.file_type %d; ", r.file_type);
    printf("types:");
    for (int t = 0; t < MOE_TYPE_COUNT; t++)
        if (r.tensors_by_type[t])
            printf(" %s %u", moe_type_name((uint32_t)t), r.tensors_by_type[t]);
    printf("\n");
    rc = 0;
done:
    for (uint32_t i = 0; i < n_rules; i++) free(patterns[i]);
    return rc;
}
