/* budget.c: `moe budget MODEL [MODEL...]` -- does it fit, and how much context and how many
 * streams fit, per device.
 *
 * Opens each model (local or by URL: headers only), asks tools/ for its memory facts and the
 * plan for the options, and prints a table, JSON, and/or an SVG chart. Several models are
 * several builds of one model: with --ladder they print as one table of rungs and the largest
 * that fits. A file whose architecture is "clip" (an mmproj) is the vision tower of the others.
 * The trap: --mem-per-device defaults to this machine's RAM (MemTotal), which is what a CPU run
 * has, not what a GPU has: say it in the output so nobody reads it as a GPU plan. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "../src/format/format.h"
#include "../src/tools/tools.h"

#define GIB        (1024.0 * 1024.0 * 1024.0)
#define MAX_MODELS 64

/* This machine's RAM from /proc/meminfo (bytes), 0 when unknown. */
static uint64_t machine_ram(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) break;
    fclose(f);
    return (uint64_t)kb * 1024;
}

static const char *human(uint64_t b, char *buf, size_t cap) {
    if (b >= (1ull << 30))
        snprintf(buf, cap, "%.2f GiB", (double)b / GIB);
    else if (b >= (1ull << 20))
        snprintf(buf, cap, "%.2f MiB", (double)b / (1 << 20));
    else if (b >= (1ull << 10))
        snprintf(buf, cap, "%.2f KiB", (double)b / (1 << 10));
    else
        snprintf(buf, cap, "%" PRIu64 " B", b);
    return buf;
}

static uint64_t weight_bytes(const moe_budget_model *m, bool vision) {
    uint64_t w = 0;
    for (int k = 0; k <= MOE_PART_VISION; k++)
        if (k != MOE_PART_VISION || vision) w += m->weights[k];
    return w;
}

static uint64_t weight_params(const moe_budget_model *m, bool vision) {
    uint64_t n = 0;
    for (int k = 0; k <= MOE_PART_VISION; k++)
        if (k != MOE_PART_VISION || vision) n += m->params[k];
    return n;
}

static double bits_per_weight(const moe_budget_model *m, bool vision) {
    uint64_t n = weight_params(m, vision);
    return n ? 8.0 * (double)weight_bytes(m, vision) / (double)n : 0.0;
}

/* ==== Text ==== */

static void print_fit(FILE *out, const moe_budget_model *m, const moe_budget_plan *p) {
    const moe_budget_config *c = &p->config;
    uint64_t mag = p->spare < 0 ? (uint64_t)0 - (uint64_t)p->spare : (uint64_t)p->spare;
    char amount[32];
    if (mag >= GIB / 100)
        snprintf(amount, sizeof amount, "%.2f GiB", (double)mag / GIB);
    else
        human(mag, amount, sizeof amount); /* 0.00 GiB would say nothing */
    fprintf(out, p->fits ? "fits with %s to spare%s\n" : "short by %s%s\n", amount,
            c->devices > 1 ? " on the fullest device" : "");
    if (p->max_ctx)
        fprintf(out, "largest context that fits with %" PRIu64 " stream%s: %" PRIu64 " tokens%s\n",
                c->streams, c->streams == 1 ? "" : "s", p->max_ctx,
                m->ctx_train && p->max_ctx == m->ctx_train ? " (the model's trained context)" : "");
    else
        fprintf(out, "no context fits with %" PRIu64 " stream%s\n", c->streams,
                c->streams == 1 ? "" : "s");
    if (p->max_streams)
        fprintf(out, "largest stream count that fits at context %" PRIu64 ": %" PRIu64 "\n", c->ctx,
                p->max_streams);
    else
        fprintf(out, "no stream fits at context %" PRIu64 "\n", c->ctx);
}

static void print_model(FILE *out, const moe_budget_model *m, const moe_budget_plan *p) {
    const moe_budget_config *c = &p->config;
    char a[32], b[32];
    fprintf(out, "model: %s\n", m->name);
    uint32_t kinds[MOE_LAYER_KIND_COUNT] = {0};
    for (uint32_t l = 0; l < m->n_layer; l++) kinds[m->kind[l]]++;
    fprintf(out, "  %s, %u layers (", m->arch, m->n_layer);
    bool first = true;
    for (int k = 0; k < MOE_LAYER_KIND_COUNT; k++) {
        if (!kinds[k]) continue;
        fprintf(out, "%s%u %s", first ? "" : ", ", kinds[k],
                moe_layer_kind_name((moe_layer_kind)k));
        if (k == MOE_LAYER_SLIDING) fprintf(out, " of %" PRIu64 " tokens", m->window);
        first = false;
    }
    fprintf(out, "), %" PRIu64 " parameters, %s of weights, %.2f bits/weight\n",
            weight_params(m, c->vision), human(weight_bytes(m, c->vision), a, sizeof a),
            bits_per_weight(m, c->vision));
    fprintf(out, "  KV cache (%s): %" PRIu64 " bytes per token", moe_budget_kv_name(c->kv_type),
            p->kv_bytes_per_token);
    if (p->swa_kv_bytes_per_token)
        fprintf(out, " + %" PRIu64 " bytes per token of the last %" PRIu64 " (sliding window)",
                p->swa_kv_bytes_per_token, m->window);
    uint32_t indexed = 0;
    for (uint32_t l = 0; l < m->n_layer; l++) indexed += m->index_values[l] != 0;
    if (p->index_bytes_per_token)
        fprintf(out, "; indexer cache (f32, %u layers): %" PRIu64 " bytes per token", indexed,
                p->index_bytes_per_token);
    fprintf(out, "; recurrent state: %" PRIu64 " bytes per stream\n", p->state_bytes_per_stream);
    char mem[32];
    fprintf(out,
            "plan: %u device%s x %s, context %" PRIu64 ", %" PRIu64 " stream%s, "
            "KV %s%s\n",
            c->devices, c->devices > 1 ? "s" : "", human(c->mem_per_device, mem, sizeof mem),
            c->ctx, c->streams, c->streams == 1 ? "" : "s", moe_budget_kv_name(c->kv_type),
            c->vision ? "" : ", without the vision tower");
    fprintf(out, "  %-20s %14s", "part", "per device");
    fprintf(out, c->devices > 1 ? " %14s\n" : "%s\n", c->devices > 1 ? "all devices" : "");
    for (int k = 0; k < MOE_PART_COUNT; k++) {
        uint64_t dev0 = p->device[k], all = 0;
        for (uint32_t d = 0; d < c->devices; d++) all += p->device[(size_t)d * MOE_PART_COUNT + k];
        if ((k == MOE_PART_VISION || k == MOE_PART_MTP) && !m->weights[k]) continue;
        if (k == MOE_PART_INDEX && !p->index_bytes_per_token) continue;
        fprintf(out, "  %-20s %14s", moe_budget_part_name((moe_budget_part)k),
                human(dev0, a, sizeof a));
        if (c->devices > 1) fprintf(out, " %14s", human(all, b, sizeof b));
        if (k == MOE_ROLE_ROUTED_EXPERTS && c->devices > 1)
            fprintf(out,
                    c->split_experts ? "  (whole experts: expert e on device e %% %u)"
                                     : "  (rows of every expert matrix split %u ways)",
                    c->devices);
        if (k == MOE_PART_VISION && !c->vision) fprintf(out, "  (left out: --no-vision)");
        fputc('\n', out);
    }
    fprintf(out, "  %-20s %14s\n", "total", human(p->device_total_max, a, sizeof a));
    if (c->expert_cache && m->n_expert) {
        const uint64_t routed = m->weights[MOE_ROLE_ROUTED_EXPERTS];
        const double per_tok = (double)p->expert_bytes_per_token / 1048576.0;
        fprintf(out,
                "expert cache: %s of the %s of routed experts resident (%.0f%%), the rest read "
                "from the file; a token runs %.1f MiB of experts: from disk per token %.1f / "
                "%.1f / %.1f MiB at hit rates 50 / 80 / 95%%\n",
                human(p->device[MOE_ROLE_ROUTED_EXPERTS], a, sizeof a), human(routed, b, sizeof b),
                routed ? 100.0 * (double)p->device[MOE_ROLE_ROUTED_EXPERTS] / (double)routed : 0.0,
                per_tok, 0.5 * per_tok, 0.2 * per_tok, 0.05 * per_tok);
    }
    print_fit(out, m, p);
}

static void print_ladder(FILE *out, const moe_budget_model *const *m, const moe_budget_plan *p,
                         size_t n, size_t best) {
    const moe_budget_config *c = &p[0].config;
    char a[32], b[32], s[32];
    char mem[32];
    fprintf(out,
            "ladder: %zu builds of %s on %u device%s x %s, context %" PRIu64 ", %" PRIu64
            " stream%s, KV %s\n",
            n, m[0]->arch, c->devices, c->devices > 1 ? "s" : "",
            human(c->mem_per_device, mem, sizeof mem), c->ctx, c->streams,
            c->streams == 1 ? "" : "s", moe_budget_kv_name(c->kv_type));
    size_t w = 5;
    for (size_t i = 0; i < n; i++) w = strlen(m[i]->name) > w ? strlen(m[i]->name) : w;
    if (w > 60) w = 60;
    fprintf(out, "  %-*s %12s %8s %14s %14s %12s %s\n", (int)w, "build", "weights", "bits/w",
            "per device", "spare", "max ctx", "fits");
    for (size_t i = 0; i < n; i++) {
        bool neg = p[i].spare < 0;
        uint64_t mag = neg ? (uint64_t)-p[i].spare : (uint64_t)p[i].spare;
        char sp[40];
        snprintf(sp, sizeof sp, "%s%s", neg ? "-" : "", human(mag, s, sizeof s));
        fprintf(out, "  %-*s %12s %8.2f %14s %14s %12" PRIu64 " %s\n", (int)w, m[i]->name,
                human(weight_bytes(m[i], c->vision), a, sizeof a), bits_per_weight(m[i], c->vision),
                human(p[i].device_total_max, b, sizeof b), sp, p[i].max_ctx,
                p[i].fits ? (i == best ? "yes  <- largest that fits" : "yes") : "no");
    }
    if (best < n)
        fprintf(out, "largest that fits: %s\n", m[best]->name);
    else
        fprintf(out, "no build fits\n");
}

/* ==== JSON ==== */

static void json_parts(moe_json *j, const uint64_t *parts, int n) {
    moe_json_object_begin(j);
    for (int k = 0; k < n; k++) {
        moe_json_key(j, moe_budget_part_id((moe_budget_part)k));
        moe_json_uint(j, parts[k]);
    }
    moe_json_object_end(j);
}

static void print_json(FILE *out, const moe_budget_model *const *m, const moe_budget_plan *p,
                       size_t n, size_t best, bool ladder) {
    const moe_budget_config *c = &p[0].config;
    moe_json j;
    moe_json_init(&j, true);
    moe_json_object_begin(&j);
    moe_json_key(&j, "config");
    moe_json_object_begin(&j);
    moe_json_kv_uint(&j, "devices", c->devices);
    moe_json_kv_string(&j, "split", c->split_experts ? "experts" : "rows");
    moe_json_kv_uint(&j, "mem_per_device", c->mem_per_device);
    moe_json_kv_uint(&j, "ctx", c->ctx);
    moe_json_kv_uint(&j, "streams", c->streams);
    moe_json_kv_string(&j, "kv_type", moe_budget_kv_name(c->kv_type));
    moe_json_kv_bool(&j, "vision", c->vision);
    moe_json_object_end(&j);
    moe_json_key(&j, "models");
    moe_json_array_begin(&j);
    for (size_t i = 0; i < n; i++) {
        const moe_budget_model *mm = m[i];
        moe_json_object_begin(&j);
        moe_json_kv_string(&j, "name", mm->name);
        moe_json_kv_string(&j, "arch", mm->arch);
        moe_json_kv_uint(&j, "file_bytes", mm->file_bytes);
        moe_json_kv_uint(&j, "n_params", weight_params(mm, c->vision));
        moe_json_kv_uint(&j, "weight_bytes", weight_bytes(mm, c->vision));
        moe_json_kv_double(&j, "bits_per_weight", bits_per_weight(mm, c->vision));
        moe_json_key(&j, "weights");
        json_parts(&j, mm->weights, MOE_PART_VISION + 1);
        moe_json_key(&j, "params");
        json_parts(&j, mm->params, MOE_PART_VISION + 1);
        moe_json_key(&j, "layers");
        moe_json_array_begin(&j);
        for (uint32_t l = 0; l < mm->n_layer; l++) {
            moe_json_object_begin(&j);
            moe_json_kv_string(&j, "kind", moe_layer_kind_name(mm->kind[l]));
            moe_json_kv_uint(&j, "k_values", mm->k_values[l]);
            moe_json_kv_uint(&j, "v_values", mm->v_values[l]);
            moe_json_kv_uint(&j, "state_values", mm->state_values[l]);
            moe_json_kv_uint(&j, "index_values", mm->index_values[l]);
            moe_json_object_end(&j);
        }
        moe_json_array_end(&j);
        moe_json_kv_uint(&j, "window", mm->window);
        moe_json_kv_uint(&j, "ctx_train", mm->ctx_train);
        moe_json_kv_uint(&j, "kv_bytes_per_token", p[i].kv_bytes_per_token);
        moe_json_kv_uint(&j, "swa_kv_bytes_per_token", p[i].swa_kv_bytes_per_token);
        moe_json_kv_uint(&j, "index_bytes_per_token", p[i].index_bytes_per_token);
        moe_json_kv_uint(&j, "state_bytes_per_stream", p[i].state_bytes_per_stream);
        moe_json_key(&j, "devices");
        moe_json_array_begin(&j);
        for (uint32_t d = 0; d < c->devices; d++) {
            const uint64_t *dev = p[i].device + (size_t)d * MOE_PART_COUNT;
            uint64_t total = 0;
            for (int k = 0; k < MOE_PART_COUNT; k++) total += dev[k];
            moe_json_object_begin(&j);
            moe_json_key(&j, "parts");
            json_parts(&j, dev, MOE_PART_COUNT);
            moe_json_kv_uint(&j, "total", total);
            moe_json_object_end(&j);
        }
        moe_json_array_end(&j);
        moe_json_kv_uint(&j, "device_total_max", p[i].device_total_max);
        moe_json_kv_int(&j, "spare", p[i].spare);
        moe_json_kv_bool(&j, "fits", p[i].fits);
        moe_json_kv_uint(&j, "max_ctx", p[i].max_ctx);
        moe_json_kv_uint(&j, "max_streams", p[i].max_streams);
        moe_json_object_end(&j);
    }
    moe_json_array_end(&j);
    if (ladder) {
        moe_json_key(&j, "largest_fit");
        if (best < n)
            moe_json_string(&j, m[best]->name);
        else
            moe_json_null(&j);
    }
    moe_json_object_end(&j);
    fwrite(j.buf, 1, j.len, out);
    fputc('\n', out);
    moe_json_free(&j);
}

/* ==== Command ==== */

static int cmp_weights(const void *a, const void *b) {
    const moe_budget_model *x = *(const moe_budget_model *const *)a;
    const moe_budget_model *y = *(const moe_budget_model *const *)b;
    uint64_t wx = weight_bytes(x, true), wy = weight_bytes(y, true);
    return wx < wy ? -1 : wx > wy;
}

int moe_cmd_budget(int argc, char **argv) {
    const char *paths[MAX_MODELS], *svg = NULL;
    size_t n_paths = 0;
    long long devices = 1, ctx = 4096, streams = 1;
    double mem_gib = 0;
    bool json = false, ladder = false;
    moe_budget_config c = {.kv_type = MOE_TYPE_F16, .vision = true};
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json"))
            json = true;
        else if (!strcmp(a, "--ladder"))
            ladder = true;
        else if (!strcmp(a, "--no-vision"))
            c.vision = false;
        else if (!strcmp(a, "--devices")) {
            if (!moe_arg_int("budget", a, v, 1, MOE_BUDGET_MAX_DEVICES, &devices)) return 2;
            i++;
        } else if (!strcmp(a, "--mem-per-device")) {
            if (!moe_arg_float("budget", a, v, 1e-6, 1e9, &mem_gib)) return 2;
            i++;
        } else if (!strcmp(a, "--ctx")) {
            if (!moe_arg_int("budget", a, v, 1, (long long)MOE_BUDGET_SEARCH_MAX, &ctx)) return 2;
            i++;
        } else if (!strcmp(a, "--streams")) {
            if (!moe_arg_int("budget", a, v, 1, (long long)MOE_BUDGET_SEARCH_MAX, &streams))
                return 2;
            i++;
        } else if (!strcmp(a, "--kv-type")) {
            if (!moe_arg_kv_type("budget", v, &c.kv_type)) return 2;
            i++;
        } else if (!strcmp(a, "--expert-cache")) {
            if (!moe_arg_size("budget", a, v, &c.expert_cache)) return 2;
            i++;
        } else if (!strcmp(a, "--split")) {
            if (!v || (strcmp(v, "rows") != 0 && strcmp(v, "experts") != 0))
                return moe_cli_usage_error("budget", "--split expects rows or experts, got '%s'",
                                           v ? v : "(nothing)");
            c.split_experts = v[0] == 'e';
            i++;
        } else if (!strcmp(a, "--svg")) {
            if (!v) return moe_cli_usage_error("budget", "--svg needs a file name");
            svg = v;
            i++;
        } else if (a[0] == '-' && a[1]) {
            return moe_cli_unknown_option("budget", a);
        } else if (n_paths == MAX_MODELS) {
            return moe_cli_usage_error("budget", "at most %d models", MAX_MODELS);
        } else {
            paths[n_paths++] = a;
        }
    }
    if (!n_paths) return moe_cli_usage_error("budget", "which model?");
    c.devices = (uint32_t)devices;
    c.ctx = (uint64_t)ctx;
    c.streams = (uint64_t)streams;
    bool mem_default = mem_gib == 0;
    c.mem_per_device = mem_default ? machine_ram() : (uint64_t)(mem_gib * GIB);
    if (!c.mem_per_device) {
        fprintf(stderr, "moe budget: cannot read MemTotal from /proc/meminfo; give "
                        "--mem-per-device GiB\n");
        return 1;
    }

    moe_http *http = NULL;
    moe_budget_model *models = moe_xcalloc(n_paths, sizeof *models);
    moe_gguf **vision = moe_xcalloc(n_paths, sizeof *vision);
    size_t n_models = 0, n_vision = 0;
    int rc = 0;
    moe_error err = {0};
    for (size_t i = 0; i < n_paths && !rc; i++) {
        moe_gguf *g = moe_gguf_open_any(paths[i], &http, &err);
        if (!g) {
            fprintf(stderr, "moe budget: %s\n", err.msg);
            rc = 1;
            break;
        }
        const char *arch = moe_gguf_get_str(g, "general.architecture");
        if (arch && !strcmp(arch, "clip")) {
            vision[n_vision++] = g;
            continue;
        }
        if (moe_budget_model_init(&models[n_models], g, paths[i], &err) != MOE_OK) {
            fprintf(stderr, "moe budget: %s\n", err.msg);
            moe_budget_model_free(&models[n_models]);
            rc = 1;
        } else {
            n_models++;
        }
        moe_gguf_close(g);
    }
    if (!rc && !n_models) {
        fprintf(stderr, "moe budget: only vision towers given; which model?\n");
        rc = 2;
    }
    for (size_t i = 0; !rc && i < n_models; i++) {
        for (size_t v = 0; v < n_vision; v++) moe_budget_model_add_vision(&models[i], vision[v]);
        if (ladder && strcmp(models[i].arch, models[0].arch) != 0) {
            fprintf(stderr,
                    "moe budget: --ladder compares builds of one model, but %s is %s "
                    "and %s is %s\n",
                    models[0].name, models[0].arch, models[i].name, models[i].arch);
            rc = 2;
        }
    }
    for (size_t v = 0; v < n_vision; v++) moe_gguf_close(vision[v]);
    free(vision);

    if (!rc) {
        const moe_budget_model **order = moe_xcalloc(n_models, sizeof *order);
        for (size_t i = 0; i < n_models; i++) order[i] = &models[i];
        if (ladder) qsort(order, n_models, sizeof *order, cmp_weights);
        moe_budget_plan *plans = moe_xcalloc(n_models, sizeof *plans);
        size_t best = n_models;
        for (size_t i = 0; i < n_models; i++) {
            moe_budget_plan_make(order[i], &c, &plans[i]);
            if (plans[i].fits) best = i; /* ascending size: the last that fits is the largest */
        }
        if (json) {
            print_json(stdout, order, plans, n_models, best, ladder);
        } else {
            if (mem_default)
                printf("memory per device: %.2f GiB, this machine's RAM (--mem-per-device to "
                       "plan for another device)\n",
                       (double)c.mem_per_device / GIB);
            if (ladder) {
                print_ladder(stdout, order, plans, n_models, best);
            } else {
                for (size_t i = 0; i < n_models; i++) {
                    if (i) putchar('\n');
                    print_model(stdout, order[i], &plans[i]);
                }
            }
        }
        if (svg) {
            char *text = moe_budget_svg(order, plans, n_models, ladder);
            if (moe_file_write(svg, text, strlen(text), &err) != MOE_OK) {
                fprintf(stderr, "moe budget: %s\n", err.msg);
                rc = 1;
            }
            free(text);
        }
        if (http)
            fprintf(json ? stderr : stdout,
                    "remote: %" PRIu64 " requests, %" PRIu64 " bytes read\n",
                    moe_http_requests(http), moe_http_bytes(http));
        for (size_t i = 0; i < n_models; i++) moe_budget_plan_free(&plans[i]);
        free(plans);
        free(order);
    }
    for (size_t i = 0; i < n_models; i++) moe_budget_model_free(&models[i]);
    free(models);
    moe_http_free(http);
    if (!rc && fflush(stdout) != 0) rc = 1;
    return rc;
}
