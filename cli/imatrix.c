/* imatrix.c: `moe imatrix MODEL --text F [-o OUT] [--chunks N] [--ctx N] [-t N]
 * [--process-output]` -- the importance matrix of a model over a calibration text, in
 * llama.cpp's GGUF imatrix format (src/tools/imatrix.c). */
#include <stdio.h>
#include <string.h>

#include "../src/tools/tools.h"
#include "args.h"
#include "cli.h"

int moe_cmd_imatrix(int argc, char **argv) {
    moe_imatrix_params p = {.out_path = "imatrix.gguf", .progress = true};
    long long n;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if ((!strcmp(a, "--text") || !strcmp(a, "-f")) && v) {
            p.text_path = argv[++i];
        } else if ((!strcmp(a, "-o") || !strcmp(a, "--out")) && v) {
            p.out_path = argv[++i];
        } else if (!strcmp(a, "--chunks")) {
            if (!moe_arg_int("imatrix", a, v, 1, INT32_MAX, &n)) return 2;
            p.max_chunks = (uint64_t)n;
            i++;
        } else if (!strcmp(a, "--ctx") || !strcmp(a, "-c")) {
            if (!moe_arg_int("imatrix", a, v, 2, 1 << 20, &n)) return 2;
            p.n_ctx = (uint32_t)n;
            i++;
        } else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) {
            if (!moe_arg_int("imatrix", a, v, 1, 512, &n)) return 2;
            p.n_threads = (int)n;
            i++;
        } else if (!strcmp(a, "--process-output")) {
            p.process_output = true;
        } else if (!strcmp(a, "--quiet")) {
            p.progress = false;
        } else if (a[0] == '-' && a[1]) {
            return moe_cli_unknown_option("imatrix", a);
        } else if (!p.model_path) {
            p.model_path = a;
        } else {
            return moe_cli_usage_error("imatrix", "unexpected argument '%s'", a);
        }
    }
    if (!p.model_path || !p.text_path)
        return moe_cli_usage_error("imatrix", "a model and --text FILE are required");
    if (!p.n_threads) p.n_threads = moe_cpu_cores();
    moe_imatrix_report r;
    moe_error err = {0};
    if (moe_imatrix_collect(&p, &r, &err) != MOE_OK) {
        fprintf(stderr, "moe imatrix: %s\n", err.msg);
        return 1;
    }
    printf("wrote %s: %zu weights, %llu chunks of %u tokens (%llu tokens) from %s\n", p.out_path,
           r.entries, (unsigned long long)r.chunks, p.n_ctx ? p.n_ctx : 512,
           (unsigned long long)r.tokens, p.text_path);
    return 0;
}
