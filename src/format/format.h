/* format: GGUF and safetensors files read and written (safetensors, compressed-tensors W4A16:
 * see their section below); one model may span several shard files.
 *
 * The reader parses the header, metadata and tensor directory of every shard through a cursor
 * that checks each read before it happens, then maps the files (mmap, read-only) so tensor data
 * is addressed in place. moe_gguf_parse() runs the same parser over a buffer (fuzzing, remote
 * headers fetched by range). Split models (`name-00001-of-00004.gguf`) open as one model from
 * any shard's path; tensors keep the index of the shard that holds them.
 * The trap: offsets in the tensor directory are relative to the shard's data section, which
 * starts at the header's end rounded up to general.alignment -- not at the file start. */
#ifndef MOE_FORMAT_H
#define MOE_FORMAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../base/base.h"
#include "../quant/quant.h"

/* ==== Limits (each a defence against a hostile file) ==== */

#define MOE_GGUF_MAX_DIMS          4          /* ggml tensors have at most 4 dimensions */
#define MOE_GGUF_MAX_STRING        (1u << 26) /* 64 MiB: chat templates are KBs, no key needs more */
#define MOE_GGUF_MAX_ARRAY         (1u << 26) /* 64 Mi elements: vocab arrays are ~256k */
#define MOE_GGUF_MAX_KV            (1u << 20) /* metadata pairs; real files have < 100 */
#define MOE_GGUF_MAX_TENSORS       (1u << 20) /* tensors in one file; DeepSeek-V3 has ~1.9k */
#define MOE_GGUF_MAX_NEST          8    /* nested array depth: each level costs a stack frame */
#define MOE_GGUF_MAX_SHARDS        4096 /* split files of one model */
#define MOE_GGUF_DEFAULT_ALIGNMENT 32

/* ==== Metadata values ==== */

typedef enum moe_gguf_vtype {
    MOE_GGUF_U8 = 0,
    MOE_GGUF_I8 = 1,
    MOE_GGUF_U16 = 2,
    MOE_GGUF_I16 = 3,
    MOE_GGUF_U32 = 4,
    MOE_GGUF_I32 = 5,
    MOE_GGUF_F32 = 6,
    MOE_GGUF_BOOL = 7,
    MOE_GGUF_STRING = 8,
    MOE_GGUF_ARRAY = 9,
    MOE_GGUF_U64 = 10,
    MOE_GGUF_I64 = 11,
    MOE_GGUF_F64 = 12,
    MOE_GGUF_VTYPE_COUNT
} moe_gguf_vtype;

/* A length-counted string; also NUL-terminated (the NUL is not counted). */
typedef struct moe_str {
    const char *ptr;
    uint64_t len;
} moe_str;

typedef struct moe_gguf_value moe_gguf_value;
struct moe_gguf_value {
    moe_gguf_vtype type;
    union {
        uint64_t u; /* U8 U16 U32 U64 and BOOL (0/1) */
        int64_t i;  /* I8 I16 I32 I64 */
        double f;   /* F32 F64 */
        moe_str s;  /* STRING */
        struct {
            moe_gguf_vtype elem_type;
            uint64_t n;
            /* elements: STRING -> moe_str[n]; ARRAY -> moe_gguf_value[n] (each an ARRAY);
             * numbers and BOOL -> packed little-endian values exactly as in the file */
            const void *data;
        } arr;
    };
};

typedef struct moe_gguf_kv {
    moe_str key;
    moe_gguf_value value;
    uint64_t file_offset; /* where the pair starts in its shard (for messages) */
} moe_gguf_kv;

/* ==== Tensors ==== */

typedef struct moe_tensor {
    moe_str name;
    moe_type type;
    uint32_t n_dims;
    int64_t ne[MOE_GGUF_MAX_DIMS]; /* ne[0] is the row length (contiguous); unused dims are 1 */
    uint64_t n_values;             /* product of ne */
    uint64_t n_bytes;              /* bytes of data: rows * row bytes of `type` */
    uint32_t shard;                /* index into the shards */
    uint64_t offset;               /* from the start of the shard's data section */
    uint64_t file_offset;          /* from the start of the shard file */
    const uint8_t *data;           /* mapped bytes, or NULL when the data is not mapped */
    moe_layout layout; /* how the bytes at data lie (quant.h): the file's unless the loader
                        * repacked them (moe_gguf_tensor_repack) */
} moe_tensor;

typedef struct moe_gguf_shard {
    char *path;
    uint32_t version;
    uint64_t file_size;
    uint64_t header_bytes;  /* magic .. end of tensor directory */
    uint64_t data_offset;   /* start of the data section (header rounded up to alignment) */
    uint64_t tensor_bytes;  /* sum of this shard's tensors' n_bytes */
    uint64_t padding_bytes; /* everything else: file_size - header_bytes - tensor_bytes */
    uint32_t n_tensors;
    uint32_t n_kv;
} moe_gguf_shard;

typedef struct moe_gguf moe_gguf;

/* Open a GGUF file (with every shard if it is part of a split) and map its data. */
moe_gguf *moe_gguf_open(const char *path, moe_error *err);
/* Parse one shard's header from memory. Tensor `data` points into buf when the buffer holds
 * the data too (buf_is_whole_file), else NULL; no checks against the file size then. */
moe_gguf *moe_gguf_parse(const void *buf, size_t size, bool buf_is_whole_file, moe_error *err);
/* The same, naming the source in error messages (a path or URL) instead of "(buffer)". */
moe_gguf *moe_gguf_parse_named(const void *buf, size_t size, bool buf_is_whole_file,
                               const char *name, moe_error *err);
void moe_gguf_close(moe_gguf *g);
/* Assemble one model from shards parsed one at a time (moe_gguf_parse_named over headers
 * fetched by range), parts[i] being shard i: records each shard's real size (a header alone
 * cannot know it; padding and the reconciliation come from it), checks every tensor's data
 * ends inside its file, and indexes names across shards. Takes ownership of parts[0..n) (each
 * a one-shard model), also on failure. Split keys are the caller's to check. */
moe_gguf *moe_gguf_join(moe_gguf **parts, const uint64_t *file_sizes, uint32_t n, moe_error *err);

uint32_t moe_gguf_alignment(const moe_gguf *g);
uint32_t moe_gguf_n_shards(const moe_gguf *g);
const moe_gguf_shard *moe_gguf_shard_get(const moe_gguf *g, uint32_t i);
/* A shard's own general.alignment (shards may differ; moe_gguf_alignment is shard 0's). */
uint32_t moe_gguf_shard_alignment(const moe_gguf *g, uint32_t i);
/* Whether shard i's tensor data is a hole: a sparse file with no data after the block the
 * header ends in (`moe synth --header-only`), which reads as zeros. false where the file system
 * cannot tell (no SEEK_DATA) or the data section is smaller than a block. */
bool moe_gguf_shard_data_is_hole(const moe_gguf *g, uint32_t i);

/* Metadata: of the first shard (split files repeat the model's keys there). */
uint64_t moe_gguf_n_kv(const moe_gguf *g);
const moe_gguf_kv *moe_gguf_kv_get(const moe_gguf *g, uint64_t i);
const moe_gguf_value *moe_gguf_find(const moe_gguf *g, const char *key);
/* Typed getters: false when the key is absent or of an incompatible type; any integer type
 * converts when the value fits. */
bool moe_gguf_get_u64(const moe_gguf *g, const char *key, uint64_t *out);
bool moe_gguf_get_i64(const moe_gguf *g, const char *key, int64_t *out);
bool moe_gguf_get_f64(const moe_gguf *g, const char *key, double *out);
bool moe_gguf_get_bool(const moe_gguf *g, const char *key, bool *out);
const char *moe_gguf_get_str(const moe_gguf *g, const char *key); /* NULL if absent/not string */
const char *moe_gguf_vtype_name(moe_gguf_vtype t);
/* Bytes of one number/bool value; 0 for string, array and unknown types. */
unsigned moe_gguf_vtype_size(uint32_t t);

/* Read every mapped shard's data section into anonymous memory (huge-page aligned, advised
 * MADV_HUGEPAGE, read-only) and point the tensors there. Why: pages of a mapped file can be
 * reclaimed by the host between steps and read back from disk, which made one benchmark run 40x
 * slower; anonymous pages stay. The data is read from the file (pread, 64 MiB at a
 * time on the pool's threads; NULL pool: the caller alone), never copied through the mapping,
 * and the mapping's data pages are unmapped after, so the peak is the data once, not twice.
 * Costs the data size in memory (no swap here) and one pass over the file. Tensor pointers
 * stay valid: the moe_tensor structs do not move, only their `data`. No-op for shards that are
 * not mapped or already read. On a read error (which names the file and byte) the shard's
 * tensors still point into the mapping. */
moe_status moe_gguf_to_memory(moe_gguf *g, moe_pool *pool, uint64_t *bytes_read, moe_error *err);
/* Make moe_gguf_to_memory(_except) report on stderr, as "LABEL: reading weights: X of Y MiB
 * (P%)" (updated in place on a terminal, a line per tenth otherwise) and "LABEL: weights read:
 * ... in T s", when the read takes over a second (the env MOE_PROGRESS_AFTER=SECONDS changes
 * that, for tests). label must outlive the reads; NULL: silent (the default). */
void moe_gguf_set_progress(moe_gguf *g, const char *label);
/* The same, leaving out the tensors skip says yes to: they are not read (their pages of the
 * anonymous copy are never touched, so cost nothing) and their `data` becomes NULL (whoever
 * needs them reads them from the file: the expert cache). */
moe_status moe_gguf_to_memory_except(moe_gguf *g, moe_pool *pool,
                                     bool (*skip)(const moe_tensor *t, void *ctx), void *skip_ctx,
                                     uint64_t *bytes_read, moe_error *err);

/* Repack tensor t (one of g's) in place into `layout` (quant.h, "Weight layouts in memory"):
 * every matrix of it (ne[0] x ne[1], ne[2] of them), whole groups of rows; its bytes stay where
 * they are and t->layout says which layout they have. Its data must lie in g's anonymous copy
 * (moe_gguf_to_memory), rewritten there, or in the mapping, whose pages under t are replaced by
 * anonymous ones holding the repacked bytes (the file is never written; *mapped_bytes += t's
 * bytes, the process's own memory now; may be NULL). Either way the pages are read-only after.
 * The groups are packed over the pool's threads (NULL: the caller's). */
moe_status moe_gguf_tensor_repack(moe_gguf *g, const moe_tensor *t, moe_layout layout,
                                  moe_pool *pool, uint64_t *mapped_bytes, moe_error *err);

/* Tensors of all shards, in file order (shard 0 first). */
uint64_t moe_gguf_n_tensors(const moe_gguf *g);
const moe_tensor *moe_gguf_tensor_get(const moe_gguf *g, uint64_t i);
const moe_tensor *moe_gguf_tensor_find(const moe_gguf *g, const char *name);

/* ==== Remote files: HTTP(S) range reads (http.c, libcurl) ====
 *
 * A model given as an http:// or https:// URL is read by range requests: each shard's header
 * and tensor directory (a first range, grown until the directory is whole), and later only the
 * tensor rows a tool asks for. Redirects are followed; a server that answers a range request
 * with the whole file (200 instead of 206) is refused with a clear error rather than
 * downloaded. Every request and byte is counted so tools can say what a report cost. */

#define MOE_HTTP_FIRST_RANGE   (64u << 10)  /* first bytes of a shard: small models' whole index */
#define MOE_HTTP_MAX_HEADER    (1ull << 30) /* a header past 1 GiB is hostile, not a model */
#define MOE_HTTP_MAX_REDIRECTS 10

typedef struct moe_http moe_http;

moe_http *moe_http_new(void);
void moe_http_free(moe_http *h);
/* Size of the first range read from each shard (tests make it small to exercise growth). */
void moe_http_set_first_range(moe_http *h, uint64_t bytes);
uint64_t moe_http_requests(const moe_http *h); /* HTTP exchanges, redirects included */
uint64_t moe_http_bytes(const moe_http *h);    /* body bytes received */
/* True for "http://..." and "https://..." (case-insensitive scheme). */
bool moe_path_is_url(const char *path);
/* Bytes [offset, offset + n) of url into buf. *got is n, or less only where the file ends
 * first; *file_size (may be NULL) is the file's full size from Content-Range. */
moe_status moe_http_read(moe_http *h, const char *url, uint64_t offset, uint64_t n, void *buf,
                         uint64_t *got, uint64_t *file_size, moe_error *err);
/* POST a JSON body to url (an API call, not a file read): the reply's body into *reply (reset
 * first) and its HTTP status into *status. bearer, when not NULL, goes in an Authorization
 * header. Fails only on transport errors; the caller judges the status. */
#define MOE_HTTP_MAX_REPLY (256u << 20) /* an API reply past 256 MiB is not one */
moe_status moe_http_post_json(moe_http *h, const char *url, const char *body, size_t len,
                              const char *bearer, moe_strbuf *reply, long *status, moe_error *err);
/* Open a GGUF model by URL (every shard of a split, found from any shard's name); tensor
 * `data` pointers are NULL. Shard paths are the shards' URLs. */
moe_gguf *moe_gguf_open_url(moe_http *h, const char *url, moe_error *err);
/* A local path through moe_gguf_open, a URL through moe_gguf_open_url with *http (created on
 * first use; the caller frees it with moe_http_free). */
moe_gguf *moe_gguf_open_any(const char *path_or_url, moe_http **http, moe_error *err);
/* Bytes [offset, offset + n) of tensor t's data: from the mapping when the model is local,
 * else one range request through http (which must then be non-NULL). */
moe_status moe_tensor_read(const moe_gguf *g, moe_http *http, const moe_tensor *t, uint64_t offset,
                           uint64_t n, void *out, moe_error *err);

/* ==== Writer ==== */

typedef struct moe_gguf_writer moe_gguf_writer;

moe_gguf_writer *moe_gguf_writer_new(void);
void moe_gguf_writer_free(moe_gguf_writer *w);
/* Sets general.alignment; the writer pads to that key's value (default 32) whenever it is a
 * u32 power of two, also when it came in with a model's copied metadata. */
void moe_gguf_writer_set_alignment(moe_gguf_writer *w, uint32_t alignment);
/* Metadata in insertion order; setting a key again replaces its value in place. */
void moe_gguf_writer_set_u32(moe_gguf_writer *w, const char *key, uint32_t v);
void moe_gguf_writer_set_i32(moe_gguf_writer *w, const char *key, int32_t v);
void moe_gguf_writer_set_u64(moe_gguf_writer *w, const char *key, uint64_t v);
void moe_gguf_writer_set_f32(moe_gguf_writer *w, const char *key, float v);
void moe_gguf_writer_set_bool(moe_gguf_writer *w, const char *key, bool v);
void moe_gguf_writer_set_str(moe_gguf_writer *w, const char *key, const char *v);
/* Any value, including arrays (nested arrays too), copied deeply. */
void moe_gguf_writer_set_value(moe_gguf_writer *w, const char *key, const moe_gguf_value *v);
/* An array of numbers/bools (packed little-endian, as in the file) or, for MOE_GGUF_STRING,
 * of NUL-terminated strings (const char *[n]). Arrays of moe_str (strings holding NULs) and
 * nested arrays go through moe_gguf_writer_set_value. */
void moe_gguf_writer_set_arr(moe_gguf_writer *w, const char *key, moe_gguf_vtype elem_type,
                             const void *elems, uint64_t n);
/* Add a tensor; data (n_bytes of the type/shape) is copied, or referenced if `borrow`. NULL
 * data adds a tensor whose bytes are streamed (moe_gguf_writer_stream_*). */
moe_status moe_gguf_writer_add_tensor(moe_gguf_writer *w, const char *name, moe_type type,
                                      uint32_t n_dims, const int64_t *ne, const void *data,
                                      bool borrow, moe_error *err);
/* A deferred tensor's producer: fill out[n_bytes] with the tensor's bytes when the writer reaches
 * it (tensors are produced in the order added, one at a time); an error stops the write. */
typedef moe_status (*moe_gguf_tensor_fill_fn)(void *ctx, const char *name, void *out,
                                              uint64_t n_bytes, moe_error *err);
/* Add a tensor whose bytes `fill` produces during moe_gguf_writer_write (each write calls it
 * again), so a writer of a large model holds one tensor at a time. */
moe_status moe_gguf_writer_add_tensor_deferred(moe_gguf_writer *w, const char *name, moe_type type,
                                               uint32_t n_dims, const int64_t *ne,
                                               moe_gguf_tensor_fill_fn fill, void *ctx,
                                               moe_error *err);
/* general.file_type: llama.cpp's `enum llama_ftype` (include/llama.h) for a file whose weights
 * are mostly `type`, named as llama-quantize names its outputs (Q4_K -> MOSTLY_Q4_K_M = 15,
 * MXFP4 -> MOSTLY_MXFP4_MOE = 38, F32 -> ALL_F32 = 0); false for types no ftype names (Q8_1,
 * Q8_K, the integer types, F64). */
bool moe_gguf_file_type_of(moe_type type, uint32_t *ftype);
/* Sets general.file_type to the ftype of the tensor type holding the most bytes among the
 * tensors added so far (ties: the lower type id), as a mix is named after its dominant type.
 * False, and no key set, without tensors or when that type has no ftype. */
bool moe_gguf_writer_set_file_type(moe_gguf_writer *w);
/* Write one file, or a split when max_tensors_per_shard > 0 and there are more tensors than
 * that: the shards are then named like llama.cpp's gguf-split does, "<path without .gguf>-
 * 00001-of-0000N.gguf", each carrying split.no / split.count / split.tensors.count. */
moe_status moe_gguf_writer_write(moe_gguf_writer *w, const char *path,
                                 uint32_t max_tensors_per_shard, moe_error *err);
/* The model moe_gguf_writer_write would make, held in memory instead of a file: keys and
 * directory parsed back by the reader, every tensor's bytes copied or produced (fill, in the
 * order added) into anonymous memory the model owns. `name` stands for the file in messages. */
moe_gguf *moe_gguf_writer_to_memory(const moe_gguf_writer *w, const char *name, moe_error *err);
/* Streaming, for files larger than memory: add every tensor with NULL data first, then begin
 * (writes header, keys and directory), hand each tensor's n_bytes in the order added, finish.
 * One file, no split. */
moe_status moe_gguf_writer_stream_begin(moe_gguf_writer *w, const char *path, moe_error *err);
moe_status moe_gguf_writer_stream_tensor(moe_gguf_writer *w, const void *data, moe_error *err);
moe_status moe_gguf_writer_stream_finish(moe_gguf_writer *w, moe_error *err);
/* The keys and tensor directory of the file moe_gguf_writer_write would make, at that file's
 * full size with the tensor data left a hole (a sparse file that reads as zeros): a model's
 * layout for tools that read only the directory (inspect, budget). Tensors need no data. */
moe_status moe_gguf_writer_write_header_only(const moe_gguf_writer *w, const char *path,
                                             moe_error *err);
/* The keys set so far as a reader sees them: a header without tensors, parsed (the caller
 * closes it). Lets a writer check what it wrote with the same code that will load it. */
moe_gguf *moe_gguf_writer_read_keys(const moe_gguf_writer *w, moe_error *err);

/* ==== safetensors (safetensors.c) ====
 *
 * A .safetensors file is an 8-byte little-endian header length N, N bytes of JSON (an object:
 * tensor name -> {"dtype", "shape", "data_offsets": [begin, end]}, plus an optional
 * "__metadata__" object of strings), then the data; offsets count from the end of the header.
 * Shapes are row-major, the LAST dimension contiguous (the reverse of GGUF's ne[]). A sharded
 * checkpoint is a directory with model.safetensors.index.json, whose "weight_map" names the
 * file of every tensor. Files are mapped read-only; tensor `data` points into the mapping. */

#define MOE_ST_MAX_HEADER  (100u << 20) /* the reference implementation's limit on the JSON */
#define MOE_ST_MAX_DIMS    8            /* no model tensor has more; bounds the shape array */
#define MOE_ST_MAX_TENSORS (1u << 20)   /* tensors over all shards; DeepSeek-V3 has ~92k */
#define MOE_ST_MAX_SHARDS  4096         /* files of one checkpoint */

typedef enum moe_st_dtype {
    MOE_ST_BOOL,
    MOE_ST_U8,
    MOE_ST_I8,
    MOE_ST_F8_E4M3, /* "fn": no infinities; with block scales (weight_scale_inv) in FP8 models */
    MOE_ST_F8_E5M2,
    MOE_ST_F8_E8M0, /* a power of two (MX scales) */
    MOE_ST_I16,
    MOE_ST_U16,
    MOE_ST_F16,
    MOE_ST_BF16,
    MOE_ST_I32,
    MOE_ST_U32,
    MOE_ST_F32,
    MOE_ST_F64,
    MOE_ST_I64,
    MOE_ST_U64,
    MOE_ST_DTYPE_COUNT
} moe_st_dtype;

const char *moe_st_dtype_name(moe_st_dtype d); /* "BF16", as the header spells it */
unsigned moe_st_dtype_size(moe_st_dtype d);    /* bytes of one value; 0 if unknown */
bool moe_st_dtype_from_name(const char *name, moe_st_dtype *out);
float moe_f8_e4m3_to_f32(uint8_t b);

typedef struct moe_st_tensor {
    char *name;
    moe_st_dtype dtype;
    uint32_t n_dims;                /* 0 for a scalar */
    int64_t shape[MOE_ST_MAX_DIMS]; /* shape[n_dims - 1] is contiguous */
    uint64_t n_values, n_bytes;     /* product of shape; n_values x dtype size */
    uint32_t file;                  /* index into the files */
    uint64_t offset;                /* from the start of the file's data section */
    uint64_t file_offset;           /* from the start of the file */
    const uint8_t *data;            /* mapped bytes */
} moe_st_tensor;

typedef struct moe_st_file {
    char *path;
    uint64_t file_size;
    uint64_t header_bytes; /* 8 + the JSON header (with its padding) */
    uint64_t tensor_bytes; /* the data section, tiled exactly by the tensors */
    uint32_t n_tensors;
} moe_st_file;

typedef struct moe_st moe_st;

/* Open a .safetensors file, a model.safetensors.index.json, or a checkpoint directory (its
 * index, else its model.safetensors). Tensors are in file order, each file's by offset. */
moe_st *moe_st_open(const char *path, moe_error *err);
/* Parse one whole file held in memory (fuzzing, tests); `name` names it in errors. */
moe_st *moe_st_parse(const void *buf, size_t size, const char *name, moe_error *err);
void moe_st_close(moe_st *s);
/* True for a directory holding a checkpoint or a path ending in .safetensors(.index.json). */
bool moe_st_is_checkpoint(const char *path);
const char *moe_st_dir(const moe_st *s); /* the checkpoint's directory (config.json lives there) */
uint32_t moe_st_n_files(const moe_st *s);
const moe_st_file *moe_st_file_get(const moe_st *s, uint32_t i);
uint64_t moe_st_n_tensors(const moe_st *s);
const moe_st_tensor *moe_st_tensor_get(const moe_st *s, uint64_t i);
const moe_st_tensor *moe_st_tensor_find(const moe_st *s, const char *name);
/* Drop the mapped pages wholly inside t's bytes from this process (the page cache keeps them,
 * a later read maps them again): a tool that streams a checkpoint tensor by tensor stays at one
 * tensor's worth of resident memory. t->data stays valid. */
void moe_st_tensor_release(const moe_st *s, const moe_st_tensor *t);
/* __metadata__ of the first file, in header order. */
size_t moe_st_n_meta(const moe_st *s);
const char *moe_st_meta_key(const moe_st *s, size_t i);
const char *moe_st_meta_value(const moe_st *s, size_t i);
const char *moe_st_meta_find(const moe_st *s, const char *key);
/* Values [first, first + n) of t (row-major) as f32: floats and ints of every dtype. */
moe_status moe_st_to_f32(const moe_st_tensor *t, uint64_t first, uint64_t n, float *out,
                         moe_error *err);
/* A 2-D F8_E4M3 weight times its block scales (DeepSeek-style weight_scale_inv, one per
 * block_rows x block_cols block, shape [ceil(rows / br), ceil(cols / bc)]) into out[rows * cols].
 */
moe_status moe_st_dequant_fp8_blocks(const moe_st_tensor *w, const moe_st_tensor *scale_inv,
                                     int64_t block_rows, int64_t block_cols, float *out,
                                     moe_error *err);

/* ==== compressed-tensors W4A16 (safetensors.c) ====
 *
 * A quantized linear module M is three tensors: M.weight_packed (I32 [rows, cols / 8]: int4
 * levels + 8, value k of a row in word k / 8 at bits 4 * (k % 8)), M.weight_scale (bf16
 * [rows, cols / 32], one scale per group of 32 along the row) and M.weight_shape ([rows, cols],
 * I64 as compressed-tensors writes it; I32 accepted). w = scale x level. */
typedef struct moe_w4a16_module {
    const moe_st_tensor *packed, *scale, *shape;
    int64_t rows, cols;
} moe_w4a16_module;

/* The module's tensors, checked to fit each other (group size 32). */
moe_status moe_w4a16_module_find(const moe_st *s, const char *module, moe_w4a16_module *m,
                                 moe_error *err);
/* Rows [r0, r1) as f32: out[(r - r0) * cols + c]. */
moe_status moe_w4a16_dequant_rows(const moe_w4a16_module *m, int64_t r0, int64_t r1, float *out,
                                  moe_error *err);
/* DIR/config.json's quantization_config: every config group compressed-tensors
 * pack-quantized, 4 bits, symmetric, group_size 32 (what moe reads); else why not. */
moe_status moe_w4a16_config_check(const char *dir, moe_error *err);

/* The writer streams: declare every tensor (in data order), begin (writes the header), write
 * the tensors' bytes in that order in any chunks, finish (checks the byte count). The header is
 * padded with spaces to a multiple of 8, as the reference writer does. */
typedef struct moe_st_writer moe_st_writer;
moe_st_writer *moe_st_writer_new(void);
void moe_st_writer_free(moe_st_writer *w);
void moe_st_writer_set_meta(moe_st_writer *w, const char *key, const char *value);
moe_status moe_st_writer_declare(moe_st_writer *w, const char *name, moe_st_dtype dtype,
                                 uint32_t n_dims, const int64_t *shape, moe_error *err);
moe_status moe_st_writer_begin(moe_st_writer *w, const char *path, moe_error *err);
moe_status moe_st_writer_write(moe_st_writer *w, const void *data, size_t n, moe_error *err);
moe_status moe_st_writer_finish(moe_st_writer *w, moe_error *err);
/* Data bytes still to write (before begin: all the declared tensors'). */
uint64_t moe_st_writer_remaining(const moe_st_writer *w);

/* ==== Hugging Face checkpoints read as GGUF (hf.c) ====
 *
 * What llama.cpp's converter would make of a checkpoint directory (config.json, safetensors,
 * tokenizer files): its metadata keys, tensor names and tensor edits, for gemma4, llama,
 * qwen3moe and qwen35 (moe_hf_open; the functions below are gemma4's, what moe repack uses). moe
 * repack writes them to a file; moe_hf_open serves them to the engine as a model in memory. config
 * objects are jansson's (json_t). */
struct json_t;
/* DIR/config.json, parsed (json_decref it); NULL with err set when absent or not an object. */
struct json_t *moe_hf_read_config(const char *dir, moe_error *err);
/* model_type of the text model (text_config's in a multimodal config); NULL when absent. */
const char *moe_hf_model_type(struct json_t *config);
/* The GGUF name of a gemma4 HF tensor into out: 0 when mapped, 1 when it belongs to the vision /
 * audio towers (the converter writes those to an mmproj file), -1 when unknown. */
int moe_hf_gguf_name(const char *hf, char *out, size_t cap);
/* The converter's general.* and gemma4.* keys from config; path is the checkpoint directory
 * (general.name is its last component, as the converter takes it). */
moe_status moe_hf_write_metadata(moe_gguf_writer *w, struct json_t *config, const char *path,
                                 moe_error *err);
/* tokenizer.chat_template (and tokenizer.chat_template.NAME) from DIR/chat_template.jinja or
 * tokenizer_config.json's chat_template, when there is one. */
void moe_hf_write_chat_template(moe_gguf_writer *w, const char *dir);
/* rope_freqs.weight as the converter makes it (n values; free() it); NULL when the config has
 * no global_head_dim. */
float *moe_hf_rope_freqs(struct json_t *config, int64_t *n);
/* Rows of embed_tokens the converter keeps: tokenizer.json's vocab + added tokens; -1 when it
 * cannot be told (no tokenizer.json, or a tokenizer.model). */
int64_t moe_hf_vocab_rows(const char *dir);
/* The converter's GGUF type for a tensor copied as it is: 1-D, norms and the router as F32,
 * the rest in the source dtype; false when the dtype has no GGUF type. */
bool moe_hf_copy_type(const moe_st_tensor *t, const char *gguf_name, moe_type *out);
/* The checkpoint at path (a directory or its index / .safetensors) as a model in memory: keys,
 * tokenizer keys (tokenizer.huggingface.json, tokenizer.huggingface.config,
 * tokenizer.chat_template) and tensors; W4A16 modules become Q4_0 exactly (F32 where a scale
 * is not an f16 number). keys_only: the keys alone, no tensors read. */
moe_gguf *moe_hf_open(const char *path, bool keys_only, moe_error *err);
/* A GGUF file, or a checkpoint (moe_st_is_checkpoint) through moe_hf_open. */
moe_gguf *moe_gguf_open_model(const char *path, moe_error *err);

#endif
