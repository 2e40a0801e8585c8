/* svg.c: `moe budget --svg` -- the memory plan as a chart that stands on its own.
 *
 * Draws stacked bars (one colour per part, a legend, a y axis with round ticks in a unit that
 * suits the sizes, the memory per device as a dashed line, each bar's total above it) as plain
 * SVG 1.1 text: no scripts, no external fonts or styles, so any browser or image viewer shows
 * it. One chart per model with a bar per device; with a ladder, a chart with a bar per build
 * (its fullest device) comes first. The trap: names are file paths or URLs, so every one is
 * XML-escaped; a raw '&' in a URL would make the whole file unreadable. */
#include "tools.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void sb_text(moe_strbuf *b, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '&':
            moe_strbuf_printf(b, "&amp;");
            break;
        case '<':
            moe_strbuf_printf(b, "&lt;");
            break;
        case '>':
            moe_strbuf_printf(b, "&gt;");
            break;
        case '"':
            moe_strbuf_printf(b, "&quot;");
            break;
        default:
            if ((unsigned char)*s >= 0x20) moe_strbuf_printf(b, "%c", *s);
        }
    }
}

/* Colour-blind-friendly palette (Okabe-Ito and kin), one per part. */
static const char *const colours[MOE_PART_COUNT] = {
    "#0072B2", "#56B4E9", "#E69F00", "#F0E442", "#44AA99", "#009E73", "#999999",
    "#117733", "#CC79A7", "#D55E00", "#AA4499", "#882255", "#BBBBBB",
};

typedef struct bar {
    char label[64];
    const uint64_t *parts; /* [MOE_PART_COUNT] */
} bar;

/* A unit for values up to max: divisor and name. */
static void pick_unit(double max, double *div, const char **name) {
    if (max >= 1024.0 * 1024 * 1024)
        *div = 1024.0 * 1024 * 1024, *name = "GiB";
    else if (max >= 1024.0 * 1024)
        *div = 1024.0 * 1024, *name = "MiB";
    else if (max >= 1024.0)
        *div = 1024.0, *name = "KiB";
    else
        *div = 1.0, *name = "bytes";
}

/* A round tick step giving about 5 ticks up to max (1, 2 or 5 times a power of ten). */
static double nice_step(double max) {
    if (max <= 0) return 1;
    double raw = max / 5, p = pow(10, floor(log10(raw))), f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
}

#define BAR_W    56
#define BAR_GAP  28
#define PLOT_H   300
#define LEFT     90
#define LEGEND_W 330 /* the legend, and the memory line's label left of it */

/* One chart at vertical offset y0; returns its height. */
static int chart(moe_strbuf *b, int y0, int width, const char *title, const char *subtitle,
                 const bar *bars, size_t n, uint64_t mem, const bool *fits) {
    double max = (double)mem;
    for (size_t i = 0; i < n; i++) {
        double t = 0;
        for (int k = 0; k < MOE_PART_COUNT; k++) t += (double)bars[i].parts[k];
        if (t > max) max = t;
    }
    double div;
    const char *unit;
    pick_unit(max, &div, &unit);
    double step = nice_step(max / div), top = ceil(max / div / step) * step;
    if (top <= 0) top = 1;
    int px = LEFT, py = y0 + 70; /* plot origin (top-left) */
    int plot_w = (int)n * (BAR_W + BAR_GAP) + BAR_GAP;
    moe_strbuf_printf(b, "<text x=\"%d\" y=\"%d\" font-size=\"16\" font-weight=\"bold\">", 20,
                      y0 + 28);
    sb_text(b, title);
    moe_strbuf_printf(b, "</text>\n<text x=\"%d\" y=\"%d\" font-size=\"12\" fill=\"#444\">", 20,
                      y0 + 48);
    sb_text(b, subtitle);
    moe_strbuf_printf(b, "</text>\n");
    /* axes, ticks and grid */
    for (double v = 0; v <= top + step / 2; v += step) {
        double y = py + PLOT_H - v / top * PLOT_H;
        moe_strbuf_printf(b,
                          "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>\n",
                          px, y, px + plot_w, y);
        moe_strbuf_printf(
            b, "<text x=\"%d\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\">%g</text>\n", px - 6,
            y + 4, v);
    }
    moe_strbuf_printf(b, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#000\"/>\n", px,
                      py, px, py + PLOT_H);
    moe_strbuf_printf(b, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#000\"/>\n", px,
                      py + PLOT_H, px + plot_w, py + PLOT_H);
    moe_strbuf_printf(b,
                      "<text x=\"%d\" y=\"%d\" font-size=\"12\" text-anchor=\"middle\" "
                      "transform=\"rotate(-90 %d %d)\">memory (%s)</text>\n",
                      28, py + PLOT_H / 2, 28, py + PLOT_H / 2, unit);
    /* bars */
    for (size_t i = 0; i < n; i++) {
        int x = px + BAR_GAP + (int)i * (BAR_W + BAR_GAP);
        double acc = 0;
        for (int k = 0; k < MOE_PART_COUNT; k++) {
            double v = (double)bars[i].parts[k] / div;
            if (v <= 0) continue;
            double y1 = py + PLOT_H - (acc + v) / top * PLOT_H, h = v / top * PLOT_H;
            moe_strbuf_printf(b,
                              "<rect x=\"%d\" y=\"%.2f\" width=\"%d\" height=\"%.2f\" fill=\"%s\">"
                              "<title>%s: %.3f %s</title></rect>\n",
                              x, y1, BAR_W, h, colours[k], moe_budget_part_name((moe_budget_part)k),
                              v, unit);
            acc += v;
        }
        double ytop = py + PLOT_H - acc / top * PLOT_H;
        moe_strbuf_printf(
            b,
            "<text x=\"%d\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\">%.3g %s%s"
            "</text>\n",
            x + BAR_W / 2, ytop - 5, acc, unit, fits && !fits[i] ? " (short)" : "");
        moe_strbuf_printf(b,
                          "<text x=\"%d\" y=\"%d\" font-size=\"11\" text-anchor=\"end\" "
                          "transform=\"rotate(-30 %d %d)\">",
                          x + BAR_W / 2, py + PLOT_H + 16, x + BAR_W / 2, py + PLOT_H + 16);
        sb_text(b, bars[i].label);
        moe_strbuf_printf(b, "</text>\n");
    }
    /* the memory line */
    double ym = py + PLOT_H - (double)mem / div / top * PLOT_H;
    moe_strbuf_printf(b,
                      "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#c00\" "
                      "stroke-width=\"2\" stroke-dasharray=\"6 4\"/>\n",
                      px, ym, px + plot_w, ym);
    moe_strbuf_printf(
        b,
        "<text x=\"%d\" y=\"%.1f\" font-size=\"11\" fill=\"#c00\">memory per</text>"
        "<text x=\"%d\" y=\"%.1f\" font-size=\"11\" fill=\"#c00\">device %.3g %s</text>\n",
        px + plot_w + 6, ym - 2, px + plot_w + 6, ym + 11, (double)mem / div, unit);
    /* legend */
    int lx = width - LEGEND_W + 10, ly = py;
    moe_strbuf_printf(
        b, "<text x=\"%d\" y=\"%d\" font-size=\"12\" font-weight=\"bold\">parts</text>\n", lx, ly);
    for (int k = MOE_PART_COUNT - 1, row = 0; k >= 0; k--, row++) {
        int y = ly + 10 + row * 20;
        moe_strbuf_printf(b,
                          "<rect x=\"%d\" y=\"%d\" width=\"14\" height=\"14\" fill=\"%s\"/>"
                          "<text x=\"%d\" y=\"%d\" font-size=\"12\">%s</text>\n",
                          lx, y, colours[k], lx + 20, y + 11,
                          moe_budget_part_name((moe_budget_part)k));
    }
    return 70 + PLOT_H + 110;
}

static const char *base_name(const char *path) {
    const char *q = strrchr(path, '/');
    return q && q[1] ? q + 1 : path;
}

char *moe_budget_svg(const moe_budget_model *const *models, const moe_budget_plan *plans,
                     size_t n_models, bool ladder) {
    size_t max_bars = ladder ? n_models : 0;
    for (size_t i = 0; i < n_models; i++)
        if (plans[i].config.devices > max_bars) max_bars = plans[i].config.devices;
    if (max_bars > 64) max_bars = 64; /* more devices than this are drawn as the first 64 */
    int width = LEFT + (int)max_bars * (BAR_W + BAR_GAP) + BAR_GAP + LEGEND_W;
    if (width < 640) width = 640;
    moe_strbuf body = {0};
    int y = 0;
    char title[512], sub[512];
    if (ladder && n_models) {
        bar *bars = moe_xcalloc(n_models, sizeof *bars);
        bool *fits = moe_xcalloc(n_models, sizeof *fits);
        for (size_t i = 0; i < n_models; i++) {
            /* the fullest device is device 0 (it gets the remainder rows) */
            uint64_t w = 0, n = 0;
            for (int k = 0; k <= MOE_PART_VISION; k++)
                w += models[i]->weights[k], n += models[i]->params[k];
            snprintf(bars[i].label, sizeof bars[i].label, "%.40s (%.2f bpw)",
                     base_name(models[i]->name), n ? 8.0 * (double)w / (double)n : 0.0);
            bars[i].parts = plans[i].device;
            fits[i] = plans[i].fits;
        }
        const moe_budget_config *c = &plans[0].config;
        snprintf(title, sizeof title, "Quant ladder: %zu builds of %s, fullest device each",
                 n_models, models[0]->arch);
        snprintf(sub, sizeof sub, "%u device(s), context %llu, %llu stream(s), KV %s", c->devices,
                 (unsigned long long)c->ctx, (unsigned long long)c->streams,
                 moe_budget_kv_name(c->kv_type));
        y += chart(&body, y, width, title, sub, bars, n_models, c->mem_per_device, fits);
        free(bars);
        free(fits);
    }
    /* a ladder shows the devices of its largest build that fits (else of its smallest) */
    size_t first = 0, last = n_models;
    if (ladder && n_models) {
        first = 0;
        for (size_t i = 0; i < n_models; i++)
            if (plans[i].fits) first = i;
        last = first + 1;
    }
    for (size_t i = first; i < last; i++) {
        const moe_budget_plan *p = &plans[i];
        size_t nb = p->config.devices < 64 ? p->config.devices : 64;
        bar *bars = moe_xcalloc(nb, sizeof *bars);
        for (size_t d = 0; d < nb; d++) {
            snprintf(bars[d].label, sizeof bars[d].label, "device %zu", d);
            bars[d].parts = p->device + d * MOE_PART_COUNT;
        }
        snprintf(title, sizeof title, "Memory per device: %s", base_name(models[i]->name));
        snprintf(sub, sizeof sub, "%s; context %llu, %llu stream(s), KV %s; %s %.2f GiB",
                 models[i]->arch, (unsigned long long)p->config.ctx,
                 (unsigned long long)p->config.streams, moe_budget_kv_name(p->config.kv_type),
                 p->fits ? "fits, spare" : "short by",
                 (double)(p->spare < 0 ? -p->spare : p->spare) / (1024.0 * 1024 * 1024));
        y += chart(&body, y, width, title, sub, bars, nb, p->config.mem_per_device, NULL);
        free(bars);
    }
    moe_strbuf out = {0};
    moe_strbuf_printf(
        &out,
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
        "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"%d\" height=\"%d\" "
        "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\">\n"
        "<title>moe budget</title>\n<rect width=\"100%%\" height=\"100%%\" fill=\"#fff\"/>\n",
        width, y, width, y);
    moe_strbuf_printf(&out, "%s</svg>\n", body.s ? body.s : "");
    free(body.s);
    return out.s;
}

/* ==== Latency distribution (moe bench --server) ==== */

#define HIST_BINS 40
#define HIST_W    560
#define HIST_H    220

/* A histogram of sorted samples (seconds, drawn in ms) at vertical offset y0, p50 and p99
 * marked; samples past the 99.9th percentile count in the last bin. Returns its height. */
static int histogram(moe_strbuf *b, int y0, const char *title, const double *v, size_t n,
                     const char *colour) {
    const int px = LEFT, py = y0 + 40;
    moe_strbuf_printf(b, "<text x=\"20\" y=\"%d\" font-size=\"14\" font-weight=\"bold\">", y0 + 24);
    sb_text(b, title);
    moe_strbuf_printf(b, " (%zu samples)</text>\n", n);
    double hi = n ? v[(size_t)floor(0.999 * (double)(n - 1))] * 1e3 : 1;
    if (hi <= 0) hi = n ? v[n - 1] * 1e3 : 1;
    if (hi <= 0) hi = 1;
    const double xstep = nice_step(hi), xtop = ceil(hi / xstep) * xstep;
    uint64_t bins[HIST_BINS] = {0}, most = 1;
    for (size_t i = 0; i < n; i++) {
        int k = (int)(v[i] * 1e3 / xtop * HIST_BINS);
        bins[k < 0 ? 0 : k >= HIST_BINS ? HIST_BINS - 1 : k]++;
    }
    for (int k = 0; k < HIST_BINS; k++) most = bins[k] > most ? bins[k] : most;
    const double ystep = nice_step((double)most), ytop = ceil((double)most / ystep) * ystep;
    for (double y = 0; y <= ytop + ystep / 2; y += ystep) {
        const double yy = py + HIST_H - y / ytop * HIST_H;
        moe_strbuf_printf(
            b,
            "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>"
            "<text x=\"%d\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\">%g</text>\n",
            px, yy, px + HIST_W, yy, px - 6, yy + 4, y);
    }
    for (double x = 0; x <= xtop + xstep / 2; x += xstep) {
        const double xx = px + x / xtop * HIST_W;
        moe_strbuf_printf(b,
                          "<text x=\"%.1f\" y=\"%d\" font-size=\"11\" "
                          "text-anchor=\"middle\">%g</text>\n",
                          xx, py + HIST_H + 16, x);
    }
    moe_strbuf_printf(b,
                      "<text x=\"%d\" y=\"%d\" font-size=\"12\" text-anchor=\"middle\">ms</text>"
                      "<text x=\"28\" y=\"%d\" font-size=\"12\" text-anchor=\"middle\" "
                      "transform=\"rotate(-90 28 %d)\">count</text>\n",
                      px + HIST_W / 2, py + HIST_H + 34, py + HIST_H / 2, py + HIST_H / 2);
    const double bw = (double)HIST_W / HIST_BINS;
    for (int k = 0; k < HIST_BINS; k++) {
        if (!bins[k]) continue;
        const double h = (double)bins[k] / ytop * HIST_H;
        moe_strbuf_printf(b,
                          "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\">"
                          "<title>%.3g-%.3g ms: %llu</title></rect>\n",
                          px + k * bw, py + HIST_H - h, bw - 1, h, colour, k * xtop / HIST_BINS,
                          (k + 1) * xtop / HIST_BINS, (unsigned long long)bins[k]);
    }
    moe_strbuf_printf(b, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#000\"/>\n", px,
                      py + HIST_H, px + HIST_W, py + HIST_H);
    const struct {
        const char *name;
        double pct;
    } marks[] = {{"p50", 50}, {"p99", 99}};
    for (size_t m = 0; m < 2 && n; m++) {
        size_t rank = (size_t)ceil(marks[m].pct / 100.0 * (double)n);
        const double ms = v[rank ? rank - 1 : 0] * 1e3;
        const double xx = px + (ms < xtop ? ms : xtop) / xtop * HIST_W;
        moe_strbuf_printf(b,
                          "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#c00\" "
                          "stroke-dasharray=\"4 3\"/><text x=\"%.1f\" y=\"%d\" font-size=\"11\" "
                          "fill=\"#c00\">%s %.3g ms</text>\n",
                          xx, py, xx, py + HIST_H, xx + 3, py + 12 + 14 * (int)m, marks[m].name,
                          ms);
    }
    return 40 + HIST_H + 50;
}

char *moe_latency_svg(const moe_bench_server_result *r, const char *subtitle) {
    moe_strbuf body = {0};
    moe_strbuf_printf(&body, "<text x=\"20\" y=\"28\" font-size=\"16\" font-weight=\"bold\">"
                             "Latency: moe bench --server</text>\n"
                             "<text x=\"20\" y=\"48\" font-size=\"12\" fill=\"#444\">");
    sb_text(&body, subtitle);
    moe_strbuf_printf(&body, "</text>\n");
    int y = 56;
    y += histogram(&body, y, "Time to first token", r->ttft, r->n_ttft, "#0072B2");
    y += histogram(&body, y, "Inter-token latency", r->itl, r->n_itl, "#E69F00");
    const int width = LEFT + HIST_W + 40;
    moe_strbuf out = {0};
    moe_strbuf_printf(&out,
                      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
                      "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"%d\" "
                      "height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"sans-serif\">\n"
                      "<title>moe bench --server</title>\n"
                      "<rect width=\"100%%\" height=\"100%%\" fill=\"#fff\"/>\n%s</svg>\n",
                      width, y, width, y, body.s);
    free(body.s);
    return out.s;
}
