/* bench/grammar.c: what constrained decoding costs next to decoding itself.
 *
 * Loads a model (default: ../shared/models/stories260K), then generates N tokens at
 * temperature 1 under a grammar, timing separately the forward pass (moe_ctx_decode) and the
 * sampler with the grammar (mask, draw, accept); the same sampler without a grammar is timed on
 * the same logits, so the grammar's own cost is their difference. Times are the thread's CPU
 * time (single-threaded forward pass), so other load on the machine does not skew the ratio.
 * Repeats R times and prints the median of each. Usage: grammar [MODEL] [--tokens N] [--repeats R]
 * [--grammar FILE] (default grammar: JSON objects, llama.cpp's json.gbnf shape, unbounded). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../src/base/base.h"
#include "../src/chat/chat.h"
#include "../src/engine/engine.h"
#include "../src/model/model.h"

static const char json_gbnf[] =
    "root   ::= object\n"
    "value  ::= object | array | string | number | (\"true\" | \"false\" | \"null\") ws\n"
    "object ::= \"{\" ws ( string \":\" ws value (\",\" ws string \":\" ws value)* )? \"}\" ws\n"
    "array  ::= \"[\" ws ( value (\",\" ws value)* )? \"]\" ws\n"
    "string ::= \"\\\"\" ( [^\"\\\\\\x7F\\x00-\\x1F] | \"\\\\\" ([\"\\\\bfnrt] | \"u\" "
    "[0-9a-fA-F]{4}) )* \"\\\"\" ws\n"
    "number ::= (\"-\"? ([0-9] | [1-9] [0-9]{0,15})) (\".\" [0-9]+)? ([eE] [-+]? [0-9]{1,3})? "
    "ws\n"
    "ws ::= | \" \" | \"\\n\" [ \\t]{0,20}\n";

/* This thread's CPU seconds: a machine shared with other work does not count against either side.
 */
static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const char *model_path = "../shared/models/stories260K/stories260K.gguf";
    const char *grammar_path = NULL;
    int n_tokens = 512, repeats = 5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            n_tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeats") && i + 1 < argc)
            repeats = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--grammar") && i + 1 < argc)
            grammar_path = argv[++i];
        else
            model_path = argv[i];
    }
    if (n_tokens < 1 || repeats < 1 || repeats > 100) moe_die("bad --tokens / --repeats");
    moe_error err = {0};
    char *src = NULL;
    if (grammar_path) {
        uint8_t *data;
        size_t size;
        if (moe_file_read(grammar_path, &data, &size, &err)) moe_die("%s", err.msg);
        src = moe_xstrndup((const char *)data, size);
        free(data);
    }
    moe_grammar *gr =
        moe_grammar_parse(src ? src : json_gbnf, strlen(src ? src : json_gbnf), NULL, &err);
    if (!gr) moe_die("%s", err.msg);
    moe_model *m = moe_model_load(model_path, &err);
    moe_tokenizer *tok = m ? moe_tokenizer_from_gguf(m->gguf, &err) : NULL;
    if (!tok) moe_die("%s: %s", model_path, err.msg);
    moe_grammar_vocab *gv = moe_chat_grammar_vocab(tok, true);
    const uint32_t n_vocab = m->cfg.n_vocab;
    moe_ctx_params cp = {.n_ctx = (uint32_t)n_tokens + 8, .n_seq = 1, .max_rows = 8};
    moe_ctx *ctx = moe_ctx_new(m, &cp, &err);
    if (!ctx) moe_die("%s", err.msg);
    float *logits = moe_xmalloc(sizeof(float) * n_vocab);
    double *t_fwd = moe_xmalloc(sizeof(double) * repeats),
           *t_gram = moe_xmalloc(sizeof(double) * repeats),
           *t_plain = moe_xmalloc(sizeof(double) * repeats);
    int produced = 0;
    for (int r = 0; r < repeats; r++) {
        moe_sampler_params sp = {
            .temperature = 1.0f, .top_p = 1, .repeat_penalty = 1, .seed = 1234 + (uint64_t)r};
        moe_sampler *plain = moe_sampler_new(&sp, n_vocab);
        sp.grammar = gr;
        sp.grammar_vocab = gv;
        moe_sampler *constrained = moe_sampler_new(&sp, n_vocab);
        MOE_CHECK(moe_ctx_seq_truncate(ctx, 0, 0, &err) == MOE_OK);
        int32_t token = moe_tokenizer_bos(tok);
        double fwd = 0, gram = 0, pl = 0;
        int pos = 0;
        for (; pos < n_tokens; pos++) {
            moe_row row = {.seq = 0, .pos = pos, .token = token, .logits = true};
            double t0 = cpu_now();
            if (moe_ctx_decode(ctx, &row, 1, logits, &err)) moe_die("%s", err.msg);
            double t1 = cpu_now();
            (void)moe_sampler_sample(plain, logits);
            double t2 = cpu_now();
            token = moe_sampler_sample(constrained, logits).token;
            double t3 = cpu_now();
            fwd += t1 - t0;
            pl += t2 - t1;
            gram += t3 - t2;
            if (moe_tokenizer_is_eog(tok, token)) break; /* the grammar finished */
        }
        produced = pos;
        t_fwd[r] = fwd / (pos + 1);
        t_gram[r] = gram / (pos + 1);
        t_plain[r] = pl / (pos + 1);
        moe_sampler_free(plain);
        moe_sampler_free(constrained);
    }
    const double f = moe_median(t_fwd, repeats), g = moe_median(t_gram, repeats),
                 p = moe_median(t_plain, repeats);
    printf("model %s, %d tokens (last run) x %d runs, medians per token:\n", model_path, produced,
           repeats);
    printf("  forward pass           %8.2f us\n", f * 1e6);
    printf("  sampler, no grammar    %8.2f us\n", p * 1e6);
    printf("  sampler with grammar   %8.2f us\n", g * 1e6);
    printf("  grammar cost: %.2f us per token = %.1f %% of decode (forward + plain sampler)\n",
           (g - p) * 1e6, 100.0 * (g - p) / (f + p));
    free(logits);
    free(t_fwd);
    free(t_gram);
    free(t_plain);
    free(src);
    moe_ctx_free(ctx);
    moe_grammar_vocab_free(gv);
    moe_grammar_free(gr);
    moe_tokenizer_free(tok);
    moe_model_free(m);
    return 0;
}
