/* encode.c: text -> token ids. Special-token partition, then SentencePiece or BPE.
 *
 * Owns the three steps of encoding: cutting special tokens out of the text (longest text first,
 * each one over every raw fragment left, as llama.cpp does), the SentencePiece merge loop
 * (highest-score adjacent pair first, leftmost on ties, unknown characters as <0xNN> bytes) and
 * the BPE merge loop (lowest merge rank first, leftmost on ties) over the words the
 * pre-tokenizer cut: byte-level (each byte as GPT-2's stand-in character) or SentencePiece-style
 * (gemma4: spaces as U+2581, UTF-8 characters as they are, a character with no token as its
 * <0xNN> bytes). Both loops share one heap of candidate pairs and one symbol list.
 * The trap: a pair popped from the heap may be stale -- one of its symbols was merged away or
 * grew since it was pushed. A pair is applied only when both symbols are alive, still adjacent,
 * and unchanged (same byte length for SPM, same token id for BPE); otherwise it is dropped. */
#include <stdlib.h>
#include <string.h>

#include "text_internal.h"

/* ==== Output ==== */

typedef struct id_list {
    int32_t *v;
    size_t n, cap;
} id_list;

static void ids_push(id_list *l, int32_t id) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->v = moe_xrealloc(l->v, l->cap * sizeof *l->v);
    }
    l->v[l->n++] = id;
}

/* ==== Symbols and the pair heap ==== */

typedef struct symbol {
    size_t off, len; /* bytes of the working text */
    int32_t prev, next;
    int32_t id; /* BPE: the token these bytes are, or -1 */
} symbol;

typedef struct pair {
    double priority; /* larger first: SPM score, or -rank for BPE */
    int32_t left, right;
    size_t len;      /* SPM: byte length of the merged text */
    int32_t left_id; /* BPE: the ids the pair was built from */
    int32_t right_id;
    int32_t merged; /* BPE: the id the merge makes */
} pair;

typedef struct work {
    symbol *sym;
    size_t n_sym, cap_sym;
    pair *heap;
    size_t n_heap, cap_heap;
} work;

static bool pair_before(const pair *a, const pair *b) {
    if (a->priority != b->priority) return a->priority > b->priority;
    return a->left < b->left;
}

static void heap_push(work *w, pair p) {
    if (w->n_heap == w->cap_heap) {
        w->cap_heap = w->cap_heap ? 2 * w->cap_heap : 64;
        w->heap = moe_xrealloc(w->heap, w->cap_heap * sizeof *w->heap);
    }
    size_t i = w->n_heap++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!pair_before(&p, &w->heap[parent])) break;
        w->heap[i] = w->heap[parent];
        i = parent;
    }
    w->heap[i] = p;
}

static pair heap_pop(work *w) {
    pair top = w->heap[0];
    pair last = w->heap[--w->n_heap];
    size_t i = 0, n = w->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && pair_before(&w->heap[c + 1], &w->heap[c])) c++;
        if (!pair_before(&w->heap[c], &last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n) w->heap[i] = last;
    return top;
}

/* One symbol per UTF-8 character of text (a stray byte is a character of its own). */
static void symbols_from_chars(work *w, const char *text, size_t len) {
    w->n_sym = 0;
    w->n_heap = 0;
    if (w->cap_sym < len) {
        w->cap_sym = len;
        w->sym = moe_xrealloc(w->sym, w->cap_sym * sizeof *w->sym);
    }
    for (size_t off = 0; off < len;) {
        size_t n = moe_utf8_len((uint8_t)text[off]);
        if (n > len - off) n = len - off;
        symbol *s = &w->sym[w->n_sym];
        s->off = off;
        s->len = n;
        s->prev = (int32_t)w->n_sym - 1;
        s->next = off + n < len ? (int32_t)w->n_sym + 1 : -1;
        s->id = MOE_TOKEN_NONE;
        w->n_sym++;
        off += n;
    }
}

/* Merge symbol right into left. */
static void symbols_merge(work *w, int32_t left, int32_t right) {
    symbol *l = &w->sym[left], *r = &w->sym[right];
    l->len += r->len;
    r->len = 0;
    l->next = r->next;
    if (r->next >= 0) w->sym[r->next].prev = left;
}

/* Bytes with no token of their own: <0xNN> tokens, else the unknown token. */
static moe_status push_bytes(const moe_tokenizer *tok, const char *s, size_t n, id_list *out,
                             moe_error *err) {
    for (size_t i = 0; i < n; i++) {
        int32_t id = tok->byte_ids[(uint8_t)s[i]];
        if (id < 0) id = tok->unk;
        if (id < 0)
            return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                 "byte 0x%02x has no token and the vocabulary has no unknown token",
                                 (uint8_t)s[i]);
        ids_push(out, id);
    }
    return MOE_OK;
}

/* ==== SentencePiece ==== */

static void spm_try_pair(const moe_tokenizer *tok, work *w, const char *text, int32_t left,
                         int32_t right) {
    if (left < 0 || right < 0) return;
    const symbol *l = &w->sym[left], *r = &w->sym[right];
    int32_t id = moe_str_index_get(tok, text + l->off, l->len + r->len);
    if (id < 0) return;
    pair p = {
        .priority = tok->tokens[id].score, .left = left, .right = right, .len = l->len + r->len};
    heap_push(w, p);
}

/* text is already escaped (spaces as U+2581, dummy prefix added). */
static moe_status spm_tokenize(const moe_tokenizer *tok, work *w, const char *text, size_t len,
                               id_list *out, moe_error *err) {
    symbols_from_chars(w, text, len);
    for (size_t i = 1; i < w->n_sym; i++) spm_try_pair(tok, w, text, (int32_t)i - 1, (int32_t)i);
    while (w->n_heap) {
        pair p = heap_pop(w);
        symbol *l = &w->sym[p.left], *r = &w->sym[p.right];
        if (l->len == 0 || r->len == 0 || l->next != p.right || l->len + r->len != p.len)
            continue; /* stale */
        symbols_merge(w, p.left, p.right);
        spm_try_pair(tok, w, text, w->sym[p.left].prev, p.left);
        spm_try_pair(tok, w, text, p.left, w->sym[p.left].next);
    }
    for (int32_t i = w->n_sym ? 0 : -1; i >= 0; i = w->sym[i].next) {
        const symbol *s = &w->sym[i];
        int32_t id = moe_str_index_get(tok, text + s->off, s->len);
        if (id >= 0) {
            ids_push(out, id);
            continue;
        }
        moe_status st = push_bytes(tok, text + s->off, s->len, out, err);
        if (st != MOE_OK) return st;
    }
    return MOE_OK;
}

#define SPM_SPACE "\xe2\x96\x81" /* U+2581 LOWER ONE EIGHTH BLOCK */

/* Escape a raw fragment for SPM into buf: optional dummy prefix, ' ' -> U+2581. */
static size_t spm_escape(const char *text, size_t len, bool prefix, char *buf) {
    size_t n = 0;
    if (prefix) {
        memcpy(buf, SPM_SPACE, 3);
        n = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(buf + n, SPM_SPACE, 3);
            n += 3;
        } else {
            buf[n++] = text[i];
        }
    }
    return n;
}

/* ==== Byte-level BPE ==== */

static void bpe_try_pair(const moe_tokenizer *tok, work *w, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    int32_t a = w->sym[left].id, b = w->sym[right].id;
    if (a < 0 || b < 0) return;
    const moe_merge_entry *m = moe_merge_find(tok, a, b);
    if (!m || m->merged < 0) return;
    pair p = {.priority = -(double)m->rank,
              .left = left,
              .right = right,
              .left_id = a,
              .right_id = b,
              .merged = m->merged};
    heap_push(w, p);
}

/* One pre-tokenized word: mapped through GPT-2's byte-to-unicode table (byte-level), or escaped
 * text (SentencePiece-style, where a symbol with no token falls back to its bytes). */
static moe_status bpe_word(const moe_tokenizer *tok, work *w, const char *word, size_t len,
                           id_list *out, moe_error *err) {
    if (tok->ignore_merges) {
        int32_t id = moe_str_index_get(tok, word, len);
        if (id >= 0) {
            ids_push(out, id);
            return MOE_OK;
        }
    }
    symbols_from_chars(w, word, len);
    for (size_t i = 0; i < w->n_sym; i++)
        w->sym[i].id = moe_str_index_get(tok, word + w->sym[i].off, w->sym[i].len);
    for (size_t i = 1; i < w->n_sym; i++) bpe_try_pair(tok, w, (int32_t)i - 1, (int32_t)i);
    while (w->n_heap) {
        pair p = heap_pop(w);
        symbol *l = &w->sym[p.left], *r = &w->sym[p.right];
        if (l->len == 0 || r->len == 0 || l->next != p.right || l->id != p.left_id ||
            r->id != p.right_id)
            continue; /* stale */
        symbols_merge(w, p.left, p.right);
        w->sym[p.left].id = p.merged;
        bpe_try_pair(tok, w, w->sym[p.left].prev, p.left);
        bpe_try_pair(tok, w, p.left, w->sym[p.left].next);
    }
    for (int32_t i = w->n_sym ? 0 : -1; i >= 0; i = w->sym[i].next) {
        if (w->sym[i].id >= 0) {
            ids_push(out, w->sym[i].id);
            continue;
        }
        if (tok->kind == MOE_TOKENIZER_SPM_BPE) {
            moe_status st = push_bytes(tok, word + w->sym[i].off, w->sym[i].len, out, err);
            if (st != MOE_OK) return st;
            continue;
        }
        /* a byte whose mapped character is no token: only the unknown token can stand in */
        if (tok->unk < 0)
            return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                                 "a byte has no token and the vocabulary has no unknown token");
        ids_push(out, tok->unk);
    }
    return MOE_OK;
}

/* The pre-tokenizer's words of text, each merged by bpe_word: byte-level words mapped into
 * `mapped` first; SentencePiece-style text is escaped already, and a run of newlines that is
 * itself a token stays whole (llama.cpp's rule for Gemma 4, whose newline tokens no merge makes).
 */
static moe_status bpe_tokenize(const moe_tokenizer *tok, work *w, const char *text, size_t len,
                               char *mapped, id_list *out, moe_error *err) {
    moe_span *spans;
    size_t n_spans;
    moe_status st = moe_pretok_split(&tok->pretok, text, len, &spans, &n_spans, err);
    if (st != MOE_OK) return st;
    for (size_t s = 0; s < n_spans && st == MOE_OK; s++) {
        const char *raw = text + spans[s].off;
        if (tok->kind == MOE_TOKENIZER_SPM_BPE) {
            size_t k = 0;
            while (k < spans[s].len && raw[k] == '\n') k++;
            int32_t whole = k == spans[s].len ? moe_str_index_get(tok, raw, k) : MOE_TOKEN_NONE;
            if (whole >= 0)
                ids_push(out, whole);
            else
                st = bpe_word(tok, w, raw, spans[s].len, out, err);
            continue;
        }
        size_t n = 0;
        for (size_t i = 0; i < spans[s].len; i++) {
            uint32_t cp = moe_bytelevel_cp((uint8_t)raw[i]);
            if (cp < 0x80) {
                mapped[n++] = (char)cp;
            } else { /* all mapped code points are < 0x800: two bytes */
                mapped[n++] = (char)(0xc0 | (cp >> 6));
                mapped[n++] = (char)(0x80 | (cp & 0x3f));
            }
        }
        st = bpe_word(tok, w, mapped, n, out, err);
    }
    free(spans);
    return st;
}

/* ==== Special-token partition ==== */

typedef struct fragment {
    size_t off, len; /* raw text, when id < 0 */
    int32_t id;      /* a special token, or -1 */
} fragment;

typedef struct fragment_list {
    fragment *v;
    size_t n, cap;
} fragment_list;

static void frag_push(fragment_list *l, size_t off, size_t len, int32_t id) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 16;
        l->v = moe_xrealloc(l->v, l->cap * sizeof *l->v);
    }
    l->v[l->n++] = (fragment){off, len, id};
}

/* Whether [at, at + n) touches one of the sorted, disjoint plain spans (binary search: a prompt
 * may hold a span per special-token string a client wrote). */
static bool in_plain_span(const moe_text_span *plain, size_t n_plain, size_t at, size_t n) {
    size_t lo = 0, hi = n_plain;
    while (lo < hi) { /* the first span that ends after `at` */
        size_t mid = lo + (hi - lo) / 2;
        if (plain[mid].off + plain[mid].len <= at)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n_plain && plain[lo].off < at + n;
}

/* Cut every allowed special token out of the raw fragments, longest token first. A control
 * token whose text touches a plain span stays text. */
static void partition(const moe_tokenizer *tok, const char *text, size_t len, bool parse_special,
                      const moe_text_span *plain, size_t n_plain, fragment_list *frags) {
    fragment_list next = {0};
    frag_push(frags, 0, len, MOE_TOKEN_NONE);
    for (uint32_t k = 0; k < tok->n_special; k++) {
        int32_t id = tok->special[k];
        const moe_vocab_token *t = &tok->tokens[id];
        const bool user_defined = t->type == MOE_TOKEN_USER_DEFINED;
        if (!parse_special && !user_defined) continue;
        const char *needle = tok->text_buf + t->text_off;
        bool any = false;
        next.n = 0;
        for (size_t f = 0; f < frags->n; f++) {
            fragment fr = frags->v[f];
            if (fr.id >= 0 || fr.len < t->text_len) {
                frag_push(&next, fr.off, fr.len, fr.id);
                continue;
            }
            size_t raw = fr.off, pos = fr.off, end = fr.off + fr.len;
            for (;;) {
                const char *hit = memmem(text + pos, end - pos, needle, t->text_len);
                if (!hit) break;
                size_t at = (size_t)(hit - text);
                if (!user_defined && in_plain_span(plain, n_plain, at, t->text_len)) {
                    pos = at + 1;
                    continue;
                }
                if (at > raw) frag_push(&next, raw, at - raw, MOE_TOKEN_NONE);
                frag_push(&next, at, t->text_len, id);
                raw = pos = at + t->text_len;
                any = true;
            }
            if (raw < end) frag_push(&next, raw, end - raw, MOE_TOKEN_NONE);
        }
        if (any) {
            fragment_list t2 = *frags;
            *frags = next;
            next = t2;
        }
    }
    free(next.v);
}

/* ==== Encode ==== */

moe_status moe_tokenizer_encode(const moe_tokenizer *tok, const char *text, size_t len,
                                unsigned flags, int32_t **ids, size_t *n_ids, moe_error *err) {
    return moe_tokenizer_encode_spans(tok, text, len, flags, NULL, 0, ids, n_ids, err);
}

moe_status moe_tokenizer_encode_spans(const moe_tokenizer *tok, const char *text, size_t len,
                                      unsigned flags, const moe_text_span *plain, size_t n_plain,
                                      int32_t **ids, size_t *n_ids, moe_error *err) {
    *ids = NULL;
    *n_ids = 0;
    if (len > MOE_TOKENIZER_MAX_TEXT)
        return moe_error_set(err, MOE_ERR_RANGE,
                             "text of %zu bytes is too long to encode (max %zu)", len,
                             MOE_TOKENIZER_MAX_TEXT);
    if (len && !text) return moe_error_set(err, MOE_ERR_ARG, "encode: text is NULL");
    const bool add_special = flags & MOE_ENCODE_ADD_SPECIAL;
    id_list out = {0};
    work w = {0};
    fragment_list frags = {0};
    /* scratch for one fragment: SPM escapes a byte to at most 3 bytes (+3 for the prefix), the
     * byte-level mapping to at most 2 */
    char *buf = moe_xmalloc(3 * len + 4);
    moe_status st = MOE_OK;

    if (add_special && tok->add_bos) ids_push(&out, tok->bos);
    if (len) partition(tok, text, len, flags & MOE_ENCODE_PARSE_SPECIAL, plain, n_plain, &frags);
    /* SPM: the dummy prefix goes before the first raw fragment (and after special tokens) */
    bool prev_special = !(flags & MOE_ENCODE_CONTINUATION);
    for (size_t f = 0; f < frags.n && st == MOE_OK; f++) {
        const fragment *fr = &frags.v[f];
        if (fr->id >= 0) {
            ids_push(&out, fr->id);
            prev_special = true;
            continue;
        }
        if (tok->kind == MOE_TOKENIZER_SPM) {
            size_t n =
                spm_escape(text + fr->off, fr->len, tok->add_space_prefix && prev_special, buf);
            st = spm_tokenize(tok, &w, buf, n, &out, err);
        } else if (tok->kind == MOE_TOKENIZER_SPM_BPE) {
            size_t n = spm_escape(text + fr->off, fr->len, false, buf);
            st = bpe_tokenize(tok, &w, buf, n, NULL, &out, err); /* nothing to map */
        } else {
            st = bpe_tokenize(tok, &w, text + fr->off, fr->len, buf, &out, err);
        }
        prev_special = false;
    }
    if (add_special && tok->add_eos) ids_push(&out, tok->eos);

    free(buf);
    free(frags.v);
    free(w.sym);
    free(w.heap);
    if (st != MOE_OK) {
        free(out.v);
        return st;
    }
    if (!out.v) out.v = moe_xmalloc(sizeof *out.v); /* a valid pointer even for no ids */
    *ids = out.v;
    *n_ids = out.n;
    return MOE_OK;
}
