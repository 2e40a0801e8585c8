/* inspect.c: `moe inspect FILE|SHARD|URL|CHECKPOINT [--json | --formats]` -- what is in a GGUF
 * file or a safetensors checkpoint (a file, an index or a directory), byte by byte.
 *
 * Parses arguments, opens the model (every shard of a split; by HTTP range requests for a URL,
 * then the request count is the last line), asks tools/ for the analysis and prints it as text
 * or JSON. The trap: metadata strings and names come from the file, so every
 * one printed as text goes through print_escaped (a chat template would otherwise spill
 * newlines and terminal escapes into the report). */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "../src/format/format.h"
#include "../src/tools/tools.h"

/* Text output: longest string shown whole, strings inside arrays, array elements shown. */
#define TEXT_STRING_MAX       72
#define TEXT_ARRAY_STRING_MAX 24
#define TEXT_ARRAY_HEAD       3
/* JSON output: strings longer than this are cut (the full length is given beside them), and
 * arrays give their first elements only: a 150k-token vocabulary is a fact, not a report. */
#define JSON_STRING_MAX 4096
#define JSON_ARRAY_HEAD 16

/* ==== Text ==== */

/* s[0..len) with control characters, quotes and backslashes escaped; at most `max` bytes,
 * then "..." (cut on a UTF-8 character boundary). */
static void print_escaped(FILE *out, const char *s, uint64_t len, uint64_t max) {
    uint64_t n = len < max ? len : max;
    while (n < len && n > 0 && ((unsigned char)s[n] & 0xc0) == 0x80) n--;
    for (uint64_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n')
            fputs("\\n", out);
        else if (c == '\t')
            fputs("\\t", out);
        else if (c == '"' || c == '\\')
            fprintf(out, "\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            fprintf(out, "\\x%02x", c);
        else
            fputc(c, out);
    }
    if (n < len) fputs("...", out);
}

/* Element i of a packed number array as a scalar value. */
static moe_gguf_value array_number(const moe_gguf_value *v, uint64_t i) {
    moe_gguf_value e = {.type = v->arr.elem_type};
    size_t es = moe_gguf_vtype_size(v->arr.elem_type);
    const uint8_t *p = (const uint8_t *)v->arr.data + i * es;
    uint64_t raw = 0;
    for (size_t b = 0; b < es; b++) raw |= (uint64_t)p[b] << (8 * b);
    switch (e.type) {
    case MOE_GGUF_I8:
        e.i = (int8_t)raw;
        break;
    case MOE_GGUF_I16:
        e.i = (int16_t)raw;
        break;
    case MOE_GGUF_I32:
        e.i = (int32_t)raw;
        break;
    case MOE_GGUF_I64:
        e.i = (int64_t)raw;
        break;
    case MOE_GGUF_F32: {
        uint32_t u = (uint32_t)raw;
        float f;
        memcpy(&f, &u, 4);
        e.f = f;
        break;
    }
    case MOE_GGUF_F64:
        memcpy(&e.f, &raw, 8);
        break;
    default:
        e.u = raw;
        break;
    }
    return e;
}

static void print_value(FILE *out, const moe_gguf_value *v, bool in_array) {
    switch (v->type) {
    case MOE_GGUF_U8:
    case MOE_GGUF_U16:
    case MOE_GGUF_U32:
    case MOE_GGUF_U64:
        fprintf(out, "%" PRIu64, v->u);
        break;
    case MOE_GGUF_I8:
    case MOE_GGUF_I16:
    case MOE_GGUF_I32:
    case MOE_GGUF_I64:
        fprintf(out, "%" PRId64, v->i);
        break;
    case MOE_GGUF_F32:
        fprintf(out, "%.9g", v->f);
        break;
    case MOE_GGUF_F64:
        fprintf(out, "%.17g", v->f);
        break;
    case MOE_GGUF_BOOL:
        fputs(v->u ? "true" : "false", out);
        break;
    case MOE_GGUF_STRING: {
        uint64_t max = in_array ? TEXT_ARRAY_STRING_MAX : TEXT_STRING_MAX;
        fputc('"', out);
        print_escaped(out, v->s.ptr, v->s.len, max);
        fputc('"', out);
        if (v->s.len > max && !in_array) fprintf(out, " (%" PRIu64 " bytes)", v->s.len);
        break;
    }
    case MOE_GGUF_ARRAY: {
        uint64_t n = v->arr.n, show = n <= TEXT_ARRAY_HEAD + 2 ? n : TEXT_ARRAY_HEAD;
        if (in_array)
            fputc('[', out);
        else
            fprintf(out, "[%s x %" PRIu64 "] ", moe_gguf_vtype_name(v->arr.elem_type), n);
        for (uint64_t i = 0; i < show; i++) {
            if (i) fputs(", ", out);
            moe_gguf_value e;
            if (v->arr.elem_type == MOE_GGUF_STRING)
                e = (moe_gguf_value){.type = MOE_GGUF_STRING,
                                     .s = ((const moe_str *)v->arr.data)[i]};
            else if (v->arr.elem_type == MOE_GGUF_ARRAY)
                e = ((const moe_gguf_value *)v->arr.data)[i];
            else
                e = array_number(v, i);
            print_value(out, &e, true);
        }
        if (show < n) fputs(", ...", out);
        if (in_array) fputc(']', out);
        break;
    }
    default:
        fputs("?", out);
        break;
    }
}

static void print_shape(FILE *out, const moe_tensor *t) {
    char b[128];
    int k = snprintf(b, sizeof b, "[");
    for (uint32_t d = 0; d < t->n_dims; d++)
        k += snprintf(b + k, sizeof b - (size_t)k, "%s%" PRId64, d ? ", " : "", t->ne[d]);
    snprintf(b + k, sizeof b - (size_t)k, "]");
    fprintf(out, "%-24s", b);
}

static double percent(uint64_t part, uint64_t whole) {
    return whole ? 100.0 * (double)part / (double)whole : 0.0;
}

/* The format map: per role, the formats of its matrices with identical layers collapsed
 * into ranges ("gate/up IQ2_S, down IQ3_S in layers 0-38 (39)"). */
static void print_formats(FILE *out, const moe_inspect_report *r) {
    fprintf(out, "formats by role:\n");
    for (int k = 0; k < MOE_ROLE_COUNT; k++) {
        bool any = false;
        for (size_t i = 0; i < r->n_formats; i++) {
            const moe_inspect_format *f = &r->formats[i];
            if (f->role != (moe_role)k) continue;
            fprintf(out, any ? "; " : "  %s: ", moe_role_name(f->role));
            print_escaped(out, f->formats, strlen(f->formats), 400);
            if (f->n_layers)
                fprintf(out, " in layer%s %s (%u)", f->n_layers > 1 ? "s" : "", f->layers,
                        f->n_layers);
            any = true;
        }
        if (any) fputc('\n', out);
    }
}

/* What the architecture's descriptor reads: layers by kind, experts, state per token. */
static void print_plan(FILE *out, const moe_inspect_plan *p) {
    if (!p->known) {
        fprintf(out, "\nplan: none: %s\n", p->note);
        return;
    }
    fprintf(out, "\nplan: %u layers", p->n_layer);
    if (p->n_layer_nextn) fprintf(out, " (+%u NextN/MTP, not run)", p->n_layer_nextn);
    fputc(':', out);
    for (int k = 0; k < MOE_LAYER_KIND_COUNT; k++)
        if (p->kind_count[k])
            fprintf(out, " %u %s,", p->kind_count[k], moe_layer_kind_name((moe_layer_kind)k));
    fprintf(out, " FFN: %u dense, %u routed", p->n_dense_ffn, p->n_expert_ffn);
    if (p->n_expert_ffn) fprintf(out, " (%u experts, %u per token)", p->n_expert, p->n_expert_used);
    fprintf(out, "\n  state: %" PRIu64 " KV values per token", p->kv_values_per_token);
    if (p->index_values_per_token)
        fprintf(out, " + %" PRIu64 " indexer values (f32)", p->index_values_per_token);
    fprintf(out, ", %" PRIu64 " recurrent-state values per sequence\n", p->state_values_per_seq);
    if (p->n_layer_nextn)
        fprintf(out,
                "  weights: routed experts of the trunk (layers 0-%u) %" PRIu64
                " bytes; NextN/MTP layers %" PRIu64 " bytes\n",
                p->n_layer - 1, p->trunk_routed_bytes, p->nextn_bytes);
}

static void print_report_text(FILE *out, const moe_inspect_report *r, bool many_files);

static void print_text(FILE *out, const moe_gguf *g, const moe_inspect_report *r) {
    uint32_t ns = moe_gguf_n_shards(g);
    const moe_gguf_shard *s0 = moe_gguf_shard_get(g, 0);
    fprintf(out, "file: %s (%" PRIu64 " bytes)\n", s0->path, s0->file_size);
    fprintf(out, "GGUF version %u, alignment %u, %" PRIu64 " tensors, %" PRIu64 " metadata keys\n",
            s0->version, moe_gguf_alignment(g), r->n_tensors, moe_gguf_n_kv(g));
    if (ns > 1) {
        fprintf(out, "shards: %u\n", ns);
        for (uint32_t s = 0; s < ns; s++) {
            const moe_gguf_shard *sh = moe_gguf_shard_get(g, s);
            fprintf(out,
                    "  %u/%u %s: %" PRIu64 " bytes, %u tensors, header %" PRIu64
                    ", tensor bytes %" PRIu64 ", padding %" PRIu64 "\n",
                    s + 1, ns, sh->path, sh->file_size, sh->n_tensors, sh->header_bytes,
                    sh->tensor_bytes, sh->padding_bytes);
        }
    }

    fprintf(out, "\nmetadata:\n");
    for (uint64_t i = 0; i < moe_gguf_n_kv(g); i++) {
        const moe_gguf_kv *kv = moe_gguf_kv_get(g, i);
        fputs("  ", out);
        print_escaped(out, kv->key.ptr, kv->key.len, 128);
        fprintf(out, " (%s) = ", moe_gguf_vtype_name(kv->value.type));
        print_value(out, &kv->value, false);
        fputc('\n', out);
    }

    size_t w = 4;
    for (uint64_t i = 0; i < r->n_tensors; i++) {
        size_t l = moe_gguf_tensor_get(g, i)->name.len;
        if (l > w) w = l < 64 ? l : 64;
    }
    fprintf(out, "\ntensors:\n  %-*s %-8s %-24s %12s %12s%s\n", (int)w, "name", "type", "shape",
            "bytes", "offset", ns > 1 ? " shard" : "");
    for (uint64_t i = 0; i < r->n_tensors; i++) {
        const moe_tensor *t = moe_gguf_tensor_get(g, i);
        fputs("  ", out);
        print_escaped(out, t->name.ptr, t->name.len, 64);
        fprintf(out, "%*s %-8s ", (int)(w > t->name.len ? w - t->name.len : 0), "",
                moe_type_name(t->type));
        print_shape(out, t);
        fprintf(out, " %12" PRIu64 " %12" PRIu64, t->n_bytes, t->file_offset);
        if (ns > 1) fprintf(out, " %u", t->shard + 1);
        fputc('\n', out);
    }

    print_report_text(out, r, ns > 1);
}

/* The part of the text report that comes from the analysis alone (both formats). */
static void print_report_text(FILE *out, const moe_inspect_report *r, bool many_files) {
    fprintf(out, "\ntypes:\n");
    for (size_t i = 0; i < r->n_types; i++)
        fprintf(out, "  %-8s %6" PRIu64 " tensors %14" PRIu64 " bytes %6.2f%%\n", r->types[i].name,
                r->types[i].count, r->types[i].bytes, percent(r->types[i].bytes, r->tensor_bytes));

    fprintf(out, "\nbytes by role:\n");
    for (int k = 0; k < MOE_ROLE_COUNT; k++)
        fprintf(out, "  %-18s %6" PRIu64 " tensors %14" PRIu64 " bytes %6.2f%%\n",
                moe_role_name((moe_role)k), r->role_count[k], r->role_bytes[k],
                percent(r->role_bytes[k], r->tensor_bytes));

    if (r->n_layers) {
        fprintf(out, "\nbytes by layer:\n  %-8s %7s %12s %12s %12s %12s %12s %12s\n", "layer",
                "tensors", "bytes", "routed", "shared", "attention", "dense ffn", "other");
        for (size_t i = 0; i < r->n_layers; i++) {
            const moe_inspect_layer *l = &r->layers[i];
            fprintf(out, "  blk.%-4" PRId64 " %7" PRIu64 " %12" PRIu64, l->layer, l->count,
                    l->bytes);
            static const moe_role cols[] = {MOE_ROLE_ROUTED_EXPERTS, MOE_ROLE_SHARED_EXPERTS,
                                            MOE_ROLE_ATTENTION, MOE_ROLE_DENSE_FFN};
            uint64_t other = l->bytes;
            for (size_t c = 0; c < 4; c++) {
                fprintf(out, " %12" PRIu64, l->role_bytes[cols[c]]);
                other -= l->role_bytes[cols[c]];
            }
            fprintf(out, " %12" PRIu64 "\n", other);
        }
    }

    fputc('\n', out);
    print_formats(out, r);
    print_plan(out, &r->plan);

    fprintf(out,
            "\nreconciles: tensor bytes %" PRIu64 " + header %" PRIu64 " + padding %" PRIu64
            " %s file size %" PRIu64 "%s\n",
            r->tensor_bytes, r->header_bytes, r->padding_bytes,
            r->reconciles ? "=" : "!=", r->file_bytes, many_files ? " (all shards)" : "");
}

/* ==== JSON ==== */

static void json_value(moe_json *j, const moe_gguf_value *v) {
    switch (v->type) {
    case MOE_GGUF_U8:
    case MOE_GGUF_U16:
    case MOE_GGUF_U32:
    case MOE_GGUF_U64:
        moe_json_uint(j, v->u);
        break;
    case MOE_GGUF_I8:
    case MOE_GGUF_I16:
    case MOE_GGUF_I32:
    case MOE_GGUF_I64:
        moe_json_int(j, v->i);
        break;
    case MOE_GGUF_F32:
    case MOE_GGUF_F64:
        moe_json_double(j, v->f);
        break;
    case MOE_GGUF_BOOL:
        moe_json_bool(j, v->u != 0);
        break;
    case MOE_GGUF_STRING:
        moe_json_string_n(j, v->s.ptr, v->s.len < JSON_STRING_MAX ? v->s.len : JSON_STRING_MAX);
        break;
    case MOE_GGUF_ARRAY: {
        uint64_t show = v->arr.n < JSON_ARRAY_HEAD ? v->arr.n : JSON_ARRAY_HEAD;
        moe_json_array_begin(j);
        for (uint64_t i = 0; i < show; i++) {
            moe_gguf_value e;
            if (v->arr.elem_type == MOE_GGUF_STRING)
                e = (moe_gguf_value){.type = MOE_GGUF_STRING,
                                     .s = ((const moe_str *)v->arr.data)[i]};
            else if (v->arr.elem_type == MOE_GGUF_ARRAY)
                e = ((const moe_gguf_value *)v->arr.data)[i];
            else
                e = array_number(v, i);
            json_value(j, &e);
        }
        moe_json_array_end(j);
        break;
    }
    default:
        moe_json_null(j);
        break;
    }
}

static void json_report(moe_json *jp, const moe_inspect_report *r);

static void print_json(FILE *out, const moe_gguf *g, const moe_inspect_report *r) {
    moe_json j;
    moe_json_init(&j, true);
    moe_json_object_begin(&j);
    const moe_gguf_shard *s0 = moe_gguf_shard_get(g, 0);
    moe_json_kv_uint(&j, "version", s0->version);
    moe_json_kv_uint(&j, "alignment", moe_gguf_alignment(g));
    moe_json_key(&j, "files");
    moe_json_array_begin(&j);
    for (uint32_t s = 0; s < moe_gguf_n_shards(g); s++) {
        const moe_gguf_shard *sh = moe_gguf_shard_get(g, s);
        moe_json_object_begin(&j);
        moe_json_kv_string(&j, "path", sh->path);
        moe_json_kv_uint(&j, "version", sh->version);
        moe_json_kv_uint(&j, "alignment", moe_gguf_shard_alignment(g, s));
        moe_json_kv_uint(&j, "file_bytes", sh->file_size);
        moe_json_kv_uint(&j, "header_bytes", sh->header_bytes);
        moe_json_kv_uint(&j, "data_offset", sh->data_offset);
        moe_json_kv_uint(&j, "tensor_bytes", sh->tensor_bytes);
        moe_json_kv_uint(&j, "padding_bytes", sh->padding_bytes);
        moe_json_kv_uint(&j, "n_tensors", sh->n_tensors);
        moe_json_kv_uint(&j, "n_kv", sh->n_kv);
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);

    moe_json_key(&j, "metadata");
    moe_json_array_begin(&j);
    for (uint64_t i = 0; i < moe_gguf_n_kv(g); i++) {
        const moe_gguf_kv *kv = moe_gguf_kv_get(g, i);
        moe_json_object_begin(&j);
        moe_json_key(&j, "key");
        moe_json_string_n(&j, kv->key.ptr, kv->key.len);
        moe_json_kv_string(&j, "type", moe_gguf_vtype_name(kv->value.type));
        if (kv->value.type == MOE_GGUF_ARRAY) {
            moe_json_kv_string(&j, "elem_type", moe_gguf_vtype_name(kv->value.arr.elem_type));
            moe_json_kv_uint(&j, "n", kv->value.arr.n);
        } else if (kv->value.type == MOE_GGUF_STRING) {
            moe_json_kv_uint(&j, "length", kv->value.s.len);
        }
        moe_json_key(&j, "value");
        json_value(&j, &kv->value);
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);

    moe_json_key(&j, "tensors");
    moe_json_array_begin(&j);
    for (uint64_t i = 0; i < r->n_tensors; i++) {
        const moe_tensor *t = moe_gguf_tensor_get(g, i);
        moe_json_object_begin(&j);
        moe_json_key(&j, "name");
        moe_json_string_n(&j, t->name.ptr, t->name.len);
        moe_json_kv_string(&j, "type", moe_type_name(t->type));
        moe_json_key(&j, "shape");
        moe_json_array_begin(&j);
        for (uint32_t d = 0; d < t->n_dims; d++) moe_json_int(&j, t->ne[d]);
        moe_json_array_end(&j);
        moe_json_kv_uint(&j, "bytes", t->n_bytes);
        moe_json_kv_uint(&j, "offset", t->offset);
        moe_json_kv_uint(&j, "file_offset", t->file_offset);
        moe_json_kv_uint(&j, "shard", t->shard);
        moe_json_kv_string(&j, "role", moe_role_id(moe_tensor_role(t->name.ptr)));
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);

    json_report(&j, r);
    moe_json_object_end(&j);
    fwrite(j.buf, 1, j.len, out);
    fputc('\n', out);
    moe_json_free(&j);
}

/* The JSON from the analysis alone (both formats): types, roles, layers, formats, plan,
 * totals; the caller has the document's object open. */
static void json_report(moe_json *jp, const moe_inspect_report *r) {
#define j (*jp)
    moe_json_key(&j, "types");
    moe_json_array_begin(&j);
    for (size_t i = 0; i < r->n_types; i++) {
        moe_json_object_begin(&j);
        moe_json_kv_string(&j, "type", r->types[i].name);
        moe_json_kv_uint(&j, "count", r->types[i].count);
        moe_json_kv_uint(&j, "bytes", r->types[i].bytes);
        moe_json_kv_double(&j, "percent", percent(r->types[i].bytes, r->tensor_bytes));
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);

    moe_json_key(&j, "roles");
    moe_json_object_begin(&j);
    for (int k = 0; k < MOE_ROLE_COUNT; k++) {
        moe_json_key(&j, moe_role_id((moe_role)k));
        moe_json_object_begin(&j);
        moe_json_kv_uint(&j, "count", r->role_count[k]);
        moe_json_kv_uint(&j, "bytes", r->role_bytes[k]);
        moe_json_kv_double(&j, "percent", percent(r->role_bytes[k], r->tensor_bytes));
        moe_json_object_end(&j);
    }
    moe_json_object_end(&j);

    moe_json_key(&j, "layers");
    moe_json_array_begin(&j);
    for (size_t i = 0; i < r->n_layers; i++) {
        const moe_inspect_layer *l = &r->layers[i];
        moe_json_object_begin(&j);
        moe_json_kv_int(&j, "layer", l->layer);
        moe_json_kv_uint(&j, "count", l->count);
        moe_json_kv_uint(&j, "bytes", l->bytes);
        moe_json_key(&j, "roles");
        moe_json_object_begin(&j);
        for (int k = 0; k < MOE_ROLE_COUNT; k++) {
            moe_json_key(&j, moe_role_id((moe_role)k));
            moe_json_uint(&j, l->role_bytes[k]);
        }
        moe_json_object_end(&j);
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);

    moe_json_key(&j, "formats");
    moe_json_array_begin(&j);
    for (size_t i = 0; i < r->n_formats; i++) {
        const moe_inspect_format *f = &r->formats[i];
        moe_json_object_begin(&j);
        moe_json_kv_string(&j, "role", moe_role_id(f->role));
        moe_json_kv_string(&j, "formats", f->formats);
        moe_json_kv_string(&j, "layers", f->layers);
        moe_json_kv_uint(&j, "n_layers", f->n_layers);
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);

    const moe_inspect_plan *p = &r->plan;
    moe_json_key(&j, "plan");
    moe_json_object_begin(&j);
    moe_json_kv_bool(&j, "known", p->known);
    if (!p->known) moe_json_kv_string(&j, "note", p->note);
    moe_json_kv_uint(&j, "n_layer", p->n_layer);
    moe_json_kv_uint(&j, "n_layer_nextn", p->n_layer_nextn);
    moe_json_key(&j, "layers_by_kind");
    moe_json_object_begin(&j);
    for (int k = 0; k < MOE_LAYER_KIND_COUNT; k++)
        moe_json_kv_uint(&j, moe_layer_kind_name((moe_layer_kind)k), p->kind_count[k]);
    moe_json_object_end(&j);
    moe_json_kv_uint(&j, "dense_ffn_layers", p->n_dense_ffn);
    moe_json_kv_uint(&j, "expert_layers", p->n_expert_ffn);
    moe_json_kv_uint(&j, "n_expert", p->n_expert);
    moe_json_kv_uint(&j, "n_expert_used", p->n_expert_used);
    moe_json_kv_uint(&j, "kv_values_per_token", p->kv_values_per_token);
    moe_json_kv_uint(&j, "index_values_per_token", p->index_values_per_token);
    moe_json_kv_uint(&j, "state_values_per_seq", p->state_values_per_seq);
    moe_json_kv_uint(&j, "trunk_routed_bytes", p->trunk_routed_bytes);
    moe_json_kv_uint(&j, "nextn_bytes", p->nextn_bytes);
    moe_json_object_end(&j);

    moe_json_key(&j, "totals");
    moe_json_object_begin(&j);
    moe_json_kv_uint(&j, "n_tensors", r->n_tensors);
    moe_json_kv_uint(&j, "tensor_bytes", r->tensor_bytes);
    moe_json_kv_uint(&j, "header_bytes", r->header_bytes);
    moe_json_kv_uint(&j, "padding_bytes", r->padding_bytes);
    moe_json_kv_uint(&j, "file_bytes", r->file_bytes);
    moe_json_kv_bool(&j, "reconciles", r->reconciles);
    moe_json_object_end(&j);
#undef j
}

/* ==== safetensors ==== */

static void print_st_shape(FILE *out, const moe_st_tensor *t) {
    char b[160];
    int k = snprintf(b, sizeof b, "[");
    for (uint32_t d = 0; d < t->n_dims; d++)
        k += snprintf(b + k, sizeof b - (size_t)k, "%s%" PRId64, d ? ", " : "", t->shape[d]);
    snprintf(b + k, sizeof b - (size_t)k, "]");
    fprintf(out, "%-24s", b);
}

static void print_st_text(FILE *out, const moe_st *s, const moe_inspect_report *r) {
    uint32_t nf = moe_st_n_files(s);
    const moe_st_file *f0 = moe_st_file_get(s, 0);
    fprintf(out, "file: %s (%" PRIu64 " bytes)\n", f0->path, f0->file_size);
    fprintf(out,
            "safetensors, %" PRIu64 " tensors, %zu metadata keys (row-major shapes, last "
            "dimension contiguous)\n",
            r->n_tensors, moe_st_n_meta(s));
    if (nf > 1) {
        fprintf(out, "shards: %u\n", nf);
        for (uint32_t i = 0; i < nf; i++) {
            const moe_st_file *f = moe_st_file_get(s, i);
            fprintf(out,
                    "  %u/%u %s: %" PRIu64 " bytes, %u tensors, header %" PRIu64
                    ", tensor bytes %" PRIu64 "\n",
                    i + 1, nf, f->path, f->file_size, f->n_tensors, f->header_bytes,
                    f->tensor_bytes);
        }
    }
    fprintf(out, "\nmetadata:\n");
    for (size_t i = 0; i < moe_st_n_meta(s); i++) {
        const char *k = moe_st_meta_key(s, i), *v = moe_st_meta_value(s, i);
        fputs("  ", out);
        print_escaped(out, k, strlen(k), 128);
        fputs(" = \"", out);
        print_escaped(out, v, strlen(v), TEXT_STRING_MAX);
        fputs("\"\n", out);
    }
    size_t w = 4;
    for (uint64_t i = 0; i < r->n_tensors; i++) {
        size_t l = strlen(moe_st_tensor_get(s, i)->name);
        if (l > w) w = l < 72 ? l : 72;
    }
    fprintf(out, "\ntensors:\n  %-*s %-8s %-24s %12s %12s%s\n", (int)w, "name", "dtype", "shape",
            "bytes", "offset", nf > 1 ? " file" : "");
    for (uint64_t i = 0; i < r->n_tensors; i++) {
        const moe_st_tensor *t = moe_st_tensor_get(s, i);
        size_t l = strlen(t->name);
        fputs("  ", out);
        print_escaped(out, t->name, l, 72);
        fprintf(out, "%*s %-8s ", (int)(w > l ? w - l : 0), "", moe_st_dtype_name(t->dtype));
        print_st_shape(out, t);
        fprintf(out, " %12" PRIu64 " %12" PRIu64, t->n_bytes, t->file_offset);
        if (nf > 1) fprintf(out, " %u", t->file + 1);
        fputc('\n', out);
    }
    print_report_text(out, r, nf > 1);
}

static void print_st_json(FILE *out, const moe_st *s, const moe_inspect_report *r) {
    moe_json j;
    moe_json_init(&j, true);
    moe_json_object_begin(&j);
    moe_json_kv_string(&j, "format", "safetensors");
    moe_json_key(&j, "files");
    moe_json_array_begin(&j);
    for (uint32_t i = 0; i < moe_st_n_files(s); i++) {
        const moe_st_file *f = moe_st_file_get(s, i);
        moe_json_object_begin(&j);
        moe_json_kv_string(&j, "path", f->path);
        moe_json_kv_uint(&j, "file_bytes", f->file_size);
        moe_json_kv_uint(&j, "header_bytes", f->header_bytes);
        moe_json_kv_uint(&j, "tensor_bytes", f->tensor_bytes);
        moe_json_kv_uint(&j, "n_tensors", f->n_tensors);
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);
    moe_json_key(&j, "metadata");
    moe_json_object_begin(&j);
    for (size_t i = 0; i < moe_st_n_meta(s); i++)
        moe_json_kv_string(&j, moe_st_meta_key(s, i), moe_st_meta_value(s, i));
    moe_json_object_end(&j);
    moe_json_key(&j, "tensors");
    moe_json_array_begin(&j);
    for (uint64_t i = 0; i < r->n_tensors; i++) {
        const moe_st_tensor *t = moe_st_tensor_get(s, i);
        moe_json_object_begin(&j);
        moe_json_kv_string(&j, "name", t->name);
        moe_json_kv_string(&j, "type", moe_st_dtype_name(t->dtype));
        moe_json_key(&j, "shape");
        moe_json_array_begin(&j);
        for (uint32_t d = 0; d < t->n_dims; d++) moe_json_int(&j, t->shape[d]);
        moe_json_array_end(&j);
        moe_json_kv_uint(&j, "bytes", t->n_bytes);
        moe_json_kv_uint(&j, "offset", t->offset);
        moe_json_kv_uint(&j, "file_offset", t->file_offset);
        moe_json_kv_uint(&j, "shard", t->file);
        moe_json_kv_string(&j, "role", moe_role_id(moe_hf_tensor_role(t->name)));
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);
    json_report(&j, r);
    moe_json_object_end(&j);
    fwrite(j.buf, 1, j.len, out);
    fputc('\n', out);
    moe_json_free(&j);
}

/* `moe inspect` of a safetensors file, index or checkpoint directory. */
static int inspect_st(const char *path, bool json, bool formats) {
    moe_error err = {0};
    moe_st *s = moe_st_open(path, &err);
    if (!s) {
        fprintf(stderr, "moe inspect: %s\n", err.msg);
        return 1;
    }
    moe_inspect_report *r = moe_inspect_analyze_st(s);
    if (json)
        print_st_json(stdout, s, r);
    else if (formats)
        print_formats(stdout, r);
    else
        print_st_text(stdout, s, r);
    bool ok = r->reconciles;
    moe_inspect_report_free(r);
    moe_st_close(s);
    if (fflush(stdout) != 0) return 1;
    return ok ? 0 : 1;
}

/* ==== Command ==== */

int moe_cmd_inspect(int argc, char **argv) {
    const char *path = NULL;
    bool json = false, formats = false;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = true;
        else if (strcmp(argv[i], "--formats") == 0)
            formats = true;
        else if (argv[i][0] == '-' && argv[i][1])
            return moe_cli_unknown_option("inspect", argv[i]);
        else if (path)
            return moe_cli_usage_error("inspect", "one file at a time (got %s and %s)", path,
                                       argv[i]);
        else
            path = argv[i];
    }
    if (!path) return moe_cli_usage_error("inspect", "which file?");
    if (!moe_path_is_url(path) && moe_st_is_checkpoint(path))
        return inspect_st(path, json, formats);
    moe_error err = {0};
    moe_http *http = NULL;
    moe_gguf *g = moe_gguf_open_any(path, &http, &err);
    if (!g) {
        fprintf(stderr, "moe inspect: %s\n", err.msg);
        moe_http_free(http);
        return 1;
    }
    moe_inspect_report *r = moe_inspect_analyze(g);
    if (json)
        print_json(stdout, g, r);
    else if (formats)
        print_formats(stdout, r);
    else
        print_text(stdout, g, r);
    if (http) /* the cost of a remote report: on stderr under --json, which stays one document */
        fprintf(json ? stderr : stdout,
                "remote: %" PRIu64 " requests, %" PRIu64 " bytes read of %" PRIu64
                " in %u file%s\n",
                moe_http_requests(http), moe_http_bytes(http), r->file_bytes, moe_gguf_n_shards(g),
                moe_gguf_n_shards(g) > 1 ? "s" : "");
    bool ok = r->reconciles;
    moe_inspect_report_free(r);
    moe_gguf_close(g);
    moe_http_free(http);
    if (fflush(stdout) != 0) return 1;
    return ok ? 0 : 1;
}
