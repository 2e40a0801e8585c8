/* eval.c: `moe eval labels | compare | kl` -- the command lines and the printing; the scoring,
 * the bootstrap and the KL statistics live in src/tools/eval.c. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../src/tools/tools.h"
#include "args.h"
#include "cli.h"

static const char labels_usage[] =
    "usage: moe eval labels MODEL|URL --records F.jsonl [--reverse-options] [-o|--out OUT.jsonl] "
    "[--json]\n"
    "         [-t N] [--kv-type f32|f16|q8_0] [--chat-template-file F.jinja] [--api-key K] "
    "[--model "
    "NAME]\n\n"
    "Each record (a JSON object per line): \"prompt\" (text) or \"messages\" (a chat, rendered "
    "with\n"
    "the model's template), \"labels\" (2..64 strings), optional \"id\", \"answer\" (index or "
    "text)\n"
    "and \"options\" (one per label; \"{options}\" in the prompt becomes the lines \"LABEL. "
    "OPTION\").\n"
    "The answer is the label whose tokens have the highest summed log-probability after the\n"
    "prompt. MODEL runs in-process; an http(s) URL is an OpenAI-compatible server (POST "
    "/tokenize,\n"
    "/apply-template, /v1/completions with echo + logprobs). --reverse-options scores every\n"
    "three-label record with options a second time with the options listed in reverse.\n"
    "Per-record results (JSONL) go to -o, else to stdout; the summary to stdout (with -o) or\n"
    "stderr, as one JSON object with --json. --ids adds the token ids scored to each result.\n"
    "Labels are tokenized alone (no BOS): on a SentencePiece vocabulary write them without a\n"
    "leading space (its dummy prefix adds one). -t defaults to the physical cores, --kv-type\n"
    "to f32;\n"
    "--model names the model to a server (vLLM wants its served name), --api-key its key.\n";

static const char compare_usage[] =
    "usage: moe eval compare A.jsonl B.jsonl [--resamples N] [--seed S] [--json]\n\n"
    "Accuracy of two `moe eval labels` result files over the records both scored (by id), the\n"
    "paired difference B - A with a 95% percentile bootstrap interval (N resamples, default "
    "10000,\n"
    "at least 2000; indices are splitmix64(S) mod n, one stream, see src/tools/tools.h), and "
    "the\n"
    "records whose correctness flips.\n";

static const char kl_usage[] =
    "usage: moe eval kl MODEL --ref REF_MODEL (--text F | --tokens IDS) [--ctx N] [-t N] "
    "[--json]\n\n"
    "KL(REF || MODEL) of the next-token distributions as llama-perplexity --kl-divergence "
    "reports\n"
    "it: chunks of N tokens (default 512), each scored over its second half; mean, median, "
    "p90,\n"
    "p95, p99, p99.9, max, min, top-1 agreement and both perplexities.\n";

/* The engine options' defaults here: the physical cores (as every forward-pass command), and an
 * f32 KV cache (exact scores). */
static moe_engine_args eval_engine_args(void) {
    return (moe_engine_args){.n_threads = moe_cpu_cores(), .kv_type = MOE_TYPE_F32};
}

/* ==== labels ==== */

static void write_ids(moe_json *j, const char *key, const int32_t *ids, size_t n) {
    if (key) moe_json_key(j, key);
    moe_json_array_begin(j);
    for (size_t i = 0; i < n; i++) moe_json_int(j, ids[i]);
    moe_json_array_end(j);
}

static void write_result(moe_json *j, const moe_eval_record *r, const moe_eval_score *s, bool ids) {
    moe_json_object_begin(j);
    moe_json_kv_string(j, "id", r->id);
    moe_json_kv_uint(j, "line", r->line);
    moe_json_kv_bool(j, "reversed", r->reversed);
    moe_json_kv_uint(j, "prompt_tokens", s->n_prompt);
    moe_json_key(j, "labels");
    moe_json_array_begin(j);
    for (uint32_t k = 0; k < r->n_labels; k++) moe_json_string(j, r->labels[k]);
    moe_json_array_end(j);
    moe_json_key(j, "label_tokens");
    moe_json_array_begin(j);
    for (uint32_t k = 0; k < r->n_labels; k++) moe_json_uint(j, s->n_tokens[k]);
    moe_json_array_end(j);
    moe_json_key(j, "logprobs");
    moe_json_array_begin(j);
    for (uint32_t k = 0; k < r->n_labels; k++) moe_json_double(j, s->logprob[k]);
    moe_json_array_end(j);
    moe_json_kv_int(j, "pred", s->pred);
    moe_json_kv_string(j, "pred_label", r->labels[s->pred]);
    if (ids) {
        write_ids(j, "prompt_ids", s->prompt_ids, s->n_prompt);
        moe_json_key(j, "label_ids");
        moe_json_array_begin(j);
        for (uint32_t k = 0; k < r->n_labels; k++)
            write_ids(j, NULL, s->label_ids[k], s->n_tokens[k]);
        moe_json_array_end(j);
    }
    moe_json_key(j, "answer");
    if (r->answer >= 0)
        moe_json_int(j, r->answer);
    else
        moe_json_null(j);
    moe_json_key(j, "correct");
    if (r->answer >= 0)
        moe_json_bool(j, s->pred == r->answer);
    else
        moe_json_null(j);
    moe_json_object_end(j);
}

typedef struct labels_tally {
    size_t records, answered, correct;                         /* the records as given */
    size_t rev_records, rev_answered, rev_correct, consistent; /* their reversed copies */
} labels_tally;

static void print_tally(FILE *f, const labels_tally *t, bool json) {
    if (json) {
        moe_json j;
        moe_json_init(&j, false);
        moe_json_object_begin(&j);
        moe_json_kv_uint(&j, "records", t->records);
        moe_json_kv_uint(&j, "answered", t->answered);
        moe_json_kv_uint(&j, "correct", t->correct);
        moe_json_kv_double(&j, "accuracy",
                           t->answered ? (double)t->correct / (double)t->answered : 0.0 / 0.0);
        if (t->rev_records) {
            moe_json_kv_uint(&j, "reversed_records", t->rev_records);
            moe_json_kv_uint(&j, "reversed_correct", t->rev_correct);
            moe_json_kv_double(&j, "reversed_accuracy",
                               t->rev_answered ? (double)t->rev_correct / (double)t->rev_answered
                                               : 0.0 / 0.0);
            moe_json_kv_uint(&j, "consistent", t->consistent);
        }
        moe_json_object_end(&j);
        fprintf(f, "%s\n", j.buf);
        moe_json_free(&j);
        return;
    }
    fprintf(f, "records %zu, with an answer %zu, correct %zu", t->records, t->answered, t->correct);
    if (t->answered) fprintf(f, ": accuracy %.4f", (double)t->correct / (double)t->answered);
    fprintf(f, "\n");
    if (t->rev_records) {
        fprintf(f, "reversed options: %zu records, correct %zu", t->rev_records, t->rev_correct);
        if (t->rev_answered)
            fprintf(f, ": accuracy %.4f", (double)t->rev_correct / (double)t->rev_answered);
        fprintf(f, "; the same option chosen both ways in %zu of %zu\n", t->consistent,
                t->rev_records);
    }
}

static int cmd_labels(int argc, char **argv) {
    const char *model = NULL, *records_path = NULL, *out_path = NULL, *tmpl = NULL;
    const char *api_key = NULL, *model_name = NULL;
    bool reverse = false, json = false, ids = false;
    moe_engine_args engine = eval_engine_args();
    for (int i = 0; i < argc; i++) {
        const int taken = moe_engine_args_parse("eval labels", &engine, argc, argv, &i);
        if (taken < 0) return 2;
        if (taken) continue;
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(labels_usage, stdout);
            printf("\nengine options:\n");
            moe_engine_args_print(stdout, &engine);
            return 0;
        } else if (strcmp(argv[i], "--records") == 0 && i + 1 < argc)
            records_path = argv[++i];
        else if ((strcmp(argv[i], "-o") == 0 || strcmp(argv[i], "--out") == 0) && i + 1 < argc)
            out_path = argv[++i];
        else if (strcmp(argv[i], "--chat-template-file") == 0 && i + 1 < argc)
            tmpl = argv[++i];
        else if (strcmp(argv[i], "--api-key") == 0 && i + 1 < argc)
            api_key = argv[++i];
        else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc)
            model_name = argv[++i];
        else if (strcmp(argv[i], "--reverse-options") == 0)
            reverse = true;
        else if (strcmp(argv[i], "--json") == 0)
            json = true;
        else if (strcmp(argv[i], "--ids") == 0)
            ids = true;
        else if (argv[i][0] == '-')
            return moe_cli_unknown_option("eval labels", argv[i]);
        else if (!model)
            model = argv[i];
        else
            return moe_cli_usage_error("eval", "labels: unexpected argument '%s'", argv[i]);
    }
    if (!model || !records_path)
        return moe_cli_usage_error("eval", "labels: a MODEL or URL and --records are required");
    moe_error err = {0};
    moe_eval_record *recs;
    size_t n;
    if (moe_eval_records_read(records_path, reverse, &recs, &n, &err) != MOE_OK) {
        fprintf(stderr, "moe eval labels: %s\n", err.msg);
        return 1;
    }
    moe_eval_engine_params ep = {.n_threads = engine.n_threads,
                                 .kv_type = engine.kv_type,
                                 .chat_template = tmpl,
                                 .no_repack = engine.no_repack};
    moe_eval_scorer *sc = moe_path_is_url(model)
                              ? moe_eval_scorer_url(model, api_key, model_name, &err)
                              : moe_eval_scorer_engine(model, &ep, recs, n, &err);
    FILE *out = stdout;
    if (sc && out_path && !(out = fopen(out_path, "w")))
        moe_error_set(&err, MOE_ERR_IO, "%s: cannot create", out_path);
    labels_tally t = {0};
    moe_json j;
    moe_json_init(&j, false);
    int32_t prev_pred = -1;
    const bool progress = isatty(2) && out_path;
    for (size_t i = 0; sc && out && !err.code && i < n; i++) {
        moe_eval_score s;
        if (moe_eval_scorer_run(sc, &recs[i], &s, &err) != MOE_OK) {
            moe_eval_score_free(&s);
            break;
        }
        moe_json_reset(&j);
        write_result(&j, &recs[i], &s, ids);
        moe_eval_score_free(&s);
        fprintf(out, "%s\n", j.buf);
        const moe_eval_record *r = &recs[i];
        if (r->reversed) {
            t.rev_records++;
            t.rev_answered += r->answer >= 0;
            t.rev_correct += r->answer >= 0 && s.pred == r->answer;
            t.consistent += s.pred == (int32_t)r->n_labels - 1 - prev_pred;
        } else {
            t.records++;
            t.answered += r->answer >= 0;
            t.correct += r->answer >= 0 && s.pred == r->answer;
        }
        prev_pred = s.pred;
        if (progress && (i + 1 == n || (i + 1) % 10 == 0))
            fprintf(stderr, "\rmoe eval labels: %zu / %zu records", i + 1, n);
    }
    moe_json_free(&j);
    if (progress) fputc('\n', stderr);
    if (out && out != stdout && fclose(out) != 0 && !err.code)
        moe_error_set(&err, MOE_ERR_IO, "%s: write failed", out_path);
    moe_eval_scorer_free(sc);
    moe_eval_records_free(recs, n);
    if (err.code) {
        fprintf(stderr, "moe eval labels: %s\n", err.msg);
        return 1;
    }
    print_tally(out_path ? stdout : stderr, &t, json);
    return 0;
}

/* ==== compare ==== */

static int cmd_compare(int argc, char **argv) {
    const char *paths[2] = {NULL, NULL};
    long long resamples = MOE_EVAL_DEFAULT_RESAMPLES, seed = 1;
    bool json = false;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(compare_usage, stdout);
            return 0;
        } else if (strcmp(argv[i], "--resamples") == 0 && i + 1 < argc) {
            if (!moe_arg_int("eval", "--resamples", argv[++i], MOE_EVAL_MIN_RESAMPLES, 10000000,
                             &resamples))
                return 2;
        } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
            if (!moe_arg_int("eval", "--seed", argv[++i], 0, INT64_MAX, &seed)) return 2;
        } else if (strcmp(argv[i], "--json") == 0) {
            json = true;
        } else if (argv[i][0] == '-') {
            return moe_cli_unknown_option("eval compare", argv[i]);
        } else if (!paths[0]) {
            paths[0] = argv[i];
        } else if (!paths[1]) {
            paths[1] = argv[i];
        } else {
            return moe_cli_usage_error("eval", "compare: unexpected argument '%s'", argv[i]);
        }
    }
    if (!paths[1]) return moe_cli_usage_error("eval", "compare: two result files are required");
    moe_error err = {0};
    moe_eval_result *res[2] = {NULL, NULL};
    size_t n[2] = {0, 0};
    moe_eval_compare c = {0};
    for (int f = 0; f < 2 && !err.code; f++) moe_eval_results_read(paths[f], &res[f], &n[f], &err);
    if (!err.code)
        moe_eval_compare_run(res[0], n[0], res[1], n[1], (uint32_t)resamples, (uint64_t)seed, &c,
                             &err);
    moe_eval_results_free(res[0], n[0]);
    moe_eval_results_free(res[1], n[1]);
    if (err.code) {
        fprintf(stderr, "moe eval compare: %s\n", err.msg);
        return 1;
    }
    if (json) {
        moe_json j;
        moe_json_init(&j, false);
        moe_json_object_begin(&j);
        moe_json_kv_uint(&j, "n", c.n);
        moe_json_kv_uint(&j, "only_a", c.n_only_a);
        moe_json_kv_uint(&j, "only_b", c.n_only_b);
        moe_json_kv_uint(&j, "correct_a", c.correct_a);
        moe_json_kv_uint(&j, "correct_b", c.correct_b);
        moe_json_kv_double(&j, "accuracy_a", c.acc_a);
        moe_json_kv_double(&j, "accuracy_b", c.acc_b);
        moe_json_kv_double(&j, "diff", c.diff);
        moe_json_key(&j, "ci95");
        moe_json_array_begin(&j);
        moe_json_double(&j, c.ci_low);
        moe_json_double(&j, c.ci_high);
        moe_json_array_end(&j);
        moe_json_kv_uint(&j, "resamples", c.resamples);
        moe_json_kv_uint(&j, "seed", c.seed);
        moe_json_kv_uint(&j, "a_right_b_wrong", c.a_right_b_wrong);
        moe_json_kv_uint(&j, "a_wrong_b_right", c.a_wrong_b_right);
        moe_json_kv_uint(&j, "pred_changed", c.pred_changed);
        moe_json_key(&j, "flipped");
        moe_json_array_begin(&j);
        for (size_t i = 0; i < c.n_flipped; i++) moe_json_string(&j, c.flipped[i]);
        moe_json_array_end(&j);
        moe_json_object_end(&j);
        printf("%s\n", j.buf);
        moe_json_free(&j);
    } else {
        printf("records compared: %zu (only in A: %zu, only in B: %zu)\n", c.n, c.n_only_a,
               c.n_only_b);
        printf("A %s: accuracy %.4f (%zu)\nB %s: accuracy %.4f (%zu)\n", paths[0], c.acc_a,
               c.correct_a, paths[1], c.acc_b, c.correct_b);
        printf("B - A: %+.4f, 95%% interval [%+.4f, %+.4f] (paired bootstrap, %u resamples, seed "
               "%" PRIu64 ")\n",
               c.diff, c.ci_low, c.ci_high, c.resamples, c.seed);
        printf("flipped: %zu right in A only, %zu right in B only; predictions changed: %zu\n",
               c.a_right_b_wrong, c.a_wrong_b_right, c.pred_changed);
        for (size_t i = 0; i < c.n_flipped; i++) printf("  %s\n", c.flipped[i]);
    }
    moe_eval_compare_free(&c);
    return 0;
}

/* ==== kl ==== */

static int cmd_kl(int argc, char **argv) {
    moe_eval_kl_params p = {.n_ctx = 512};
    moe_engine_args engine = eval_engine_args();
    const char *tokens_arg = NULL;
    bool json = false;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--ctx") == 0 && i + 1 < argc) {
            long long v;
            if (!moe_arg_int("eval", "--ctx", argv[++i], 4, 1 << 24, &v)) return 2;
            p.n_ctx = (uint32_t)v;
            continue;
        }
        const int taken = moe_engine_args_parse("eval kl", &engine, argc, argv, &i);
        if (taken < 0) return 2;
        if (taken) continue;
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(kl_usage, stdout);
            printf("\nengine options:\n");
            moe_engine_args_print(stdout, &engine);
            return 0;
        } else if (strcmp(argv[i], "--ref") == 0 && i + 1 < argc)
            p.ref = argv[++i];
        else if (strcmp(argv[i], "--text") == 0 && i + 1 < argc)
            p.text_path = argv[++i];
        else if (strcmp(argv[i], "--tokens") == 0 && i + 1 < argc)
            tokens_arg = argv[++i];
        else if (strcmp(argv[i], "--json") == 0)
            json = true;
        else if (argv[i][0] == '-')
            return moe_cli_unknown_option("eval kl", argv[i]);
        else if (!p.model)
            p.model = argv[i];
        else
            return moe_cli_usage_error("eval", "kl: unexpected argument '%s'", argv[i]);
    }
    if (!p.model || !p.ref || !p.text_path == !tokens_arg)
        return moe_cli_usage_error("eval", "kl: MODEL, --ref and one of --text or --tokens are "
                                           "required");
    int32_t *ids = NULL;
    if (tokens_arg && !moe_arg_token_list("eval", "--tokens", tokens_arg, &ids, &p.n_tokens))
        return 2;
    p.tokens = ids;
    p.n_threads = engine.n_threads;
    p.kv_type = engine.kv_type;
    p.no_repack = engine.no_repack;
    moe_error err = {0};
    moe_eval_kl k;
    const moe_status st = moe_eval_kl_run(&p, &k, &err);
    free(ids);
    if (st != MOE_OK) {
        fprintf(stderr, "moe eval kl: %s\n", err.msg);
        return 1;
    }
    if (json) {
        moe_json j;
        moe_json_init(&j, false);
        moe_json_object_begin(&j);
        moe_json_kv_uint(&j, "tokens", k.n_text_tokens);
        moe_json_kv_uint(&j, "ctx", k.n_ctx);
        moe_json_kv_uint(&j, "chunks", k.n_chunks);
        moe_json_kv_uint(&j, "scored", k.n_scored);
        moe_json_kv_double(&j, "kl_mean", k.kl_mean);
        moe_json_kv_double(&j, "kl_median", k.kl_median);
        moe_json_kv_double(&j, "kl_p90", k.kl_p90);
        moe_json_kv_double(&j, "kl_p95", k.kl_p95);
        moe_json_kv_double(&j, "kl_p99", k.kl_p99);
        moe_json_kv_double(&j, "kl_p999", k.kl_p999);
        moe_json_kv_double(&j, "kl_max", k.kl_max);
        moe_json_kv_double(&j, "kl_min", k.kl_min);
        moe_json_kv_double(&j, "top1_agreement", k.top1_agreement);
        moe_json_kv_double(&j, "ppl", k.ppl);
        moe_json_kv_double(&j, "ppl_ref", k.ppl_ref);
        moe_json_object_end(&j);
        printf("%s\n", j.buf);
        moe_json_free(&j);
    } else {
        printf("%zu tokens, %u chunks of %u, %zu positions scored (second half of each chunk)\n",
               k.n_text_tokens, k.n_chunks, k.n_ctx, k.n_scored);
        printf("PPL(model) %.6f  PPL(ref) %.6f  ln ratio %+.6f\n", k.ppl, k.ppl_ref,
               log(k.ppl) - log(k.ppl_ref));
        printf("KL(ref || model): mean %.6f  median %.6f  p90 %.6f  p95 %.6f  p99 %.6f  p99.9 "
               "%.6f  max %.6f  min %.6f\n",
               k.kl_mean, k.kl_median, k.kl_p90, k.kl_p95, k.kl_p99, k.kl_p999, k.kl_max, k.kl_min);
        printf("same top-1: %.3f %%\n", 100.0 * k.top1_agreement);
    }
    moe_eval_kl_free(&k);
    return 0;
}

int moe_cmd_eval(int argc, char **argv) {
    if (argc < 1)
        return moe_cli_usage_error("eval", "a subcommand is required: labels, compare or kl");
    if (strcmp(argv[0], "labels") == 0) return cmd_labels(argc - 1, argv + 1);
    if (strcmp(argv[0], "compare") == 0) return cmd_compare(argc - 1, argv + 1);
    if (strcmp(argv[0], "kl") == 0) return cmd_kl(argc - 1, argv + 1);
    return moe_cli_usage_error("eval", "unknown subcommand '%s' (labels, compare, kl)", argv[0]);
}
