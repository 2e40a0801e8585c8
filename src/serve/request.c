/* request.c: what the API adapters do with any request -- errors in the API's shape, response
 * ids, reading the JSON body, the sampling fields the APIs share, setting and tokenizing the
 * prompt, and writing client JSON and token pieces back.
 *
 * The trap: every helper that answers the client (a 4xx or 5xx) returns false, and its caller
 * must not reply again -- serve_reply_text ignores a second reply, but a handler that goes on
 * after one wastes a generation. */
#include "serve_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ==== Errors and ids ==== */

static const char *reason_api_type(serve_api api, int status) {
    if (api == SERVE_API_ANTHROPIC) {
        switch (status) {
        case 401:
            return "authentication_error";
        case 403:
            return "permission_error";
        case 404:
            return "not_found_error";
        case 413:
            return "request_too_large";
        case 429:
            return "rate_limit_error";
        case 529:
            return "overloaded_error";
        default:
            return status >= 500 ? "api_error" : "invalid_request_error";
        }
    }
    switch (status) {
    case 429:
        return "rate_limit_exceeded";
    case 503:
        return "overloaded_error";
    default:
        return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

void serve_reply_error(serve_http *h, serve_api api, int status, const char *param,
                       const char *code, const char *fmt, ...) {
    if (api == SERVE_API_ANTHROPIC && status == 503) status = 529; /* Anthropic's "overloaded" */
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    moe_json j;
    moe_json_init(&j, false);
    moe_json_object_begin(&j);
    if (api == SERVE_API_ANTHROPIC) {
        moe_json_kv_string(&j, "type", "error");
        moe_json_key(&j, "error");
        moe_json_object_begin(&j);
        moe_json_kv_string(&j, "type", reason_api_type(api, status));
        moe_json_kv_string(&j, "message", msg);
        moe_json_object_end(&j);
    } else {
        moe_json_key(&j, "error");
        moe_json_object_begin(&j);
        moe_json_kv_string(&j, "message", msg);
        moe_json_kv_string(&j, "type", reason_api_type(api, status));
        moe_json_key(&j, "param");
        if (param)
            moe_json_string(&j, param);
        else
            moe_json_null(&j);
        moe_json_key(&j, "code");
        if (code)
            moe_json_string(&j, code);
        else
            moe_json_null(&j);
        moe_json_object_end(&j);
    }
    moe_json_object_end(&j);
    serve_reply_json(h, status, &j);
    moe_json_free(&j);
}

void serve_make_id(serve_server *srv, const char *prefix, char *out, size_t size) {
    const unsigned long n = atomic_fetch_add(&srv->next_id, 1);
    snprintf(out, size, "%s%08lx%08lx", prefix, (unsigned long)time(NULL) & 0xffffffffUL, n);
}

/* ==== The body and the generation parameters ==== */

/* Nesting depth of a JSON text, counting brackets outside strings (before jansson recurses). */
size_t serve_json_depth(const char *s, size_t n) {
    size_t depth = 0, max = 0;
    bool in_str = false;
    for (size_t i = 0; i < n; i++) {
        const char c = s[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
        } else if (c == '"')
            in_str = true;
        else if (c == '[' || c == '{') {
            if (++depth > max) max = depth;
        } else if ((c == ']' || c == '}') && depth)
            depth--;
    }
    return max;
}

json_t *serve_parse_body(serve_http *h, serve_api api) {
    if (serve_json_depth(h->body, h->body_len) > SERVE_MAX_JSON_DEPTH) {
        serve_reply_error(h, api, 400, NULL, NULL, "the JSON body nests deeper than %d levels",
                          SERVE_MAX_JSON_DEPTH);
        return NULL;
    }
    json_error_t e;
    /* \u0000 is valid JSON and a model may write it: what we send we must take back */
    json_t *v = json_loadb(h->body ? h->body : "", h->body_len, JSON_ALLOW_NUL, &e);
    if (!v) {
        serve_reply_error(h, api, 400, NULL, NULL,
                          "could not parse the JSON body of the request: %s (line %d, column %d)",
                          e.text, e.line, e.column);
        return NULL;
    }
    if (!json_is_object(v)) {
        serve_reply_error(h, api, 400, NULL, NULL, "the JSON body must be an object");
        json_decref(v);
        return NULL;
    }
    return v;
}

static bool number_field(serve_http *h, serve_api api, json_t *body, const char *key, double lo,
                         double hi, double *out) {
    json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_number(v)) {
        serve_reply_error(h, api, 400, key, NULL, "%s: expected a number", key);
        return false;
    }
    const double d = json_number_value(v);
    if (!(d >= lo && d <= hi)) {
        serve_reply_error(h, api, 400, key, NULL, "%s: %g is outside %g..%g", key, d, lo, hi);
        return false;
    }
    *out = d;
    return true;
}

bool serve_parse_sampling(serve_http *h, serve_api api, json_t *body, serve_gen *g,
                          const char *stop_field) {
    moe_sampler_params *sp = &g->sampling;
    double temperature = 1.0, top_p = 1.0, top_k = 0, min_p = 0, presence = 0, frequency = 0,
           repetition = 1.0;
    double seed = -1;
    if (!number_field(h, api, body, "temperature", 0, 2, &temperature) ||
        !number_field(h, api, body, "top_p", 0, 1, &top_p) ||
        !number_field(h, api, body, "top_k", 0, 1 << 30, &top_k) ||
        !number_field(h, api, body, "min_p", 0, 1, &min_p) ||
        !number_field(h, api, body, "presence_penalty", -2, 2, &presence) ||
        !number_field(h, api, body, "frequency_penalty", -2, 2, &frequency) ||
        !number_field(h, api, body, "repetition_penalty", 0.01, 100, &repetition) ||
        !number_field(h, api, body, "seed", -9.2e18, 9.2e18, &seed))
        return false;
    *sp = (moe_sampler_params){.temperature = (float)temperature,
                               .top_k = (int32_t)top_k,
                               .top_p = (float)top_p,
                               .min_p = (float)min_p,
                               .repeat_penalty = (float)repetition,
                               .presence_penalty = (float)presence,
                               .frequency_penalty = (float)frequency,
                               .penalty_last_n = 64,
                               .seed = seed >= 0 ? (uint64_t)seed
                                                 : (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)g};
    json_t *bias = json_object_get(body, "logit_bias");
    if (bias && !json_is_null(bias)) {
        if (!json_is_object(bias)) {
            serve_reply_error(h, api, 400, "logit_bias", NULL,
                              "logit_bias: expected an object of token id -> bias");
            return false;
        }
        const size_t n = json_object_size(bias);
        if (n > SERVE_MAX_BIAS) {
            serve_reply_error(h, api, 400, "logit_bias", NULL,
                              "logit_bias: %zu entries (at most %d)", n, SERVE_MAX_BIAS);
            return false;
        }
        g->bias_tokens = moe_xcalloc(n ? n : 1, sizeof(int32_t));
        g->bias_values = moe_xcalloc(n ? n : 1, sizeof(float));
        const uint32_t n_vocab = moe_tokenizer_n_vocab(serve_sched_tokenizer(h->srv->sched));
        const char *key;
        json_t *val;
        json_object_foreach(bias, key, val) {
            char *end;
            const long id = strtol(key, &end, 10);
            if (!*key || *end || id < 0 || id >= (long)n_vocab || !json_is_number(val) ||
                json_number_value(val) < -100 || json_number_value(val) > 100) {
                serve_reply_error(h, api, 400, "logit_bias", NULL,
                                  "logit_bias: '%s' must be a token id below %u mapped to a "
                                  "number in -100..100",
                                  key, n_vocab);
                return false;
            }
            const double b = json_number_value(val);
            g->bias_tokens[g->sampling.n_bias] = (int32_t)id;
            g->bias_values[g->sampling.n_bias++] = b <= -100 ? -INFINITY : (float)b;
        }
    }
    json_t *grammar = json_object_get(body, "grammar"); /* llama-server's GBNF field */
    if (grammar && !json_is_null(grammar)) {
        if (!json_is_string(grammar)) {
            serve_reply_error(h, api, 400, "grammar", NULL, "grammar: expected a GBNF string");
            return false;
        }
        moe_error err = {0};
        g->grammar =
            moe_grammar_parse(json_string_value(grammar), json_string_length(grammar), NULL, &err);
        if (!g->grammar) {
            serve_reply_error(h, api, 400, "grammar", NULL, "grammar: %s", err.msg);
            return false;
        }
    }
    if (!g->grammar && h->srv->p.grammar) { /* --grammar-file: checked at start-up */
        moe_error err = {0};
        g->grammar = moe_grammar_parse(h->srv->p.grammar, strlen(h->srv->p.grammar), NULL, &err);
        g->grammar_is_default = true;
    }
    json_t *stop = stop_field ? json_object_get(body, stop_field) : NULL;
    if (stop && !json_is_null(stop)) {
        json_t *one = json_is_string(stop) ? stop : NULL;
        if (!one && !json_is_array(stop)) {
            serve_reply_error(h, api, 400, stop_field, NULL,
                              "%s: expected a string or an array of strings", stop_field);
            return false;
        }
        const size_t n = one ? 1 : json_array_size(stop);
        if (n > SERVE_MAX_STOP) {
            serve_reply_error(h, api, 400, stop_field, NULL, "%s: %zu strings (at most %d)",
                              stop_field, n, SERVE_MAX_STOP);
            return false;
        }
        for (size_t i = 0; i < n; i++) {
            json_t *v = one ? one : json_array_get(stop, i);
            if (!json_is_string(v) || json_string_length(v) == 0 ||
                json_string_length(v) > SERVE_MAX_STOP_BYTES) {
                serve_reply_error(h, api, 400, stop_field, NULL,
                                  "%s[%zu]: expected a non-empty string of at most %d bytes",
                                  stop_field, i, SERVE_MAX_STOP_BYTES);
                return false;
            }
            g->stop[g->n_stop++] = moe_xstrndup(json_string_value(v), json_string_length(v));
        }
    }
    return true;
}

bool serve_set_prompt(serve_http *h, serve_api api, int32_t *ids, size_t n, serve_gen *g) {
    const uint32_t n_ctx = serve_sched_n_ctx(h->srv->sched);
    if (n == 0) {
        free(ids);
        serve_reply_error(h, api, 400, NULL, NULL, "the prompt is empty");
        return false;
    }
    if (n >= n_ctx) {
        free(ids);
        serve_reply_error(h, api, 400, "messages", "context_length_exceeded",
                          "the prompt is too long: %zu tokens of %u (this model's maximum context "
                          "length is %u tokens, and at least one must be left to generate)",
                          n, n_ctx, n_ctx);
        return false;
    }
    g->prompt = ids;
    g->n_prompt = (uint32_t)n;
    h->log_prompt = (uint32_t)n;
    return true;
}

bool serve_tokenize_prompt(serve_http *h, serve_api api, const char *text, size_t len,
                           serve_gen *g) {
    const moe_tokenizer *tok = serve_sched_tokenizer(h->srv->sched);
    moe_error err = {0};
    size_t n = 0;
    int32_t *ids = NULL;
    if (moe_tokenizer_encode(tok, text, len, MOE_ENCODE_ADD_SPECIAL | MOE_ENCODE_PARSE_SPECIAL,
                             &ids, &n, &err) != MOE_OK) {
        serve_reply_error(h, api, 400, NULL, NULL, "cannot tokenize the prompt: %s", err.msg);
        return false;
    }
    return serve_set_prompt(h, api, ids, n, g);
}

/* ==== Writing JSON back ==== */

void serve_json_value(moe_json *j, json_t *v) {
    /* a client's value echoed back must not nest past our writer's limit (which would end the
     * process): deeper levels are written as null */
    if ((json_is_object(v) || json_is_array(v)) && j->depth + 1 >= MOE_JSON_MAX_DEPTH) {
        moe_json_null(j);
        return;
    }
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        moe_json_object_begin(j);
        const char *key;
        json_t *val;
        json_object_foreach(v, key, val) {
            moe_json_key(j, key);
            serve_json_value(j, val);
        }
        moe_json_object_end(j);
        break;
    }
    case JSON_ARRAY: {
        moe_json_array_begin(j);
        size_t i;
        json_t *val;
        json_array_foreach(v, i, val) serve_json_value(j, val);
        moe_json_array_end(j);
        break;
    }
    case JSON_STRING:
        moe_json_string_n(j, json_string_value(v), json_string_length(v));
        break;
    case JSON_INTEGER:
        moe_json_int(j, json_integer_value(v));
        break;
    case JSON_REAL:
        moe_json_double(j, json_real_value(v));
        break;
    case JSON_TRUE:
        moe_json_bool(j, true);
        break;
    case JSON_FALSE:
        moe_json_bool(j, false);
        break;
    case JSON_NULL:
        moe_json_null(j);
        break;
    }
}

void serve_json_token_piece(moe_json *j, const moe_tokenizer *tok, int32_t id) {
    size_t len;
    const char *p = moe_tokenizer_token_piece(tok, id, true, &len);
    moe_json_string_n(j, p, len);
}

void serve_json_token_bytes(moe_json *j, const moe_tokenizer *tok, int32_t id) {
    size_t len;
    const unsigned char *p = (const unsigned char *)moe_tokenizer_token_piece(tok, id, true, &len);
    moe_json_array_begin(j);
    for (size_t i = 0; i < len; i++) moe_json_int(j, p[i]);
    moe_json_array_end(j);
}
