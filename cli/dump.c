/* dump.c: `moe dump FILE TENSOR [--rows A:B] [--out F]` -- a tensor's values, dequantized by
 * the reference decoders, as little-endian float32 to a file or as text on the terminal.
 * A row is ne[0] values; a 3-D expert tensor has ne[1] x ne[2] rows, expert-major. FILE may be
 * a safetensors checkpoint too: a tensor of any dtype (a row is its last dimension), or a
 * compressed-tensors W4A16 module by name ("M" or "M.weight": scale x level). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/format/format.h"
#include "args.h"
#include "cli.h"

#define DUMP_TEXT_PER_LINE 8 /* values per terminal line */

/* "A:B" (B exclusive), "A:" (to the end) or "A" (one row) within [0, n_rows]. */
static bool parse_rows(const char *text, uint64_t n_rows, uint64_t *a, uint64_t *b) {
    char *end;
    unsigned long long lo = strtoull(text, &end, 10), hi;
    if (end == text) return false;
    if (*end == '\0')
        hi = lo + 1;
    else if (*end == ':' && end[1] == '\0')
        hi = n_rows;
    else if (*end == ':') {
        char *end2;
        hi = strtoull(end + 1, &end2, 10);
        if (end2 == end + 1 || *end2) return false;
    } else
        return false;
    if (lo >= hi || hi > n_rows) return false;
    *a = lo;
    *b = hi;
    return true;
}

/* Where the rows come from: a GGUF tensor (reference decoder), a safetensors tensor (any dtype),
 * or a compressed-tensors W4A16 module (scale x level). */
typedef struct dump_src {
    const moe_tensor *t; /* GGUF */
    const moe_type_traits *tr;
    uint64_t row_bytes;
    const moe_st_tensor *st; /* safetensors tensor */
    moe_w4a16_module w4;     /* W4A16 module, when st is NULL and this is */
    bool is_w4;
    uint64_t row_len, n_rows;
    const char *type_name;
} dump_src;

static bool decode_row(const dump_src *d, uint64_t r, float *row, moe_error *err) {
    if (d->t) {
        d->tr->to_float(d->t->data + r * d->row_bytes, row, (int64_t)d->row_len);
        return true;
    }
    if (d->is_w4)
        return moe_w4a16_dequant_rows(&d->w4, (int64_t)r, (int64_t)r + 1, row, err) == MOE_OK;
    return moe_st_to_f32(d->st, r * d->row_len, d->row_len, row, err) == MOE_OK;
}

/* Rows [a, b) of d as text on stdout, or as float32 into out_path. */
static int dump_rows(const dump_src *d, const char *name, uint64_t a, uint64_t b,
                     const char *out_path) {
    float *row = moe_xmalloc(sizeof(float) * (d->row_len ? d->row_len : 1));
    FILE *out = out_path ? fopen(out_path, "wb") : stdout;
    if (!out) {
        fprintf(stderr, "moe dump: cannot write %s\n", out_path);
        free(row);
        return 1;
    }
    bool ok = true;
    moe_error err = {0};
    for (uint64_t r = a; r < b && ok; r++) {
        ok = decode_row(d, r, row, &err);
        if (!ok) break;
        if (out_path) {
            ok = fwrite(row, sizeof(float), d->row_len, out) == d->row_len;
            continue;
        }
        printf("row %" PRIu64 ":", r);
        for (uint64_t i = 0; i < d->row_len; i++)
            printf("%s%.9g", i % DUMP_TEXT_PER_LINE ? " " : "\n  ", row[i]);
        printf("\n");
    }
    if (err.code != MOE_OK) fprintf(stderr, "moe dump: %s\n", err.msg);
    if (out_path) {
        ok = fclose(out) == 0 && ok;
        if (ok)
            printf("wrote rows %" PRIu64 "..%" PRIu64 " of '%s' (%s, %" PRIu64
                   " values each) as float32 to %s\n",
                   a, b - 1, name, d->type_name, d->row_len, out_path);
        else if (err.code == MOE_OK)
            fprintf(stderr, "moe dump: write to %s failed\n", out_path);
    }
    free(row);
    return ok ? 0 : 1;
}

/* The tensor `name` of a safetensors checkpoint, or the W4A16 module it names ("M" or
 * "M.weight"); false (message printed) when neither. */
static bool find_st(const moe_st *s, const char *path, const char *name, dump_src *d) {
    d->st = moe_st_tensor_find(s, name);
    if (d->st) {
        d->row_len = d->st->n_dims ? (uint64_t)d->st->shape[d->st->n_dims - 1] : 1;
        d->n_rows = d->row_len ? d->st->n_values / d->row_len : 0;
        d->type_name = moe_st_dtype_name(d->st->dtype);
        return true;
    }
    size_t n = strlen(name);
    char *module = moe_xstrndup(name, n > 7 && strcmp(name + n - 7, ".weight") == 0 ? n - 7 : n);
    moe_error err = {0};
    d->is_w4 = moe_w4a16_module_find(s, module, &d->w4, &err) == MOE_OK;
    free(module);
    if (!d->is_w4) {
        if (err.code == MOE_ERR_NOT_FOUND)
            fprintf(stderr,
                    "moe dump: %s: no tensor or W4A16 module named '%s' (`moe inspect` lists "
                    "them)\n",
                    path, name);
        else
            fprintf(stderr, "moe dump: %s: %s\n", path, err.msg);
        return false;
    }
    d->row_len = (uint64_t)d->w4.cols;
    d->n_rows = (uint64_t)d->w4.rows;
    d->type_name = "W4A16";
    return true;
}

int moe_cmd_dump(int argc, char **argv) {
    const char *path = NULL, *name = NULL, *rows_arg = NULL, *out_path = NULL;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--rows") == 0 && i + 1 < argc)
            rows_arg = argv[++i];
        else if (strcmp(argv[i], "--out") == 0 && i + 1 < argc)
            out_path = argv[++i];
        else if (argv[i][0] == '-')
            return moe_cli_unknown_option("dump", argv[i]);
        else if (!path)
            path = argv[i];
        else if (!name)
            name = argv[i];
        else
            return moe_cli_usage_error("dump", "unexpected argument '%s'", argv[i]);
    }
    if (!path || !name) return moe_cli_usage_error("dump", "a file and a tensor name are required");
    moe_error err = {0};
    moe_gguf *g = NULL;
    moe_st *s = NULL;
    if (moe_st_is_checkpoint(path))
        s = moe_st_open(path, &err);
    else
        g = moe_gguf_open(path, &err);
    if (!g && !s) {
        fprintf(stderr, "moe dump: %s\n", err.msg);
        return 1;
    }
    int rc = 1;
    dump_src d = {0};
    bool found = false;
    if (s) {
        found = find_st(s, path, name, &d);
    } else if ((d.t = moe_gguf_tensor_find(g, name)) == NULL) {
        fprintf(stderr, "moe dump: %s: no tensor named '%s' (`moe inspect` lists them)\n", path,
                name);
    } else if (!(d.tr = moe_type_traits_get(d.t->type))->to_float) {
        fprintf(stderr, "moe dump: %s: tensor '%s' has type %s, which moe cannot decode\n", path,
                name, d.tr->name);
    } else {
        d.row_len = (uint64_t)d.t->ne[0];
        d.n_rows = d.t->n_values / d.row_len;
        d.row_bytes = moe_type_row_bytes(d.t->type, d.t->ne[0]);
        d.type_name = d.tr->name;
        found = true;
    }
    uint64_t a = 0, b = d.n_rows;
    if (found && rows_arg && !parse_rows(rows_arg, d.n_rows, &a, &b)) {
        moe_gguf_close(g);
        moe_st_close(s);
        return moe_cli_usage_error("dump",
                                   "--rows expects A:B, A: or A within 0..%" PRIu64 ", got '%s'",
                                   d.n_rows, rows_arg);
    }
    if (found) rc = dump_rows(&d, name, a, b, out_path);
    moe_gguf_close(g);
    moe_st_close(s);
    return rc;
}
