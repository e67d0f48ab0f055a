/*
 * The XXH3-64 core of kvtier.records._xxcopy (_xxh3.c), as its Python bindings (_xxcopy.c) call
 * it. Private to the extension: its symbols stay hidden in the built module.
 */
#ifndef KVTIER_XXH3_H
#define KVTIER_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define XXC_HAVE_AVX2 1
#else
#define XXC_HAVE_AVX2 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define XXC_INTERNAL __attribute__((visibility("hidden")))
#else
#define XXC_INTERNAL
#endif

typedef uint8_t u8;
typedef uint32_t u32;
typedef uint64_t u64;

/* Stripes first..first+count-1 of the input, read from src (and copied to dst unless NULL),
   scrambling after each 16th stripe. */
typedef void (*stripes_fn)(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first);

XXC_INTERNAL void stripes_scalar(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first);
#if XXC_HAVE_AVX2
XXC_INTERNAL void stripes_avx2(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first);
XXC_INTERNAL void stripes_avx512(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first);
#endif

/* Whether the copying AVX2 / AVX-512 passes prefetch destination lines for writing (PREFETCHW):
   set at import where xxc_cpu_has_prefetchw() says the CPU has it; else they prefetch them for
   reading. Either way the bytes and the digest are the same. */
XXC_INTERNAL extern int xxc_prefetch_writes;
XXC_INTERNAL int xxc_cpu_has_prefetchw(void);

/* XXH3-64 (seed 0) of pre[0:plen] + src[0:slen], src copied into dst (unless NULL) in the same
   pass, on the given stripes path. */
XXC_INTERNAL u64 xxh3_copy(stripes_fn stripes, const u8 *pre, size_t plen, const u8 *src, u8 *dst, size_t slen);

/* ---- little-endian reads ---------------------------------------------------------------- */

static inline u64 read64(const u8 *p)
{
    u64 v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

#endif
