/* testutil: what every test suite shares -- fixture paths in ../shared, file loading, temp dirs.
 *
 * Fixtures are used in place from ../shared (relative to the project root, where `make test`
 * runs). A suite whose fixtures are absent skips with a message, unless CI=true, where their
 * absence is a failure. Include after <cmocka.h>'s prerequisites via this header only. */
#ifndef MOE_TESTUTIL_H
#define MOE_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <cmocka.h>

#include "../src/base/base.h"
#include "../src/quant/quant.h"

/* Path of a fixture under ../shared, or NULL when it is absent (then the calling test has
 * already been skipped, or failed under CI=true). The string is static per call site use. */
const char *moe_test_shared(const char *relpath);
/* Read a fixture whole; skips/fails like moe_test_shared. Caller frees. NULL when skipped. */
uint8_t *moe_test_shared_read(const char *relpath, size_t *size);
/* Path of a fetched fixture under build/fixtures (`make fixtures`), or NULL when it is absent;
 * skips or fails (CI=true) like moe_test_shared. */
const char *moe_test_fixture(const char *relpath);
/* A fresh empty directory for this process's scratch files (removed at exit). */
const char *moe_test_tmpdir(void);
/* Path of the built moe binary (MOE_BIN, default ./moe). */
const char *moe_test_bin(void);
/* Run a shell command, capturing stdout+stderr (caller frees *out); returns the exit status. */
int moe_test_run(const char *cmd, char **out);
/* moe_test_run of a command that must succeed: the test fails with its output otherwise. */
void moe_test_run_ok(const char *cmd);
/* Copy the GGUF at src to dst: every key but those drop_keys names (NULL-terminated, or NULL),
 * every tensor whose name contains none of drop_tensors (likewise); with dequantize, each tensor
 * decoded to F32 by moe's decoders (bit-exact with ggml's, checked in the quant suite). Fails
 * the test on an error. */
void moe_test_copy_gguf(const char *src, const char *dst, const char *const *drop_keys,
                        const char *const *drop_tensors, bool dequantize);
/* `moe synth -o <tmpdir>/<file> <flags>` (flags as on the command line); fails the test when
 * synth does. The path, static per call (valid until the next call). */
const char *moe_test_synth(const char *file, const char *flags);

/* ==== A server and HTTP ==== */

typedef struct moe_test_server {
    pid_t pid;
    pid_t lead;    /* under a launcher (mpirun): rank 0, which a stop signals (0: pid itself) */
    char url[128]; /* http://HOST:PORT */
    char log[512]; /* its stderr */
} moe_test_server;

/* Start `moe serve --port 0 EXTRA...` (XDG_CACHE_HOME in the scratch directory, stderr to
 * <tmpdir>/<name>.log); waits for its "ready" line and reads the URL. false: it did not start. */
bool moe_test_server_start(moe_test_server *s, const char *name, char *const extra[]);
/* The same as `LAUNCHER... BIN serve --port 0 EXTRA...` (launcher NULL-terminated, looked up in
 * PATH: mpirun -np 2 ...); with a launcher, /health's rank 0 becomes s->lead. */
bool moe_test_server_start_with(moe_test_server *s, const char *name, char *const launcher[],
                                const char *bin, char *const extra[]);
/* SIGTERM (to s->lead when set: rank 0 stops the others and the job exits 0), then wait
 * (bounded); the exit status, or -1 if it had to be killed. */
int moe_test_server_stop(moe_test_server *s);
/* The same, with the SIGTERM sent to `signalled` (rank 0 of a server under mpirun). */
int moe_test_server_stop_via(moe_test_server *s, pid_t signalled);
/* Wait up to `seconds` for the server to exit (of itself); its exit status, or -1 when it had
 * to be killed. */
int moe_test_server_wait(moe_test_server *s, int seconds);
/* GET (body NULL) or POST a JSON body; the reply body (caller frees), its status in *status.
 * Fails the test when the transfer fails. */
char *moe_test_http(const char *url, const char *body, long *status);
/* The same request as a CURL easy handle not yet run (for a curl multi handle): headers a curl
 * slist the caller keeps, the reply collected into *out (the URL is copied). */
void *moe_test_http_handle(const char *url, const char *body, void *headers, moe_strbuf *out);

/* ==== 8 streams together equal each alone ==== */

/* 8 completion requests (BOS then ids with repeats, so that prompt lookup drafts; a seed of its
 * own each for a sampled case), run one at a time through a plain server (`--parallel 1 --spec
 * none` and alone_extra) and then all at once through one with `--parallel 8` and together:
 * each stream's text must equal its text alone, token for token. Both servers are
 * `LAUNCHER... BIN serve MODEL --ctx 256 -t 1 ...` (launcher NULL: none; bin NULL: MOE_BIN). */
typedef struct moe_test_streams {
    const char *model;
    double temp;
    const char *what; /* names the together server's setting in a failure */
    char *const *launcher;
    const char *bin;
    char *const *alone_extra, *const *together; /* NULL-terminated, or NULL */
} moe_test_streams;
/* Fails the test on a difference or a server that does not start or stop cleanly; the together
 * server's /metrics (caller frees). */
char *moe_test_streams_equal_alone(const moe_test_streams *t);
/* The value of a /metrics line, summed over its labels (0 when absent). */
double moe_test_metric(const char *metrics, const char *name);

/* ==== Seeded random numbers (splitmix64; the same stream on every machine) ==== */

/* ==== Quantization fixtures (../shared/quant, see its README) ==== */

typedef struct moe_test_quant_fixture {
    char name[16]; /* "Q4_K" */
    moe_type type;
    int64_t row_len, n_rows, block_values;
    size_t block_bytes;
    bool has_src;     /* <TYPE>.src.f32 present */
    char dot_type[8]; /* ggml's name of the activation type: q8_0, q8_1, q8_K, f16, bf16 */
} moe_test_quant_fixture;

#define MOE_TEST_QUANT_N_VEC 4 /* activation rows per type in <TYPE>.x.f32 / .xq.blocks */

/* MANIFEST.json, parsed once: the number of types (*out points at them). When ../shared is
 * absent the calling test is skipped (failed under CI=true) and this does not return. */
int moe_test_quant_fixtures(const moe_test_quant_fixture **out);
/* quant/<TYPE>.<suffix> ("blocks", "x.f32", "xq.blocks", ...), checked to be exactly `expect`
 * bytes (fails the test otherwise). Caller frees. */
uint8_t *moe_test_quant_read(const moe_test_quant_fixture *f, const char *suffix, size_t expect);

/* ==== Python Jinja2 (tests/render_jinja.py) ==== */

/* Render spec ({"fixed_date", "cases": [...]}, see tests/render_jinja.py) with Python Jinja2;
 * the results array ([{"ok", "text" | "error"}], one per case). Fails the test when Python
 * does. The caller decrefs. `name` names the scratch files. */
struct json_t;
struct json_t *moe_test_render_jinja(struct json_t *spec, const char *name);

/* A Python 3 with numpy for test-side references ("/usr/bin/python3" or "python3"), or NULL
 * (with a skip message; a failure when CI=true) when there is none. */
const char *moe_test_python_numpy(void);
/* gemma4-moe-q4_0 against its f32-activation reference: this many times llama.cpp's own distance
 * from it (Q8_0 activations, amplified through its six layers; test_model.c parity_gemma4_q4_0);
 * the hf suite holds its Q4_0 repack to the same against the bf16 checkpoint. */
#define MOE_TEST_GEMMA4_Q8_ACT_SLACK 1.25
/* max |ours - ref| over max |ref| of one row of n logits (max |ours - ref| when ref is all 0). */
double moe_test_row_rel_err(const float *ours, const float *ref, uint32_t n);
/* Run a command and parse its stdout as JSON (stderr dropped); fails the test when it exits
 * non-zero or prints something else. The caller decrefs. */
struct json_t *moe_test_run_json(const char *cmd);
/* The unsigned integer member `key` of a JSON object; fails the test when there is none. */
uint64_t moe_test_json_uint(struct json_t *object, const char *key);

/* ==== A chat model ==== */

/* stories260K (../shared) written again as <tmpdir>/<name>.gguf, with ids 3 and 4 (byte tokens
 * <0x00>, <0x01>) turned into the control tokens <|im_start|> and <|im_end|>, and, when
 * template_rel is not NULL, tokenizer.chat_template set to that file of ../shared. NULL (test
 * skipped) without ../shared. */
const char *moe_test_chat_model(const char *name, const char *template_rel);

#define MOE_SKIP_IF_NULL(p)                                                                        \
    do {                                                                                           \
        if (!(p)) {                                                                                \
            skip();                                                                                \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#endif
