/* main.c: the `moe` dispatcher: `moe <subcommand> [args]`, `moe --help`, `moe --version`.
 * Subcommands are listed in one table below; each lives in its own cli/<name>.c. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"
#include "args.h"
#include "cli.h"
#include "../src/engine/engine.h"
#include "../src/quant/quant.h"

/* The engine options (--ctx, -t, --kv-type, --expert-cache...) of logits and bench. */
static void engine_options(FILE *out) {
    moe_engine_args_print(out, NULL);
}

static const moe_command commands[] = {
    {"run", moe_cmd_run, "generate text from a prompt (no model: the built-in demo model)",
     "[MODEL] [-p PROMPT | --tokens ID,...] [-n N] [--temp T] [--seed S] [-t THREADS] "
     "[--spec ngram|mtp|none (default: mtp where the model has an MTP layer)] [--draft N] "
     "[--expert-cache SIZE] [--split experts|rows] [--grammar-file F.gbnf] ...",
     moe_cmd_run_options},
    {"chat", moe_cmd_chat, "chat with a model in the terminal",
     "[MODEL] [--system TEXT] [--chat-template-file F.jinja] [--verbose-prompt] [sampling "
     "options]",
     moe_cmd_chat_options},
    {"logits", moe_cmd_logits, "write the logits of every position of a token-id prompt",
     "MODEL --tokens ID,ID,... [--mtp] [--out FILE.f32] [engine options below]", engine_options},
    {"inspect", moe_cmd_inspect,
     "header, metadata, tensor table, types histogram, bytes by role and layer",
     "FILE|SHARD|URL|DIR|F.safetensors [--json | --formats]", NULL},
    {"budget", moe_cmd_budget,
     "memory per device for a model (or a ladder of builds): fits, largest context and streams",
     "MODEL|URL [MODEL...] [--devices N] [--split rows|experts] [--mem-per-device GiB] [--ctx N] "
     "[--streams N] "
     "[--kv-type f16|f32|q8_0] [--expert-cache SIZE] [--no-vision] [--ladder] [--json] [--svg "
     "FILE]",
     NULL},
    {"audit", moe_cmd_audit,
     "quantization error of chosen rows against a float reference (rel. Frobenius, cosine, matvec)",
     "QUANT REFERENCE [--tensor REGEX] [--experts 0,100,287] [--rows N] [--seed S] [--json]\n"
     "       moe audit --ladder SRC --types IQ2_S,IQ3_S,IQ4_XS,Q4_K,... [--tensor REGEX] "
     "[--experts ...]\n"
     "        [--rows N] [--imatrix F.gguf] [-t|--threads N] [--json]  (each rung quantized from "
     "SRC's "
     "floats)",
     NULL},
    {"dump", moe_cmd_dump, "the dequantized values of a tensor (or rows of it) as float32",
     "FILE|CHECKPOINT TENSOR|W4A16-MODULE [--rows A:B] [--out FILE.f32]", NULL},
    {"synth", moe_cmd_synth,
     "write a GGUF model of a supported architecture with seeded random weights",
     "-o|--out FILE [--preset "
     "tiny|llama-tiny|glm4moe-tiny|qwen3-30b-a3b|glm53-flash|glm5next-tiny]\n"
     "        [--arch A] [--layers N] [--embd N] [--heads N] [--heads-kv N] [--head-dim N] [--ff "
     "N]\n"
     "        [--experts N] [--experts-used N] [--expert-ff N] [--vocab N] [--ctx N] [--seed S]\n"
     "        [--type 'REGEX=TYPE' ...] [--types ud-iq3_xxs] [--random-blocks] [--header-only]",
     NULL},
    {"repack", moe_cmd_repack,
     "a QAT bf16 safetensors checkpoint to Q4_0 GGUF or W4A16 with each group's 4-bit step "
     "recovered; --verify checks every group",
     "SRC OUT --to q4_0-gguf|w4a16 [--workers N] [--max-shard-size 5GB] [--vocab-from F.gguf]\n"
     "        [--json] [--report FILE] [--no-progress]\n"
     "        | --verify SRC OUT [--workers N] [--json]",
     NULL},
    {"quantize", moe_cmd_quantize,
     "requantize a GGUF model to a type or a mix, optionally with an importance matrix",
     "IN OUT [--type TYPE|Q4_K_M|Q5_K_M|IQ4_XS|IQ3_XXS|IQ2_M|ud-iq3_xxs] [--rule 'REGEX=TYPE' "
     "...]\n"
     "        [--imatrix FILE.gguf] [-t|--threads N] [--split-max-tensors N] [--quiet]\n"
     "  --type: a mix (llama.cpp's rules; default Q4_K_M) or one type for every weight matrix\n"
     "  (IQ4_XS and IQ3_XXS name the mixes: --rule '.=IQ4_XS' puts one type everywhere);\n"
     "  --rule: a tensor's type by name, first match wins, before the mix (norms and routers\n"
     "  stay as they are); IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S need --imatrix (llama.cpp GGUF)",
     NULL},
    {"imatrix", moe_cmd_imatrix,
     "importance matrix of a model over a text (llama.cpp's GGUF imatrix, for moe quantize)",
     "MODEL --text|-f FILE [-o|--out OUT.gguf] [--chunks N] [--ctx|-c N] [-t|--threads N] "
     "[--process-output] "
     "[--quiet]\n"
     "  per weight (per expert for *_exps): the sum of each input column's squared activation and\n"
     "  the rows counted, over chunks of --ctx tokens (512), each starting with BOS",
     NULL},
    {"template", moe_cmd_template, "render a chat template, or parse model output (--parse)",
     "MODEL|FILE.jinja --messages FILE.json [--tools FILE.json] [--kwargs JSON] "
     "[--no-generation-prompt | --generation-prompt] [--reasoning-open]\n"
     "        | [MODEL|FILE.jinja] --parse FORMAT|auto [--tools FILE.json]",
     NULL},
    {"bench", moe_cmd_bench,
     "throughput (prefill, decode, batched decode) beside the machine's read bandwidth",
     "MODEL [-t THREADS] [--runs N] [--pp N] [--tg N] [--streams 1,2,4,8] [--stream-steps N]\n"
     "        [--depth 1024,4096,16384] [--verify N] [--accept 0.87,0.66,0.52] [--kv-type "
     "f16|f32|q8_0]\n"
     "        [--mmap] [--expert-cache SIZE] [--split experts|rows] [--csv | --json] ...\n"
     "   or: moe bench --server URL [--concurrency 16] [--tokens 256] [--repeats 3] "
     "[--start-cmd CMD] [--svg FILE] [--json]",
     moe_cmd_bench_options},
    {"eval", moe_cmd_eval,
     "score labelled records by label probability, compare two runs, KL against a reference",
     "labels MODEL|URL --records F.jsonl [--reverse-options] [-o OUT.jsonl] [--json]\n"
     "        | compare A.jsonl B.jsonl [--resamples N] [--seed S] [--json]\n"
     "        | kl MODEL --ref REF_MODEL (--text F | --tokens IDS) [--ctx N] [--json]\n"
     "        (`moe eval labels --help` etc. for each)",
     NULL},
    {"serve", moe_cmd_serve,
     "OpenAI- and Anthropic-compatible HTTP server (continuous batching), a chat page at /",
     "[MODEL] [--host H] [--port N] [--api-key K ...] [--ctx N] [--parallel B] [--threads T] "
     "[--queue N] [--queue-timeout S] [--spec ngram|none] [--draft N]\n"
     "        [--cache-dir DIR [--cache-disk-size SIZE]]  (`moe serve --help-options` lists all)",
     moe_cmd_serve_options},
    {0},
};

static void print_help(FILE *out) {
    fprintf(out,
            "moe %s: sparse mixture-of-experts inference from quantized GGUF weights\n\n"
            "usage: moe <command> [arguments]\n\ncommands:\n",
            moe_version());
    for (const moe_command *c = commands; c->name; c++)
        fprintf(out, "  %-9s %s\n", c->name, c->summary);
    fprintf(out, "\n`moe <command> --help` shows a command's arguments.\n");
    fprintf(out, "MODEL is a GGUF file, or a Hugging Face checkpoint directory (gemma4, llama, "
                 "qwen3moe: bf16/f16/f32 or compressed-tensors W4A16; config.json, "
                 "tokenizer.json) converted in memory.\n");
}

int moe_cli_usage_error(const char *cmd, const char *fmt, ...) {
    fprintf(stderr, "moe %s: ", cmd);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    for (const moe_command *c = commands; c->name; c++)
        if (strcmp(c->name, cmd) == 0) fprintf(stderr, "usage: moe %s %s\n", c->name, c->usage);
    return 2;
}

/* ==== Suggestions ==== */

#define SUGGEST_MAX_LEN 64 /* longer words are nobody's typo of a flag */

static size_t edit_distance(const char *a, const char *b) {
    const size_t la = strlen(a), lb = strlen(b);
    if (la > SUGGEST_MAX_LEN || lb > SUGGEST_MAX_LEN) return SIZE_MAX;
    size_t row[SUGGEST_MAX_LEN + 1];
    for (size_t j = 0; j <= lb; j++) row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            const size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

const char *moe_cli_nearest(const char *word, const char *const *candidates, size_t n) {
    const size_t len = strlen(word) - strspn(word, "-");
    if (word[0] == '-' && len < 2)
        return NULL; /* "-m" is one edit from every short flag: no guess */
    size_t limit = len / 3 > 2 ? len / 3 : 2, best = SIZE_MAX;
    const char *found = NULL;
    for (size_t k = 0; k < n; k++) {
        const size_t d = edit_distance(word, candidates[k]);
        if (d <= limit && d < best) best = d, found = candidates[k];
    }
    return found;
}

static const moe_command *command_named(const char *name, size_t len) {
    for (const moe_command *c = commands; c->name; c++)
        if (strlen(c->name) == len && strncmp(c->name, name, len) == 0) return c;
    return NULL;
}

#define SUGGEST_MAX_FLAGS 256

int moe_cli_unknown_option(const char *cmd, const char *arg) {
    const moe_command *c = command_named(cmd, strcspn(cmd, " "));
    /* the candidates: every -flag in the synopsis and in the option lines */
    char *text = NULL;
    size_t text_len = 0;
    FILE *mem = open_memstream(&text, &text_len);
    if (mem && c) {
        fputs(c->usage, mem);
        fputc('\n', mem);
        if (c->options) c->options(mem);
    }
    if (mem) fclose(mem);
    const char *flags[SUGGEST_MAX_FLAGS];
    char words[SUGGEST_MAX_FLAGS][SUGGEST_MAX_LEN + 1];
    size_t n = 0;
    for (const char *p = text ? text : ""; *p && n < SUGGEST_MAX_FLAGS;) {
        const bool starts = *p == '-' && (p == text || strchr(" [|(,", p[-1]));
        const size_t w = starts ? strspn(p, "-abcdefghijklmnopqrstuvwxyz0123456789") : 1;
        if (starts && w > 1 && w <= SUGGEST_MAX_LEN) {
            memcpy(words[n], p, w);
            words[n][w] = '\0';
            flags[n] = words[n];
            n++;
        }
        p += w;
    }
    free(text);
    const char *near = moe_cli_nearest(arg, flags, n);
    if (near) return moe_cli_usage_error(cmd, "unknown option '%s' (did you mean %s?)", arg, near);
    return moe_cli_usage_error(cmd, "unknown option '%s'", arg);
}

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        print_help(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
        char cpu[256];
        moe_cpu_describe(cpu, sizeof cpu);
        const moe_kernels *k = moe_kernels_get();
        printf("moe %s\nkernels: %s (cpu: %s), %s\nmpi: %s\n", moe_version(), k->name, cpu,
               k->exact ? "exact path (MOE_EXACT=1: ggml's float order)"
                        : "fast path (MOE_EXACT=1 for ggml's float order)",
               moe_dist_describe());
        return 0;
    }
    for (const moe_command *c = commands; c->name; c++) {
        if (strcmp(c->name, argv[1]) != 0) continue;
        if (argc > 2 && (strcmp(argv[2], "--help") == 0 || strcmp(argv[2], "-h") == 0)) {
            printf("usage: moe %s %s\n\n%s\n", c->name, c->usage, c->summary);
            if (c->options) {
                printf("\noptions:\n");
                c->options(stdout);
            }
            return 0;
        }
        const int rc = c->run(argc - 2, argv + 2);
        /* the other ranks may be waiting for this one (a rank gone: finalize says which) */
        if (rc && moe_dist_size() > 1 && moe_dist_lost(false, NULL) < 0) {
            fprintf(stderr, "moe %s: rank %d failed: ending every rank of the job\n", c->name,
                    moe_dist_rank());
            moe_dist_abort(rc);
        }
        moe_dist_finalize();
        return rc;
    }
    const char *names[sizeof commands / sizeof commands[0]];
    size_t n_names = 0;
    for (const moe_command *c = commands; c->name; c++) names[n_names++] = c->name;
    const char *near = moe_cli_nearest(argv[1], names, n_names);
    if (near)
        fprintf(stderr, "moe: unknown command '%s' (did you mean 'moe %s'?)\n\n", argv[1], near);
    else
        fprintf(stderr, "moe: unknown command '%s'\n\n", argv[1]);
    print_help(stderr);
    return 2;
}
