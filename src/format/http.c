/* http.c: GGUF over HTTP(S) range requests (libcurl) -- headers, split siblings, tensor rows.
 *
 * Owns the transport and the choice of which bytes to fetch; parsing stays in gguf.c (each
 * shard's header goes through moe_gguf_parse_named, the shards through moe_gguf_join). A
 * header's length is not written anywhere in the file, so a small walk (`scan`) over the bytes
 * fetched so far finds either the end of the tensor directory or a lower bound on the bytes it
 * still needs; the range then grows to at least that (doubling, so a 10 MB vocabulary costs a
 * handful of requests, not one per string). The walk validates nothing: on anything odd it
 * stops and lets the real parser report the error with its byte offset.
 * The trap: a server without range support answers 200 with the whole file; the write callback
 * refuses the body at its first byte, or `moe inspect` of a 400 GB model would download it. */
#include "format.h"

#include <curl/curl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Seconds to connect, and the stall (under 1 KB/s for this long) that ends a transfer. */
#define CONNECT_TIMEOUT_S 30
#define STALL_TIME_S      60

struct moe_http {
    CURL *curl; /* one handle, so connections are reused across ranges and shards */
    uint64_t first_range;
    uint64_t requests, bytes;
};

/* ==== Transport ==== */

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void curl_init_once(void) {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) moe_die("curl_global_init failed");
}

moe_http *moe_http_new(void) {
    pthread_once(&curl_once, curl_init_once);
    moe_http *h = moe_xcalloc(1, sizeof *h);
    h->curl = curl_easy_init();
    if (!h->curl) moe_die("curl_easy_init failed");
    h->first_range = MOE_HTTP_FIRST_RANGE;
    return h;
}

void moe_http_free(moe_http *h) {
    if (!h) return;
    curl_easy_cleanup(h->curl);
    free(h);
}

void moe_http_set_first_range(moe_http *h, uint64_t bytes) {
    h->first_range = bytes ? bytes : 1;
}
uint64_t moe_http_requests(const moe_http *h) {
    return h ? h->requests : 0;
}
uint64_t moe_http_bytes(const moe_http *h) {
    return h ? h->bytes : 0;
}

bool moe_path_is_url(const char *path) {
    return strncasecmp(path, "http://", 7) == 0 || strncasecmp(path, "https://", 8) == 0;
}

/* One range transfer's state, reset by every status line (a redirect starts a new response). */
typedef struct xfer {
    uint8_t *buf;
    uint64_t want; /* bytes asked for */
    uint64_t len;  /* bytes received */
    long status;
    bool has_range;
    uint64_t range_start, range_end, total; /* from Content-Range: bytes start-end/total */
    bool total_known;
    const char *refusal; /* why the write callback stopped the body, or NULL */
} xfer;

static size_t on_header(char *line, size_t size, size_t n, void *arg) {
    xfer *x = arg;
    size_t len = size * n;
    char tmp[256];
    size_t k = len < sizeof tmp - 1 ? len : sizeof tmp - 1;
    memcpy(tmp, line, k);
    tmp[k] = '\0';
    if (strncmp(tmp, "HTTP/", 5) == 0) {
        const char *sp = strchr(tmp, ' ');
        x->status = sp ? strtol(sp + 1, NULL, 10) : 0;
        x->has_range = x->total_known = false;
    } else if (strncasecmp(tmp, "Content-Range:", 14) == 0) {
        unsigned long long a, b, t;
        char star;
        if (sscanf(tmp + 14, " bytes %llu-%llu/%llu", &a, &b, &t) == 3) {
            x->has_range = x->total_known = true;
            x->range_start = a;
            x->range_end = b;
            x->total = t;
        } else if (sscanf(tmp + 14, " bytes */%llu", &t) == 1) {
            x->total_known = true; /* the 416 form: no range, the size only */
            x->total = t;
        } else if (sscanf(tmp + 14, " bytes %llu-%llu/%c", &a, &b, &star) == 3 && star == '*') {
            x->has_range = true; /* size unknown to the server */
            x->range_start = a;
            x->range_end = b;
        }
    }
    return len;
}

static size_t on_body(char *data, size_t size, size_t n, void *arg) {
    xfer *x = arg;
    size_t len = size * n;
    if (x->status == 200) {
        x->refusal = "no-range";
        return 0; /* abort before the whole file streams in */
    }
    if (x->status != 206) return len; /* an error page: drop it, the status says enough */
    if (len > x->want - x->len) {
        x->refusal = "too-long";
        return 0;
    }
    memcpy(x->buf + x->len, data, len);
    x->len += len;
    return len;
}

moe_status moe_http_read(moe_http *h, const char *url, uint64_t offset, uint64_t n, void *buf,
                         uint64_t *got, uint64_t *file_size, moe_error *err) {
    *got = 0;
    if (n == 0) return MOE_OK;
    uint64_t last;
    if (moe_add_overflow(offset, n - 1, &last))
        return moe_error_set(err, MOE_ERR_RANGE,
                             "%s: range at %" PRIu64 " + %" PRIu64 " bytes overflows", url, offset,
                             n);
    char range[64];
    snprintf(range, sizeof range, "%" PRIu64 "-%" PRIu64, offset, last);
    xfer x = {.buf = buf, .want = n};
    char curl_err[CURL_ERROR_SIZE] = "";
    CURL *c = h->curl;
    curl_easy_reset(c);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_RANGE, range);
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(c, CURLOPT_MAXREDIRS, (long)MOE_HTTP_MAX_REDIRECTS);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, (long)CONNECT_TIMEOUT_S);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, (long)STALL_TIME_S);
    curl_easy_setopt(c, CURLOPT_USERAGENT, "moe");
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, curl_err);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, &x);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &x);
    CURLcode rc = curl_easy_perform(c);
    long redirects = 0;
    curl_easy_getinfo(c, CURLINFO_REDIRECT_COUNT, &redirects);
    h->requests += 1 + (uint64_t)(redirects > 0 ? redirects : 0);
    h->bytes += x.len;

    if (x.refusal && strcmp(x.refusal, "no-range") == 0)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "%s: the server does not support range requests (it answered "
                             "bytes=%s with HTTP 200 and the whole file, not 206 Partial "
                             "Content); moe reads remote models by ranges only -- download the "
                             "file or serve it from a server with range support",
                             url, range);
    if (x.refusal)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: the server sent more than the %" PRIu64
                             " bytes asked for (bytes=%s)",
                             url, n, range);
    if (rc != CURLE_OK)
        return moe_error_set(err, MOE_ERR_IO, "%s: %s%s%s", url, curl_easy_strerror(rc),
                             curl_err[0] ? ": " : "", curl_err);
    if (x.status == 416)
        return moe_error_set(err, MOE_ERR_RANGE, "%s: bytes=%s is past the end of the file%s", url,
                             range, x.total_known ? "" : " (HTTP 416)");
    if (x.status != 206)
        return moe_error_set(err, MOE_ERR_IO, "%s: HTTP %ld for bytes=%s", url, x.status, range);
    if (!x.has_range || x.range_start != offset)
        return moe_error_set(err, MOE_ERR_FORMAT,
                             "%s: a 206 answer to bytes=%s without a "
                             "matching Content-Range",
                             url, range);
    if (!x.total_known)
        return moe_error_set(err, MOE_ERR_UNSUPPORTED,
                             "%s: the server does not say the file's "
                             "size (Content-Range ends in /*)",
                             url);
    uint64_t expect = x.total > offset ? x.total - offset : 0;
    if (expect > n) expect = n;
    if (x.len != expect || x.range_end - x.range_start + 1 != x.len)
        return moe_error_set(err, MOE_ERR_IO,
                             "%s: bytes=%s: received %" PRIu64 " bytes, "
                             "expected %" PRIu64 " (file of %" PRIu64 " bytes)",
                             url, range, x.len, expect, x.total);
    *got = x.len;
    if (file_size) *file_size = x.total;
    return MOE_OK;
}

/* ==== JSON API calls ==== */

static size_t on_reply(char *data, size_t size, size_t n, void *arg) {
    moe_strbuf *b = arg;
    const size_t len = size * n;
    if (len > MOE_HTTP_MAX_REPLY - b->len) return 0; /* curl reports a write error */
    moe_strbuf_put(b, data, len);
    return len;
}

moe_status moe_http_post_json(moe_http *h, const char *url, const char *body, size_t len,
                              const char *bearer, moe_strbuf *reply, long *status, moe_error *err) {
    moe_strbuf_reset(reply);
    *status = 0;
    char curl_err[CURL_ERROR_SIZE] = "";
    CURL *c = h->curl;
    curl_easy_reset(c);
    struct curl_slist *headers = curl_slist_append(NULL, "Content-Type: application/json");
    char auth[512];
    if (bearer) {
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", bearer);
        headers = curl_slist_append(headers, auth);
    }
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_POST, 1L);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, (long)CONNECT_TIMEOUT_S);
    curl_easy_setopt(c, CURLOPT_USERAGENT, "moe");
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, curl_err);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_reply);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, reply);
    const CURLcode rc = curl_easy_perform(c);
    curl_slist_free_all(headers);
    h->requests++;
    h->bytes += reply->len;
    if (rc != CURLE_OK)
        return moe_error_set(err, MOE_ERR_IO, "%s: %s%s%s", url, curl_easy_strerror(rc),
                             curl_err[0] ? ": " : "", curl_err);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
    return MOE_OK;
}

/* ==== Where a header ends ==== */

typedef enum { SCAN_DONE, SCAN_MORE, SCAN_ODD } scan_result;

typedef struct scan {
    const uint8_t *b;
    uint64_t size, pos;
    uint64_t need; /* SCAN_MORE: the buffer must hold at least this many bytes */
    bool odd;      /* something the parser will reject: stop walking */
} scan;

static bool sc_has(scan *s, uint64_t n) {
    if (n <= s->size - s->pos) return true;
    if (moe_add_overflow(s->pos, n, &s->need)) s->odd = true;
    return false;
}

static bool sc_le(scan *s, unsigned n, uint64_t *v) {
    if (!sc_has(s, n)) return false;
    *v = 0;
    for (unsigned i = 0; i < n; i++) *v |= (uint64_t)s->b[s->pos + i] << (8 * i);
    s->pos += n;
    return true;
}

static bool sc_skip(scan *s, uint64_t n) {
    if (!sc_has(s, n)) return false;
    s->pos += n;
    return true;
}

static bool sc_string(scan *s) {
    uint64_t len;
    if (!sc_le(s, 8, &len)) return false;
    if (len > MOE_GGUF_MAX_STRING) return !(s->odd = true);
    return sc_skip(s, len);
}

static bool sc_value(scan *s, uint64_t type, unsigned depth) {
    unsigned nb = (type <= UINT32_MAX ? moe_gguf_vtype_size((uint32_t)type) : 0);
    if (nb) return sc_skip(s, nb);
    if (type == MOE_GGUF_STRING) return sc_string(s);
    if (type != MOE_GGUF_ARRAY || depth > MOE_GGUF_MAX_NEST) return !(s->odd = true);
    uint64_t elem, n;
    if (!sc_le(s, 4, &elem) || !sc_le(s, 8, &n)) return false;
    if (n > MOE_GGUF_MAX_ARRAY) return !(s->odd = true);
    unsigned eb = (elem <= UINT32_MAX ? moe_gguf_vtype_size((uint32_t)elem) : 0);
    if (eb) return sc_skip(s, n * eb);
    uint64_t start = s->pos;
    for (uint64_t i = 0; i < n; i++) {
        if (!sc_value(s, elem, depth + 1)) {
            /* the elements left take what the ones read so far took on average (a vocabulary
             * is fetched in one more range, not one per string), and at least 8 bytes each */
            if (!s->odd) {
                uint64_t avg = i ? (s->pos - start) / i : 0, need;
                if (avg < 8) avg = 8;
                if (!moe_add_overflow(s->need, (n - i - 1) * avg, &need)) s->need = need;
            }
            return false;
        }
    }
    return true;
}

/* Walk b[0..size): SCAN_DONE with s->pos at the end of the tensor directory, SCAN_MORE with
 * s->need, or SCAN_ODD (the parser will say what is wrong). */
static scan_result scan_header(scan *s) {
    uint64_t magic, version, n_tensors, n_kv;
    if (!sc_le(s, 4, &magic) || !sc_le(s, 4, &version) || !sc_le(s, 8, &n_tensors) ||
        !sc_le(s, 8, &n_kv))
        return s->odd ? SCAN_ODD : SCAN_MORE;
    if (memcmp(s->b, "GGUF", 4) != 0 || n_tensors > MOE_GGUF_MAX_TENSORS || n_kv > MOE_GGUF_MAX_KV)
        return SCAN_ODD;
    for (uint64_t i = 0; i < n_kv; i++) {
        uint64_t type;
        if (!sc_string(s) || !sc_le(s, 4, &type) || !sc_value(s, type, 1))
            return s->odd ? SCAN_ODD : SCAN_MORE;
    }
    uint64_t start = s->pos;
    for (uint64_t i = 0; i < n_tensors; i++) {
        uint64_t n_dims = 0;
        bool ok = sc_string(s) && sc_le(s, 4, &n_dims);
        if (ok && n_dims > MOE_GGUF_MAX_DIMS) return SCAN_ODD;
        if (!ok || !sc_skip(s, 8 * n_dims + 4 + 8)) {
            if (s->odd) return SCAN_ODD;
            /* the entries left are like the ones read (at least 24 bytes each) */
            uint64_t avg = i ? (s->pos - start) / i : 0, need;
            if (avg < 24) avg = 24;
            if (!moe_add_overflow(s->need, (n_tensors - i - 1) * avg, &need)) s->need = need;
            return SCAN_MORE;
        }
    }
    return SCAN_DONE;
}

/* ==== Opening by URL ==== */

/* Fetch and parse one shard's header; *file_size from the server. */
static moe_gguf *open_shard_url(moe_http *h, const char *url, uint64_t *file_size, moe_error *err) {
    uint64_t cap = h->first_range, have = 0, total = 0;
    uint8_t *buf = moe_xmalloc((size_t)cap);
    if (moe_http_read(h, url, 0, cap, buf, &have, &total, err) != MOE_OK) {
        free(buf);
        return NULL;
    }
    for (;;) {
        scan s = {.b = buf, .size = have};
        scan_result r = scan_header(&s);
        if (r != SCAN_MORE || have == total) {
            uint64_t use = r == SCAN_DONE ? s.pos : have;
            moe_gguf *g = moe_gguf_parse_named(buf, (size_t)use, false, url, err);
            free(buf);
            *file_size = total;
            return g;
        }
        /* the bound plus an eighth for what it cannot foresee, and at least half as much
         * again as we have, so a poor bound still costs only logarithmically many requests */
        uint64_t want = s.need + s.need / 8, floor = have + have / 2;
        if (want < floor) want = floor;
        if (want > total) want = total;
        if (want > MOE_HTTP_MAX_HEADER) {
            free(buf);
            moe_error_set(err, MOE_ERR_RANGE,
                          "%s: the header needs more than %" PRIu64 " bytes (at least %" PRIu64
                          "), past the limit of %llu",
                          url, have, s.need, (unsigned long long)MOE_HTTP_MAX_HEADER);
            return NULL;
        }
        buf = moe_xrealloc(buf, (size_t)want);
        uint64_t got;
        if (moe_http_read(h, url, have, want - have, buf + have, &got, NULL, err) != MOE_OK) {
            free(buf);
            return NULL;
        }
        have += got;
    }
}

/* Where "-NNNNN-of-MMMMM.gguf" starts in url (before any ?query or #fragment), with the shard
 * number and count; false when the name is not a split's. */
static bool split_url(const char *url, size_t *at, size_t *end, unsigned *no, unsigned *count) {
    size_t e = strcspn(url, "?#");
    const size_t tail = strlen("-00001-of-00001.gguf");
    if (e < tail) return false;
    const char *s = url + e - tail;
    if (s[0] != '-' || strncmp(s + 6, "-of-", 4) != 0 || strncmp(s + 15, ".gguf", 5) != 0)
        return false;
    unsigned a = 0, b = 0;
    for (int k = 1; k <= 5; k++) {
        if (s[k] < '0' || s[k] > '9' || s[k + 9] < '0' || s[k + 9] > '9') return false;
        a = a * 10 + (unsigned)(s[k] - '0');
        b = b * 10 + (unsigned)(s[k + 9] - '0');
    }
    *at = e - tail;
    *end = e;
    *no = a;
    *count = b;
    return true;
}

moe_gguf *moe_gguf_open_url(moe_http *h, const char *url, moe_error *err) {
    uint64_t size0;
    moe_gguf *g0 = open_shard_url(h, url, &size0, err);
    if (!g0) return NULL;
    uint64_t count = 0, no = 0, total = 0;
    if (!moe_gguf_get_u64(g0, "split.count", &count) || count <= 1)
        return moe_gguf_join(&g0, &size0, 1, err);

    size_t at, end;
    unsigned name_no, name_count;
    moe_gguf_get_u64(g0, "split.no", &no);
    bool has_total = moe_gguf_get_u64(g0, "split.tensors.count", &total);
    if (count > MOE_GGUF_MAX_SHARDS || !split_url(url, &at, &end, &name_no, &name_count) ||
        name_count != count || no + 1 != name_no || !has_total) {
        if (count > MOE_GGUF_MAX_SHARDS)
            moe_error_set(err, MOE_ERR_RANGE,
                          "%s: split.count is %" PRIu64 ", more than the limit %d", url, count,
                          MOE_GGUF_MAX_SHARDS);
        else if (!split_url(url, &at, &end, &name_no, &name_count))
            moe_error_set(err, MOE_ERR_FORMAT,
                          "%s: split.count is %" PRIu64 " but the name "
                          "does not end in -NNNNN-of-MMMMM.gguf, so the other shards cannot be "
                          "found",
                          url, count);
        else if (!has_total)
            moe_error_set(err, MOE_ERR_FORMAT, "%s: split.tensors.count is missing", url);
        else
            moe_error_set(err, MOE_ERR_FORMAT,
                          "%s: the name says shard %u of %u but the "
                          "metadata says split.no %" PRIu64 " (0-based) of split.count %" PRIu64,
                          url, name_no, name_count, no, count);
        moe_gguf_close(g0);
        return NULL;
    }
    moe_gguf **parts = moe_xcalloc((size_t)count, sizeof *parts);
    uint64_t *sizes = moe_xcalloc((size_t)count, sizeof *sizes);
    parts[no] = g0;
    sizes[no] = size0;
    size_t ulen = strlen(url);
    char *sib = moe_xmalloc(ulen + 1);
    uint64_t sum = 0;
    moe_status bad = MOE_OK;
    for (uint32_t i = 0; i < count && bad == MOE_OK; i++) {
        if (!parts[i]) {
            memcpy(sib, url, ulen + 1);
            char num[8];
            snprintf(num, sizeof num, "%05u", i + 1);
            memcpy(sib + at + 1, num, 5);
            parts[i] = open_shard_url(h, sib, &sizes[i], err);
            if (!parts[i]) {
                moe_error_prefix(err, "shard %u of %" PRIu64 " of %s", i + 1, count, url);
                bad = err ? err->code : MOE_ERR_IO;
                break;
            }
            uint64_t sno = UINT64_MAX, scount = 0, stotal = 0;
            moe_gguf_get_u64(parts[i], "split.no", &sno);
            moe_gguf_get_u64(parts[i], "split.count", &scount);
            moe_gguf_get_u64(parts[i], "split.tensors.count", &stotal);
            if (sno != i || scount != count || stotal != total)
                bad = moe_error_set(err, MOE_ERR_FORMAT,
                                    "%s: expected split.no %u, split.count %" PRIu64
                                    ", split.tensors.count %" PRIu64 " (as in %s)",
                                    sib, i, count, total, url);
        }
        sum += moe_gguf_n_tensors(parts[i]);
    }
    free(sib);
    if (bad == MOE_OK && sum != total)
        bad = moe_error_set(err, MOE_ERR_FORMAT,
                            "%s: split.tensors.count is %" PRIu64 " but the %" PRIu64
                            " shards hold %" PRIu64 " tensors",
                            url, total, count, sum);
    moe_gguf *m = NULL;
    if (bad == MOE_OK) {
        m = moe_gguf_join(parts, sizes, (uint32_t)count, err);
    } else {
        for (uint64_t i = 0; i < count; i++) moe_gguf_close(parts[i]);
    }
    free(parts);
    free(sizes);
    return m;
}

moe_gguf *moe_gguf_open_any(const char *path_or_url, moe_http **http, moe_error *err) {
    if (!moe_path_is_url(path_or_url)) return moe_gguf_open(path_or_url, err);
    if (!*http) *http = moe_http_new();
    return moe_gguf_open_url(*http, path_or_url, err);
}

moe_status moe_tensor_read(const moe_gguf *g, moe_http *http, const moe_tensor *t, uint64_t offset,
                           uint64_t n, void *out, moe_error *err) {
    if (offset > t->n_bytes || n > t->n_bytes - offset)
        return moe_error_set(err, MOE_ERR_RANGE,
                             "tensor '%s': bytes %" PRIu64 "+%" PRIu64 " are outside its %" PRIu64
                             " bytes",
                             t->name.ptr, offset, n, t->n_bytes);
    if (t->data) {
        memcpy(out, t->data + offset, (size_t)n);
        return MOE_OK;
    }
    const moe_gguf_shard *sh = moe_gguf_shard_get(g, t->shard);
    if (!http || !sh || !moe_path_is_url(sh->path))
        return moe_error_set(err, MOE_ERR_ARG,
                             "tensor '%s': its data is not mapped and "
                             "there is no URL to read it from",
                             t->name.ptr);
    uint64_t got;
    moe_status s = moe_http_read(http, sh->path, t->file_offset + offset, n, out, &got, NULL, err);
    if (s != MOE_OK) return s;
    if (got != n)
        return moe_error_set(err, MOE_ERR_IO,
                             "%s: tensor '%s': the file ends %" PRIu64 " bytes into a %" PRIu64
                             "-byte read",
                             sh->path, t->name.ptr, got, n);
    return MOE_OK;
}
