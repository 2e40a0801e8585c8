/* decode.c: token ids -> bytes, whole or streamed.
 *
 * Owns moe_tokenizer_decode() and the streaming detokenizer. Each token's bytes were computed
 * once at load (vocab.c: spaces restored, <0xNN> and GPT-2's byte mapping undone), so decoding
 * is copying. The trap: whole decoding returns the tokens' bytes as they are, which may be
 * invalid UTF-8 (a model can emit half a character and stop); the stream detokenizer is the
 * one that guarantees whole, valid UTF-8, by holding back an incomplete sequence and turning
 * bytes that cannot start or continue one into U+FFFD. */
#include <stdlib.h>
#include <string.h>

#include "text_internal.h"

/* ==== Pieces ==== */

const char *moe_tokenizer_token_piece(const moe_tokenizer *tok, int32_t id, bool render_special,
                                      size_t *len) {
    *len = 0;
    if (id < 0 || (uint32_t)id >= tok->n_vocab) return "";
    const moe_vocab_token *t = &tok->tokens[id];
    if (!render_special && (t->type == MOE_TOKEN_CONTROL || t->type == MOE_TOKEN_UNKNOWN))
        return "";
    *len = t->piece_len;
    return tok->piece_buf + t->piece_off;
}

/* The piece of id under the decode flags, before any prefix-space removal. */
static const char *piece_for(const moe_tokenizer *tok, int32_t id, unsigned flags, size_t *len) {
    if ((flags & MOE_DECODE_SKIP_SPECIAL) && (id == tok->bos || id == tok->eos)) {
        *len = 0;
        return "";
    }
    return moe_tokenizer_token_piece(tok, id, flags & MOE_DECODE_RENDER_SPECIAL, len);
}

/* ==== Whole decoding ==== */

moe_status moe_tokenizer_decode(const moe_tokenizer *tok, const int32_t *ids, size_t n_ids,
                                unsigned flags, char **text, size_t *len, moe_error *err) {
    *text = NULL;
    *len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || (uint32_t)ids[i] >= tok->n_vocab)
            return moe_error_set(err, MOE_ERR_RANGE,
                                 "token %zu: id %d is outside the vocabulary (%u)", i, ids[i],
                                 tok->n_vocab);
        total += tok->tokens[ids[i]].piece_len; /* < 2^22 tokens of < 2^16 bytes each */
    }
    char *out = moe_xmalloc(total + 1);
    size_t n = 0;
    bool strip = (flags & MOE_DECODE_STRIP_PREFIX_SPACE) && tok->add_space_prefix;
    for (size_t i = 0; i < n_ids; i++) {
        size_t plen;
        const char *p = piece_for(tok, ids[i], flags, &plen);
        if (!plen) continue;
        if (strip && p[0] == ' ') {
            p++;
            plen--;
        }
        strip = false;
        memcpy(out + n, p, plen);
        n += plen;
    }
    out[n] = '\0';
    *text = out;
    *len = n;
    return MOE_OK;
}

/* ==== Streaming ==== */

#define UTF8_REPLACEMENT "\xef\xbf\xbd" /* U+FFFD */

struct moe_detok {
    const moe_tokenizer *tok;
    unsigned flags;
    bool started;    /* a piece with bytes has been seen (the prefix space is gone) */
    uint8_t held[4]; /* the start of an incomplete UTF-8 sequence */
    size_t n_held;
    char *out; /* [cap] the text returned by the last call */
    size_t cap;
};

moe_detok *moe_detok_new(const moe_tokenizer *tok, unsigned flags) {
    moe_detok *d = moe_xcalloc(1, sizeof *d);
    d->tok = tok;
    d->flags = flags;
    /* worst case: held bytes plus a piece, every byte becoming a 3-byte U+FFFD */
    d->cap = 3 * ((size_t)tok->max_piece_len + 4) + 1;
    d->out = moe_xmalloc(d->cap);
    return d;
}

void moe_detok_free(moe_detok *d) {
    if (!d) return;
    free(d->out);
    free(d);
}

void moe_detok_reset(moe_detok *d) {
    d->started = false;
    d->n_held = 0;
}

/* Length of the sequence a lead byte starts; 0 when it cannot start one. */
static size_t lead_len(uint8_t b) {
    if (b < 0x80) return 1;
    if (b >= 0xc2 && b <= 0xdf) return 2;
    if (b >= 0xe0 && b <= 0xef) return 3;
    if (b >= 0xf0 && b <= 0xf4) return 4;
    return 0;
}

/* Whether byte c may stand at position i (>= 1) of a sequence led by lead (no overlongs, no
 * surrogates, nothing above U+10FFFF). */
static bool cont_ok(uint8_t lead, size_t i, uint8_t c) {
    if ((c & 0xc0) != 0x80) return false;
    if (i != 1) return true;
    switch (lead) {
    case 0xe0:
        return c >= 0xa0;
    case 0xed:
        return c <= 0x9f;
    case 0xf0:
        return c >= 0x90;
    case 0xf4:
        return c <= 0x8f;
    default:
        return true;
    }
}

/* Emit whatever of the held bytes is decided; keep an incomplete valid prefix. */
static void drain(moe_detok *d, size_t *n) {
    while (d->n_held) {
        size_t need = lead_len(d->held[0]);
        size_t bad = 0; /* bytes to replace with one U+FFFD */
        if (need == 0) {
            bad = 1;
        } else {
            for (size_t i = 1; i < d->n_held && i < need; i++) {
                if (!cont_ok(d->held[0], i, d->held[i])) {
                    bad = i;
                    break;
                }
            }
            if (!bad && d->n_held < need) return; /* incomplete: hold */
        }
        size_t used = bad ? bad : need;
        if (bad) {
            memcpy(d->out + *n, UTF8_REPLACEMENT, 3);
            *n += 3;
        } else {
            memcpy(d->out + *n, d->held, need);
            *n += need;
        }
        memmove(d->held, d->held + used, d->n_held - used);
        d->n_held -= used;
    }
}

moe_status moe_detok_push(moe_detok *d, int32_t id, const char **text, size_t *len,
                          moe_error *err) {
    *text = d->out;
    *len = 0;
    d->out[0] = '\0';
    if (id < 0 || (uint32_t)id >= d->tok->n_vocab)
        return moe_error_set(err, MOE_ERR_RANGE, "token id %d is outside the vocabulary (%u)", id,
                             d->tok->n_vocab);
    size_t plen;
    const char *p = piece_for(d->tok, id, d->flags, &plen);
    if (plen && !d->started) {
        d->started = true;
        if ((d->flags & MOE_DECODE_STRIP_PREFIX_SPACE) && d->tok->add_space_prefix && p[0] == ' ') {
            p++;
            plen--;
        }
    }
    size_t n = 0;
    for (size_t i = 0; i < plen; i++) {
        d->held[d->n_held++] = (uint8_t)p[i];
        drain(d, &n);
    }
    d->out[n] = '\0';
    *len = n;
    return MOE_OK;
}

const char *moe_detok_flush(moe_detok *d, size_t *len) {
    size_t n = 0;
    if (d->n_held) { /* an incomplete sequence at the end is one malformed character */
        memcpy(d->out, UTF8_REPLACEMENT, 3);
        n = 3;
        d->n_held = 0;
    }
    d->out[n] = '\0';
    *len = n;
    return d->out;
}
