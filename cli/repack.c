/* repack.c: `moe repack SRC OUT --to q4_0-gguf|w4a16 [--workers N]` and `moe repack --verify
 * SRC OUT` -- a QAT bf16 checkpoint rewritten with its 4-bit grid recovered, and the check of
 * such an output against its source (src/tools/repack.c does the work). Prints a summary, or
 * the JSON report with --json (and into --report FILE). Exit 1 on any verify mismatch. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../src/tools/tools.h"
#include "args.h"
#include "cli.h"

static void report_json(moe_json *j, const moe_repack_report *r, const char *src, const char *out,
                        const char *to) {
    moe_json_object_begin(j);
    moe_json_kv_string(j, "source", src);
    moe_json_kv_string(j, "output", out);
    moe_json_kv_string(j, "to", to);
    moe_json_kv_uint(j, "groups", r->groups);
    moe_json_key(j, "groups_by_m");
    moe_json_object_begin(j);
    for (int m = 0; m < 9; m++) {
        char k[2] = {(char)('0' + m), 0};
        moe_json_kv_uint(j, k, r->groups_by_m[m]);
    }
    moe_json_object_end(j);
    moe_json_kv_uint(j, "offgrid_groups", r->offgrid_groups);
    moe_json_key(j, "offgrid_tensors");
    moe_json_array_begin(j);
    for (size_t i = 0; i < r->n_offgrid; i++) {
        moe_json_object_begin(j);
        moe_json_kv_string(j, "name", r->offgrid[i].name);
        moe_json_kv_uint(j, "groups", r->offgrid[i].groups);
        moe_json_kv_int(j, "first_group", r->offgrid[i].first_group);
        moe_json_object_end(j);
    }
    moe_json_array_end(j);
    moe_json_kv_uint(j, "tensors_quantized", r->n_quantized);
    moe_json_kv_uint(j, "tensors_copied", r->n_copied);
    moe_json_kv_uint(j, "tensors_skipped", r->n_skipped);
    moe_json_kv_uint(j, "copied_bytes", r->copied_bytes);
    moe_json_kv_uint(j, "bytes_in", r->bytes_in);
    moe_json_kv_uint(j, "bytes_out", r->bytes_out);
    moe_json_kv_uint(j, "embd_rows_dropped", r->embd_rows_dropped);
    moe_json_kv_double(j, "seconds", r->seconds);
    moe_json_object_end(j);
}

static void report_text(FILE *f, const moe_repack_report *r, const char *out) {
    fprintf(f, "wrote %s: %" PRIu64 " bytes from %" PRIu64 " in %.1f s\n", out, r->bytes_out,
            r->bytes_in, r->seconds);
    fprintf(f, "groups: %" PRIu64 ", off the grid %" PRIu64 "; recovered with step max|w|/m:",
            r->groups, r->offgrid_groups);
    for (int m = 1; m <= 8; m++) fprintf(f, " m=%d %" PRIu64, m, r->groups_by_m[m]);
    fprintf(f, ", all-zero %" PRIu64 "\n", r->groups_by_m[0]);
    fprintf(f, "tensors: %" PRIu64 " quantized, %" PRIu64 " copied (%" PRIu64 " bytes)",
            r->n_quantized, r->n_copied, r->copied_bytes);
    if (r->n_skipped) fprintf(f, ", %" PRIu64 " vision/audio not written (mmproj)", r->n_skipped);
    fputc('\n', f);
    if (r->embd_rows_dropped)
        fprintf(f,
                "token_embd: the last %" PRIu64 " rows (past tokenizer.json's vocabulary) "
                "dropped, as llama.cpp's converter does\n",
                r->embd_rows_dropped);
    for (size_t i = 0; i < r->n_offgrid; i++)
        fprintf(f,
                "kept at source precision: %s (%" PRIu64 " groups off the grid, first %" PRId64
                ")\n",
                r->offgrid[i].name, r->offgrid[i].groups, r->offgrid[i].first_group);
}

static int verify(const char *src, const char *out, int workers, bool json) {
    moe_repack_check v;
    moe_error err = {0};
    if (moe_repack_verify(src, out, workers, &v, &err) != MOE_OK) {
        fprintf(stderr, "moe repack --verify: %s\n", err.msg);
        return 1;
    }
    for (int i = 0; i < v.n_messages; i++) fprintf(stderr, "mismatch: %s\n", v.messages[i]);
    if (json) {
        moe_json j;
        moe_json_init(&j, true);
        moe_json_object_begin(&j);
        moe_json_kv_bool(&j, "ok", v.mismatches == 0);
        moe_json_kv_uint(&j, "groups", v.groups);
        moe_json_kv_uint(&j, "bad_groups", v.bad_groups);
        moe_json_kv_uint(&j, "tensors_quantized", v.tensors_quantized);
        moe_json_kv_uint(&j, "tensors_copied", v.tensors_copied);
        moe_json_kv_uint(&j, "copied_bytes", v.copied_bytes);
        moe_json_kv_uint(&j, "tensors_skipped", v.skipped);
        moe_json_kv_uint(&j, "mismatches", v.mismatches);
        moe_json_kv_double(&j, "worst_scale_rel", v.worst_scale_rel);
        moe_json_kv_string(&j, "worst_scale_tensor", v.worst_scale_tensor);
        moe_json_kv_double(&j, "seconds", v.seconds);
        moe_json_object_end(&j);
        printf("%s\n", j.buf);
        moe_json_free(&j);
    } else {
        printf("verify %s: %" PRIu64 " groups checked (%" PRIu64 " bad) in %" PRIu64
               " tensors, %" PRIu64 " copied tensors (%" PRIu64 " bytes); worst scale difference "
               "%.3g%s%s%s; %s (%.1f s)\n",
               out, v.groups, v.bad_groups, v.tensors_quantized, v.tensors_copied, v.copied_bytes,
               v.worst_scale_rel, v.worst_scale_tensor[0] ? " (" : "", v.worst_scale_tensor,
               v.worst_scale_tensor[0] ? ")" : "", v.mismatches ? "MISMATCH" : "ok", v.seconds);
    }
    if (v.mismatches)
        fprintf(stderr, "moe repack --verify: %" PRIu64 " mismatch%s\n", v.mismatches,
                v.mismatches > 1 ? "es" : "");
    return v.mismatches ? 1 : 0;
}

/* "5GB", "500MB", "2GiB", "123456" (bytes) -> bytes; false when it is not one of those. */
static bool parse_size(const char *text, uint64_t *out) {
    char *end;
    double v = strtod(text, &end);
    if (end == text || !(v > 0) || v > 1e18) return false;
    static const struct {
        const char *unit;
        double scale;
    } units[] = {{"", 1},     {"B", 1},        {"KB", 1e3},        {"MB", 1e6},
                 {"GB", 1e9}, {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
        if (strcmp(end, units[i].unit) == 0) {
            *out = (uint64_t)(v * units[i].scale);
            return *out > 0;
        }
    return false;
}

int moe_cmd_repack(int argc, char **argv) {
    const char *paths[2] = {0}, *to = NULL, *report = NULL, *vocab_from = NULL;
    int n_paths = 0;
    bool json = false, do_verify = false, progress = true;
    long long workers = 0;
    uint64_t max_shard = 5000000000ull; /* transformers' save_pretrained default, "5GB" */
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--to") == 0 && v) {
            to = argv[++i];
        } else if (strcmp(a, "--workers") == 0) {
            if (!moe_arg_int("repack", a, v, 1, 512, &workers)) return 2;
            i++;
        } else if (strcmp(a, "--max-shard-size") == 0 && v) {
            if (!parse_size(v, &max_shard))
                return moe_cli_usage_error("repack", "--max-shard-size %s: like 5GB, 500MB, 2GiB",
                                           v);
            i++;
        } else if (strcmp(a, "--vocab-from") == 0 && v) {
            vocab_from = argv[++i];
        } else if (strcmp(a, "--report") == 0 && v) {
            report = argv[++i];
        } else if (strcmp(a, "--json") == 0) {
            json = true;
        } else if (strcmp(a, "--verify") == 0) {
            do_verify = true;
        } else if (strcmp(a, "--no-progress") == 0) {
            progress = false;
        } else if (a[0] == '-' && a[1]) {
            return moe_cli_unknown_option("repack", a);
        } else if (n_paths < 2) {
            paths[n_paths++] = a;
        } else {
            return moe_cli_usage_error("repack", "one source and one output (got a third: %s)", a);
        }
    }
    if (n_paths != 2) return moe_cli_usage_error("repack", "needs SRC and OUT");
    if (do_verify) return verify(paths[0], paths[1], (int)workers, json);
    moe_repack_options o = {.workers = (int)workers,
                            .progress = progress && !json,
                            .max_shard_bytes = max_shard,
                            .vocab_from = vocab_from};
    if (!to) return moe_cli_usage_error("repack", "--to q4_0-gguf or --to w4a16");
    if (strcmp(to, "q4_0-gguf") == 0)
        o.to = MOE_REPACK_Q4_0_GGUF;
    else if (strcmp(to, "w4a16") == 0)
        o.to = MOE_REPACK_W4A16;
    else
        return moe_cli_usage_error("repack", "--to %s: q4_0-gguf or w4a16", to);
    moe_repack_report r;
    moe_error err = {0};
    moe_status st = moe_repack(paths[0], paths[1], &o, &r, &err);
    if (st != MOE_OK) {
        fprintf(stderr, "moe repack: %s\n", err.msg);
        moe_repack_report_free(&r);
        return 1;
    }
    moe_json j;
    moe_json_init(&j, true);
    report_json(&j, &r, paths[0], paths[1], to);
    int rc = 0;
    if (report) {
        moe_error e = {0};
        if (moe_file_write(report, j.buf, j.len, &e) != MOE_OK) {
            fprintf(stderr, "moe repack: %s\n", e.msg);
            rc = 1;
        }
    }
    if (json)
        printf("%s\n", j.buf);
    else
        report_text(stdout, &r, paths[1]);
    moe_json_free(&j);
    moe_repack_report_free(&r);
    return rc;
}
