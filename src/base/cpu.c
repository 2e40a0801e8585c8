/* cpu.c: CPU feature detection (CPUID + XGETBV) and the ISA level the kernel tables follow.
 *
 * Owns the detected features and the MOE_ISA override; it does not own the tables themselves
 * (quant/kernels.c). An AVX-512 bit in CPUID is not enough: the OS must also save the ZMM and
 * opmask registers across context switches (XCR0 bits 5-7), or the first context switch
 * corrupts them. AMX needs more: XCR0 bits 17-18 (tile config and data), and on Linux a
 * per-process permission (arch_prctl ARCH_REQ_XCOMP_PERM, kernel >= 5.16) before the first tile
 * instruction, or that instruction faults; detection asks for it once, so every thread of the
 * process (the pool's too, whenever started) may then use the tiles. The trap: everything here must
 * compile and run on any x86-64 (and build off x86), so no intrinsics beyond <cpuid.h> and one
 * inline xgetbv, which is only executed after CPUID says OSXSAVE is on. */
#include "base.h"

#include <ctype.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define MOE_X86 1
#endif
#if defined(MOE_X86) && defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#define MOE_ARCH_REQ_XCOMP_PERM 0x1023 /* asm/prctl.h */
#define MOE_XFEATURE_XTILEDATA  18     /* the XSAVE component of the tile data */
#endif

static moe_cpu_features features;
static unsigned isa_levels = 1u << MOE_ISA_SCALAR;
static moe_isa isa_supported = MOE_ISA_SCALAR, isa_active = MOE_ISA_SCALAR;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static const char *const isa_names[MOE_ISA_COUNT] = {"scalar", "avx2",       "avxvnni",
                                                     "avx512", "avx512vnni", "amx"};

const char *moe_isa_name(moe_isa isa) {
    return (unsigned)isa < MOE_ISA_COUNT ? isa_names[isa] : "?";
}

bool moe_isa_from_name(const char *name, moe_isa *out) {
    for (int i = 0; i < MOE_ISA_COUNT; i++)
        if (name && strcmp(name, isa_names[i]) == 0) {
            *out = (moe_isa)i;
            return true;
        }
    return false;
}

#ifdef MOE_X86
static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (uint64_t)hi << 32 | lo;
}

/* Whether this process may use the AMX tile data (asking the kernel once; it grants it for the
 * whole process). Off Linux, no: other systems are untested. */
static bool amx_permission(void) {
#ifdef MOE_ARCH_REQ_XCOMP_PERM
    return syscall(SYS_arch_prctl, MOE_ARCH_REQ_XCOMP_PERM, MOE_XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
}

static void detect_x86(moe_cpu_features *f) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return;
    const unsigned max_leaf = a;
    memcpy(f->vendor, &b, 4), memcpy(f->vendor + 4, &d, 4), memcpy(f->vendor + 8, &c, 4);
    f->vendor[12] = 0;

    __get_cpuid(1, &a, &b, &c, &d);
    const bool osxsave = c >> 27 & 1, avx = c >> 28 & 1;
    f->fma = c >> 12 & 1;
    f->f16c = c >> 29 & 1;
    bool os_tiles = false;
    if (osxsave && avx) {
        const uint64_t xcr0 = xgetbv0();
        f->os_ymm = (xcr0 & 0x6) == 0x6;                /* SSE + AVX state */
        f->os_zmm = f->os_ymm && (xcr0 & 0xe0) == 0xe0; /* opmask, ZMM_Hi256, Hi16_ZMM */
        os_tiles = (xcr0 & 0x60000) == 0x60000;         /* XTILECFG, XTILEDATA */
    }
    if (max_leaf >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        const unsigned max_sub = a;
        f->avx2 = b >> 5 & 1;
        f->bmi2 = b >> 8 & 1;
        f->avx512f = b >> 16 & 1;
        f->avx512dq = b >> 17 & 1;
        f->avx512bw = b >> 30 & 1;
        f->avx512vl = b >> 31 & 1;
        f->avx512vbmi = c >> 1 & 1;
        f->gfni = c >> 8 & 1;
        f->avx512vnni = c >> 11 & 1;
        f->amx_tile = d >> 24 & 1;
        f->amx_int8 = d >> 25 & 1;
        if (max_sub >= 1) {
            __cpuid_count(7, 1, a, b, c, d);
            f->avxvnni = a >> 4 & 1;
            f->avx512bf16 = a >> 5 & 1;
        }
    }
    /* the features are usable only with the OS saving their registers */
    if (!f->os_ymm) f->avx2 = f->fma = f->f16c = f->avxvnni = false;
    if (!f->os_zmm)
        f->avx512f = f->avx512bw = f->avx512vl = f->avx512dq = f->avx512vnni = f->avx512vbmi =
            f->avx512bf16 = false;
    if (!(f->amx_tile && f->amx_int8 && os_tiles && amx_permission()))
        f->amx_tile = f->amx_int8 = false;

    __get_cpuid(0x80000000, &a, &b, &c, &d);
    if (a >= 0x80000004) {
        unsigned r[12];
        for (unsigned i = 0; i < 3; i++)
            __get_cpuid(0x80000002 + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
        memcpy(f->brand, r, 48);
        f->brand[48] = 0;
        /* trim the padding some vendors put around the name */
        char *s = f->brand;
        while (*s == ' ') s++;
        memmove(f->brand, s, strlen(s) + 1);
        for (size_t n = strlen(f->brand); n > 0 && f->brand[n - 1] == ' ';) f->brand[--n] = 0;
    }
}
#endif

unsigned moe_cpu_levels_of(const moe_cpu_features *f) {
    unsigned set = 1u << MOE_ISA_SCALAR;
    if (!(f->avx2 && f->fma && f->f16c)) return set;
    set |= 1u << MOE_ISA_AVX2;
    if (f->avxvnni) set |= 1u << MOE_ISA_AVXVNNI; /* a branch: not needed by avx512 */
    if (!(f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq)) return set;
    set |= 1u << MOE_ISA_AVX512;
    /* GFNI and BMI2: the IQ2_S / IQ2_XS pair decodes (x86_avx512_iq.h). Every CPU with VNNI and
     * VBMI has both (Ice Lake and later, Zen 4 and later), so none loses the level for them */
    if (!(f->avx512vnni && f->avx512vbmi && f->gfni && f->bmi2)) return set;
    set |= 1u << MOE_ISA_AVX512VNNI;
    if (f->amx_tile && f->amx_int8) set |= 1u << MOE_ISA_AMX;
    return set;
}

/* The highest level of a set (scalar for an empty one). */
static moe_isa best_of(unsigned levels) {
    moe_isa best = MOE_ISA_SCALAR;
    for (int i = 0; i < MOE_ISA_COUNT; i++)
        if (levels >> i & 1) best = (moe_isa)i;
    return best;
}

moe_isa moe_cpu_isa_resolve(const char *request, unsigned levels, char *why, size_t why_size) {
    if (why_size) why[0] = 0;
    levels |= 1u << MOE_ISA_SCALAR;
    const moe_isa best = best_of(levels);
    if (!request || !*request) return best;
    moe_isa want;
    if (!moe_isa_from_name(request, &want)) {
        snprintf(why, why_size,
                 "MOE_ISA=%s is not a kernel table (scalar, avx2, avxvnni, avx512, avx512vnni, "
                 "amx); using %s",
                 request, moe_isa_name(best));
        return best;
    }
    if (!(levels >> want & 1)) {
        char runs[96] = "";
        size_t n = 0;
        for (int i = 0; i < MOE_ISA_COUNT && n < sizeof runs; i++)
            if (levels >> i & 1)
                n += (size_t)snprintf(runs + n, sizeof runs - n, "%s%s", n ? ", " : "",
                                      moe_isa_name((moe_isa)i));
        snprintf(why, why_size, "MOE_ISA=%s: this CPU does not run it (it runs %s); using %s",
                 request, runs, moe_isa_name(best));
        return best;
    }
    return want;
}

static void detect(void) {
#ifdef MOE_X86
    detect_x86(&features);
#endif
    isa_levels = moe_cpu_levels_of(&features);
    isa_supported = best_of(isa_levels);
    char why[200];
    isa_active = moe_cpu_isa_resolve(getenv("MOE_ISA"), isa_levels, why, sizeof why);
    if (why[0]) moe_log(MOE_LOG_ERROR, "%s", why);
}

static pthread_once_t exact_once = PTHREAD_ONCE_INIT;
static atomic_bool exact;

static void read_exact(void) {
    const char *e = getenv("MOE_EXACT");
    atomic_store(&exact, e && e[0] && strcmp(e, "0") != 0);
}

bool moe_exact(void) {
    pthread_once(&exact_once, read_exact);
    return atomic_load(&exact);
}

void moe_exact_set(bool on) {
    pthread_once(&exact_once, read_exact);
    atomic_store(&exact, on);
}

const moe_cpu_features *moe_cpu_features_get(void) {
    pthread_once(&once, detect);
    return &features;
}

moe_isa moe_cpu_isa_supported(void) {
    pthread_once(&once, detect);
    return isa_supported;
}

unsigned moe_cpu_isa_levels(void) {
    pthread_once(&once, detect);
    return isa_levels;
}

bool moe_cpu_isa_runs(moe_isa isa) {
    return (unsigned)isa < MOE_ISA_COUNT && (moe_cpu_isa_levels() >> isa & 1);
}

moe_isa moe_cpu_isa(void) {
    pthread_once(&once, detect);
    return isa_active;
}

void moe_cpu_describe(char *buf, size_t size) {
    const moe_cpu_features *f = moe_cpu_features_get();
    static const struct {
        const char *name;
        size_t offset;
    } flags[] = {
#define FLAG(x) {#x, offsetof(moe_cpu_features, x)}
        FLAG(avx2),       FLAG(fma),      FLAG(f16c),     FLAG(avxvnni),    FLAG(avx512f),
        FLAG(avx512bw),   FLAG(avx512vl), FLAG(avx512dq), FLAG(avx512vnni), FLAG(avx512vbmi),
        FLAG(avx512bf16), FLAG(gfni),     FLAG(bmi2),     FLAG(amx_tile),   FLAG(amx_int8),
#undef FLAG
    };
    size_t n = (size_t)snprintf(buf, size, "%s", f->brand[0] ? f->brand : "unknown cpu");
    for (size_t i = 0; i < sizeof flags / sizeof flags[0] && n < size; i++)
        if (*(const bool *)((const char *)f + flags[i].offset))
            n += (size_t)snprintf(buf + n, size - n, " %s", flags[i].name);
}

/* ==== Cores ==== */

/* An integer from a small sysfs file, or -1. */
static long sysfs_long(const char *path) {
    FILE *f = fopen(path, "r");
    long v = -1;
    if (f) {
        if (fscanf(f, "%ld", &v) != 1) v = -1;
        fclose(f);
    }
    return v;
}

int moe_cpu_cores(void) {
    cpu_set_t set;
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (sched_getaffinity(0, sizeof set, &set) != 0) CPU_ZERO(&set);
    /* a core is (package, core id): count the distinct ones among the CPUs we may use */
    long seen[CPU_SETSIZE][2];
    int n_seen = 0, n_allowed = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
        if (!CPU_ISSET(cpu, &set)) continue;
        n_allowed++;
        char path[128];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/core_id", cpu);
        const long core = sysfs_long(path);
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/physical_package_id",
                 cpu);
        const long pkg = sysfs_long(path);
        if (core < 0) return n_allowed > 0 ? n_allowed : (online > 0 ? (int)online : 1);
        bool dup = false;
        for (int i = 0; i < n_seen && !dup; i++) dup = seen[i][0] == pkg && seen[i][1] == core;
        if (!dup) seen[n_seen][0] = pkg, seen[n_seen++][1] = core;
    }
    if (n_seen > 0) return n_seen;
    return online > 0 ? (int)online : 1;
}
