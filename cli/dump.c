/* dump.c: `moe dump FILE TENSOR [--rows A:B] [--out F]` -- a tensor's values, dequantized by
 * the reference decoders, as little-endian float32 to a file or as text on the terminal.
 * A row is ne[0] values; a 3-D expert tensor has ne[1] x ne[2] rows, expert-major. */
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

int moe_cmd_dump(int argc, char **argv) {
    const char *path = NULL, *name = NULL, *rows_arg = NULL, *out_path = NULL;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--rows") == 0 && i + 1 < argc)
            rows_arg = argv[++i];
        else if (strcmp(argv[i], "--out") == 0 && i + 1 < argc)
            out_path = argv[++i];
        else if (argv[i][0] == '-')
            return moe_cli_usage_error("dump", "unknown option '%s'", argv[i]);
        else if (!path)
            path = argv[i];
        else if (!name)
            name = argv[i];
        else
            return moe_cli_usage_error("dump", "unexpected argument '%s'", argv[i]);
    }
    if (!path || !name) return moe_cli_usage_error("dump", "a file and a tensor name are required");
    moe_error err = {0};
    moe_gguf *g = moe_gguf_open(path, &err);
    if (!g) {
        fprintf(stderr, "moe dump: %s\n", err.msg);
        return 1;
    }
    int rc = 1;
    const moe_tensor *t = moe_gguf_tensor_find(g, name);
    const moe_type_traits *tr = t ? moe_type_traits_get(t->type) : NULL;
    const uint64_t row_len = t ? (uint64_t)t->ne[0] : 0;
    const uint64_t n_rows = t ? t->n_values / row_len : 0;
    uint64_t a = 0, b = n_rows;
    if (!t) {
        fprintf(stderr, "moe dump: %s: no tensor named '%s' (`moe inspect` lists them)\n", path,
                name);
    } else if (!tr->to_float) {
        fprintf(stderr, "moe dump: %s: tensor '%s' has type %s, which moe cannot decode\n", path,
                name, tr->name);
    } else if (rows_arg && !parse_rows(rows_arg, n_rows, &a, &b)) {
        moe_gguf_close(g);
        return moe_cli_usage_error("dump",
                                   "--rows expects A:B, A: or A within 0..%" PRIu64 ", got '%s'",
                                   n_rows, rows_arg);
    } else {
        const uint64_t row_bytes = moe_type_row_bytes(t->type, t->ne[0]);
        float *row = moe_xmalloc(sizeof(float) * row_len);
        FILE *out = out_path ? fopen(out_path, "wb") : stdout;
        if (!out) {
            fprintf(stderr, "moe dump: cannot write %s\n", out_path);
        } else {
            bool ok = true;
            for (uint64_t r = a; r < b && ok; r++) {
                tr->to_float(t->data + r * row_bytes, row, (int64_t)row_len);
                if (out_path) {
                    ok = fwrite(row, sizeof(float), row_len, out) == row_len;
                    continue;
                }
                printf("row %" PRIu64 ":", r);
                for (uint64_t i = 0; i < row_len; i++)
                    printf("%s%.9g", i % DUMP_TEXT_PER_LINE ? " " : "\n  ", row[i]);
                printf("\n");
            }
            if (out_path) {
                ok = fclose(out) == 0 && ok;
                if (ok)
                    printf("wrote rows %" PRIu64 "..%" PRIu64 " of '%s' (%s, %" PRIu64
                           " values each) as float32 to %s\n",
                           a, b - 1, name, tr->name, row_len, out_path);
                else
                    fprintf(stderr, "moe dump: write to %s failed\n", out_path);
            }
            rc = ok ? 0 : 1;
        }
        free(row);
    }
    moe_gguf_close(g);
    return rc;
}
