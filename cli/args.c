/* args.c: argument parsing helpers shared by the subcommands, and the demo model a missing model
 * argument stands for. */
#include "args.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/base/base.h"
#include "../src/engine/engine.h"
#include "../src/tools/tools.h"
#include "cli.h"

bool moe_arg_int(const char *cmd, const char *flag, const char *text, long long min, long long max,
                 long long *out) {
    char *end;
    errno = 0;
    long long v = text ? strtoll(text, &end, 10) : 0;
    if (!text || errno || end == text || *end || v < min || v > max) {
        moe_cli_usage_error(cmd, "%s expects an integer in %lld..%lld, got '%s'", flag, min, max,
                            text ? text : "(nothing)");
        return false;
    }
    *out = v;
    return true;
}

bool moe_arg_float(const char *cmd, const char *flag, const char *text, double min, double max,
                   double *out) {
    char *end;
    errno = 0;
    double v = text ? strtod(text, &end) : 0;
    if (!text || errno || end == text || *end || !isfinite(v) || v < min || v > max) {
        moe_cli_usage_error(cmd, "%s expects a number in %g..%g, got '%s'", flag, min, max,
                            text ? text : "(nothing)");
        return false;
    }
    *out = v;
    return true;
}

bool moe_arg_token_list(const char *cmd, const char *flag, const char *text, int32_t **ids,
                        size_t *n) {
    size_t cap = 16, count = 0;
    int32_t *out = moe_xmalloc(cap * sizeof *out);
    const char *p = text ? text : "";
    while (*p) {
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            free(out);
            moe_cli_usage_error(cmd, "%s expects comma-separated token ids, bad entry at '%s'",
                                flag, p);
            return false;
        }
        if (count == cap) out = moe_xrealloc(out, (cap *= 2) * sizeof *out);
        out[count++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    if (!count) {
        free(out);
        moe_cli_usage_error(cmd, "%s needs at least one token id", flag);
        return false;
    }
    *ids = out;
    *n = count;
    return true;
}

char *moe_arg_model_path(const char *cmd, const char *given) {
    if (given) return moe_xstrdup(given);
    moe_error err = {0};
    char *demo = moe_demo_model_path(&err);
    if (!demo) {
        fprintf(stderr, "moe %s: %s\n", cmd, err.msg);
        return NULL;
    }
    fprintf(stderr,
            "moe %s: no model given: using the built-in demo model %s "
            "(its weights are RANDOM: the text means nothing)\n",
            cmd, demo);
    return demo;
}

bool moe_arg_kv_type(const char *cmd, const char *text, bool allow_q8_0, moe_type *out) {
    moe_type t;
    if (text && moe_type_from_name(text, &t) &&
        (t == MOE_TYPE_F32 || t == MOE_TYPE_F16 || (allow_q8_0 && t == MOE_TYPE_Q8_0))) {
        *out = t;
        return true;
    }
    moe_cli_usage_error(cmd, "--kv-type expects %s, got '%s'",
                        allow_q8_0 ? "f32, f16 or q8_0" : "f32 or f16", text ? text : "(nothing)");
    return false;
}

bool moe_arg_size(const char *cmd, const char *flag, const char *text, uint64_t *out) {
    char *end;
    errno = 0;
    const double v = text ? strtod(text, &end) : 0;
    static const char units[] = "KMGT";
    double scale = 1;
    bool ok = text && !errno && end != text && isfinite(v) && v > 0;
    if (ok && *end) {
        const char *u = strchr(units, *end & ~0x20); /* K, M, G, T in either case */
        ok = u && *end;
        if (ok) {
            for (const char *k = units; k <= u; k++) scale *= 1024;
            end++;
            if (*end == 'i') end++;
            if (*end == 'B' || *end == 'b') end++;
            ok = !*end;
        }
    }
    if (!ok || v * scale >= 18e18) {
        moe_cli_usage_error(cmd, "%s expects a size such as 512M, 12G or 1.5T, got '%s'", flag,
                            text ? text : "(nothing)");
        return false;
    }
    *out = (uint64_t)(v * scale);
    return true;
}

int moe_engine_args_parse(const char *cmd, moe_engine_args *a, int argc, char **argv, int *i) {
    const char *flag = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    long long n;
    if (strcmp(flag, "--ctx") == 0) {
        if (!moe_arg_int(cmd, flag, v, 1, 1 << 24, &n)) return -1;
        a->n_ctx = (uint32_t)n;
    } else if (strcmp(flag, "-t") == 0 || strcmp(flag, "--threads") == 0) {
        if (!moe_arg_int(cmd, flag, v, 1, 1024, &n)) return -1;
        a->n_threads = (int)n;
    } else if (strcmp(flag, "--kv-type") == 0) {
        if (!moe_arg_kv_type(cmd, v, false, &a->kv_type)) return -1;
    } else if (strcmp(flag, "--expert-cache") == 0) {
        if (!moe_arg_size(cmd, flag, v, &a->expert_cache_bytes)) return -1;
    } else if (strcmp(flag, "--expert-stats") == 0 || strcmp(flag, "--pin-experts") == 0) {
        if (!v) {
            moe_cli_usage_error(cmd, "%s needs a file name", flag);
            return -1;
        }
        *(flag[2] == 'e' ? &a->expert_stats : &a->pin_experts) = v;
    } else {
        return 0;
    }
    ++*i;
    return 1;
}

bool moe_arg_type_rule(const char *cmd, const char *flag, const char *text, char **pattern,
                       moe_type *type) {
    const char *eq = text ? strrchr(text, '=') : NULL;
    if (!eq || eq == text || !moe_type_from_name(eq + 1, type)) {
        moe_cli_usage_error(cmd, "%s expects REGEX=TYPE (a type like Q8_0, Q4_K, IQ4_XS), got '%s'",
                            flag, text ? text : "");
        return false;
    }
    *pattern = moe_xstrndup(text, (size_t)(eq - text));
    return true;
}

bool moe_engine_args_check(const char *cmd, const moe_engine_args *a) {
    if ((a->expert_stats || a->pin_experts) && !a->expert_cache_bytes) {
        moe_cli_usage_error(cmd, "%s needs --expert-cache SIZE",
                            a->expert_stats ? "--expert-stats" : "--pin-experts");
        return false;
    }
    return true;
}

char *moe_cli_read_grammar(const char *cmd, const char *path) {
    moe_error err = {0};
    uint8_t *data = NULL;
    size_t size = 0;
    if (moe_file_read(path, &data, &size, &err) != MOE_OK) {
        fprintf(stderr, "moe %s: --grammar-file: %s\n", cmd, err.msg);
        return NULL;
    }
    char *src = moe_xmalloc(size + 1);
    memcpy(src, data, size);
    src[size] = '\0';
    free(data);
    moe_grammar *g = moe_grammar_parse(src, size, NULL, &err);
    if (!g) {
        fprintf(stderr, "moe %s: %s: %s\n", cmd, path, err.msg);
        free(src);
        return NULL;
    }
    moe_grammar_free(g);
    return src;
}
