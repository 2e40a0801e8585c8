/* generate: the shared loop behind `moe run` and `moe chat` -- load, prefill a prompt in
 * chunks, sample and stream tokens until a limit or end of generation, and time it all.
 * Sampling and model flags are parsed here once so both commands accept the same ones. */
#ifndef MOE_CLI_GENERATE_H
#define MOE_CLI_GENERATE_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "../src/engine/engine.h"
#include "../src/text/text.h"
#include "args.h"

typedef struct moe_gen_options {
    const char *model_path; /* NULL: the built-in demo model */
    int64_t n_predict;      /* tokens to generate (< 0: until end of generation or context) */
    moe_engine_args engine; /* --ctx, -t, --kv-type */
    moe_sampler_params sampling;
    bool print_ids;           /* show ids instead of text */
    bool ignore_eos;          /* keep going past end-of-generation tokens */
    moe_spec_kind spec;       /* --spec: where speculative drafts come from */
    bool spec_given;          /* --spec was given (else: mtp where the model has an MTP layer) */
    uint32_t n_draft;         /* --draft N: drafts per step (default 3) */
    const char *grammar_file; /* --grammar-file: constrain the output to this GBNF grammar */
    bool quiet;               /* show nothing (moe bench): the reply is only kept in g->reply */
} moe_gen_options;

#define MOE_GEN_MAX_DRAFT MOE_SPEC_MAX_DRAFT

typedef struct moe_gen {
    moe_gen_options opt;
    moe_model *model;
    moe_tokenizer *tok;
    moe_ctx *ctx;
    moe_sampler *sampler;
    moe_grammar *grammar;             /* --grammar-file, or NULL */
    moe_grammar_vocab *grammar_vocab; /* the tokenizer's trie, with a grammar */
    float *logits;                    /* [n_vocab] the next token's */
    float *verify;                    /* [n_draft + 1][n_vocab] a verify step's rows */
    int32_t *hist; /* [n_ctx + 1] the sequence's tokens and the one about to be fed */
    moe_row *rows; /* [chunk] prefill rows */
    /* --spec mtp: the trunk's hidden states the MTP head's cache still lacks (positions from its
     * length to the sequence's), and the tokens that followed them; the last one's follower is
     * the token about to be fed */
    float *mtp_h;     /* [chunk + n_draft + 1][n_embd] */
    int32_t *mtp_tok; /* [chunk + n_draft + 1] */
    uint32_t mtp_pending;
    float *mtp_logits; /* [n_vocab] the head's scratch */
    bool text_started; /* some text of this sequence was shown (keeps SPM's leading space) */
    bool tty;          /* stdout is a terminal: control characters are shown escaped */
    bool interrupted;  /* the last moe_gen_run was ended by Ctrl-C */
    char *reply;       /* [reply_len] the text the last moe_gen_run showed */
    size_t reply_len, reply_cap;
    double load_seconds;
    /* running totals for the stats line */
    uint64_t n_prompt, n_generated;
    uint64_t n_steps; /* forward steps while generating */
    uint64_t drafted[MOE_GEN_MAX_DRAFT], accepted[MOE_GEN_MAX_DRAFT]; /* by draft position */
    double prompt_seconds, gen_seconds;
} moe_gen;

void moe_gen_options_default(moe_gen_options *o);
/* Parse one option at argv[*i] into o; returns 1 if consumed, 0 if not an option of ours, -1 on
 * a usage error (already reported). */
int moe_gen_parse_option(const char *cmd, moe_gen_options *o, int argc, char **argv, int *i);
/* --help lines for every option moe_gen_parse_option takes, with defaults from `defaults`. */
void moe_gen_print_options(FILE *out, const moe_gen_options *defaults);

bool moe_gen_open(moe_gen *g, const moe_gen_options *o, const char *cmd);
void moe_gen_close(moe_gen *g);
/* Start over: an empty sequence, the sampler as new, the totals at zero (moe bench's runs;
 * g->opt.spec may then be changed between none and the kind it was opened with). */
void moe_gen_reset(moe_gen *g);
/* Feed tokens (appended to sequence 0); leaves the last row's logits in g->logits. */
bool moe_gen_prefill(moe_gen *g, const int32_t *ids, size_t n, moe_error *err);
/* Generate until n_predict, end of generation or a full context; each id is streamed as text
 * (or as an id with print_ids). `stop` optionally ends generation when the text so far ends
 * with it. Returns false on an engine error. */
bool moe_gen_run(moe_gen *g, int64_t n_predict, const char *stop, moe_error *err);
void moe_gen_print_stats(const moe_gen *g);

/* Ctrl-C (SIGINT) while moe_gen_catch_interrupt's handler is in: moe_gen_run stops at the next
 * token (g->interrupted), and a blocking read returns EINTR instead of going on. */
extern volatile sig_atomic_t moe_gen_interrupted;
void moe_gen_catch_interrupt(void);

#endif
