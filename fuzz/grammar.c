/* fuzz/grammar.c: libFuzzer entry for constrained decoding -- the GBNF parser, grammar walks
 * and JSON Schema conversion.
 *
 * The first byte picks the mode. GBNF: the rest is a grammar; a parse error must come back as
 * a status with "grammar:LINE:COL", never a crash, a hang or a sanitizer report; a grammar that
 * parses is walked over a byte vocabulary (every byte, a few multi-byte pieces, an end token),
 * its masks taken and tokens accepted, and whatever the mask allows must be accepted. Schema:
 * the rest is a JSON Schema; its grammar, when there is one, must parse. Build and run:
 * `make fuzz-grammar`. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../src/chat/chat.h"
#include "../src/engine/engine.h"

#define N_PIECES 262 /* 256 bytes, 5 longer pieces, the end token */

static const char *const longer[] = {"{\"", "\": ", "ab", "\xc3\xa9", "\xe2\x98"};

static const char *piece(void *ud, int32_t id, size_t *len, bool *eog) {
    static char bytes[256];
    (void)ud;
    *eog = id == N_PIECES - 1;
    if (id < 256) {
        bytes[id] = (char)id;
        *len = 1;
        return bytes + id;
    }
    if (*eog) {
        *len = 0;
        return "";
    }
    *len = strlen(longer[id - 256]);
    return longer[id - 256];
}

static void walk(const moe_grammar *g, const uint8_t *choices, size_t n) {
    static moe_grammar_vocab *v;
    if (!v) v = moe_grammar_vocab_new(N_PIECES, piece, NULL, true);
    moe_grammar_state *st = moe_grammar_state_new(g, v);
    float logits[N_PIECES];
    for (size_t step = 0; step < 64; step++) {
        memset(logits, 0, sizeof logits);
        const uint32_t allowed = moe_grammar_state_apply(st, logits);
        if (!allowed) break;
        /* the choice-th allowed token */
        uint32_t want = (n ? choices[step % n] : 0) % allowed, t = 0;
        for (;; t++)
            if (logits[t] == 0.0f && want-- == 0) break;
        if (!moe_grammar_state_allows(st, (int32_t)t)) abort();
        if (!moe_grammar_state_accept(st, (int32_t)t)) abort();
        if (t == N_PIECES - 1) break;
    }
    moe_grammar_state_free(st);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    moe_error err = {0};
    const char *text = (const char *)data + 1;
    const size_t len = size - 1;
    if (data[0] & 1) {
        char *schema = malloc(len + 1);
        memcpy(schema, text, len);
        schema[len] = 0;
        char *src = moe_chat_schema_grammar(schema, NULL, &err);
        free(schema);
        if (!src) return 0;
        moe_grammar *g = moe_grammar_parse(src, strlen(src), NULL, &err);
        if (!g) abort(); /* our own grammar must parse */
        walk(g, data, size);
        moe_grammar_free(g);
        free(src);
        return 0;
    }
    moe_grammar *g = moe_grammar_parse(text, len, NULL, &err);
    if (!g) {
        if (strncmp(err.msg, "grammar:", 8) != 0) abort();
        return 0;
    }
    walk(g, data, size);
    moe_grammar_free(g);
    return 0;
}
