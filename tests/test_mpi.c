/* test_mpi: expert and tensor parallelism over Open MPI (engine/dist.c, engine/rows.c, --split
 * experts|rows). `mpirun -np 2` and `-np 4` (as root, oversubscribed) of the MPI build
 * (build/mpi/moe, or MOE_MPI_BIN; `make test` builds it where mpicc is installed) against one
 * rank of the default build, on every MoE parity model in ../shared, both split modes: logits
 * within 1e-6 of max|logit| and the same argmax per row, that argmax equal to llama.cpp's greedy
 * tokens (the fixture's); split by experts the ranks' shares of the experts add up to the one-rank
 * count, split by rows every rank runs every expert one rank ran (ranks whose slices are all empty:
 * none); each rank's routed-expert bytes (by rows: what it read) are those `moe budget --devices K
 * --split MODE` plans, and by rows its RSS follows them; with --split-dense (dense FFNs and shared
 * experts split too) each split gives its logits without it, bit for bit. Without
 * mpirun or an MPI build the MPI tests skip with a message, even under CI=true: MPI is optional.
 * The argument errors need no MPI. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>
#include <jansson.h>

#include "testutil.h"

#define MPIRUN      "mpirun --allow-run-as-root --oversubscribe -np"
#define REL_TOL     1e-6 /* of max|logit|: the bound for a split run */
#define MAX_TOKENS  64
#define API_KEY     "sk-moe-test"
#define CLIENTS_DIR "tests/clients"

/* The MPI build's path, or NULL (with a message) when it or mpirun is missing. */
static const char *mpi_bin(void) {
    static char path[512];
    const char *env = getenv("MOE_MPI_BIN");
    snprintf(path, sizeof path, "%s", env && *env ? env : "build/mpi/moe");
    struct stat st;
    char *out = NULL;
    if (stat(path, &st) != 0) {
        print_message("mpi: no MPI build at %s (`make test` builds it with mpicc): skipped\n",
                      path);
        return NULL;
    }
    if (moe_test_run("command -v mpirun", &out) != 0) {
        free(out);
        print_message("mpi: no mpirun (Debian openmpi-bin): skipped\n");
        return NULL;
    }
    free(out);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "%s --version", path);
    if (moe_test_run(cmd, &out) != 0 || !strstr(out, "mpi: Open MPI")) {
        print_message("mpi: %s was not built with MPI=1: skipped\n", path);
        free(out);
        return NULL;
    }
    free(out);
    return path;
}

static float *read_f32(const char *path, size_t *n) {
    size_t bytes = 0;
    moe_error err = {0};
    uint8_t *data = NULL;
    if (moe_file_read(path, &data, &bytes, &err) != MOE_OK) fail_msg("%s: %s", path, err.msg);
    *n = bytes / sizeof(float);
    return (float *)data;
}

static size_t argmax(const float *row, size_t n) {
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (row[i] > row[best]) best = i;
    return best;
}

/* Run a command; fail the test with its output when it exits non-zero. Returns the output. */
__attribute__((noinline)) static char *run_ok(const char *cmd) {
    char *out = NULL;
    const int rc = moe_test_run(cmd, &out);
    if (rc != 0) fail_msg("%s exited %d:\n%s", cmd, rc, out);
    return out;
}

/* `moe budget --devices k --split split`'s routed-expert bytes per device into want[k]. */
static void budget_routed(const char *model, int k, const char *split, long long *want) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "%s budget %s --devices %d --split %s --mem-per-device 64 --json 2>/dev/null",
             moe_test_bin(), model, k, split);
    char *out = run_ok(cmd);
    json_error_t jerr;
    json_t *root = json_loads(out, 0, &jerr);
    if (!root) fail_msg("%s: %s in:\n%s", cmd, jerr.text, out);
    json_t *devices =
        json_object_get(json_array_get(json_object_get(root, "models"), 0), "devices");
    assert_int_equal(json_array_size(devices), k);
    for (int d = 0; d < k; d++)
        want[d] = (long long)json_integer_value(json_object_get(
            json_object_get(json_array_get(devices, (size_t)d), "parts"), "routed_experts"));
    json_decref(root);
    free(out);
}

/* Each rank's "holds H of A bytes of routed experts" equals the budget's device H; its RSS
 * (MiB) into rss[r]. */
static void check_held(const char *out, int k, const long long *want, double *rss,
                       const char *name) {
    for (int r = 0; r < k; r++) {
        char key[64];
        snprintf(key, sizeof key, "moe logits: rank %d of %d ran", r, k);
        const char *p = strstr(out, key), *h = p ? strstr(p, "holds ") : NULL;
        long long held = -1, all;
        if (!h ||
            sscanf(h, "holds %lld of %lld bytes of routed experts; RSS %lf MiB", &held, &all,
                   &rss[r]) != 3 ||
            held != want[r])
            fail_msg("%s -np %d: rank %d holds %lld bytes of routed experts, the budget says %lld:"
                     "\n%s",
                     name, k, r, held, want[r], out);
    }
}

/* The experts each rank reports running ("rank R of K ran E experts"), summed (max: the most any
 * rank ran); -1 unless every rank 0..K-1 reported once. */
static long long experts_ran(const char *out, int k, bool max) {
    long long sum = 0;
    int seen = 0;
    for (const char *p = out; (p = strstr(p, "moe logits: rank ")) != NULL; p++) {
        int r, size;
        long long e;
        if (sscanf(p, "moe logits: rank %d of %d ran %lld experts", &r, &size, &e) != 3 ||
            size != k || r < 0 || r >= k || (seen & (1 << r)))
            return -1;
        seen |= 1 << r;
        sum = max ? (e > sum ? e : sum) : sum + e;
    }
    return seen == (1 << k) - 1 ? sum : -1;
}

/* One model, k ranks split by `split` against the one-rank logits `base` ([n_rows][n_vocab]);
 * returns the largest |difference| / max|logit| and checks the argmax rows, the expert shares
 * (one_rank_experts: what one rank ran) and the bytes held; each rank's RSS (MiB) into rss. */
static double check_split(const char *bin, const char *model, const char *tokens, int k,
                          const char *split, const float *base, size_t n_rows, size_t n_vocab,
                          long long one_rank_experts, const char *name, long long *held,
                          double *rss) {
    char out_path[512], cmd[4096], mode[32];
    /* "rows+dense": --split rows --split-dense */
    const bool dense = strstr(split, "+dense") != NULL;
    snprintf(mode, sizeof mode, "%.*s", (int)strcspn(split, "+"), split);
    snprintf(out_path, sizeof out_path, "%s/%s.%s.np%d.f32", moe_test_tmpdir(), name, split, k);
    snprintf(cmd, sizeof cmd, MPIRUN " %d %s logits %s --tokens %s --split %s%s --out %s 2>&1", k,
             bin, model, tokens, mode, dense ? " --split-dense" : "", out_path);
    budget_routed(model, k, mode, held);
    char *out = run_ok(cmd);
    const bool rows = !strcmp(mode, "rows");
    const long long shares = experts_ran(out, k, rows);
    if (shares != one_rank_experts)
        fail_msg("%s -np %d --split %s: the ranks' expert shares come to %lld, one rank ran "
                 "%lld:\n%s",
                 name, k, split, shares, one_rank_experts, out);
    check_held(out, k, held, rss, name);
    free(out);
    size_t n;
    float *got = read_f32(out_path, &n);
    assert_int_equal(n, n_rows * n_vocab);
    double max_abs = 0, max_diff = 0;
    for (size_t i = 0; i < n; i++) {
        const double a = base[i] < 0 ? -base[i] : base[i], d = (double)got[i] - base[i];
        if (a > max_abs) max_abs = a;
        if ((d < 0 ? -d : d) > max_diff) max_diff = d < 0 ? -d : d;
    }
    for (size_t r = 0; r < n_rows; r++)
        if (argmax(got + r * n_vocab, n_vocab) != argmax(base + r * n_vocab, n_vocab))
            fail_msg("%s -np %d --split %s: row %zu's argmax differs from one rank's", name, k,
                     split, r);
    if (max_diff > REL_TOL * max_abs)
        fail_msg("%s -np %d --split %s: max |diff| %.3g > %.0e x max|logit| %.3g", name, k, split,
                 max_diff, REL_TOL, max_abs);
    free(got);
    return max_abs > 0 ? max_diff / max_abs : 0;
}

/* The model's logits with one rank (the default build, no split) into *base; the experts the
 * MPI build runs alone (one rank, --split experts). */
static float *one_rank(const char *bin, const char *model, const char *tokens, const char *name,
                       size_t *n, long long *experts) {
    char path[512], cmd[4096];
    snprintf(path, sizeof path, "%s/%s.np1.f32", moe_test_tmpdir(), name);
    snprintf(cmd, sizeof cmd, "%s logits %s --tokens %s --out %s 2>&1", moe_test_bin(), model,
             tokens, path);
    free(run_ok(cmd));
    snprintf(cmd, sizeof cmd, "%s logits %s --tokens %s --split experts --out %s.split 2>&1", bin,
             model, tokens, path);
    char *out = run_ok(cmd);
    *experts = experts_ran(out, 1, false);
    if (*experts <= 0) fail_msg("one rank reported no expert count:\n%s", out);
    free(out);
    return read_f32(path, n);
}

/* Both split modes of one model at -np 2 and -np 4, and each with --split-dense, printed. A
 * dense block split computes every dot whole on one rank, so "+dense" gives the logits of the
 * same split without it, bit for bit. */
static void check_both_splits(const char *bin, const char *model, const char *tokens,
                              const float *base, size_t n_rows, size_t n_vocab, long long experts,
                              const char *name) {
    static const char *const splits[] = {"experts", "rows", "experts+dense", "rows+dense"};
    for (int s = 0; s < 4; s++)
        for (int k = 2; k <= 4; k += 2) {
            long long held[8];
            double rss[8];
            const double rel_diff = check_split(bin, model, tokens, k, splits[s], base, n_rows,
                                                n_vocab, experts, name, held, rss);
            print_message("mpi: %-22s -np %d --split %-13s: max |diff| / max|logit| = %.3g%s\n",
                          name, k, splits[s], rel_diff, rel_diff == 0 ? " (bit-identical)" : "");
            if (s < 2) continue;
            char with[512], without[512];
            snprintf(with, sizeof with, "%s/%s.%s.np%d.f32", moe_test_tmpdir(), name, splits[s], k);
            snprintf(without, sizeof without, "%s/%s.%s.np%d.f32", moe_test_tmpdir(), name,
                     splits[s - 2], k);
            size_t n_with, n_without;
            float *a = read_f32(with, &n_with), *b = read_f32(without, &n_without);
            if (n_with != n_without || memcmp(a, b, sizeof(float) * n_with) != 0)
                fail_msg("%s -np %d: --split %s differs from --split %s", name, k, splits[s],
                         splits[s - 2]);
            free(a);
            free(b);
        }
}

/* Every MoE model of ../shared/parity (config.n_expert > 0), its whole token sequence (prompt and
 * llama.cpp's greedy continuation) as one batch: -np 2 and -np 4 against one rank, and the
 * argmax of the last prompt row onwards equal to llama.cpp's greedy tokens. */
static void parity_models_split(void **state) {
    (void)state;
    const char *index = moe_test_shared("parity/INDEX.json");
    MOE_SKIP_IF_NULL(index);
    const char *bin = mpi_bin();
    MOE_SKIP_IF_NULL(bin);
    json_error_t jerr;
    json_t *root = json_load_file(index, 0, &jerr);
    if (!root) fail_msg("%s: %s", index, jerr.text);
    size_t i, n_checked = 0;
    json_t *entry;
    json_array_foreach(json_object_get(root, "models"), i, entry) {
        const char *name = json_string_value(json_object_get(entry, "name"));
        char rel[256], model[512];
        snprintf(rel, sizeof rel, "parity/%s.json", name);
        json_t *meta = json_load_file(moe_test_shared(rel), 0, &jerr);
        if (!meta) fail_msg("%s: %s", rel, jerr.text);
        const json_int_t n_expert =
            json_integer_value(json_object_get(json_object_get(meta, "config"), "n_expert"));
        json_decref(meta);
        if (n_expert <= 0) continue; /* a dense model: nothing to split */
        snprintf(rel, sizeof rel, "parity/%s.tokens.json", name);
        json_t *tok = json_load_file(moe_test_shared(rel), 0, &jerr);
        if (!tok) fail_msg("%s: %s", rel, jerr.text);
        json_t *all = json_object_get(tok, "all_tokens"), *prompt = json_object_get(tok, "prompt");
        const size_t n_tok = json_array_size(all), n_prompt = json_array_size(prompt);
        assert_true(n_tok > n_prompt && n_prompt > 0 && n_tok <= MAX_TOKENS);
        char tokens[MAX_TOKENS * 12] = "";
        for (size_t t = 0; t < n_tok; t++)
            snprintf(tokens + strlen(tokens), sizeof tokens - strlen(tokens), t ? ",%lld" : "%lld",
                     (long long)json_integer_value(json_array_get(all, t)));
        snprintf(rel, sizeof rel, "parity/%s", json_string_value(json_object_get(entry, "file")));
        snprintf(model, sizeof model, "%s", moe_test_shared(rel));
        size_t n;
        long long experts;
        float *base = one_rank(bin, model, tokens, name, &n, &experts);
        assert_int_equal(n % n_tok, 0);
        const size_t n_vocab = n / n_tok;
        check_both_splits(bin, model, tokens, base, n_tok, n_vocab, experts, name);
        /* llama.cpp's greedy: argmax(row p) = all_tokens[p + 1] from the last prompt row on */
        for (size_t p = n_prompt - 1; p + 1 < n_tok; p++)
            if ((json_int_t)argmax(base + p * n_vocab, n_vocab) !=
                json_integer_value(json_array_get(all, p + 1)))
                fail_msg("%s: row %zu's argmax is not llama.cpp's greedy token", name, p);
        free(base);
        json_decref(tok);
        n_checked++;
    }
    json_decref(root);
    assert_true(n_checked > 0);
}

/* A synthetic model (moe synth FLAGS) run by one rank on SYNTH_TOKENS (16 rows). */
#define SYNTH_TOKENS "1,403,407,261,378,432,383,286,261,376,298,315,421,395,317,426"
typedef struct synth_run {
    const char *bin, *model, *name;
    float *base; /* [16][n_vocab] one rank's logits */
    size_t n;    /* floats in base */
    long long experts;
} synth_run;

/* false: skipped (no MPI build). */
static bool synth_one_rank(synth_run *r, const char *name, const char *flags) {
    r->bin = mpi_bin();
    if (!r->bin) {
        skip();
        return false;
    }
    char file[64];
    snprintf(file, sizeof file, "%s.gguf", name);
    r->model = moe_test_synth(file, flags);
    r->name = name;
    r->base = one_rank(r->bin, r->model, SYNTH_TOKENS, name, &r->n, &r->experts);
    return true;
}

/* check_split of the synthetic model at k ranks; each rank's held bytes and RSS (MiB). */
static double synth_split(const synth_run *r, int k, const char *split, long long *held,
                          double *rss) {
    return check_split(r->bin, r->model, SYNTH_TOKENS, k, split, r->base, 16, r->n / 16, r->experts,
                       r->name, held, rss);
}

/* 8 of 32 experts per token: a rank's partial sums several experts, so the sum's order changes
 * and the logits need not be bit-identical; they stay within the bound. */
static void many_experts_per_token(void **state) {
    (void)state;
    synth_run r;
    if (!synth_one_rank(&r, "mpi8of32",
                        "--arch qwen3moe --layers 4 --embd 256 --heads 4 --heads-kv 2 --head-dim "
                        "64 --experts 32 --experts-used 8 --expert-ff 128 --vocab 512 --seed 7"))
        return;
    long long held[8];
    double rss[8];
    for (int k = 2; k <= 4; k++)
        print_message("mpi: 8 of 32 experts -np %d: max |diff| / max|logit| = %.3g\n", k,
                      synth_split(&r, k, "experts", held, rss));
    free(r.base);
}

/* Split by rows in quant blocks: Q4_K experts with an intermediate of 1024 (4 blocks of 256), so
 * -np 2 and -np 4 split it evenly and -np 3 does not (blocks 1, 1, 2). One layer: a second
 * layer would quantize the first one's output again for its own matmuls (8-bit activation
 * blocks), where a last-bit change can move a rounding and so the logits by 1e-4; one layer
 * keeps the comparison at the sum's own rounding. Each rank's RSS follows what it holds: within
 * a job, the differences of RSS are the differences of held bytes (the mapped stacked tensors
 * are never touched, only the slices read). */
static void rows_split_in_blocks(void **state) {
    (void)state;
    synth_run r;
    if (!synth_one_rank(&r, "mpirowsq4k",
                        "--arch qwen3moe --layers 1 --embd 512 --heads 4 --heads-kv 2 --head-dim "
                        "64 --experts 32 --experts-used 8 --expert-ff 1024 --vocab 512 --seed 9 "
                        "--type exps=Q4_K --random-blocks"))
        return;
    long long held[8];
    double rss[8];
    for (int k = 2; k <= 4; k++) {
        const double rel_diff = synth_split(&r, k, "rows", held, rss);
        print_message("mpi: Q4_K rows -np %d: max |diff| / max|logit| = %.3g; rank 0 holds "
                      "%.1f MiB, RSS %.1f MiB\n",
                      k, rel_diff, (double)held[0] / 1048576.0, rss[0]);
        for (int rank = 1; rank < k; rank++) {
            const double d_rss = rss[rank] - rss[0],
                         d_held = (double)(held[rank] - held[0]) / 1048576.0;
            if (d_rss - d_held > 2.0 || d_held - d_rss > 2.0)
                fail_msg("-np %d: rank %d's RSS is %.1f MiB from rank 0's, its routed experts "
                         "%.1f MiB",
                         k, rank, d_rss, d_held);
        }
        if (k == 3 && held[2] != 2 * held[0]) /* blocks 1, 1, 2 */
            fail_msg("-np 3: the ranks hold %lld, %lld, %lld bytes", held[0], held[1], held[2]);
    }
    free(r.base);
}

/* A parity model (parity/FILE), and the MPI build in *bin; NULL (the test skipped) without
 * either. */
static const char *parity_and_bin(const char *file, const char **bin) {
    char rel[128];
    snprintf(rel, sizeof rel, "parity/%s", file);
    const char *model = moe_test_shared(rel);
    *bin = model ? mpi_bin() : NULL;
    return *bin ? model : NULL;
}

/* `moe run` greedy under -np 2 and -np 4, both splits, prints the same tokens as one rank (a
 * hybrid model whose F32 experts split by rows evenly: qwen3next). */
static void run_greedy_tokens(void **state) {
    (void)state;
    const char *bin, *model = parity_and_bin("qwen3next-f32.gguf", &bin);
    MOE_SKIP_IF_NULL(model);
    const char *args = "--tokens 1,403,407,261,378,432,383,286,261,376,298,315,421,395,317,426 "
                       "-n 16 --temp 0 --print-ids";
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "(%s run %s %s 2>/dev/null)", moe_test_bin(), model, args);
    char *want = run_ok(cmd);
    for (int k = 2; k <= 4; k += 2)
        for (int rows = 0; rows < 2; rows++) {
            snprintf(cmd, sizeof cmd, "(" MPIRUN " %d %s run %s %s --split %s 2>/dev/null)", k, bin,
                     model, args, rows ? "rows" : "experts");
            char *got = run_ok(cmd);
            if (strcmp(got, want) != 0)
                fail_msg("-np %d --split %s printed\n%s\none rank printed\n%s", k,
                         rows ? "rows" : "experts", got, want);
            free(got);
        }
    free(want);
}

/* `moe ARGS` exits 2 with `expect` in its output. */
static void expect_usage_error(const char *args, const char *expect) {
    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", moe_test_bin(), args);
    const int rc = moe_test_run(cmd, &out);
    if (rc != 2 || !strstr(out, expect))
        fail_msg("%s: exit %d, expected 2 and '%s' in:\n%s", cmd, rc, expect, out);
    free(out);
}

/* Wrong uses of --split say what is wrong (the default build has no MPI). */
static void split_argument_errors(void **state) {
    (void)state;
    static const struct {
        const char *args, *expect;
    } cases[] = {
        {"logits x.gguf --tokens 1 --split cols",
         "--split expects none, experts or rows, got 'cols'"},
        {"logits x.gguf --tokens 1 --split", "--split expects none, experts or rows"},
        {"logits x.gguf --tokens 1 --split-dense", "--split-dense needs --split experts|rows"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect_usage_error(cases[i].args, cases[i].expect);
    /* the default build: --split needs MPI, and says how to get it */
    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s --version | grep -q 'mpi: none'", moe_test_bin());
    if (moe_test_run(cmd, &out) == 0)
        expect_usage_error("logits x.gguf --tokens 1 --split experts", "make MPI=1");
    free(out);
}

/* One rank fails (its model file is missing) while the other waits for it in a collective: the
 * job ends with the failing rank's message instead of hanging (`timeout` only guards the suite
 * against a hang; it asserts nothing about speed). */
static void failing_rank_ends_job(void **state) {
    (void)state;
    const char *bin, *model = parity_and_bin("qwen3moe-mixed.gguf", &bin);
    MOE_SKIP_IF_NULL(model);
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "timeout 300 " MPIRUN " 2 sh -c 'if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then exec %s "
             "logits %s/missing.gguf --tokens 1,2 --split experts; else exec %s logits %s --tokens "
             "1,2 --split experts; fi'",
             bin, moe_test_tmpdir(), bin, model);
    const int rc = moe_test_run(cmd, &out);
    if (rc == 0 || rc == 124 || !strstr(out, "rank 1 failed: ending every rank of the job"))
        fail_msg("%s: exit %d, expected a failure naming rank 1 in:\n%s", cmd, rc, out);
    free(out);
}

/* `moe chat` under mpirun -np 2 (--split rows --split-dense): rank 0 reads the terminal, rank 1
 * replays its calls; the greedy token ids equal one rank's, on qwen3next (routed and shared
 * experts split by rows) and on qwen35-mtp (dense FFNs split; MTP drafting by default: the draft
 * head's calls replayed too). */
static void chat_under_mpirun(void **state) {
    (void)state;
    static const char *const models[] = {"qwen3next-f32.gguf", "qwen35-mtp-f32.gguf"};
    for (int i = 0; i < 2; i++) {
        const char *bin, *model = parity_and_bin(models[i], &bin);
        MOE_SKIP_IF_NULL(model);
        char cmd[2048];
        /* the ids only (a rank's stdout may reach mpirun's through a terminal, and the "> "
         * prompts on stderr may land between them) */
        snprintf(cmd, sizeof cmd,
                 "printf 'hello there\\nhow are you\\n' | %s chat %s --temp 0 -n 12 --print-ids "
                 "2>/dev/null | tr -cd '0-9,\\n'",
                 moe_test_bin(), model);
        char *want = run_ok(cmd);
        snprintf(cmd, sizeof cmd,
                 "printf 'hello there\\nhow are you\\n' | " MPIRUN
                 " 2 %s chat %s --temp 0 -n 12 --print-ids --split rows --split-dense 2>/dev/null "
                 "| tr -cd '0-9,\\n'",
                 bin, model);
        char *got = run_ok(cmd);
        if (strcmp(got, want) != 0)
            fail_msg("%s: -np 2 chat printed\n%s\none rank printed\n%s", models[i], got, want);
        free(got);
        free(want);
    }
}

/* ==== moe serve under mpirun ==== */

static char *const mpi_two[] = {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                                NULL};

/* /health of a server under mpirun: both ranks, with distinct pids; rank 0's pid returned and
 * each rank's routed-expert bytes into held[2]. */
static long health_ranks(const moe_test_server *s, long long *held) {
    char url[256];
    snprintf(url, sizeof url, "%s/health", s->url);
    long status = 0;
    char *body = moe_test_http(url, NULL, &status);
    json_error_t jerr;
    json_t *root = json_loads(body, 0, &jerr), *ranks = json_object_get(root, "ranks");
    if (status != 200 || json_array_size(ranks) != 2)
        fail_msg("%s: status %ld, expected 200 and two ranks in: %s", url, status, body);
    long pid[2];
    for (size_t r = 0; r < 2; r++) {
        json_t *rank = json_array_get(ranks, r);
        pid[r] = (long)json_integer_value(json_object_get(rank, "pid"));
        held[r] = (long long)json_integer_value(json_object_get(rank, "routed_expert_bytes"));
        if (json_integer_value(json_object_get(rank, "rank")) != (json_int_t)r ||
            strcmp(json_string_value(json_object_get(rank, "status")), "ok") != 0)
            fail_msg("%s: rank %zu is not ok: %s", url, r, body);
    }
    if (pid[0] <= 0 || pid[0] == pid[1]) fail_msg("%s: the ranks' pids: %s", url, body);
    json_decref(root);
    free(body);
    return pid[0];
}

/* Stop a server under mpirun as its user should: SIGTERM to rank 0 (a signal to mpirun ends
 * every rank at once), which stops the others; the job's exit status, -1 if it had to be killed.
 * /health must show both ranks first. */
static int mpi_server_stop(moe_test_server *s) {
    long long held[2];
    if (health_ranks(s, held) != s->lead) fail_msg("%s: rank 0 is not the server's lead", s->url);
    return moe_test_server_stop(s);
}

/* node tests/clients/cases.mjs with these servers and cases; fails with its output unless every
 * case passed, else prints their report lines. */
static void client_cases(const char *base, const char *hybrid, const char *key, const char *runc,
                         const char *cases) {
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "node %s/cases.mjs --base %s --slow %s --hybrid %s --key %s --runc %s %s", CLIENTS_DIR,
             base, base, hybrid, key, runc, cases);
    const int rc = moe_test_run(cmd, &out);
    if (rc != 0) fail_msg("under mpirun -np 2: %s exited %d:\n%s", cmd, rc, out);
    for (const char *l = out; *l; l += strcspn(l, "\n"), l += *l == '\n')
        print_message("mpi serve: %.*s\n", (int)strcspn(l, "\n"), l);
    free(out);
}

/* `mpirun -np 2 moe serve`: rank 0 serves, rank 1 replays its steps. The official SDK cases that
 * need no slow server pass against stories260K (--split rows: a dense model, only the replay)
 * and the qwen3next hybrid (--split rows: prefix reuse through snapshots, replayed on both
 * ranks), 16 concurrent streams among them. /health lists both ranks with what they hold (the
 * budget's bytes); SIGTERM to rank 0 ends the job cleanly. */
static void serve_under_mpirun(void **state) {
    (void)state;
    const char *model = moe_test_shared("models/stories260K/stories260K.gguf");
    const char *runc = moe_test_shared("models/stories260K/runc_greedy_bos_n256.txt");
    const char *hybrid = moe_test_shared("parity/qwen3next-f32.gguf");
    MOE_SKIP_IF_NULL(model);
    MOE_SKIP_IF_NULL(runc);
    MOE_SKIP_IF_NULL(hybrid);
    const char *bin = mpi_bin();
    MOE_SKIP_IF_NULL(bin);
    struct stat st;
    if (stat(CLIENTS_DIR "/node_modules/openai/package.json", &st) != 0 ||
        stat(CLIENTS_DIR "/node_modules/@anthropic-ai/sdk/package.json", &st) != 0) {
        print_message("mpi: %s/node_modules is absent (`make clients`): skipped\n", CLIENTS_DIR);
        skip();
        return;
    }
    char *base_args[] = {(char *)model, "--ctx",  "1024",
                         "--parallel",  "16",     "--api-key",
                         API_KEY,       "--cors", "http://allowed.example",
                         "--split",     "rows",   NULL};
    char *hybrid_args[] = {(char *)hybrid,  "--ctx", "128",     "--parallel", "2",
                           "--cache-slots", "4",     "--split", "rows",       NULL};
    moe_test_server base = {0}, hy = {0};
    if (!moe_test_server_start_with(&base, "mpi-base", mpi_two, bin, base_args) ||
        !moe_test_server_start_with(&hy, "mpi-hybrid", mpi_two, bin, hybrid_args))
        fail_msg("a server under mpirun did not start (logs in %s)", moe_test_tmpdir());
    long long held[2], want[8];
    health_ranks(&hy, held);
    budget_routed(hybrid, 2, "rows", want);
    for (int r = 0; r < 2; r++)
        if (held[r] != want[r])
            fail_msg("/health: rank %d holds %lld bytes of routed experts, the budget says %lld", r,
                     held[r], want[r]);
    client_cases(base.url, hy.url, API_KEY, runc,
                 "models chat_nonstream chat_stream completions_runc stop_strings logprobs "
                 "concurrent_streams cached_tokens hybrid_reuse anthropic_messages "
                 "anthropic_stream tools_shape "
                 "structured_output responses errors cors round_trip disconnect_storm ops");
    assert_int_equal(mpi_server_stop(&base), 0);
    assert_int_equal(mpi_server_stop(&hy), 0);
}

/* 8 streams at once through `mpirun -np 2 moe serve --split SPLIT` (with spec: --spec SPEC
 * --draft 4), each equal to that stream alone through a server of the same split with
 * --parallel 1 and no speculation, token for token; the together server's /metrics. */
static char *mpi_streams(const char *bin, const char *model, const char *split, double temp,
                         const char *spec) {
    char *alone[] = {"--split", (char *)split, NULL};
    char *together[] = {"--split", (char *)split, "--step-delay", "2", NULL,
                        NULL,      NULL,          NULL,           NULL};
    if (spec) {
        together[4] = "--spec";
        together[5] = (char *)spec;
        together[6] = "--draft";
        together[7] = "4";
    }
    char what[64];
    snprintf(what, sizeof what, "mpirun -np 2 --split %s%s%s", split, spec ? " --spec " : "",
             spec ? spec : "");
    return moe_test_streams_equal_alone(&(moe_test_streams){.model = model,
                                                            .temp = temp,
                                                            .what = what,
                                                            .launcher = mpi_two,
                                                            .bin = bin,
                                                            .alone_extra = alone,
                                                            .together = together});
}

/* `moe serve` under mpirun -np 2: 8 streams at once, each equal to that stream alone, greedy and
 * seeded sampled, both split modes, on the qwen3next hybrid (F32 experts, shared expert,
 * snapshots replayed) and deepseek2-q8_0-q4_k (quantized experts, MLA); /metrics shows the 8
 * streams in one step. (The followers once sized their contexts without --cache-slots' default
 * and refused the last slot's steps, leaving rank 0 in a reduction: the 8th stream hung.) */
static void serve_streams_under_mpirun(void **state) {
    (void)state;
    static const char *const models[] = {"qwen3next-f32.gguf", "deepseek2-q8_0-q4_k.gguf"};
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        const char *bin, *model = parity_and_bin(models[i], &bin);
        MOE_SKIP_IF_NULL(model);
        for (int rows = 0; rows < 2; rows++)
            for (double temp = 0; temp < 1; temp += 0.8) {
                const char *split = rows ? "rows" : "experts";
                char *metrics = mpi_streams(bin, model, split, temp, NULL);
                const double batch = moe_test_metric(metrics, "moe_decode_batch_rows_max");
                print_message("mpi serve: %s --split %s, temperature %g: 8 streams equal alone, up "
                              "to %.0f rows in one decode step\n",
                              models[i], split, temp, batch);
                if (batch < 8)
                    fail_msg("%s --split %s: the 8 streams never shared a step:\n%s", models[i],
                             split, metrics);
                free(metrics);
            }
    }
}

/* serve's --spec mtp under mpirun -np 2 (glm5next: MoE, hyper-connections, its MTP head): the
 * head's calls (drafts fed each stream's hidden states, rewinds) and the verify steps with their
 * accepts are replayed; 8 streams equal each alone without speculation, greedy and sampled, both
 * split modes; /metrics shows drafts verified for several streams in one step. */
static void serve_mtp_under_mpirun(void **state) {
    (void)state;
    const char *bin, *model = parity_and_bin("glm5next-f32.gguf", &bin);
    MOE_SKIP_IF_NULL(model);
    for (int rows = 0; rows < 2; rows++)
        for (double temp = 0; temp < 1; temp += 0.8) {
            const char *split = rows ? "rows" : "experts";
            char *metrics = mpi_streams(bin, model, split, temp, "mtp");
            const double drafted = moe_test_metric(metrics, "moe_spec_drafts_total"),
                         verified = moe_test_metric(metrics, "moe_spec_verify_streams_max");
            print_message("mpi serve: glm5next-f32 --split %s --spec mtp, temperature %g: 8 "
                          "streams equal alone, %.0f drafts, up to %.0f streams in one verify "
                          "step\n",
                          split, temp, drafted, verified);
            if (drafted < 1 || verified < 2)
                fail_msg("--split %s --spec mtp: no drafts or no batched verify step:\n%s", split,
                         metrics);
            free(metrics);
        }
}

/* The job's exit status once it ends within `seconds`; else the test fails. */
static int job_exit(moe_test_server *s, int seconds, const char *what) {
    const int rc = moe_test_server_wait(s, seconds);
    if (rc < 0) fail_msg("%s: the job did not end within %d s (log: %s)", what, seconds, s->log);
    return rc;
}

/* The server's log holds `want`; fails the test otherwise. */
static void log_says(const moe_test_server *s, const char *want) {
    size_t n;
    moe_error err = {0};
    uint8_t *log = NULL;
    if (moe_file_read(s->log, &log, &n, &err) != MOE_OK) fail_msg("%s", err.msg);
    log = moe_xrealloc(log, n + 1);
    log[n] = 0;
    if (!strstr((const char *)log, want)) fail_msg("%s lacks '%s':\n%s", s->log, want, log);
    free(log);
}

/* A rank that dies (kill -9 of rank 1, its pid from /health) must not leave rank 0 waiting
 * forever. Under `mpirun --enable-recovery` (mpirun leaves rank 0 running): a request in flight
 * (slowed by --step-delay) fails with 503 naming the rank instead of hanging in its step's
 * reduction, /health answers 503 with the rank "lost", a new request gets 503 with a JSON error
 * naming it, and the job ends with that message. Under a plain mpirun, mpirun ends the
 * job itself with its message naming rank 1. Every wait is bounded. */
static void dead_rank(void **state) {
    (void)state;
    const char *bin, *model = parity_and_bin("qwen3next-f32.gguf", &bin);
    MOE_SKIP_IF_NULL(model);
    char *const recovery[] = {
        "mpirun", "--allow-run-as-root", "--oversubscribe", "--enable-recovery", "-np", "2", NULL};
    char *args[] = {(char *)model, "--split", "experts", "--step-delay", "20", NULL};
    for (int keep = 1; keep >= 0; keep--) {
        moe_test_server srv = {0};
        if (!moe_test_server_start_with(&srv, keep ? "dead-rank-kept" : "dead-rank",
                                        keep ? recovery : mpi_two, bin, args))
            fail_msg("a server under mpirun did not start (logs in %s)", moe_test_tmpdir());
        long long held[2];
        char url[256], body[512], pid_text[64];
        snprintf(url, sizeof url, "%s/health", srv.url);
        long status;
        char *reply = moe_test_http(url, NULL, &status);
        json_t *health = json_loads(reply, 0, NULL);
        const long pid1 = (long)json_integer_value(
            json_object_get(json_array_get(json_object_get(health, "ranks"), 1), "pid"));
        json_decref(health);
        free(reply);
        health_ranks(&srv, held);
        snprintf(pid_text, sizeof pid_text, "rank 1 of 2 (pid %ld", pid1);
        /* a request in flight: about 20 ms a token, far longer than the test waits */
        snprintf(url, sizeof url, "%s/v1/completions", srv.url);
        snprintf(body, sizeof body,
                 "{\"prompt\":[1,403,407],\"max_tokens\":1000,\"ignore_eos\":true}");
        struct curl_slist *hdr = curl_slist_append(NULL, "content-type: application/json");
        moe_strbuf out = {0};
        CURLM *multi = curl_multi_init();
        CURL *easy = moe_test_http_handle(url, body, hdr, &out);
        curl_multi_add_handle(multi, easy);
        int running = 1;
        for (int i = 0; i < 10; i++) { /* let it start decoding */
            curl_multi_perform(multi, &running);
            curl_multi_poll(multi, NULL, 0, 50, NULL);
        }
        kill((pid_t)pid1, SIGKILL);
        if (!keep) {
            const int rc = job_exit(&srv, 30, "plain mpirun");
            if (rc == 0) fail_msg("plain mpirun: the job exited 0 after rank 1 was killed");
            log_says(&srv, "rank 1");
        } else {
            while (running) { /* bounded by the handle's own timeout */
                if (curl_multi_perform(multi, &running) != CURLM_OK) fail_msg("curl_multi_perform");
                if (running) curl_multi_poll(multi, NULL, 0, 1000, NULL);
            }
            curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
            moe_strbuf_put(&out, "", 0);
            if (status != 503 || !strstr(out.s, pid_text))
                fail_msg("the request in flight got %ld, expected 503 naming %s): %s", status,
                         pid_text, out.s);
            snprintf(url, sizeof url, "%s/health", srv.url);
            reply = moe_test_http(url, NULL, &status);
            health = json_loads(reply, 0, NULL);
            json_t *rank1 = json_array_get(json_object_get(health, "ranks"), 1);
            if (status != 503 ||
                strcmp(json_string_value(json_object_get(health, "status")), "rank_lost") != 0 ||
                strcmp(json_string_value(json_object_get(rank1, "status")), "lost") != 0)
                fail_msg("/health after rank 1 was killed: %ld %s", status, reply);
            json_decref(health);
            free(reply);
            snprintf(url, sizeof url, "%s/v1/completions", srv.url);
            reply = moe_test_http(url, body, &status);
            json_t *err = json_loads(reply, 0, NULL), *e = json_object_get(err, "error");
            if (status != 503 ||
                !strstr(json_string_value(json_object_get(e, "message")), pid_text) ||
                strcmp(json_string_value(json_object_get(e, "code")), "rank_lost") != 0)
                fail_msg("a new request after rank 1 was killed: %ld %s", status, reply);
            json_decref(err);
            free(reply);
            /* (mpirun --enable-recovery exits 0 whatever its ranks return: Open MPI 4.1) */
            const int rc = job_exit(&srv, 30, "mpirun --enable-recovery");
            log_says(&srv, pid_text);
            print_message("mpi serve: rank 1 killed: 503 in flight, /health and new requests, the "
                          "job ended (%d) naming it\n",
                          rc);
        }
        curl_multi_remove_handle(multi, easy);
        curl_easy_cleanup(easy);
        curl_multi_cleanup(multi);
        curl_slist_free_all(hdr);
        moe_strbuf_free(&out);
    }
}

int moe_suite_mpi(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(split_argument_errors),
        cmocka_unit_test(parity_models_split),
        cmocka_unit_test(many_experts_per_token),
        cmocka_unit_test(rows_split_in_blocks),
        cmocka_unit_test(run_greedy_tokens),
        cmocka_unit_test(failing_rank_ends_job),
        cmocka_unit_test(chat_under_mpirun),
        cmocka_unit_test(serve_under_mpirun),
        cmocka_unit_test(serve_streams_under_mpirun),
        cmocka_unit_test(serve_mtp_under_mpirun),
        cmocka_unit_test(dead_rank),
    };
    return cmocka_run_group_tests_name("mpi", tests, NULL, NULL);
}
