/*
 * XXH3-64 (seed 0, default secret) of prefix + src, optionally copying src into dst in the
 * same pass: each 64-byte stripe of src is loaded once, stored to dst and fed to the eight
 * accumulators from the same registers. Written from the algorithm's public specification
 * (xxHash's doc/xxhash_spec.md, "XXH3 Algorithm Description"); the result equals
 * xxhash.xxh3_64(prefix + src).intdigest() for every length.
 *
 * Paths: a portable scalar one, an AVX2 one chosen at import when the CPU has it, and an
 * AVX-512 one (measured slower than AVX2 for the fused pass here: not the default). A pass of
 * 16 KiB or more runs without the GIL.
 */
#include "_xxh3.h"

#include <string.h>

#if XXC_HAVE_AVX2
#include <cpuid.h>
#include <immintrin.h>
#endif

XXC_INTERNAL int xxc_prefetch_writes = 0;

XXC_INTERNAL int xxc_cpu_has_prefetchw(void)
{
#if XXC_HAVE_AVX2
    unsigned int a, b, c, d;
    if (__get_cpuid(0x80000001U, &a, &b, &c, &d))
        return (c >> 8) & 1; /* PRFCHW */
#endif
    return 0;
}

/* The spec's default 192-byte secret. */
static const u8 SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define PRIME32_1 0x9E3779B1U
#define PRIME32_2 0x85EBCA77U
#define PRIME32_3 0xC2B2AE3DU
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL
#define PRIME_MX1 0x165667919E3779F9ULL
#define PRIME_MX2 0x9FB21C651E98DF25ULL

#define STRIPE 64
#define STRIPES_PER_BLOCK 16           /* (192 - 64) / 8 */
#define SCRAMBLE_AT (192 - 64)         /* the secret's last 64 bytes */
#define LAST_STRIPE_AT (192 - 64 - 7)  /* 121 */
#define MERGE_AT 11
#define MID_MAX 240

/* ---- little-endian reads ---------------------------------------------------------------- */

static inline u32 read32(const u8 *p)
{
    u32 v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline u64 rotl64(u64 x, unsigned r) { return (x << r) | (x >> (64 - r)); }

static inline u64 mul_fold(u64 a, u64 b)
{
    __uint128_t r = (__uint128_t)a * b;
    return (u64)r ^ (u64)(r >> 64);
}

static inline u64 avalanche(u64 x)
{
    x ^= x >> 37;
    x *= PRIME_MX1;
    return x ^ (x >> 32);
}

static inline u64 avalanche_xxh64(u64 x)
{
    x ^= x >> 33;
    x *= PRIME64_2;
    x ^= x >> 29;
    x *= PRIME64_3;
    return x ^ (x >> 32);
}

/* ---- inputs of 0..240 bytes (contiguous) ------------------------------------------------- */

static inline u64 mix16(const u8 *in, const u8 *sec)
{
    return mul_fold(read64(in) ^ read64(sec), read64(in + 8) ^ read64(sec + 8));
}

static u64 hash_upto16(const u8 *in, size_t len)
{
    if (len > 8) {
        u64 lo = (read64(SECRET + 24) ^ read64(SECRET + 32)) ^ read64(in);
        u64 hi = (read64(SECRET + 40) ^ read64(SECRET + 48)) ^ read64(in + len - 8);
        return avalanche((u64)len + __builtin_bswap64(lo) + hi + mul_fold(lo, hi));
    }
    if (len >= 4) {
        u64 both = (u64)read32(in + len - 4) | ((u64)read32(in) << 32);
        u64 v = (read64(SECRET + 8) ^ read64(SECRET + 16)) ^ both;
        v ^= rotl64(v, 49) ^ rotl64(v, 24);
        v *= PRIME_MX2;
        v ^= (v >> 35) + (u64)len;
        v *= PRIME_MX2;
        return v ^ (v >> 28);
    }
    if (len > 0) {
        u32 c = (u32)in[len - 1] | ((u32)len << 8) | ((u32)in[0] << 16) | ((u32)in[len >> 1] << 24);
        return avalanche_xxh64((u64)(read32(SECRET) ^ read32(SECRET + 4)) ^ (u64)c);
    }
    return avalanche_xxh64(read64(SECRET + 56) ^ read64(SECRET + 64));
}

static u64 hash_small(const u8 *in, size_t len)
{
    if (len <= 16)
        return hash_upto16(in, len);
    u64 acc = (u64)len * PRIME64_1;
    if (len <= 128) {
        size_t rounds = ((len - 1) >> 5) + 1;
        for (size_t i = rounds; i-- > 0;) {
            acc += mix16(in + 16 * i, SECRET + 32 * i);
            acc += mix16(in + len - 16 * i - 16, SECRET + 32 * i + 16);
        }
        return avalanche(acc);
    }
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; i++)
        acc += mix16(in + 16 * i, SECRET + 16 * i);
    acc = avalanche(acc);
    for (size_t i = 8; i < chunks; i++)
        acc += mix16(in + 16 * i, SECRET + 16 * (i - 8) + 3);
    acc += mix16(in + len - 16, SECRET + 119);
    return avalanche(acc);
}

/* ---- inputs over 240 bytes: stripes, blocks, scrambles ----------------------------------- */

static inline void accumulate_scalar(u64 *acc, const u8 *stripe, const u8 *sec)
{
    for (int i = 0; i < 8; i++) {
        u64 v = read64(stripe + 8 * i);
        u64 k = v ^ read64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
}

static inline void scramble_scalar(u64 *acc)
{
    for (int i = 0; i < 8; i++) {
        u64 a = acc[i];
        a ^= a >> 47;
        a ^= read64(SECRET + SCRAMBLE_AT + 8 * i);
        acc[i] = a * PRIME32_1;
    }
}

XXC_INTERNAL void stripes_scalar(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first)
{
    size_t n = first, end = first + count;
    while (n < end) {
        size_t k = n % STRIPES_PER_BLOCK;
        size_t run = STRIPES_PER_BLOCK - k;
        if (run > end - n)
            run = end - n;
        for (size_t j = 0; j < run; j++)
            accumulate_scalar(acc, src + STRIPE * j, SECRET + 8 * (k + j));
        if (dst) {
            memcpy(dst, src, STRIPE * run);  /* from L1: just read */
            dst += STRIPE * run;
        }
        src += STRIPE * run;
        n += run;
        if (n % STRIPES_PER_BLOCK == 0)
            scramble_scalar(acc);
    }
}

#if XXC_HAVE_AVX2
__attribute__((target("avx2"))) static inline __m256i accumulate_avx2(__m256i acc, __m256i data, const u8 *sec)
{
    __m256i key = _mm256_xor_si256(data, _mm256_loadu_si256((const __m256i *)sec));
    __m256i key_hi = _mm256_shuffle_epi32(key, _MM_SHUFFLE(0, 3, 0, 1));
    __m256i product = _mm256_mul_epu32(key, key_hi);              /* low32 * high32 per lane */
    __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2)); /* lane i -> i ^ 1 */
    return _mm256_add_epi64(acc, _mm256_add_epi64(product, swapped));
}

__attribute__((target("avx2"))) static inline __m256i scramble_avx2(__m256i acc, const u8 *sec)
{
    const __m256i prime = _mm256_set1_epi32((int)PRIME32_1);
    __m256i a = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
    a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)sec));
    __m256i a_hi = _mm256_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1));
    __m256i lo = _mm256_mul_epu32(a, prime);
    __m256i hi = _mm256_mul_epu32(a_hi, prime);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

/* An empty statement that takes and gives back acc in a vector register: it keeps the compiler
   from reordering a whole unrolled block's sums (it computed every product first and spilled
   them to the stack, at half the speed). */
#define KEEP_IN_REGISTERS(acc) __asm__("" : "+x"(acc))

/* Each stripe asks for the source line this many bytes ahead. A mapped value or a row read
   from the page cache is usually not in the core's caches, and the pass's loads alone kept
   too few misses in flight: on 2 MiB values read after another store's (not in the caches),
   the pass took 1/0.85 of a plain copy's thread CPU time, and 1/0.99 with lines fetched 1-2
   KiB ahead (512 bytes: 1/0.94). A prefetch never faults; its address is formed as an
   integer, so no pointer past the source is formed either. */
#define PREFETCH_AHEAD 1024
#define PREFETCH(p) _mm_prefetch((const char *)((uintptr_t)(p) + PREFETCH_AHEAD), _MM_HINT_T0)

/* A copying pass asks for the destination line as far ahead, for writing (copy == 2: PREFETCHW,
   where the CPU has it, xxc_prefetch_writes) or for reading (copy == 1). Without it each store
   to a row not in the core's caches waited for its line to be read for ownership, the fused
   pass's stores kept far fewer of those in flight than a memcpy does, and a 256 KiB value
   copied and hashed from the map just after its save took 1/0.80 of a get and memcpy's time
   (64 KiB 1/0.79, 2 MiB 1/0.84); with PREFETCHW 1/0.97 (1/0.92, 1/1.05), with the line
   prefetched for reading 1/0.96 at 256 KiB. Written as an instruction (not a builtin), so no
   target flag is needed; taken only where CPUID says the CPU has it. */
#define PREFETCH_DST(p, copy)                                                                    \
    do {                                                                                         \
        uintptr_t at_ = (uintptr_t)(p) + PREFETCH_AHEAD;                                         \
        if ((copy) == 2)                                                                         \
            __asm__ volatile("prefetchw (%0)" : : "r"(at_));                                     \
        else                                                                                     \
            _mm_prefetch((const char *)at_, _MM_HINT_T0);                                        \
    } while (0)

/* Stripes [0, run) of one block, starting at the block's stripe k; copied to dst when copy. */
#define AVX2_STRIPES(copy, run, k)                                                        \
    do {                                                                                  \
        const u8 *sec_ = SECRET + 8 * (k);                                                \
        for (size_t j_ = 0; j_ < (run); j_++, src += STRIPE, sec_ += 8) {                 \
            PREFETCH(src);                                                                \
            __m256i d0 = _mm256_loadu_si256((const __m256i *)src);                        \
            __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + 32));                 \
            if (copy) {                                                                   \
                PREFETCH_DST(dst, copy);                                                  \
                _mm256_storeu_si256((__m256i *)dst, d0);                                  \
                _mm256_storeu_si256((__m256i *)(dst + 32), d1);                           \
                dst += STRIPE;                                                            \
            }                                                                             \
            a0 = accumulate_avx2(a0, d0, sec_);                                           \
            a1 = accumulate_avx2(a1, d1, sec_ + 32);                                      \
            KEEP_IN_REGISTERS(a0);                                                        \
            KEEP_IN_REGISTERS(a1);                                                        \
        }                                                                                 \
    } while (0)

__attribute__((target("avx2"), always_inline)) static inline void
stripes_avx2_body(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first, const int copy) /* copy: see PREFETCH_DST */
{
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    size_t n = first, end = first + count;
    while (n < end) {
        size_t k = n % STRIPES_PER_BLOCK;
        if (k == 0 && end - n >= STRIPES_PER_BLOCK) {
            AVX2_STRIPES(copy, STRIPES_PER_BLOCK, 0); /* a whole block: a fixed, unrolled loop */
            n += STRIPES_PER_BLOCK;
        } else {
            size_t run = STRIPES_PER_BLOCK - k;
            if (run > end - n)
                run = end - n;
            AVX2_STRIPES(copy, run, k);
            n += run;
        }
        if (n % STRIPES_PER_BLOCK == 0) {
            a0 = scramble_avx2(a0, SECRET + SCRAMBLE_AT);
            a1 = scramble_avx2(a1, SECRET + SCRAMBLE_AT + 32);
        }
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
}

XXC_INTERNAL __attribute__((target("avx2"))) void stripes_avx2(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first)
{
    if (dst == NULL)
        stripes_avx2_body(acc, src, dst, count, first, 0);
    else if (xxc_prefetch_writes)
        stripes_avx2_body(acc, src, dst, count, first, 2);
    else
        stripes_avx2_body(acc, src, dst, count, first, 1);
}

__attribute__((target("avx512f"))) static inline __m512i accumulate_avx512(__m512i acc, __m512i data, const u8 *sec)
{
    __m512i key = _mm512_xor_si512(data, _mm512_loadu_si512((const void *)sec));
    __m512i key_hi = _mm512_shuffle_epi32(key, (_MM_PERM_ENUM)_MM_SHUFFLE(0, 3, 0, 1));
    __m512i product = _mm512_mul_epu32(key, key_hi);
    __m512i swapped = _mm512_shuffle_epi32(data, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
    return _mm512_add_epi64(acc, _mm512_add_epi64(product, swapped));
}

__attribute__((target("avx512f"))) static inline __m512i scramble_avx512(__m512i acc)
{
    const __m512i prime = _mm512_set1_epi32((int)PRIME32_1);
    __m512i a = _mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47));
    a = _mm512_xor_si512(a, _mm512_loadu_si512((const void *)(SECRET + SCRAMBLE_AT)));
    __m512i a_hi = _mm512_shuffle_epi32(a, (_MM_PERM_ENUM)_MM_SHUFFLE(0, 3, 0, 1));
    return _mm512_add_epi64(_mm512_mul_epu32(a, prime), _mm512_slli_epi64(_mm512_mul_epu32(a_hi, prime), 32));
}

#define AVX512_STRIPES(copy, run, k)                                                      \
    do {                                                                                  \
        const u8 *sec_ = SECRET + 8 * (k);                                                \
        for (size_t j_ = 0; j_ < (run); j_++, src += STRIPE, sec_ += 8) {                 \
            PREFETCH(src);                                                                \
            __m512i d = _mm512_loadu_si512((const void *)src);                            \
            if (copy) {                                                                   \
                PREFETCH_DST(dst, copy);                                                  \
                _mm512_storeu_si512((void *)dst, d);                                      \
                dst += STRIPE;                                                            \
            }                                                                             \
            a = accumulate_avx512(a, d, sec_);                                            \
            KEEP_IN_REGISTERS(a);                                                         \
        }                                                                                 \
    } while (0)

__attribute__((target("avx512f"), always_inline)) static inline void
stripes_avx512_body(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first, const int copy)
{
    __m512i a = _mm512_loadu_si512((const void *)acc);
    size_t n = first, end = first + count;
    while (n < end) {
        size_t k = n % STRIPES_PER_BLOCK;
        if (k == 0 && end - n >= STRIPES_PER_BLOCK) {
            AVX512_STRIPES(copy, STRIPES_PER_BLOCK, 0);
            n += STRIPES_PER_BLOCK;
        } else {
            size_t run = STRIPES_PER_BLOCK - k;
            if (run > end - n)
                run = end - n;
            AVX512_STRIPES(copy, run, k);
            n += run;
        }
        if (n % STRIPES_PER_BLOCK == 0)
            a = scramble_avx512(a);
    }
    _mm512_storeu_si512((void *)acc, a);
}

XXC_INTERNAL __attribute__((target("avx512f"))) void stripes_avx512(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first)
{
    if (dst == NULL)
        stripes_avx512_body(acc, src, dst, count, first, 0);
    else if (xxc_prefetch_writes)
        stripes_avx512_body(acc, src, dst, count, first, 2);
    else
        stripes_avx512_body(acc, src, dst, count, first, 1);
}
#endif

/* Bytes [start, start + len) of prefix + src into out. */
static void gather(u8 *out, const u8 *pre, size_t plen, const u8 *src, size_t start, size_t len)
{
    if (start < plen) {
        size_t take = plen - start < len ? plen - start : len;
        memcpy(out, pre + start, take);
        out += take;
        start += take;
        len -= take;
    }
    if (len)
        memcpy(out, src + (start - plen), len);
}

/* The digest of a long input from its accumulators after every stripe but the last one, and
   its last 64 bytes (last). */
static u64 merge(u64 *acc, const u8 *last, size_t total)
{
    accumulate_scalar(acc, last, SECRET + LAST_STRIPE_AT);
    u64 result = (u64)total * PRIME64_1;
    for (int i = 0; i < 4; i++)
        result += mul_fold(acc[2 * i] ^ read64(SECRET + MERGE_AT + 16 * i), acc[2 * i + 1] ^ read64(SECRET + MERGE_AT + 16 * i + 8));
    return avalanche(result);
}

static const u64 ACC_INIT[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};

static u64 hash_large(stripes_fn stripes, const u8 *pre, size_t plen, const u8 *src, u8 *dst, size_t slen)
{
    u64 acc[8];
    memcpy(acc, ACC_INIT, sizeof acc);
    size_t total = plen + slen;
    size_t full = (total - 1) / STRIPE; /* stripes before the last one, which is handled apart */
    u8 tmp[STRIPE], last_stripe[STRIPE];
    const u8 *last = last_stripe;
    if (slen >= STRIPE)
        last = src + slen - STRIPE;
    else /* prefix bytes in it: read before dst, which may overlap the prefix, is written */
        gather(last_stripe, pre, plen, src, total - STRIPE, STRIPE);
    size_t n = 0;
    for (; n < full && STRIPE * n < plen; n++) { /* stripes that hold prefix bytes */
        gather(tmp, pre, plen, src, STRIPE * n, STRIPE);
        stripes(acc, tmp, NULL, 1, n);
    }
    size_t fused_from = 0, fused_to = 0; /* src bytes the fused pass copies */
    if (n < full) {
        fused_from = STRIPE * n - plen;
        fused_to = STRIPE * full - plen;
        stripes(acc, src + fused_from, dst ? dst + fused_from : NULL, full - n, n);
    }
    if (dst) {
        memcpy(dst, src, fused_from);
        memcpy(dst + fused_to, src + fused_to, slen - fused_to);
    }
    return merge(acc, last, total);
}

XXC_INTERNAL u64 xxh3_copy(stripes_fn stripes, const u8 *pre, size_t plen, const u8 *src, u8 *dst, size_t slen)
{
    size_t total = plen + slen;
    if (total > MID_MAX)
        return hash_large(stripes, pre, plen, src, dst, slen);
    u8 buf[MID_MAX];
    memcpy(buf, pre, plen);
    memcpy(buf + plen, src, slen);
    if (dst)
        memcpy(dst, src, slen);
    return hash_small(buf, total);
}

/* ---- a long input hashed while its src fills in (a read's pieces) ------------------------- */

XXC_INTERNAL void xxh3_run_begin(xxh3_run *run, stripes_fn stripes, const u8 *pre, size_t plen, const u8 *src, size_t slen)
{
    memcpy(run->acc, ACC_INIT, sizeof run->acc);
    run->stripes = stripes;
    run->pre = pre;
    run->plen = plen;
    run->src = src;
    run->slen = slen;
    run->next = 0;
    run->full = (plen + slen - 1) / STRIPE; /* every stripe but the last, taken at the end */
}

XXC_INTERNAL void xxh3_run_feed(xxh3_run *run, size_t filled)
{
    size_t ready = (run->plen + filled) / STRIPE; /* stripes whose bytes are all there */
    if (ready > run->full)
        ready = run->full;
    u8 tmp[STRIPE];
    for (; run->next < ready && STRIPE * run->next < run->plen; run->next++) { /* with prefix bytes */
        gather(tmp, run->pre, run->plen, run->src, STRIPE * run->next, STRIPE);
        run->stripes(run->acc, tmp, NULL, 1, run->next);
    }
    if (run->next < ready) {
        run->stripes(run->acc, run->src + STRIPE * run->next - run->plen, NULL, ready - run->next, run->next);
        run->next = ready;
    }
}

XXC_INTERNAL u64 xxh3_run_end(xxh3_run *run)
{
    xxh3_run_feed(run, run->slen);
    size_t total = run->plen + run->slen;
    u8 last_stripe[STRIPE];
    const u8 *last = last_stripe;
    if (run->slen >= STRIPE)
        last = run->src + run->slen - STRIPE;
    else
        gather(last_stripe, run->pre, run->plen, run->src, total - STRIPE, STRIPE);
    return merge(run->acc, last, total);
}
