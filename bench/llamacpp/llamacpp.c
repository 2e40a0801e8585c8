/* llama.cpp side by side with `moe bench`: the same tests (pp N, tg N, batched decode of S
 * streams) on the same GGUF, run through llama.cpp's C API, as llama-bench and
 * llama-batched-bench would run them.
 *
 * llama.cpp is not packaged in Debian; the build used is the prebuilt one in npm's
 * @node-llama-cpp/linux-x64 (bench/llamacpp/package-lock.json pins it): libllama, libggml and
 * one libggml-cpu-<variant>.so per x86 level, the best for this CPU chosen at run time. We link
 * the shared libraries directly instead of going through node-llama-cpp's JavaScript API, so
 * the batch of every step is ours (one llama_decode of exactly the rows moe decodes) and no
 * scheduler or sampler sits between the timer and the forward pass.
 *
 * The trap: the package ships no llama.h. The few structs this file passes by value are
 * declared below from the library's own llama_context_default_params() /
 * llama_model_default_params() (their layout read from the disassembly), and check_layout()
 * refuses to run when the defaults the library returns are not at those offsets, so another
 * build fails with a message instead of reading garbage.
 *
 * --parity runs a parity fixture from ../shared/parity the way its reference was made (the
 * fixture's README: teacher forcing, 1 thread, f32 KV, no flash attention, no repacking) and
 * compares with its .logits.f32 (llama.cpp's, at commit 3f545becc), then once more with the
 * benchmark's settings: it shows that this build computes what llama.cpp computes. */

#include <dlfcn.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ==== The library's C API, as far as we use it ==== */

struct llama_model;
struct llama_context;
struct llama_vocab;
struct llama_memory_i;

enum { GGML_LOG_LEVEL_INFO = 2, GGML_LOG_LEVEL_WARN = 3, GGML_LOG_LEVEL_ERROR = 4 };
enum { GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1 };
enum { FLASH_ATTN_AUTO = -1, FLASH_ATTN_DISABLED = 0, FLASH_ATTN_ENABLED = 1 };

typedef struct llama_batch {
    int32_t n_tokens;
    int32_t *token;    /* [n_tokens] */
    float *embd;       /* unused (NULL): we feed token ids */
    int32_t *pos;      /* [n_tokens] */
    int32_t *n_seq_id; /* [n_tokens] */
    int32_t **seq_id;  /* [n_tokens][n_seq_max] */
    int8_t *logits;    /* [n_tokens]: 1 = output this row's logits */
} llama_batch;

/* llama_context_params as this build lays it out (0xa0 bytes). Fields we never set are named by
 * their offset. */
typedef struct llama_context_params {
    uint32_t n_ctx, n_batch, n_ubatch, n_seq_max;
    uint32_t n_rs_seq, n_outputs_max;
    int32_t field_0x18; /* default 1: not in the llama.h we could read */
    int32_t n_threads, n_threads_batch;
    int32_t ctx_type, rope_scaling_type, pooling_type, attention_type;
    int32_t flash_attn_type; /* FLASH_ATTN_* */
    float rope_freq_base, rope_freq_scale, yarn_ext_factor, yarn_attn_factor;
    float yarn_beta_fast, yarn_beta_slow;
    uint32_t yarn_orig_ctx;
    float defrag_thold;
    void *cb_eval, *cb_eval_user_data;
    int32_t type_k, type_v; /* GGML_TYPE_* of the KV cache */
    void *abort_callback, *abort_callback_data;
    bool embeddings, offload_kqv, no_perf, op_offload, swa_full, kv_unified;
    void *samplers;
    size_t n_samplers;
    uint64_t field_0x98;
} llama_context_params;
_Static_assert(offsetof(llama_context_params, n_threads) == 0x1c, "layout");
_Static_assert(offsetof(llama_context_params, flash_attn_type) == 0x34, "layout");
_Static_assert(offsetof(llama_context_params, defrag_thold) == 0x54, "layout");
_Static_assert(offsetof(llama_context_params, type_k) == 0x68, "layout");
_Static_assert(offsetof(llama_context_params, embeddings) == 0x80, "layout");
_Static_assert(sizeof(llama_context_params) == 0xa0, "layout");

/* llama_model_params as this build lays it out (0x50 bytes): kept opaque, two fields named. */
typedef struct llama_model_params {
    unsigned char bytes[0x50];
} llama_model_params;
enum {
    MODEL_PARAMS_N_GPU_LAYERS = 0x10,    /* int32, default -1 */
    MODEL_PARAMS_LOAD_MODE = 0x1c,       /* int32, default 1 (mmap) */
    MODEL_PARAMS_USE_EXTRA_BUFTS = 0x4a, /* bool, default true: CPU weight repacking */
};

void llama_backend_init(void);
llama_model_params llama_model_default_params(void);
llama_context_params llama_context_default_params(void);
struct llama_model *llama_model_load_from_file(const char *path, llama_model_params params);
struct llama_context *llama_init_from_model(struct llama_model *model, llama_context_params p);
void llama_model_free(struct llama_model *model);
void llama_free(struct llama_context *ctx);
const struct llama_vocab *llama_model_get_vocab(const struct llama_model *model);
int32_t llama_vocab_n_tokens(const struct llama_vocab *vocab);
int32_t llama_model_desc(const struct llama_model *model, char *buf, size_t size);
uint64_t llama_model_size(const struct llama_model *model);
struct llama_memory_i *llama_get_memory(const struct llama_context *ctx);
void llama_memory_clear(struct llama_memory_i *mem, bool data);
bool llama_memory_seq_rm(struct llama_memory_i *mem, int32_t seq, int32_t p0, int32_t p1);
llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(llama_batch batch);
int32_t llama_decode(struct llama_context *ctx, llama_batch batch);
void llama_synchronize(struct llama_context *ctx);
float *llama_get_logits_ith(struct llama_context *ctx, int32_t i);
void llama_log_set(void (*cb)(int level, const char *text, void *user), void *user);
void ggml_backend_load_all_from_path(const char *dir);
void llama_attach_threadpool(struct llama_context *ctx, void *threadpool, void *threadpool_batch);

/* ggml_threadpool_params (528 bytes), as ggml_threadpool_params_default() fills it */
typedef struct ggml_threadpool_params {
    bool cpumask[512]; /* GGML_MAX_N_THREADS */
    int32_t n_threads;
    int32_t prio;
    uint32_t poll; /* 0..100: how long a worker spins before it sleeps; default 50 */
    bool strict_cpu, paused;
} ggml_threadpool_params;
_Static_assert(offsetof(ggml_threadpool_params, poll) == 520, "layout");
_Static_assert(sizeof(ggml_threadpool_params) == 528, "layout");
ggml_threadpool_params ggml_threadpool_params_default(int n_threads);
void *ggml_backend_dev_by_type(int type); /* 0: CPU */
void *ggml_backend_dev_backend_reg(void *dev);
void *ggml_backend_reg_get_proc_address(void *reg, const char *name);
const char *ggml_version(void);
extern const char *LLAMA_COMMIT; /* libllama-common */

/* ==== Log capture: the CPU variant loaded, flash attention's resolution, errors ==== */

enum { LOG_KEEP = 8192 };
static struct {
    bool verbose;
    char variant[256]; /* the libggml-cpu-*.so loaded */
    char flash[128];   /* the last context's flash attention resolution */
    char buffers[512]; /* the last load's model buffers: "AMX 0.55 MiB, CPU_Mapped 1.50 MiB" */
    char errors[LOG_KEEP];
    char line[1024]; /* a message arrives in pieces; lines are judged whole */
} g_log;

static void log_line(int level, const char *line) {
    const char *p = strstr(line, "loaded CPU backend from ");
    if (p) {
        const char *base = strrchr(p, '/');
        snprintf(g_log.variant, sizeof g_log.variant, "%s", base ? base + 1 : p + 24);
        g_log.variant[strcspn(g_log.variant, "\n")] = 0;
    }
    if ((p = strstr(line, "Flash Attention "))) { /* "Flash Attention enabled" */
        snprintf(g_log.flash, sizeof g_log.flash, "%s", p + 16);
        g_log.flash[strcspn(g_log.flash, "\n")] = 0;
    }
    char kind[64];
    double mib;
    if (sscanf(line, "load_tensors: %63s model buffer size = %lf MiB", kind, &mib) == 2) {
        const size_t n = strlen(g_log.buffers);
        snprintf(g_log.buffers + n, sizeof g_log.buffers - n, "%s%s %.2f MiB", n ? ", " : "", kind,
                 mib);
    }
    if (level >= GGML_LOG_LEVEL_WARN) {
        const size_t n = strlen(g_log.errors);
        snprintf(g_log.errors + n, sizeof g_log.errors - n, "%s", line);
    }
    if (g_log.verbose) fputs(line, stderr);
}

static void on_log(int level, const char *text, void *user) {
    (void)user;
    static int line_level = GGML_LOG_LEVEL_INFO;
    if (level <= GGML_LOG_LEVEL_ERROR) line_level = level; /* 5 = continuation of the last */
    size_t n = strlen(g_log.line);
    snprintf(g_log.line + n, sizeof g_log.line - n, "%s", text);
    n = strlen(g_log.line);
    if (n && (g_log.line[n - 1] == '\n' || n + 1 == sizeof g_log.line)) {
        log_line(line_level, g_log.line);
        g_log.line[0] = 0;
    }
}

/* ==== Helpers ==== */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("llamacpp-bench: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (!p) fail("out of memory (%zu x %zu bytes)", n, size);
    return p;
}

/* Refuse a library whose defaults are not where our declarations put them. */
static void check_layout(void) {
    const llama_context_params c = llama_context_default_params();
    const bool ctx_ok = c.n_ctx == 512 && c.n_batch == 2048 && c.n_ubatch == 512 &&
                        c.n_seq_max == 1 && c.n_threads > 0 && c.n_threads == c.n_threads_batch &&
                        c.flash_attn_type == FLASH_ATTN_AUTO && c.defrag_thold == -1.0f &&
                        c.type_k == GGML_TYPE_F16 && c.type_v == GGML_TYPE_F16 && !c.embeddings &&
                        c.offload_kqv && c.samplers == NULL && c.n_samplers == 0;
    const llama_model_params m = llama_model_default_params();
    int32_t n_gpu_layers, load_mode;
    memcpy(&n_gpu_layers, m.bytes + MODEL_PARAMS_N_GPU_LAYERS, 4);
    memcpy(&load_mode, m.bytes + MODEL_PARAMS_LOAD_MODE, 4);
    const bool model_ok =
        n_gpu_layers == -1 && load_mode == 1 && m.bytes[MODEL_PARAMS_USE_EXTRA_BUFTS] == 1;
    if (!ctx_ok || !model_ok)
        fail("this libllama's %s defaults are not at the offsets this harness was written for "
             "(@node-llama-cpp/linux-x64 3.22.1, llama.cpp 0ad4a86): re-derive the structs at the "
             "top of bench/llamacpp/llamacpp.c",
             ctx_ok ? "llama_model_params" : "llama_context_params");
}

/* The directory the libraries were loaded from: the CPU variants are loaded from there. */
static void lib_dir(char *dir, size_t size) {
    Dl_info info;
    if (!dladdr((void *)llama_decode, &info) || !info.dli_fname)
        fail("cannot locate libllama (dladdr)");
    snprintf(dir, size, "%s", info.dli_fname);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = 0;
    else
        snprintf(dir, size, ".");
}

/* "<package version>, llama.cpp release <tag>" from the npm package next to the libraries. */
static void package_info(const char *dir, char *out, size_t size) {
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/../../package.json", dir);
    json_t *pkg = json_load_file(path, 0, NULL);
    snprintf(path, sizeof path, "%s/_nlcBuildMetadata.json", dir);
    json_t *meta = json_load_file(path, 0, NULL);
    const char *name = json_string_value(json_object_get(pkg, "name"));
    const char *version = json_string_value(json_object_get(pkg, "version"));
    const char *release = json_string_value(json_object_get(
        json_object_get(json_object_get(meta, "buildOptions"), "llamaCpp"), "release"));
    snprintf(out, size, "%s %s, release tag %s", name ? name : "?", version ? version : "?",
             release ? release : "?");
    json_decref(pkg);
    json_decref(meta);
}

/* ==== Options ==== */

enum { MAX_RUNS = 64, MAX_STREAMS = 16, MAX_DEPTHS = 8, FILL_ROWS = 512 };

typedef struct options {
    const char *model;
    int threads, runs, pp, tg, stream_steps, ubatch, poll;
    int streams[MAX_STREAMS], n_streams;
    int depths[MAX_DEPTHS], n_depths; /* ascending, each > 0 */
    int flash;                        /* FLASH_ATTN_* */
    bool repack, csv, parity;
    const char *out; /* --parity: the KV f16 run's logits, float32 [rows][n_vocab] */
} options;

static void usage(FILE *f) {
    fprintf(f,
            "usage: llamacpp-bench MODEL [-t N] [--runs N] [--pp N] [--tg N] [--streams 1,8]\n"
            "                      [--depth 4096,16384] [--stream-steps N] [--ubatch N]\n"
            "                      [--fa on|off|auto] [--no-repack] [--csv] [-v]\n"
            "   or: llamacpp-bench FIXTURE.gguf --parity [-t N] [--fa on|off|auto] [--no-repack]\n"
            "                      [--out FILE.f32] [-v]\n\n"
            "llama.cpp (the prebuilt libraries of npm's @node-llama-cpp/linux-x64) on MODEL, the\n"
            "tests of `moe bench`: pp N is one llama_decode of N prompt tokens (llama.cpp splits\n"
            "it in --ubatch rows), tg N is N one-token steps, streams S is S sequences decoding\n"
            "one token each per step for --stream-steps steps (tok/s of all S, like\n"
            "llama-batched-bench's S_TG). Each test: a warm-up run, then --runs runs from an\n"
            "empty KV cache (f16); median and range. Random token ids.\n\n"
            "  -t N              threads (n_threads = n_threads_batch; default 2)\n"
            "  --runs N          timed runs per test (default 5)\n"
            "  --pp N            prompt tokens (default 512; 0 skips)\n"
            "  --tg N            decode steps (default 128; 0 skips)\n"
            "  --streams LIST    stream counts (default 8; 0 skips)\n"
            "  --depth LIST      pp N and tg N again after that many tokens of context, as\n"
            "                    moe bench --depth (ascending; the context is filled once per\n"
            "                    depth, untimed, 512 rows a decode; each run starts from it)\n"
            "  --stream-steps N  steps per streams test (default 32, as moe bench)\n"
            "  --ubatch N        llama.cpp's n_ubatch (default 512, llama-bench's)\n"
            "  --fa on|off|auto  flash attention (default auto, llama-bench's)\n"
            "  --poll 0..100     threadpool polling before a worker sleeps (default 50,\n"
            "                    llama-bench's; spinning workers stall when cores are busy)\n"
            "  --no-repack       no CPU weight repacking (use_extra_bufts = false)\n"
            "  --csv             test,streams,tok_s,tok_s_min,tok_s_max,per_stream_tok_s,...\n"
            "  --parity          FIXTURE from ../shared/parity: teacher-forced logits against\n"
            "                    its .logits.f32 with the fixture's settings (1 thread, KV f32,\n"
            "                    no flash attention, no repacking: every row's argmax must be\n"
            "                    the fixture's), then with -t/--fa/repack and KV f16 (reported:\n"
            "                    flash attention and f16 KV round to f16)\n"
            "  --out FILE.f32    --parity: the KV f16 run's logits, float32 [rows][vocab]\n"
            "  -v                llama.cpp's own log on stderr\n");
}

static int parse_int(const char *opt, const char *s, int lo, int hi) {
    char *end;
    errno = 0;
    const long v = s ? strtol(s, &end, 10) : 0;
    if (!s || errno || *end || end == s || v < lo || v > hi)
        fail("%s: expected an integer in [%d, %d], got '%s'", opt, lo, hi, s ? s : "");
    return (int)v;
}

/* A comma-separated list of counts in [lo, hi] into out (zeros skipped); their number. */
static int parse_list(const char *opt, const char *v, int lo, int hi, int *out, int max) {
    if (!v) fail("%s: expected a list such as 1,2,4,8", opt);
    char buf[256], *save = NULL;
    snprintf(buf, sizeof buf, "%s", v);
    int n = 0;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        const int x = parse_int(opt, t, lo, hi);
        if (x == 0) continue;
        if (n == max) fail("%s: at most %d counts", opt, max);
        out[n++] = x;
    }
    return n;
}

static options parse_args(int argc, char **argv) {
    options o = {.threads = 2,
                 .runs = 5,
                 .pp = 512,
                 .tg = 128,
                 .stream_steps = 32,
                 .ubatch = 512,
                 .poll = 50,
                 .streams = {8},
                 .n_streams = 1,
                 .flash = FLASH_ATTN_AUTO,
                 .repack = true};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help"))
            usage(stdout), exit(0);
        else if (!strcmp(a, "-v"))
            g_log.verbose = true;
        else if (!strcmp(a, "--csv"))
            o.csv = true;
        else if (!strcmp(a, "--parity"))
            o.parity = true;
        else if (!strcmp(a, "--no-repack"))
            o.repack = false;
        else if (!strcmp(a, "--out"))
            o.out = v, i++;
        else if (!strcmp(a, "-t") || !strcmp(a, "--threads"))
            o.threads = parse_int(a, v, 1, 1024), i++;
        else if (!strcmp(a, "--runs"))
            o.runs = parse_int(a, v, 1, MAX_RUNS), i++;
        else if (!strcmp(a, "--pp"))
            o.pp = parse_int(a, v, 0, 1 << 16), i++;
        else if (!strcmp(a, "--tg"))
            o.tg = parse_int(a, v, 0, 1 << 16), i++;
        else if (!strcmp(a, "--stream-steps"))
            o.stream_steps = parse_int(a, v, 1, 1 << 16), i++;
        else if (!strcmp(a, "--ubatch"))
            o.ubatch = parse_int(a, v, 1, 1 << 16), i++;
        else if (!strcmp(a, "--poll"))
            o.poll = parse_int(a, v, 0, 100), i++;
        else if (!strcmp(a, "--fa")) {
            if (v && !strcmp(v, "on"))
                o.flash = FLASH_ATTN_ENABLED;
            else if (v && !strcmp(v, "off"))
                o.flash = FLASH_ATTN_DISABLED;
            else if (v && !strcmp(v, "auto"))
                o.flash = FLASH_ATTN_AUTO;
            else
                fail("--fa: expected on, off or auto, got '%s'", v ? v : "");
            i++;
        } else if (!strcmp(a, "--streams"))
            o.n_streams = parse_list(a, v, 0, 256, o.streams, MAX_STREAMS), i++;
        else if (!strcmp(a, "--depth")) {
            o.n_depths = parse_list(a, v, 0, 1 << 20, o.depths, MAX_DEPTHS), i++;
            for (int d = 1; d < o.n_depths; d++)
                if (o.depths[d] <= o.depths[d - 1])
                    fail("--depth: the depths must ascend, got '%s'", v);
        } else if (a[0] == '-')
            fail("unknown option '%s' (--help lists them)", a);
        else if (!o.model)
            o.model = a;
        else
            fail("one MODEL only (got '%s' and '%s')", o.model, a);
    }
    if (!o.model) usage(stderr), exit(2);
    return o;
}

/* ==== Model and contexts ==== */

static struct llama_model *load_model(const char *path, bool repack) {
    llama_model_params mp = llama_model_default_params();
    mp.bytes[MODEL_PARAMS_USE_EXTRA_BUFTS] = repack;
    g_log.errors[0] = g_log.buffers[0] = 0;
    struct llama_model *m = llama_model_load_from_file(path, mp);
    if (!m)
        fail("llama.cpp refused %s; its log said:\n%s", path,
             g_log.errors[0] ? g_log.errors : "(nothing: run with -v)");
    return m;
}

static struct llama_context *new_context(struct llama_model *m, uint32_t n_ctx, uint32_t n_batch,
                                         uint32_t n_ubatch, uint32_t n_seq, int threads, int flash,
                                         int kv_type) {
    llama_context_params c = llama_context_default_params();
    c.n_ctx = n_ctx;
    c.n_batch = n_batch;
    c.n_ubatch = n_ubatch < n_batch ? n_ubatch : n_batch;
    c.n_seq_max = n_seq;
    c.n_threads = c.n_threads_batch = threads;
    c.flash_attn_type = flash;
    c.type_k = c.type_v = kv_type;
    c.no_perf = true;
    g_log.errors[0] = 0;
    struct llama_context *ctx = llama_init_from_model(m, c);
    if (!ctx)
        fail("llama.cpp could not make a context (n_ctx %u, n_seq %u); its log said:\n%s", n_ctx,
             n_seq, g_log.errors[0] ? g_log.errors : "(nothing: run with -v)");
    return ctx;
}

static void decode(struct llama_context *ctx, llama_batch *b) {
    const int32_t rc = llama_decode(ctx, *b);
    if (rc != 0) fail("llama_decode of %d rows returned %d", b->n_tokens, rc);
}

static void batch_add(llama_batch *b, int32_t token, int32_t pos, int32_t seq, bool logits) {
    const int32_t i = b->n_tokens++;
    b->token[i] = token;
    b->pos[i] = pos;
    b->n_seq_id[i] = 1;
    b->seq_id[i][0] = seq;
    b->logits[i] = logits;
}

/* ==== Benchmark ==== */

typedef struct test {
    const char *name; /* "pp", "tg", "streams" */
    int n;            /* prompt tokens, steps, or streams */
    int depth;        /* tokens of sequence 0 in the cache before the test (pp and tg) */
    double median, lo, hi;
} test;

static uint64_t g_seed = 0x5eed;
static int32_t next_token(int32_t n_vocab) {
    g_seed = g_seed * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((g_seed >> 33) % (uint64_t)n_vocab);
}

/* `depth` random tokens of sequence 0 into an empty cache, FILL_ROWS a decode. */
static void fill(struct llama_context *ctx, llama_batch *b, int32_t n_vocab, int depth) {
    llama_memory_clear(llama_get_memory(ctx), true);
    for (int p0 = 0; p0 < depth; p0 += FILL_ROWS) {
        const int n = depth - p0 < FILL_ROWS ? depth - p0 : FILL_ROWS;
        b->n_tokens = 0;
        for (int i = 0; i < n; i++) batch_add(b, next_token(n_vocab), p0 + i, 0, i + 1 == n);
        decode(ctx, b);
    }
    llama_synchronize(ctx);
}

/* One run from the first `depth` positions of the cache (the rest dropped): `prompt` rows of
 * sequence 0 in one llama_decode, or `steps` decodes of one row per sequence; seconds from the
 * first decode to the last synchronize. */
static double run_once(struct llama_context *ctx, llama_batch *b, int32_t n_vocab, int depth,
                       int prompt, int n_seq, int steps) {
    struct llama_memory_i *mem = llama_get_memory(ctx);
    if (!depth)
        llama_memory_clear(mem, true);
    else if (!llama_memory_seq_rm(mem, 0, depth, -1))
        fail("llama.cpp could not drop positions from %d of the filled context", depth);
    const double t0 = now_s();
    if (prompt) {
        b->n_tokens = 0;
        for (int i = 0; i < prompt; i++)
            batch_add(b, next_token(n_vocab), depth + i, 0, i + 1 == prompt);
        decode(ctx, b);
    }
    for (int step = 0; step < steps; step++) {
        b->n_tokens = 0;
        for (int s = 0; s < n_seq; s++) batch_add(b, next_token(n_vocab), depth + step, s, true);
        decode(ctx, b);
    }
    llama_synchronize(ctx);
    return now_s() - t0;
}

/* A fresh ggml threadpool per test, as llama-bench makes one (its default poll, 50); without
 * one, ggml starts and joins its threads on every llama_decode. ggml_threadpool_new lives in the
 * CPU variant loaded at run time: the backend registry hands it out. */
typedef void *(*threadpool_new_fn)(ggml_threadpool_params *params);
typedef void (*threadpool_free_fn)(void *threadpool);

static void *cpu_proc(const char *name) {
    void *dev = ggml_backend_dev_by_type(0);
    void *fn =
        dev ? ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), name) : NULL;
    if (!fn) fail("the CPU backend does not export %s", name);
    return fn;
}

/* A test's shape: sequences, decode steps, rows per llama_decode, positions per sequence. */
typedef struct shape {
    int n_seq, steps, rows;
    uint32_t per_seq;
} shape;

static shape shape_of(const options *o, const test *t) {
    const bool pp = !strcmp(t->name, "pp");
    shape s = {.n_seq = !strcmp(t->name, "streams") ? t->n : 1};
    s.steps = pp ? 0 : !strcmp(t->name, "tg") ? t->n : o->stream_steps;
    s.rows = pp ? t->n : s.n_seq;
    s.per_seq = (uint32_t)(pp ? t->n : s.steps);
    return s;
}

/* Tests t[0..n) of one depth in one context (filled once when the depth is not 0). */
static void run_tests(struct llama_model *m, const options *o, test *t, int n) {
    const int depth = t[0].depth;
    uint32_t n_ctx = 0;
    int n_seq = 1, rows = depth ? FILL_ROWS : 1;
    for (int i = 0; i < n; i++) {
        const shape s = shape_of(o, &t[i]);
        const uint32_t need = (uint32_t)depth + s.per_seq * (uint32_t)s.n_seq;
        n_ctx = need > n_ctx ? need : n_ctx;
        n_seq = s.n_seq > n_seq ? s.n_seq : n_seq;
        rows = s.rows > rows ? s.rows : rows;
    }
    struct llama_context *ctx = new_context(m, n_ctx, (uint32_t)rows, (uint32_t)o->ubatch,
                                            (uint32_t)n_seq, o->threads, o->flash, GGML_TYPE_F16);
    ggml_threadpool_params tpp = ggml_threadpool_params_default(o->threads);
    if (tpp.n_threads != o->threads || tpp.poll != 50)
        fail("ggml_threadpool_params is not laid out as this harness expects");
    tpp.poll = (uint32_t)o->poll;
    void *pool = ((threadpool_new_fn)cpu_proc("ggml_threadpool_new"))(&tpp);
    if (!pool) fail("ggml_threadpool_new(%d threads) failed", o->threads);
    llama_attach_threadpool(ctx, pool, NULL);
    llama_batch b = llama_batch_init(rows, 0, n_seq);
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(m));
    if (depth) fill(ctx, &b, n_vocab, depth);
    for (int k = 0; k < n; k++) {
        const shape s = shape_of(o, &t[k]);
        const bool pp = !s.steps;
        double tok_s[MAX_RUNS];
        const double tokens = pp ? t[k].n : (double)s.n_seq * s.steps;
        for (int i = -1; i < o->runs; i++) { /* -1: the warm-up */
            const double sec = run_once(ctx, &b, n_vocab, depth, pp ? t[k].n : 0, s.n_seq, s.steps);
            if (i >= 0) tok_s[i] = tokens / sec;
        }
        qsort(tok_s, (size_t)o->runs, sizeof *tok_s, cmp_double);
        t[k].lo = tok_s[0];
        t[k].hi = tok_s[o->runs - 1];
        t[k].median =
            o->runs % 2 ? tok_s[o->runs / 2] : 0.5 * (tok_s[o->runs / 2 - 1] + tok_s[o->runs / 2]);
    }
    llama_batch_free(b);
    llama_free(ctx);
    ((threadpool_free_fn)cpu_proc("ggml_threadpool_free"))(pool);
}

static const char *flash_name(int flash) {
    return flash == FLASH_ATTN_ENABLED ? "on" : flash == FLASH_ATTN_DISABLED ? "off" : "auto";
}

/* "pp512", "tg128@d4096", "streams 8" ("streams" in the CSV, whose next column counts them) */
static void test_label(const test *t, bool csv, char *out, size_t size) {
    if (!strcmp(t->name, "streams"))
        snprintf(out, size, csv ? "%s" : "%s %d", t->name, t->n);
    else if (t->depth)
        snprintf(out, size, "%s%d@d%d", t->name, t->n, t->depth);
    else
        snprintf(out, size, "%s%d", t->name, t->n);
}

static int bench(const options *o, const char *build) {
    const double t0 = now_s();
    struct llama_model *m = load_model(o->model, o->repack);
    const double load_s = now_s() - t0;
    char desc[128];
    llama_model_desc(m, desc, sizeof desc);
    test tests[2 * (1 + MAX_DEPTHS) + MAX_STREAMS]; /* moe bench's order */
    int n = 0;
    for (int d = -1; d < o->n_depths; d++) { /* -1: depth 0, a context per test */
        const int depth = d < 0 ? 0 : o->depths[d], first = n;
        if (o->pp) tests[n++] = (test){.name = "pp", .n = o->pp, .depth = depth};
        if (o->tg) tests[n++] = (test){.name = "tg", .n = o->tg, .depth = depth};
        if (depth)
            run_tests(m, o, &tests[first], n - first);
        else
            for (int i = first; i < n; i++) run_tests(m, o, &tests[i], 1);
    }
    for (int i = 0; i < o->n_streams; i++) {
        tests[n] = (test){.name = "streams", .n = o->streams[i]};
        run_tests(m, o, &tests[n++], 1);
    }
    char flash[160]; /* as asked, and as the last context resolved it */
    snprintf(flash, sizeof flash, "fa %s (%s)", flash_name(o->flash),
             g_log.flash[0] ? g_log.flash : "resolution not logged");
    const char *cpu = g_log.variant[0] ? g_log.variant : "?";
    if (o->csv) {
        printf("test,streams,tok_s,tok_s_min,tok_s_max,per_stream_tok_s,engine,cpu_variant,"
               "threads,runs,flash_attn,kv_type,repack\n");
        for (int i = 0; i < n; i++) {
            const test *t = &tests[i];
            const bool streams = !strcmp(t->name, "streams");
            char label[48];
            test_label(t, true, label, sizeof label);
            printf("%s,%d,%.3f,%.3f,%.3f,%.3f,llama.cpp %s,%s,%d,%d,%s,f16,%d\n", label,
                   streams ? t->n : 1, t->median, t->lo, t->hi,
                   streams ? t->median / t->n : t->median, LLAMA_COMMIT, cpu, o->threads, o->runs,
                   flash_name(o->flash), o->repack);
        }
    } else {
        printf("llama.cpp %s (ggml %s; %s), CPU backend %s\n", LLAMA_COMMIT, ggml_version(), build,
               cpu);
        printf("model: %s, %s (%.2f GB, loaded in %.1f s; buffers: %s)\n", o->model, desc,
               (double)llama_model_size(m) / 1e9, load_s, g_log.buffers);
        printf("%d threads (threadpool poll %d), %s, KV f16, n_ubatch %d, repack %s, %d runs "
               "after a warm-up\n",
               o->threads, o->poll, flash, o->ubatch, o->repack ? "on" : "off", o->runs);
        printf("%-16s %10s %19s %11s  engine, threads  [llama.cpp %s, %s, %d threads]\n", "test",
               "tok/s", "range", "per stream", LLAMA_COMMIT, cpu, o->threads);
        for (int i = 0; i < n; i++) {
            const test *t = &tests[i];
            const bool streams = !strcmp(t->name, "streams");
            char label[48], per[32] = "";
            test_label(t, false, label, sizeof label);
            if (streams) snprintf(per, sizeof per, "%.2f", t->median / t->n);
            printf("%-16s %10.2f %8.2f - %8.2f %11s  llama.cpp %s, %d\n", label, t->median, t->lo,
                   t->hi, per, LLAMA_COMMIT, o->threads);
        }
    }
    llama_model_free(m);
    return 0;
}

/* ==== Parity against a fixture's llama.cpp logits ==== */

typedef struct fixture {
    int32_t *tokens; /* [n] all_tokens: the prompt, then the recorded greedy ids */
    int n, n_prompt;
    float *logits; /* [n][n_vocab] llama.cpp's, row r after feeding tokens[r] */
    int n_vocab;
} fixture;

static fixture load_fixture(const char *gguf) {
    fixture f = {0};
    const size_t len = strlen(gguf);
    if (len < 6 || strcmp(gguf + len - 5, ".gguf"))
        fail("--parity: %s: expected a fixture's .gguf (its .tokens.json and .logits.f32 beside)",
             gguf);
    char path[PATH_MAX + 64];
    json_error_t jerr;
    snprintf(path, sizeof path, "%.*s.tokens.json", (int)(len - 5), gguf);
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) fail("--parity: %s: %s (line %d)", path, jerr.text, jerr.line);
    const json_t *all = json_object_get(root, "all_tokens"),
                 *prompt = json_object_get(root, "prompt");
    if (!json_is_array(all) || !json_is_array(prompt) || json_array_size(all) == 0 ||
        json_array_size(prompt) > json_array_size(all))
        fail("--parity: %s: expected arrays 'all_tokens' and 'prompt'", path);
    f.n = (int)json_array_size(all);
    f.n_prompt = (int)json_array_size(prompt);
    f.tokens = xcalloc((size_t)f.n, sizeof *f.tokens);
    for (int i = 0; i < f.n; i++) {
        const json_t *v = json_array_get(all, (size_t)i);
        if (!json_is_integer(v)) fail("--parity: %s: all_tokens[%d] is not an integer", path, i);
        f.tokens[i] = (int32_t)json_integer_value(v);
    }
    json_decref(root);
    snprintf(path, sizeof path, "%.*s.logits.f32", (int)(len - 5), gguf);
    FILE *fp = fopen(path, "rb");
    if (!fp) fail("--parity: %s: %s", path, strerror(errno));
    fseek(fp, 0, SEEK_END);
    const long bytes = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    if (bytes <= 0 || bytes % ((long)f.n * 4))
        fail("--parity: %s: %ld bytes is not %d rows of float32", path, bytes, f.n);
    f.n_vocab = (int)(bytes / 4 / f.n);
    f.logits = xcalloc((size_t)bytes / 4, sizeof *f.logits);
    if (fread(f.logits, 4, (size_t)bytes / 4, fp) != (size_t)bytes / 4)
        fail("--parity: %s: short read", path);
    fclose(fp);
    return f;
}

static int argmax(const float *v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

/* Teacher forcing as the fixture's README says: the prompt in one llama_decode with every row's
 * logits, then one token per llama_decode. Prints the comparison; returns whether every row's
 * argmax equals llama.cpp's reference. */
static bool parity_run(struct llama_model *m, const fixture *f, const char *label, int threads,
                       int flash, int kv_type, const char *out) {
    struct llama_context *ctx =
        new_context(m, 64, 64, 64, 1, threads, flash, kv_type); /* the fixture's n_ctx */
    if (llama_vocab_n_tokens(llama_model_get_vocab(m)) != f->n_vocab)
        fail("--parity: the model has %d tokens, the fixture's logits %d",
             llama_vocab_n_tokens(llama_model_get_vocab(m)), f->n_vocab);
    llama_batch b = llama_batch_init(f->n_prompt, 0, 1);
    float *got = xcalloc((size_t)f->n * f->n_vocab, sizeof *got);
    for (int r = 0; r < f->n;) {
        const int rows = r == 0 ? f->n_prompt : 1;
        b.n_tokens = 0;
        for (int i = 0; i < rows; i++) batch_add(&b, f->tokens[r + i], r + i, 0, true);
        decode(ctx, &b);
        for (int i = 0; i < rows; i++) {
            const float *logits = llama_get_logits_ith(ctx, i);
            if (!logits) fail("--parity: llama.cpp has no logits for row %d", r + i);
            memcpy(got + (size_t)(r + i) * f->n_vocab, logits, (size_t)f->n_vocab * sizeof *got);
        }
        r += rows;
    }
    double worst = 0, worst_abs = 0;
    int worst_row = 0, argmax_equal = 0, greedy_equal = 0;
    for (int r = 0; r < f->n; r++) {
        const float *ref = f->logits + (size_t)r * f->n_vocab, *x = got + (size_t)r * f->n_vocab;
        double max_ref = 0, max_diff = 0;
        for (int i = 0; i < f->n_vocab; i++) {
            max_ref = fmax(max_ref, fabs(ref[i]));
            max_diff = fmax(max_diff, fabs((double)x[i] - ref[i]));
        }
        const double rel = max_ref > 0 ? max_diff / max_ref : max_diff;
        if (rel > worst) worst = rel, worst_row = r;
        worst_abs = fmax(worst_abs, max_diff);
        argmax_equal += argmax(x, f->n_vocab) == argmax(ref, f->n_vocab);
        if (r + 1 >= f->n_prompt && r + 1 < f->n)
            greedy_equal += argmax(x, f->n_vocab) == f->tokens[r + 1];
    }
    if (out) {
        FILE *fp = fopen(out, "wb");
        if (!fp ||
            fwrite(got, sizeof *got, (size_t)f->n * f->n_vocab, fp) != (size_t)f->n * f->n_vocab ||
            fclose(fp))
            fail("--out %s: %s", out, strerror(errno));
    }
    const int n_greedy = f->n - f->n_prompt;
    printf("%-34s max |diff| / max |ref| per row: %.3g (row %d), max |diff| %.3g; argmax equal "
           "%d/%d rows, greedy ids %d/%d\n",
           label, worst, worst_row, worst_abs, argmax_equal, f->n, greedy_equal, n_greedy);
    free(got);
    llama_batch_free(b);
    llama_free(ctx);
    return argmax_equal == f->n;
}

static int parity(const options *o, const char *build) {
    const fixture f = load_fixture(o->model);
    printf("llama.cpp %s (ggml %s; %s) vs %.*s.logits.f32 (llama.cpp 3f545becc): %d rows x %d, "
           "teacher forced\n",
           LLAMA_COMMIT, ggml_version(), build, (int)strlen(o->model) - 5, o->model, f.n,
           f.n_vocab);
    struct llama_model *m = load_model(o->model, false);
    const bool ok = parity_run(m, &f, "fixture settings (1 thr, KV f32):", 1, FLASH_ATTN_DISABLED,
                               GGML_TYPE_F32, NULL);
    printf("  CPU backend %s\n", g_log.variant[0] ? g_log.variant : "?");
    if (o->repack) llama_model_free(m), m = load_model(o->model, true);
    char label[64];
    snprintf(label, sizeof label, "bench settings (%d thr, fa %s, KV f16):", o->threads,
             flash_name(o->flash));
    parity_run(m, &f, label, o->threads, o->flash, GGML_TYPE_F16, o->out);
    llama_model_free(m);
    free(f.tokens);
    free(f.logits);
    fflush(stdout);
    if (!ok) fprintf(stderr, "llamacpp-bench: --parity: an argmax differs from the fixture's\n");
    return ok ? 0 : 1;
}

int main(int argc, char **argv) {
    const options o = parse_args(argc, argv);
    llama_log_set(on_log, NULL);
    check_layout();
    char dir[PATH_MAX], build[512];
    lib_dir(dir, sizeof dir);
    package_info(dir, build, sizeof build);
    ggml_backend_load_all_from_path(dir);
    llama_backend_init();
    return o.parity ? parity(&o, build) : bench(&o, build);
}
