/* args.c: argument parsing helpers shared by the subcommands, and the demo model a missing model
 * argument stands for. */
#include "args.h"

#include <errno.h>
#include <limits.h>
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

bool moe_arg_kv_type(const char *cmd, const char *text, moe_type *out) {
    moe_type t;
    if (text && moe_type_from_name(text, &t) &&
        (t == MOE_TYPE_F32 || t == MOE_TYPE_F16 || t == MOE_TYPE_Q8_0)) {
        *out = t;
        return true;
    }
    moe_cli_usage_error(cmd, "--kv-type expects f32, f16 or q8_0, got '%s'",
                        text ? text : "(nothing)");
    return false;
}

bool moe_arg_spec(const char *cmd, const char *text, moe_spec_kind *out) {
    static const char *const kinds[] = {
        [MOE_SPEC_NONE] = "none", [MOE_SPEC_NGRAM] = "ngram", [MOE_SPEC_MTP] = "mtp"};
    for (int k = 0; text && k < 3; k++)
        if (strcmp(text, kinds[k]) == 0) {
            *out = (moe_spec_kind)k;
            return true;
        }
    moe_cli_usage_error(cmd, "--spec expects ngram, mtp or none, got '%s'",
                        text ? text : "(nothing)");
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

/* ==== Option tables ==== */

static const moe_cli_option *option_find(const moe_cli_option *table, size_t n, const char *a) {
    for (size_t k = 0; k < n; k++)
        if (strcmp(a, table[k].flag) == 0 || (table[k].alias && strcmp(a, table[k].alias) == 0))
            return &table[k];
    return NULL;
}

static void store_int(void *field, size_t size, long long v) {
    if (size == 1)
        *(int8_t *)field = (int8_t)v;
    else if (size == 4)
        *(int32_t *)field = (int32_t)v;
    else if (size == 8)
        *(int64_t *)field = (int64_t)v;
    else
        moe_die("option field of %zu bytes", size);
}

static long long load_int(const void *field, size_t size) {
    if (size == 1) return *(const int8_t *)field;
    if (size == 4) return *(const int32_t *)field;
    return *(const int64_t *)field;
}

int moe_cli_option_parse(const char *cmd, const moe_cli_option *table, size_t n, void *base,
                         int argc, char **argv, int *i) {
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    const moe_cli_option *o = option_find(table, n, a);
    if (!o) return 0;
    void *field = (char *)base + o->offset;
    long long num;
    double f;
    switch (o->kind) {
    case MOE_OPT_SWITCH:
        *(bool *)field = true;
        return 1;
    case MOE_OPT_INT: /* a double's 2^63 does not convert back: the bounds are clamped first */
        if (!moe_arg_int(cmd, a, v, o->lo <= -9.2e18 ? LLONG_MIN : (long long)o->lo,
                         o->hi >= 9.2e18 ? LLONG_MAX : (long long)o->hi, &num))
            return -1;
        store_int(field, o->size, num);
        break;
    case MOE_OPT_FLOAT:
        if (!moe_arg_float(cmd, a, v, o->lo, o->hi, &f)) return -1;
        *(float *)field = (float)f;
        break;
    case MOE_OPT_STRING:
        if (!v) {
            moe_cli_usage_error(cmd, "%s needs %s", a, o->value ? o->value : "a value");
            return -1;
        }
        *(const char **)field = v;
        break;
    case MOE_OPT_CHOICE: {
        int k = 0;
        while (o->choices[k] && !(v && strcmp(v, o->choices[k]) == 0)) k++;
        if (!o->choices[k]) { /* "ngram, mtp or none" */
            char list[256] = "";
            for (int c = 0; o->choices[c]; c++)
                snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s",
                         c == 0              ? ""
                         : o->choices[c + 1] ? ", "
                                             : " or ",
                         o->choices[c]);
            moe_cli_usage_error(cmd, "%s expects %s, got '%s'", a, list, v ? v : "(nothing)");
            return -1;
        }
        store_int(field, o->size, k);
        break;
    }
    case MOE_OPT_SIZE:
        if (!moe_arg_size(cmd, a, v, (uint64_t *)field)) return -1;
        break;
    case MOE_OPT_KV_TYPE:
        if (!moe_arg_kv_type(cmd, v, (moe_type *)field)) return -1;
        break;
    default:
        moe_die("option %s: kind %d", o->flag, (int)o->kind);
    }
    ++*i;
    return 1;
}

void moe_cli_options_print(FILE *out, const moe_cli_option *table, size_t n, const void *defaults) {
    for (size_t k = 0; k < n; k++) {
        const moe_cli_option *o = &table[k];
        char left[64];
        snprintf(left, sizeof left, "%s%s%s%s%s", o->alias ? o->alias : "", o->alias ? ", " : "",
                 o->flag, o->value ? " " : "", o->value ? o->value : "");
        fprintf(out, "  %-26s %s", left, o->help);
        const void *field = defaults ? (const char *)defaults + o->offset : NULL;
        if (field && !strstr(o->help, "default")) {
            if (o->kind == MOE_OPT_INT)
                fprintf(out, " (default %lld)", load_int(field, o->size));
            else if (o->kind == MOE_OPT_FLOAT)
                fprintf(out, " (default %g)", *(const float *)field);
            else if (o->kind == MOE_OPT_CHOICE)
                fprintf(out, " (default %s)", o->choices[load_int(field, o->size)]);
            else if (o->kind == MOE_OPT_KV_TYPE)
                fprintf(out, " (default %s)", moe_type_name(*(const moe_type *)field));
            else if (o->kind == MOE_OPT_STRING && *(const char *const *)field)
                fprintf(out, " (default %s)", *(const char *const *)field);
        }
        fputc('\n', out);
    }
}

/* ==== The engine options ==== */

#define ENGINE(field) MOE_OPT_FIELD(moe_engine_args, field)
static const char *const split_kinds[] = {
    [MOE_SPLIT_NONE] = "none", [MOE_SPLIT_EXPERTS] = "experts", [MOE_SPLIT_ROWS] = "rows", NULL};
static const moe_cli_option engine_options[] = {
    {"--ctx", NULL, "N", "positions per sequence (default: the model's, capped)", MOE_OPT_INT,
     ENGINE(n_ctx), 1, 1 << 24, NULL},
    {"--threads", "-t", "N", "forward-pass threads", MOE_OPT_INT, ENGINE(n_threads), 1, 1024, NULL},
    {"--kv-type", NULL, "f32|f16|q8_0", "KV cache element type", MOE_OPT_KV_TYPE, ENGINE(kv_type),
     0, 0, NULL},
    {"--expert-cache", NULL, "SIZE",
     "routed experts read from the file on demand into a cache of SIZE (12G, 512M); "
     "default: all resident",
     MOE_OPT_SIZE, ENGINE(expert_cache_bytes), 0, 0, NULL},
    {"--expert-stats", NULL, "FILE", "keep the expert cache's use counts across runs in FILE",
     MOE_OPT_STRING, ENGINE(expert_stats), 0, 0, NULL},
    {"--pin-experts", NULL, "FILE", "experts always resident, one \"LAYER EXPERT\" per line",
     MOE_OPT_STRING, ENGINE(pin_experts), 0, 0, NULL},
    {"--split", NULL, "none|experts|rows",
     "under mpirun: share the routed experts among the ranks, whole experts or rows of every one "
     "(run, chat, logits, bench, serve)",
     MOE_OPT_CHOICE, ENGINE(split), 0, 0, split_kinds},
    {"--split-dense", NULL, NULL,
     "with --split: each dense FFN and shared expert split by rows across the ranks too",
     MOE_OPT_SWITCH, ENGINE(split_dense), 0, 0, NULL},
    {"--no-repack", NULL, NULL,
     "keep the weights in the file's layout (default: matrices whose type has a faster kernel "
     "on a 16-row interleaved layout are repacked at load, same bytes and same logits)",
     MOE_OPT_SWITCH, ENGINE(no_repack), 0, 0, NULL},
};
#undef ENGINE
#define N_ENGINE_OPTIONS (sizeof engine_options / sizeof engine_options[0])

int moe_engine_args_parse(const char *cmd, moe_engine_args *a, int argc, char **argv, int *i) {
    return moe_cli_option_parse(cmd, engine_options, N_ENGINE_OPTIONS, a, argc, argv, i);
}

bool moe_engine_args_repack(const char *cmd, moe_model *m, const moe_engine_args *a) {
    if (a->no_repack) return true;
    moe_layout_report r;
    moe_error err = {0};
    moe_pool *pool = moe_pool_new(a->n_threads);
    const moe_status st =
        moe_model_repack(m, !a->expert_cache_bytes && a->split == MOE_SPLIT_NONE, pool, &r, &err);
    moe_pool_free(pool);
    if (st != MOE_OK) {
        fprintf(stderr, "moe %s: %s\n", cmd, err.msg);
        return false;
    }
    char label[64];
    snprintf(label, sizeof label, "moe %s", cmd);
    moe_layout_report_print(label, &r);
    return true;
}

void moe_engine_args_print(FILE *out, const moe_engine_args *defaults) {
    moe_cli_options_print(out, engine_options, N_ENGINE_OPTIONS, defaults);
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
    if (a->split_dense && a->split == MOE_SPLIT_NONE) {
        moe_cli_usage_error(cmd, "--split-dense needs --split experts|rows");
        return false;
    }
    if (a->split != MOE_SPLIT_NONE) {
        /* MPI starts here, before any output: rank 0 owns stdout, the others' goes nowhere */
        moe_error err = {0};
        if (moe_dist_init(&err) != MOE_OK) {
            moe_cli_usage_error(cmd, "--split: %s", err.msg);
            return false;
        }
        if (moe_dist_rank() != 0 && !freopen("/dev/null", "w", stdout)) {
            fprintf(stderr, "moe %s: rank %d: cannot silence stdout\n", cmd, moe_dist_rank());
            return false;
        }
    }
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
