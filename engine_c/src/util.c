/* util.c - half-precision conversions, error formatting, available memory. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

/* IEEE 754 binary16 -> binary32, exact for every input (incl. subnormals, inf, NaN). */
float es_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do { man <<= 1; e++; } while ((man & 0x400u) == 0);
            man &= 0x3ffu;
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | (man << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* binary32 -> binary16, round to nearest even; overflow gives inf. */
uint16_t es_fp32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t exp = (x >> 23) & 0xffu;
    uint32_t man = x & 0x7fffffu;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0)); /* NaN: quiet, payload truncated, as F16C and FCVT do */
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t half = 1u << (shift - 1);
        uint32_t r = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((uint32_t)e << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

float es_bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

void es_set_err(char *buf, size_t len, const char *fmt, ...) {
    if (buf == NULL || len == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, len, fmt, ap);
    va_end(ap);
}

/* ECHOSPEC_MEM_AVAILABLE: a byte count, or a number with a K, M, G or T
 * suffix (powers of 1024; "KiB", "MB", ... accepted too); -1 when malformed. */
static int64_t parse_size(const char *s) {
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno != 0 || !(v >= 0.0)) return -1;
    double unit = 1.0;
    switch (*end) {
    case 'k': case 'K': unit = 1024.0; end++; break;
    case 'm': case 'M': unit = 1024.0 * 1024; end++; break;
    case 'g': case 'G': unit = 1024.0 * 1024 * 1024; end++; break;
    case 't': case 'T': unit = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (unit > 1.0 && *end == 'i') end++;
    if (*end == 'B' || *end == 'b') end++;
    if (*end != '\0' || v * unit > 9.0e18) return -1;
    return (int64_t)(v * unit);
}

int64_t es_mem_available(const char **source) {
    const char *src = "unknown";
    int64_t avail = -1;
    const char *env = getenv("ECHOSPEC_MEM_AVAILABLE");
    if (env != NULL && *env) {
        if (source) *source = "ECHOSPEC_MEM_AVAILABLE";
        int64_t v = parse_size(env);
        return v >= 0 ? v : -2;
    }
    FILE *f = fopen("/proc/meminfo", "r");
    if (f != NULL) {
        char line[128];
        long long kb = -1;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) break;
        fclose(f);
        if (kb >= 0) {
            avail = (int64_t)kb * 1024;
            src = "MemAvailable in /proc/meminfo";
        }
    }
    if (avail < 0) {
        long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        if (pages > 0 && page > 0) {
            avail = (int64_t)pages * page;
            src = "free physical pages";
        }
    }
    /* a container's memory limit (cgroup v2), which MemAvailable does not show */
    long long max = -1, cur = -1;
    if ((f = fopen("/sys/fs/cgroup/memory.max", "r")) != NULL) {
        if (fscanf(f, "%lld", &max) != 1) max = -1;
        fclose(f);
    }
    if (max > 0 && (f = fopen("/sys/fs/cgroup/memory.current", "r")) != NULL) {
        if (fscanf(f, "%lld", &cur) == 1 && cur <= max && (avail < 0 || max - cur < avail)) {
            avail = max - cur;
            src = "the container's memory limit (cgroup memory.max less memory.current)";
        }
        fclose(f);
    }
    if (source) *source = src;
    return avail;
}

const char *es_size_str(double bytes, char buf[32]) {
    if (bytes >= 1024.0 * 1024 * 1024) snprintf(buf, 32, "%.2f GiB", bytes / (1024.0 * 1024 * 1024));
    else if (bytes >= 1024.0 * 1024) snprintf(buf, 32, "%.1f MiB", bytes / (1024.0 * 1024));
    else if (bytes >= 1024.0) snprintf(buf, 32, "%.1f KiB", bytes / 1024.0);
    else snprintf(buf, 32, "%.0f bytes", bytes);
    return buf;
}

int es_mem_check(int64_t need, const char *what, const char *advice, char *err, size_t err_len) {
    const char *src = NULL;
    int64_t avail = es_mem_available(&src);
    if (avail == -2) {
        es_set_err(err, err_len, "ECHOSPEC_MEM_AVAILABLE=%s is not a size: give bytes, or a number "
                   "with K, M, G or T (e.g. 8G)", getenv("ECHOSPEC_MEM_AVAILABLE"));
        return ES_ERR_INVALID_ARG;
    }
    if (avail >= 0 && need > avail) {
        char a[32], b[32];
        es_set_err(err, err_len, "%s need%s %s but only %s of memory is available (%s); %s", what,
                   strstr(what, "weights") ? "" : "s", es_size_str((double)need, a),
                   es_size_str((double)avail, b), src, advice);
        return ES_ERR_NOMEM;
    }
    return ES_OK;
}
