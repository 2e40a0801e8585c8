/* audit.c: `moe audit QUANT REFERENCE [--tensor REGEX] [--experts 0,100,287] [--rows N]
 * [--seed S] [--json]` -- what a quantization cost, tensor by tensor, against its source; and
 * `moe audit --ladder SRC --types IQ2_S,IQ3_S,... [--imatrix F] [-t N]` -- what each rung would
 * cost, quantizing the chosen rows of one float source.
 *
 * Opens both models (local or by URL: headers, then only the selected rows' bytes), asks
 * tools/ for the comparison and prints a table or JSON; a remote run ends with the requests
 * and bytes it used. The trap: without --tensor every quantized matrix is audited, and with
 * --rows 0 every row -- against a remote 400 GB model that is a download, so the default
 * stays at a sample (MOE_AUDIT_DEFAULT_ROWS rows of expert 0). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "../src/format/format.h"
#include "../src/tools/tools.h"

#define MOE_AUDIT_DEFAULT_ROWS 512
#define MOE_AUDIT_DEFAULT_SEED 42

/* "0,100,287" -> experts (caller frees); false with a usage message. */
static bool parse_experts(const char *text, int64_t **out, size_t *n) {
    int64_t *e = moe_xmalloc(MOE_AUDIT_MAX_EXPERTS * sizeof *e);
    size_t k = 0;
    const char *p = text ? text : "";
    while (*p) {
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX || (*end && *end != ',') ||
            k == MOE_AUDIT_MAX_EXPERTS) {
            free(e);
            moe_cli_usage_error("audit",
                                "--experts expects comma-separated expert indices "
                                "(at most %d), bad entry at '%s'",
                                MOE_AUDIT_MAX_EXPERTS, p);
            return false;
        }
        e[k++] = v;
        p = *end ? end + 1 : end;
    }
    if (!k) {
        free(e);
        moe_cli_usage_error("audit", "--experts needs at least one index");
        return false;
    }
    *out = e;
    *n = k;
    return true;
}

/* "IQ2_S,IQ3_S,Q4_K" -> types moe can quantize; false with a usage message. */
static bool parse_types(const char *text, moe_type *out, size_t *n) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", text ? text : "");
    *n = 0;
    for (char *save, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (*n == MOE_TYPE_COUNT || !moe_type_from_name(tok, &out[*n]) ||
            !moe_type_can_quantize(out[*n])) {
            moe_cli_usage_error("audit", "--types: '%s' is not a type moe can quantize", tok);
            return false;
        }
        (*n)++;
    }
    if (!*n) moe_cli_usage_error("audit", "--ladder needs --types A,B,...");
    return *n > 0;
}

int moe_cmd_audit(int argc, char **argv) {
    const char *paths[2] = {0};
    size_t n_paths = 0;
    bool json = false, ladder = false;
    const char *types_arg = NULL, *imatrix_path = NULL;
    long long threads = 0;
    moe_type ladder_types[MOE_TYPE_COUNT];
    long long rows = MOE_AUDIT_DEFAULT_ROWS, seed = MOE_AUDIT_DEFAULT_SEED;
    int64_t *experts = NULL;
    moe_audit_options o = {0};
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json"))
            json = true;
        else if (!strcmp(a, "--ladder"))
            ladder = true;
        else if (!strcmp(a, "--types") && v) {
            types_arg = v;
            i++;
        } else if (!strcmp(a, "--imatrix") && v) {
            imatrix_path = v;
            i++;
        } else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) {
            if (!moe_arg_int("audit", a, v, 1, 512, &threads)) return 2;
            i++;
        } else if (!strcmp(a, "--tensor")) {
            if (!v) return moe_cli_usage_error("audit", "--tensor needs a regular expression");
            o.tensor_regex = v;
            i++;
        } else if (!strcmp(a, "--experts")) {
            free(experts);
            experts = NULL;
            if (!parse_experts(v, &experts, &o.n_experts)) return 2;
            i++;
        } else if (!strcmp(a, "--rows")) {
            if (!moe_arg_int("audit", a, v, 0, INT32_MAX, &rows)) return 2;
            i++;
        } else if (!strcmp(a, "--seed")) {
            if (!moe_arg_int("audit", a, v, 0, INT64_MAX, &seed)) return 2;
            i++;
        } else if (a[0] == '-' && a[1]) {
            free(experts);
            return moe_cli_unknown_option("audit", a);
        } else if (n_paths == 2) {
            free(experts);
            return moe_cli_usage_error("audit", "two models: QUANT REFERENCE (got a third, %s)", a);
        } else {
            paths[n_paths++] = a;
        }
    }
    if (n_paths != (ladder ? 1u : 2u)) {
        free(experts);
        return moe_cli_usage_error("audit", ladder ? "--ladder takes one model: the F32/F16/BF16 "
                                                     "source"
                                                   : "which models? QUANT REFERENCE");
    }
    if (!ladder && (types_arg || imatrix_path)) {
        free(experts);
        return moe_cli_usage_error("audit", "--types and --imatrix go with --ladder SRC");
    }
    if (ladder && !parse_types(types_arg, ladder_types, &o.n_ladder)) {
        free(experts);
        return 2;
    }
    if (ladder) {
        paths[1] = paths[0];
        o.ladder = ladder_types;
        if (threads <= 0) {
            const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
            threads = cpus > 0 ? (cpus < 512 ? cpus : 512) : 1;
        }
        o.pool = moe_pool_new((int)threads);
    }
    o.experts = experts;
    o.rows = (uint64_t)rows;
    o.seed = (uint64_t)seed;

    moe_error err = {0};
    moe_imatrix *im = NULL;
    if (imatrix_path && !(im = moe_imatrix_load(imatrix_path, &err))) {
        fprintf(stderr, "moe audit: %s\n", err.msg);
        moe_pool_free(o.pool);
        free(experts);
        return 1;
    }
    o.imatrix = im;
    moe_http *http = NULL; /* one connection pool for both models */
    moe_gguf *q = moe_gguf_open_any(paths[0], &http, &err);
    moe_gguf *ref = q ? moe_gguf_open_any(paths[1], &http, &err) : NULL;
    int rc = 0;
    moe_audit_report r = {0};
    uint64_t req0 = moe_http_requests(http), bytes0 = moe_http_bytes(http);
    if (!q || !ref || moe_audit_run(q, http, ref, http, &o, &r, &err) != MOE_OK) {
        fprintf(stderr, "moe audit: %s\n", err.msg);
        rc = 1;
    } else if (r.n_rows == 0 && ladder) {
        fprintf(stderr, "moe audit: no F32/F16/BF16 matrix%s%s%s whose rows the rungs divide\n",
                o.tensor_regex ? " matching '" : "", o.tensor_regex ? o.tensor_regex : "",
                o.tensor_regex ? "'" : "");
        rc = 1;
    } else if (r.n_rows == 0) {
        fprintf(stderr,
                "moe audit: no quantized tensor%s%s%s has a reference of the same name "
                "and shape in F32/F16/BF16 (%zu skipped)\n",
                o.tensor_regex ? " matching '" : "", o.tensor_regex ? o.tensor_regex : "",
                o.tensor_regex ? "'" : "", r.n_skipped);
        rc = 1;
    } else if (json) {
        moe_json j;
        moe_json_init(&j, true);
        moe_json_object_begin(&j);
        moe_json_kv_string(&j, ladder ? "source" : "quant", paths[0]);
        if (!ladder) moe_json_kv_string(&j, "reference", paths[1]);
        if (imatrix_path) moe_json_kv_string(&j, "imatrix", imatrix_path);
        moe_json_kv_uint(&j, "seed", o.seed);
        moe_json_kv_uint(&j, "x_cols", MOE_AUDIT_X_COLS);
        moe_json_kv_uint(&j, "skipped", r.n_skipped);
        moe_json_key(&j, "tensors");
        moe_json_array_begin(&j);
        for (size_t i = 0; i < r.n_rows; i++) {
            const moe_audit_row *a = &r.rows[i];
            moe_json_object_begin(&j);
            moe_json_kv_string(&j, "tensor", a->tensor);
            moe_json_key(&j, "expert");
            if (a->expert < 0)
                moe_json_null(&j);
            else
                moe_json_int(&j, a->expert);
            moe_json_kv_string(&j, "format", moe_type_name(a->type));
            moe_json_kv_string(&j, "reference_format", moe_type_name(a->ref_type));
            moe_json_kv_double(&j, "bits_per_weight", a->bits_per_weight);
            moe_json_kv_uint(&j, "rows", a->rows);
            moe_json_kv_uint(&j, "cols", a->cols);
            moe_json_kv_double(&j, "rel_fro", a->rel_fro);
            moe_json_kv_double(&j, "cosine", a->cosine);
            moe_json_kv_double(&j, "matvec_rel", a->matvec_rel);
            moe_json_object_end(&j);
        }
        moe_json_array_end(&j);
        moe_json_object_end(&j);
        fwrite(j.buf, 1, j.len, stdout);
        fputc('\n', stdout);
        moe_json_free(&j);
    } else {
        size_t w = 6;
        for (size_t i = 0; i < r.n_rows; i++)
            if (strlen(r.rows[i].tensor) > w) w = strlen(r.rows[i].tensor);
        printf("%-*s %6s %-8s %6s %6s %10s %12s %10s\n", (int)w, "tensor", "expert", "format",
               "bits/w", "rows", "rel_fro", "cosine", "matvec_rel");
        for (size_t i = 0; i < r.n_rows; i++) {
            const moe_audit_row *a = &r.rows[i];
            char e[24] = "-";
            if (a->expert >= 0) snprintf(e, sizeof e, "%lld", (long long)a->expert);
            printf("%-*s %6s %-8s %6.3g %6" PRIu64 " %10.3e %12.8f %10.3e\n", (int)w, a->tensor, e,
                   moe_type_name(a->type), a->bits_per_weight, a->rows, a->rel_fro, a->cosine,
                   a->matvec_rel);
        }
        printf("%s: %s%s%s; X: %d seeded N(0,1) columns (seed %" PRIu64 ")%s\n",
               ladder ? "ladder of the source" : "reference", paths[1],
               imatrix_path ? ", importance from " : "", imatrix_path ? imatrix_path : "",
               MOE_AUDIT_X_COLS, o.seed,
               r.n_skipped ? (ladder ? "; some rungs skipped (rows not whole blocks)"
                                     : "; some tensors had no usable reference")
                           : "");
    }
    if (http)
        fprintf(json ? stderr : stdout,
                "remote: %" PRIu64 " requests, %" PRIu64 " bytes read "
                "(%" PRIu64 " requests, %" PRIu64 " bytes for the rows)\n",
                moe_http_requests(http), moe_http_bytes(http), moe_http_requests(http) - req0,
                moe_http_bytes(http) - bytes0);
    moe_audit_report_free(&r);
    moe_gguf_close(q);
    moe_gguf_close(ref);
    moe_http_free(http);
    moe_imatrix_free(im);
    moe_pool_free(o.pool);
    free(experts);
    if (!rc && fflush(stdout) != 0) rc = 1;
    return rc;
}
