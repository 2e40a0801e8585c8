/* safetensors.c: the safetensors reader and writer -- one file, a sharded checkpoint (through
 * model.safetensors.index.json) or a checkpoint directory.
 *
 * Owns parsing and validation of the format (an 8-byte little-endian header length, a JSON
 * object naming each tensor's dtype, shape and [begin, end) data offsets, then the data) and
 * the lifetime of the mappings; decoding values to f32 lives here too because the dtypes are
 * the format's own (F8_E4M3 and friends are not GGUF types). Validation follows the reference
 * implementation (huggingface/safetensors): the header is at most MOE_ST_MAX_HEADER bytes of
 * JSON starting with '{'; every tensor's byte count equals its shape times its dtype size; the
 * tensors, sorted by offset, cover the data section exactly -- no gap, no overlap -- and the data
 * section ends where the file ends. The trap: offsets are relative to the END of the header
 * (8 + header length), not to the file start, and shapes are row-major with the LAST dimension
 * contiguous (GGUF's ne[] is the reverse). */
#include "format.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Longest name quoted in an error message. */
#define ERR_NAME_MAX 96

/* ==== Dtypes ==== */

static const struct {
    const char *name;
    unsigned size;
} dtypes[MOE_ST_DTYPE_COUNT] = {
    [MOE_ST_BOOL] = {"BOOL", 1},       [MOE_ST_U8] = {"U8", 1},
    [MOE_ST_I8] = {"I8", 1},           [MOE_ST_F8_E4M3] = {"F8_E4M3", 1},
    [MOE_ST_F8_E5M2] = {"F8_E5M2", 1}, [MOE_ST_F8_E8M0] = {"F8_E8M0", 1},
    [MOE_ST_I16] = {"I16", 2},         [MOE_ST_U16] = {"U16", 2},
    [MOE_ST_F16] = {"F16", 2},         [MOE_ST_BF16] = {"BF16", 2},
    [MOE_ST_I32] = {"I32", 4},         [MOE_ST_U32] = {"U32", 4},
    [MOE_ST_F32] = {"F32", 4},         [MOE_ST_F64] = {"F64", 8},
    [MOE_ST_I64] = {"I64", 8},         [MOE_ST_U64] = {"U64", 8},
};

const char *moe_st_dtype_name(moe_st_dtype d) {
    return (unsigned)d < MOE_ST_DTYPE_COUNT ? dtypes[d].name : "unknown";
}
unsigned moe_st_dtype_size(moe_st_dtype d) {
    return (unsigned)d < MOE_ST_DTYPE_COUNT ? dtypes[d].size : 0;
}
bool moe_st_dtype_from_name(const char *name, moe_st_dtype *out) {
    for (int d = 0; d < MOE_ST_DTYPE_COUNT; d++)
        if (strcmp(dtypes[d].name, name) == 0) {
            *out = (moe_st_dtype)d;
            return true;
        }
    return false;
}

float moe_f8_e4m3_to_f32(uint8_t b) {
    /* E4M3 "fn": bias 7, no infinities, S.1111.111 is NaN; subnormals are m * 2^-9 */
    int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
    float v;
    if (exp == 15 && man == 7)
        v = __builtin_nanf("");
    else if (exp == 0)
        v = (float)man * 0x1p-9f;
    else
        v = (1.0f + (float)man / 8.0f) * (float)(1 << exp) * 0x1p-7f;
    return sign ? -v : v;
}

static float f8_e5m2_to_f32(uint8_t b) {
    return moe_fp16_to_f32((uint16_t)(b << 8)); /* E5M2 is the top byte of an IEEE half */
}

static float f8_e8m0_to_f32(uint8_t b) {
    if (b == 0xff) return __builtin_nanf("");
    return ldexpf(1.0f, (int)b - 127); /* a power of two: 2^(b - 127) */
}

/* ==== Error messages ==== */

/* s as printable ASCII for an error message: control bytes escaped, cut at ERR_NAME_MAX. */
static const char *esc(char *out, size_t cap, const char *s) {
    size_t o = 0;
    for (size_t i = 0; s[i] && o + 8 < cap; i++) {
        if (i >= ERR_NAME_MAX) {
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        unsigned char ch = (unsigned char)s[i];
        if (ch < 0x20 || ch == 0x7f || ch == '\'' || ch == '\\')
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", ch);
        else
            out[o++] = (char)ch;
    }
    out[o] = 0;
    return out;
}

/* ==== The checkpoint ==== */

typedef struct st_file_state {
    void *map; /* mmap of the whole file, or NULL (parsed from a caller's buffer) */
    size_t map_size;
} st_file_state;

struct moe_st {
    char *dir; /* the checkpoint's directory ("." for a bare file name) */
    uint32_t n_files;
    moe_st_file *files;
    st_file_state *state;
    moe_st_tensor *tensors; /* [n_tensors], file 0 first, by offset within a file */
    uint64_t n_tensors;
    uint64_t *by_name; /* tensor indices sorted by name */
    char **meta_keys;  /* __metadata__ of file 0, in header order */
    char **meta_values;
    size_t n_meta;
};

static void st_free_contents(moe_st *s) {
    for (uint64_t i = 0; i < s->n_tensors; i++) free(s->tensors[i].name);
    for (uint32_t f = 0; f < s->n_files; f++) {
        free(s->files[f].path);
        if (s->state[f].map) munmap(s->state[f].map, s->state[f].map_size);
    }
    for (size_t i = 0; i < s->n_meta; i++) {
        free(s->meta_keys[i]);
        free(s->meta_values[i]);
    }
    free(s->meta_keys);
    free(s->meta_values);
    free(s->tensors);
    free(s->files);
    free(s->state);
    free(s->by_name);
    free(s->dir);
}

void moe_st_close(moe_st *s) {
    if (!s) return;
    st_free_contents(s);
    free(s);
}

uint32_t moe_st_n_files(const moe_st *s) {
    return s->n_files;
}
const moe_st_file *moe_st_file_get(const moe_st *s, uint32_t i) {
    return i < s->n_files ? &s->files[i] : NULL;
}
uint64_t moe_st_n_tensors(const moe_st *s) {
    return s->n_tensors;
}
const moe_st_tensor *moe_st_tensor_get(const moe_st *s, uint64_t i) {
    return i < s->n_tensors ? &s->tensors[i] : NULL;
}
const char *moe_st_dir(const moe_st *s) {
    return s->dir;
}
size_t moe_st_n_meta(const moe_st *s) {
    return s->n_meta;
}
const char *moe_st_meta_key(const moe_st *s, size_t i) {
    return i < s->n_meta ? s->meta_keys[i] : NULL;
}
const char *moe_st_meta_value(const moe_st *s, size_t i) {
    return i < s->n_meta ? s->meta_values[i] : NULL;
}
const char *moe_st_meta_find(const moe_st *s, const char *key) {
    for (size_t i = 0; i < s->n_meta; i++)
        if (strcmp(s->meta_keys[i], key) == 0) return s->meta_values[i];
    return NULL;
}

static const moe_st *sort_ctx;
static int cmp_by_name(const void *a, const void *b) {
    return strcmp(sort_ctx->tensors[*(const uint64_t *)a].name,
                  sort_ctx->tensors[*(const uint64_t *)b].name);
}

const moe_st_tensor *moe_st_tensor_find(const moe_st *s, const char *name) {
    uint64_t lo = 0, hi = s->n_tensors;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int c = strcmp(s->tensors[s->by_name[mid]].name, name);
        if (c == 0) return &s->tensors[s->by_name[mid]];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* Sort names, reject a name held twice (two shards naming one tensor). */
static moe_status index_names(moe_st *s, moe_error *err) {
    s->by_name = moe_xcalloc((size_t)s->n_tensors + 1, sizeof *s->by_name);
    for (uint64_t i = 0; i < s->n_tensors; i++) s->by_name[i] = i;
    sort_ctx = s; /* qsort has no context argument in C11; opening is not done concurrently */
    qsort(s->by_name, (size_t)s->n_tensors, sizeof *s->by_name, cmp_by_name);
    sort_ctx = NULL;
    for (uint64_t i = 1; i < s->n_tensors; i++) {
        const moe_st_tensor *a = &s->tensors[s->by_name[i - 1]], *b = &s->tensors[s->by_name[i]];
        if (strcmp(a->name, b->name) == 0) {
            char e[3 * ERR_NAME_MAX];
            return moe_error_set(err, MOE_ERR_FORMAT, "tensor '%s' is in both %s and %s",
                                 esc(e, sizeof e, a->name), s->files[a->file].path,
                                 s->files[b->file].path);
        }
    }
    return MOE_OK;
}

/* ==== Parsing one file's header ==== */

typedef struct span {
    uint64_t begin, end, index;
} span;

static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* A JSON integer >= 0 (jansson gives json_int_t). */
static bool json_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

/* One tensor entry of the header: {"dtype": ..., "shape": [...], "data_offsets": [b, e]}. */
static moe_status parse_entry(const char *path, const char *key, json_t *v, moe_st_tensor *t,
                              moe_error *err) {
    char e[3 * ERR_NAME_MAX];
    const char *n = esc(e, sizeof e, key);
    if (!json_is_object(v))
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: tensor '%s': entry is not an object", path,
                             n);
    json_t *dt = json_object_get(v, "dtype"), *sh = json_object_get(v, "shape"),
           *off = json_object_get(v, "data_offsets");
    if (!json_is_string(dt) || !json_is_array(sh) || !json_is_array(off))
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': needs \"dtype\" (string), \"shape\" and "
                             "\"data_offsets\" (arrays)",
                             path, n);
    if (json_object_size(v) != 3)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': %zu fields, expected exactly dtype, shape, "
                             "data_offsets",
                             path, n, json_object_size(v));
    if (!moe_st_dtype_from_name(json_string_value(dt), &t->dtype)) {
        char d[3 * ERR_NAME_MAX]; /* its own buffer: n points into e */
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: tensor '%s': unknown dtype '%s'", path, n,
                             esc(d, sizeof d, json_string_value(dt)));
    }
    size_t nd = json_array_size(sh);
    if (nd > MOE_ST_MAX_DIMS)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: tensor '%s': %zu dimensions, at most %d",
                             path, n, nd, MOE_ST_MAX_DIMS);
    t->n_dims = (uint32_t)nd;
    uint64_t count = 1;
    for (size_t d = 0; d < nd; d++) {
        uint64_t x;
        if (!json_u64(json_array_get(sh, d), &x) || moe_mul_overflow(count, x, &count) ||
            count > INT64_MAX)
            return moe_error_set(err, MOE_ERR_FORMAT,
                                 "%s: tensor '%s': dimension %zu is not a non-negative integer "
                                 "or the shape overflows",
                                 path, n, d);
        t->shape[d] = (int64_t)x;
    }
    t->n_values = count;
    if (moe_mul_overflow(count, moe_st_dtype_size(t->dtype), &t->n_bytes))
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: tensor '%s': size overflows", path, n);
    uint64_t b, en;
    if (json_array_size(off) != 2 || !json_u64(json_array_get(off, 0), &b) ||
        !json_u64(json_array_get(off, 1), &en) || en < b)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': data_offsets must be [begin, end] with 0 <= begin "
                             "<= end",
                             path, n);
    if (en - b != t->n_bytes)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                             "] hold %" PRIu64 " bytes, shape x %s needs %" PRIu64,
                             path, n, b, en, en - b, moe_st_dtype_name(t->dtype), t->n_bytes);
    t->offset = b;
    return MOE_OK;
}

/* Parse the header of one file (buf holds the whole file: size bytes) into tensors appended to
 * s; the file's facts into s->files[fi]. Metadata is kept for file 0 only. */
static moe_status parse_file(moe_st *s, uint32_t fi, const uint8_t *buf, uint64_t size,
                             moe_error *err) {
    moe_st_file *f = &s->files[fi];
    const char *path = f->path;
    f->file_size = size;
    if (size < 8)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: %" PRIu64 " bytes, too short for the 8-byte header length", path,
                             size);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)buf[i] << (8 * i);
    if (hlen > MOE_ST_MAX_HEADER)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: header length %" PRIu64 " is more than the limit %u", path, hlen,
                             MOE_ST_MAX_HEADER);
    if (hlen > size - 8)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: header length %" PRIu64 " runs past the end of the file (%" PRIu64
                             " bytes)",
                             path, hlen, size);
    if (hlen < 2 || buf[8] != '{')
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: the header (byte 8) is not a JSON object",
                             path);
    f->header_bytes = 8 + hlen;
    json_error_t je;
    json_t *root = json_loadb((const char *)buf + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: header JSON at byte %d: %s", path,
                             8 + je.position, je.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: the header is not a JSON object", path);
    }
    size_t n_entries = json_object_size(root);
    if (n_entries > MOE_ST_MAX_TENSORS || s->n_tensors + n_entries > MOE_ST_MAX_TENSORS) {
        json_decref(root);
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: %zu tensors, more than the limit %u", path,
                             n_entries, MOE_ST_MAX_TENSORS);
    }
    s->tensors =
        moe_xrealloc(s->tensors, ((size_t)s->n_tensors + n_entries + 1) * sizeof *s->tensors);
    uint64_t first = s->n_tensors;
    moe_status st = MOE_OK;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(v)) {
                st = moe_error_set(err, MOE_ERR_FORMAT, "%s: __metadata__ is not an object", path);
                break;
            }
            const char *mk;
            json_t *mv;
            json_object_foreach(v, mk, mv) {
                if (!json_is_string(mv)) {
                    char e[3 * ERR_NAME_MAX];
                    st = moe_error_set(err, MOE_ERR_FORMAT, "%s: __metadata__ '%s' is not a string",
                                       path, esc(e, sizeof e, mk));
                    break;
                }
                if (fi != 0) continue;
                s->meta_keys = moe_xrealloc(s->meta_keys, (s->n_meta + 1) * sizeof(char *));
                s->meta_values = moe_xrealloc(s->meta_values, (s->n_meta + 1) * sizeof(char *));
                s->meta_keys[s->n_meta] = moe_xstrdup(mk);
                s->meta_values[s->n_meta++] = moe_xstrdup(json_string_value(mv));
            }
            if (st != MOE_OK) break;
            continue;
        }
        moe_st_tensor *t = &s->tensors[s->n_tensors];
        memset(t, 0, sizeof *t);
        st = parse_entry(path, key, v, t, err);
        if (st != MOE_OK) break;
        t->name = moe_xstrdup(key);
        t->file = fi;
        s->n_tensors++;
    }
    json_decref(root);
    if (st != MOE_OK) return st;

    /* the tensors, sorted by offset, must tile [0, data size) exactly */
    uint64_t n = s->n_tensors - first;
    span *sp = moe_xcalloc((size_t)n + 1, sizeof *sp);
    for (uint64_t i = 0; i < n; i++) {
        const moe_st_tensor *t = &s->tensors[first + i];
        sp[i] = (span){t->offset, t->offset + t->n_bytes, first + i};
    }
    qsort(sp, (size_t)n, sizeof *sp, cmp_span);
    uint64_t pos = 0, data = size - f->header_bytes;
    for (uint64_t i = 0; i < n && st == MOE_OK; i++) {
        char e[3 * ERR_NAME_MAX];
        const char *name = esc(e, sizeof e, s->tensors[sp[i].index].name);
        if (sp[i].begin < pos)
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: tensor '%s' at data bytes [%" PRIu64 ", %" PRIu64
                               ") overlaps the tensor before it (which ends at %" PRIu64 ")",
                               path, name, sp[i].begin, sp[i].end, pos);
        else if (sp[i].begin > pos)
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: tensor '%s' starts at data byte %" PRIu64
                               ", leaving a gap after byte %" PRIu64,
                               path, name, sp[i].begin, pos);
        else if (sp[i].end > data)
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: tensor '%s' at data bytes [%" PRIu64 ", %" PRIu64
                               ") runs past the end of the file (data section %" PRIu64 " bytes)",
                               path, name, sp[i].begin, sp[i].end, data);
        pos = sp[i].end;
    }
    if (st == MOE_OK && pos != data)
        st = moe_error_set(err, MOE_ERR_FORMAT,
                           "%s: the tensors cover %" PRIu64
                           " data bytes but the file holds %" PRIu64 " after its header",
                           path, pos, data);
    if (st == MOE_OK) { /* keep the tensors in data order */
        moe_st_tensor *tmp = moe_xcalloc((size_t)n + 1, sizeof *tmp);
        for (uint64_t i = 0; i < n; i++) tmp[i] = s->tensors[sp[i].index];
        memcpy(s->tensors + first, tmp, (size_t)n * sizeof *tmp);
        free(tmp);
        for (uint64_t i = first; i < s->n_tensors; i++) {
            moe_st_tensor *t = &s->tensors[i];
            t->file_offset = f->header_bytes + t->offset;
            t->data = buf + t->file_offset;
        }
        f->n_tensors = (uint32_t)n;
        f->tensor_bytes = data;
    }
    free(sp);
    return st;
}

moe_st *moe_st_parse(const void *buf, size_t size, const char *name, moe_error *err) {
    moe_st *s = moe_xcalloc(1, sizeof *s);
    s->n_files = 1;
    s->files = moe_xcalloc(1, sizeof *s->files);
    s->state = moe_xcalloc(1, sizeof *s->state);
    s->files[0].path = moe_xstrdup(name ? name : "(buffer)");
    s->dir = moe_xstrdup(".");
    if (parse_file(s, 0, buf, size, err) != MOE_OK || index_names(s, err) != MOE_OK) {
        moe_st_close(s);
        return NULL;
    }
    return s;
}

/* ==== Opening files ==== */

static moe_status map_file(const char *path, void **map, size_t *size, moe_error *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return moe_error_set(err, MOE_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat stt;
    if (fstat(fd, &stt) != 0 || !S_ISREG(stt.st_mode)) {
        close(fd);
        return moe_error_set(err, MOE_ERR_IO, "%s: not a regular file", path);
    }
    *size = (size_t)stt.st_size;
    *map = NULL;
    if (*size) {
        *map = mmap(NULL, *size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (*map == MAP_FAILED) {
            *map = NULL;
            close(fd);
            return moe_error_set(err, MOE_ERR_IO, "%s: mmap of %zu bytes failed: %s", path, *size,
                                 strerror(errno));
        }
    }
    close(fd);
    return MOE_OK;
}

static char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = moe_xmalloc(n);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static char *dir_of(const char *path) {
    const char *slash = strrchr(path, '/');
    if (!slash) return moe_xstrdup(".");
    if (slash == path) return moe_xstrdup("/");
    return moe_xstrndup(path, (size_t)(slash - path));
}

static bool is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}
static bool is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* Map and parse the files s->files[0..n_files) (paths set). */
static moe_status open_files(moe_st *s, moe_error *err) {
    s->state = moe_xcalloc(s->n_files + 1, sizeof *s->state);
    for (uint32_t f = 0; f < s->n_files; f++) {
        moe_status st = map_file(s->files[f].path, &s->state[f].map, &s->state[f].map_size, err);
        if (st != MOE_OK) return st;
        st = parse_file(s, f, s->state[f].map, s->state[f].map_size, err);
        if (st != MOE_OK) return st;
    }
    return index_names(s, err);
}

/* The shard list of model.safetensors.index.json: the distinct files of its weight_map, in
 * first-seen order, then checked against what the shards hold. */
static moe_status open_index(moe_st *s, const char *index_path, moe_error *err) {
    uint8_t *text;
    size_t size;
    moe_status st = moe_file_read(index_path, &text, &size, err);
    if (st != MOE_OK) return st;
    json_error_t je;
    json_t *root = json_loadb((const char *)text, size, JSON_REJECT_DUPLICATES, &je);
    free(text);
    if (!root)
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: line %d: %s", index_path, je.line, je.text);
    json_t *map = json_object_get(root, "weight_map");
    if (!json_is_object(map)) {
        json_decref(root);
        return moe_error_set(err, MOE_ERR_FORMAT, "%s: no \"weight_map\" object", index_path);
    }
    const char *key;
    json_t *v;
    char **names = NULL;
    uint32_t n = 0;
    json_object_foreach(map, key, v) {
        const char *file = json_string_value(v);
        char e[3 * ERR_NAME_MAX];
        if (!file || !*file || strchr(file, '/') || strcmp(file, "..") == 0) {
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: weight_map['%s'] is not a file name in the checkpoint's "
                               "directory",
                               index_path, esc(e, sizeof e, key));
            break;
        }
        uint32_t k = 0;
        while (k < n && strcmp(names[k], file) != 0) k++;
        if (k == n) {
            if (n >= MOE_ST_MAX_SHARDS) {
                st = moe_error_set(err, MOE_ERR_FORMAT, "%s: more than %d shard files", index_path,
                                   MOE_ST_MAX_SHARDS);
                break;
            }
            names = moe_xrealloc(names, (n + 1) * sizeof *names);
            names[n++] = moe_xstrdup(file);
        }
    }
    if (st == MOE_OK && n == 0)
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: weight_map names no tensors", index_path);
    if (st == MOE_OK) {
        s->n_files = n;
        s->files = moe_xcalloc(n, sizeof *s->files);
        for (uint32_t k = 0; k < n; k++) s->files[k].path = path_join(s->dir, names[k]);
        st = open_files(s, err);
    }
    /* every tensor the map names is in the file it names, and every tensor is named */
    if (st == MOE_OK) {
        json_object_foreach(map, key, v) {
            const moe_st_tensor *t = moe_st_tensor_find(s, key);
            char e[3 * ERR_NAME_MAX];
            if (!t || !ends_with(s->files[t->file].path, json_string_value(v))) {
                st = moe_error_set(err, MOE_ERR_FORMAT, "%s: weight_map['%s'] = '%s', %s",
                                   index_path, esc(e, sizeof e, key), json_string_value(v),
                                   t ? "but the tensor is in another file"
                                     : "but no shard holds that tensor");
                break;
            }
        }
        if (st == MOE_OK && json_object_size(map) != s->n_tensors)
            st = moe_error_set(err, MOE_ERR_FORMAT,
                               "%s: weight_map names %zu tensors, the shards hold %" PRIu64,
                               index_path, json_object_size(map), s->n_tensors);
    }
    for (uint32_t k = 0; k < n; k++) free(names[k]);
    free(names);
    json_decref(root);
    return st;
}

moe_st *moe_st_open(const char *path, moe_error *err) {
    moe_st *s = moe_xcalloc(1, sizeof *s);
    moe_status st;
    if (is_dir(path)) {
        s->dir = moe_xstrdup(path);
        char *index = path_join(path, "model.safetensors.index.json");
        char *single = path_join(path, "model.safetensors");
        if (is_file(index)) {
            st = open_index(s, index, err);
        } else if (is_file(single)) {
            s->n_files = 1;
            s->files = moe_xcalloc(1, sizeof *s->files);
            s->files[0].path = single;
            single = NULL;
            st = open_files(s, err);
        } else {
            st = moe_error_set(err, MOE_ERR_IO,
                               "%s: a directory without model.safetensors.index.json or "
                               "model.safetensors",
                               path);
        }
        free(index);
        free(single);
    } else if (ends_with(path, ".json")) {
        s->dir = dir_of(path);
        st = open_index(s, path, err);
    } else {
        s->dir = dir_of(path);
        s->n_files = 1;
        s->files = moe_xcalloc(1, sizeof *s->files);
        s->files[0].path = moe_xstrdup(path);
        st = open_files(s, err);
    }
    if (st != MOE_OK) {
        moe_st_close(s);
        return NULL;
    }
    return s;
}

bool moe_st_is_checkpoint(const char *path) {
    if (is_dir(path)) {
        char *a = path_join(path, "model.safetensors.index.json");
        char *b = path_join(path, "model.safetensors");
        bool yes = is_file(a) || is_file(b);
        free(a);
        free(b);
        return yes;
    }
    return ends_with(path, ".safetensors") || ends_with(path, ".safetensors.index.json");
}

void moe_st_tensor_release(const moe_st *s, const moe_st_tensor *t) {
    if (t->file >= s->n_files || !s->state[t->file].map || !t->n_bytes) return;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t begin = (t->file_offset + page - 1) / page * page;
    uint64_t end = (t->file_offset + t->n_bytes) / page * page;
    if (end > begin) madvise((uint8_t *)s->state[t->file].map + begin, end - begin, MADV_DONTNEED);
}

/* ==== Values ==== */

static float value_f32(moe_st_dtype d, const uint8_t *p) {
    switch (d) {
    case MOE_ST_BOOL:
    case MOE_ST_U8:
        return (float)p[0];
    case MOE_ST_I8:
        return (float)(int8_t)p[0];
    case MOE_ST_F8_E4M3:
        return moe_f8_e4m3_to_f32(p[0]);
    case MOE_ST_F8_E5M2:
        return f8_e5m2_to_f32(p[0]);
    case MOE_ST_F8_E8M0:
        return f8_e8m0_to_f32(p[0]);
    case MOE_ST_I16:
        return (float)(int16_t)(p[0] | p[1] << 8);
    case MOE_ST_U16:
        return (float)(uint16_t)(p[0] | p[1] << 8);
    case MOE_ST_F16:
        return moe_fp16_to_f32((uint16_t)(p[0] | p[1] << 8));
    case MOE_ST_BF16:
        return moe_bf16_to_f32((uint16_t)(p[0] | p[1] << 8));
    case MOE_ST_I32:
    case MOE_ST_U32:
    case MOE_ST_F32: {
        uint32_t u =
            (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        if (d == MOE_ST_I32) return (float)(int32_t)u;
        if (d == MOE_ST_U32) return (float)u;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    default: {
        uint64_t u = 0;
        for (int i = 0; i < 8; i++) u |= (uint64_t)p[i] << (8 * i);
        if (d == MOE_ST_I64) return (float)(int64_t)u;
        if (d == MOE_ST_U64) return (float)u;
        double f;
        memcpy(&f, &u, 8);
        return (float)f;
    }
    }
}

moe_status moe_st_to_f32(const moe_st_tensor *t, uint64_t first, uint64_t n, float *out,
                         moe_error *err) {
    if (first > t->n_values || n > t->n_values - first)
        return moe_error_set(err, MOE_ERR_ARG,
                             "tensor '%s': values [%" PRIu64 ", +%" PRIu64 ") of %" PRIu64, t->name,
                             first, n, t->n_values);
    if (!t->data)
        return moe_error_set(err, MOE_ERR_ARG, "tensor '%s': data is not mapped", t->name);
    unsigned es = moe_st_dtype_size(t->dtype);
    const uint8_t *p = t->data + first * es;
    for (uint64_t i = 0; i < n; i++) out[i] = value_f32(t->dtype, p + i * es);
    return MOE_OK;
}

moe_status moe_st_dequant_fp8_blocks(const moe_st_tensor *w, const moe_st_tensor *scale_inv,
                                     int64_t block_rows, int64_t block_cols, float *out,
                                     moe_error *err) {
    if (w->dtype != MOE_ST_F8_E4M3 || w->n_dims != 2)
        return moe_error_set(err, MOE_ERR_ARG, "tensor '%s': not a 2-D F8_E4M3 matrix", w->name);
    if (block_rows <= 0 || block_cols <= 0)
        return moe_error_set(err, MOE_ERR_ARG, "block size %lldx%lld", (long long)block_rows,
                             (long long)block_cols);
    int64_t rows = w->shape[0], cols = w->shape[1];
    int64_t sr = (rows + block_rows - 1) / block_rows, sc = (cols + block_cols - 1) / block_cols;
    if (scale_inv->n_dims != 2 || scale_inv->shape[0] != sr || scale_inv->shape[1] != sc)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "tensor '%s': scales '%s' should be [%lld, %lld] for %lldx%lld "
                             "blocks of [%lld, %lld]",
                             w->name, scale_inv->name, (long long)sr, (long long)sc,
                             (long long)block_rows, (long long)block_cols, (long long)rows,
                             (long long)cols);
    unsigned es = moe_st_dtype_size(scale_inv->dtype);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const uint8_t *sp =
                scale_inv->data + ((uint64_t)(r / block_rows) * (uint64_t)sc + c / block_cols) * es;
            out[r * cols + c] =
                moe_f8_e4m3_to_f32(w->data[r * cols + c]) * value_f32(scale_inv->dtype, sp);
        }
    return MOE_OK;
}

/* ==== Writer ==== */

typedef struct writer_entry {
    char *name;
    moe_st_dtype dtype;
    uint32_t n_dims;
    int64_t shape[MOE_ST_MAX_DIMS];
    uint64_t n_bytes;
} writer_entry;

struct moe_st_writer {
    writer_entry *e;
    size_t n, cap;
    char **meta; /* key, value pairs */
    size_t n_meta;
    FILE *f;
    char *path;
    uint64_t expected, written; /* data bytes declared / written so far */
};

moe_st_writer *moe_st_writer_new(void) {
    return moe_xcalloc(1, sizeof(moe_st_writer));
}

void moe_st_writer_free(moe_st_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n; i++) free(w->e[i].name);
    for (size_t i = 0; i < 2 * w->n_meta; i++) free(w->meta[i]);
    free(w->meta);
    free(w->e);
    if (w->f) fclose(w->f);
    free(w->path);
    free(w);
}

void moe_st_writer_set_meta(moe_st_writer *w, const char *key, const char *value) {
    w->meta = moe_xrealloc(w->meta, (2 * w->n_meta + 2) * sizeof(char *));
    w->meta[2 * w->n_meta] = moe_xstrdup(key);
    w->meta[2 * w->n_meta + 1] = moe_xstrdup(value);
    w->n_meta++;
}

moe_status moe_st_writer_declare(moe_st_writer *w, const char *name, moe_st_dtype dtype,
                                 uint32_t n_dims, const int64_t *shape, moe_error *err) {
    if (w->f) return moe_error_set(err, MOE_ERR_ARG, "tensor '%s' declared after begin", name);
    if ((unsigned)dtype >= MOE_ST_DTYPE_COUNT || n_dims > MOE_ST_MAX_DIMS)
        return moe_error_set(err, MOE_ERR_ARG, "tensor '%s': bad dtype or %u dimensions", name,
                             n_dims);
    if (strcmp(name, "__metadata__") == 0)
        return moe_error_set(err, MOE_ERR_ARG, "a tensor cannot be named __metadata__");
    for (size_t i = 0; i < w->n; i++)
        if (strcmp(w->e[i].name, name) == 0)
            return moe_error_set(err, MOE_ERR_ARG, "tensor '%s' declared twice", name);
    writer_entry e = {.dtype = dtype, .n_dims = n_dims};
    uint64_t count = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (shape[d] < 0 || moe_mul_overflow(count, (uint64_t)shape[d], &count))
            return moe_error_set(err, MOE_ERR_ARG, "tensor '%s': dimension %u is out of range",
                                 name, d);
        e.shape[d] = shape[d];
    }
    if (moe_mul_overflow(count, moe_st_dtype_size(dtype), &e.n_bytes))
        return moe_error_set(err, MOE_ERR_ARG, "tensor '%s' is too large", name);
    e.name = moe_xstrdup(name);
    if (w->n == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 16;
        w->e = moe_xrealloc(w->e, w->cap * sizeof *w->e);
    }
    w->e[w->n++] = e;
    return MOE_OK;
}

moe_status moe_st_writer_begin(moe_st_writer *w, const char *path, moe_error *err) {
    json_t *root = json_object();
    if (w->n_meta) {
        json_t *m = json_object();
        for (size_t i = 0; i < w->n_meta; i++)
            json_object_set_new(m, w->meta[2 * i], json_string(w->meta[2 * i + 1]));
        json_object_set_new(root, "__metadata__", m);
    }
    uint64_t off = 0;
    for (size_t i = 0; i < w->n; i++) {
        json_t *t = json_object(), *sh = json_array();
        json_object_set_new(t, "dtype", json_string(moe_st_dtype_name(w->e[i].dtype)));
        for (uint32_t d = 0; d < w->e[i].n_dims; d++)
            json_array_append_new(sh, json_integer((json_int_t)w->e[i].shape[d]));
        json_object_set_new(t, "shape", sh);
        json_t *o = json_array();
        json_array_append_new(o, json_integer((json_int_t)off));
        json_array_append_new(o, json_integer((json_int_t)(off + w->e[i].n_bytes)));
        json_object_set_new(t, "data_offsets", o);
        json_object_set_new(root, w->e[i].name, t);
        off += w->e[i].n_bytes;
    }
    char *text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!text) moe_die("json_dumps failed");
    size_t len = strlen(text), padded = (len + 7) & ~(size_t)7; /* data 8-aligned, spaces pad */
    w->f = fopen(path, "wb");
    if (!w->f) {
        free(text);
        return moe_error_set(err, MOE_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    }
    w->path = moe_xstrdup(path);
    uint8_t hl[8];
    for (int i = 0; i < 8; i++) hl[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    bool ok = fwrite(hl, 1, 8, w->f) == 8 && fwrite(text, 1, len, w->f) == len;
    for (size_t i = len; i < padded && ok; i++) ok = fputc(' ', w->f) != EOF;
    free(text);
    w->expected = off;
    w->written = 0;
    if (!ok) return moe_error_set(err, MOE_ERR_IO, "%s: write failed: %s", path, strerror(errno));
    return MOE_OK;
}

moe_status moe_st_writer_write(moe_st_writer *w, const void *data, size_t n, moe_error *err) {
    if (!w->f) return moe_error_set(err, MOE_ERR_ARG, "safetensors writer: write before begin");
    if (n > w->expected - w->written)
        return moe_error_set(err, MOE_ERR_ARG, "%s: %zu bytes more than the tensors declared",
                             w->path, n - (size_t)(w->expected - w->written));
    if (n && fwrite(data, 1, n, w->f) != n)
        return moe_error_set(err, MOE_ERR_IO, "%s: write failed: %s", w->path, strerror(errno));
    w->written += n;
    return MOE_OK;
}

uint64_t moe_st_writer_remaining(const moe_st_writer *w) {
    if (w->f) return w->expected - w->written;
    uint64_t total = 0;
    for (size_t i = 0; i < w->n; i++) total += w->e[i].n_bytes;
    return total;
}

moe_status moe_st_writer_finish(moe_st_writer *w, moe_error *err) {
    if (!w->f) return moe_error_set(err, MOE_ERR_ARG, "safetensors writer: finish before begin");
    FILE *f = w->f;
    w->f = NULL;
    if (w->written != w->expected) {
        fclose(f);
        return moe_error_set(err, MOE_ERR_ARG,
                             "%s: %" PRIu64 " data bytes written, the tensors declared %" PRIu64,
                             w->path, w->written, w->expected);
    }
    if (fclose(f) != 0)
        return moe_error_set(err, MOE_ERR_IO, "%s: write failed: %s", w->path, strerror(errno));
    return MOE_OK;
}

/* ==== compressed-tensors W4A16 (pack-quantized, symmetric int4) ==== */

moe_status moe_w4a16_module_find(const moe_st *s, const char *module, moe_w4a16_module *m,
                                 moe_error *err) {
    static const char *const parts[3] = {"weight_packed", "weight_scale", "weight_shape"};
    const moe_st_tensor *t[3];
    char e[3 * ERR_NAME_MAX];
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(module) + strlen(parts[i]) + 2;
        char *name = moe_xmalloc(n);
        snprintf(name, n, "%s.%s", module, parts[i]);
        t[i] = moe_st_tensor_find(s, name);
        free(name);
        if (!t[i])
            return moe_error_set(err, MOE_ERR_NOT_FOUND, "no W4A16 module '%s' (no %s)",
                                 esc(e, sizeof e, module), parts[i]);
    }
    float shape[2] = {0, 0};
    if ((t[2]->dtype == MOE_ST_I64 || t[2]->dtype == MOE_ST_I32) && t[2]->n_values == 2)
        moe_st_to_f32(t[2], 0, 2, shape, err);
    int64_t rows = (int64_t)shape[0], cols = (int64_t)shape[1];
    int64_t groups = cols / MOE_GRID_GROUP;
    bool ok =
        rows > 0 && cols > 0 && cols % MOE_GRID_GROUP == 0 && t[0]->dtype == MOE_ST_I32 &&
        t[0]->n_dims == 2 && t[0]->shape[0] == rows && t[0]->shape[1] == cols / 8 &&
        (t[1]->dtype == MOE_ST_BF16 || t[1]->dtype == MOE_ST_F16 || t[1]->dtype == MOE_ST_F32) &&
        t[1]->n_dims == 2 && t[1]->shape[0] == rows && t[1]->shape[1] == groups;
    if (!ok)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "W4A16 module '%s': weight_shape [%lld, %lld], weight_packed %s "
                             "[%lld, %lld] and weight_scale %s [%lld, %lld] do not fit int4 in "
                             "int32 with one scale per %d",
                             esc(e, sizeof e, module), (long long)rows, (long long)cols,
                             moe_st_dtype_name(t[0]->dtype), (long long)t[0]->shape[0],
                             (long long)t[0]->shape[1], moe_st_dtype_name(t[1]->dtype),
                             (long long)t[1]->shape[0], (long long)t[1]->shape[1], MOE_GRID_GROUP);
    *m = (moe_w4a16_module){t[0], t[1], t[2], rows, cols};
    return MOE_OK;
}

moe_status moe_w4a16_dequant_rows(const moe_w4a16_module *m, int64_t r0, int64_t r1, float *out,
                                  moe_error *err) {
    if (r0 < 0 || r1 > m->rows || r0 > r1)
        return moe_error_set(err, MOE_ERR_ARG, "rows %lld..%lld of %lld", (long long)r0,
                             (long long)r1, (long long)m->rows);
    int64_t groups = m->cols / MOE_GRID_GROUP;
    int8_t q[MOE_GRID_GROUP];
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < groups; g++) {
            float scale;
            moe_status st = moe_st_to_f32(m->scale, (uint64_t)(r * groups + g), 1, &scale, err);
            if (st != MOE_OK) return st;
            moe_grid_unpack_int4(m->packed->data + (r * groups + g) * 16, MOE_GRID_GROUP, q);
            float *o = out + (r - r0) * m->cols + g * MOE_GRID_GROUP;
            for (int i = 0; i < MOE_GRID_GROUP; i++) o[i] = scale * (float)q[i];
        }
    return MOE_OK;
}

moe_status moe_w4a16_config_check(const char *dir, moe_error *err) {
    size_t n = strlen(dir) + 16;
    char *path = moe_xmalloc(n);
    snprintf(path, n, "%s/config.json", dir);
    json_error_t je;
    json_t *c = json_load_file(path, 0, &je);
    moe_status st = MOE_OK;
    json_t *q = json_object_get(c, "quantization_config");
    json_t *groups = json_object_get(q, "config_groups");
    const char *method = json_string_value(json_object_get(q, "quant_method"));
    if (!c) {
        st = moe_error_set(err, MOE_ERR_FORMAT, "%s: %s", path, je.text);
    } else if (!method || strcmp(method, "compressed-tensors") != 0 || !json_is_object(groups)) {
        st = moe_error_set(err, MOE_ERR_UNSUPPORTED,
                           "%s: quantization_config is not compressed-tensors", path);
    } else {
        const char *key;
        json_t *g;
        json_object_foreach(groups, key, g) {
            json_t *w = json_object_get(g, "weights");
            const char *fmt = json_string_value(json_object_get(g, "format"));
            if (!fmt) fmt = json_string_value(json_object_get(q, "format"));
            bool ok = fmt && strcmp(fmt, "pack-quantized") == 0 &&
                      json_integer_value(json_object_get(w, "num_bits")) == 4 &&
                      json_is_true(json_object_get(w, "symmetric")) &&
                      json_integer_value(json_object_get(w, "group_size")) == MOE_GRID_GROUP;
            if (!ok) {
                st = moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                   "%s: quantization_config.config_groups.%s is not "
                                   "pack-quantized symmetric int4 with group_size %d",
                                   path, key, MOE_GRID_GROUP);
                break;
            }
        }
    }
    json_decref(c);
    free(path);
    return st;
}
