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
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define XXC_HAVE_AVX2 1
#else
#define XXC_HAVE_AVX2 0
#endif

typedef uint8_t u8;
typedef uint32_t u32;
typedef uint64_t u64;

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

static inline u64 read64(const u8 *p)
{
    u64 v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

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

/* Stripes first..first+count-1 of the input, read from src (and copied to dst unless NULL),
   scrambling after each 16th stripe. */
typedef void (*stripes_fn)(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first);

static void stripes_scalar(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first)
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

/* Stripes [0, run) of one block, starting at the block's stripe k; copied to dst when copy. */
#define AVX2_STRIPES(copy, run, k)                                                        \
    do {                                                                                  \
        const u8 *sec_ = SECRET + 8 * (k);                                                \
        for (size_t j_ = 0; j_ < (run); j_++, src += STRIPE, sec_ += 8) {                 \
            PREFETCH(src);                                                                \
            __m256i d0 = _mm256_loadu_si256((const __m256i *)src);                        \
            __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + 32));                 \
            if (copy) {                                                                   \
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
stripes_avx2_body(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first, const int copy)
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

__attribute__((target("avx2"))) static void stripes_avx2(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first)
{
    if (dst)
        stripes_avx2_body(acc, src, dst, count, first, 1);
    else
        stripes_avx2_body(acc, src, dst, count, first, 0);
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

__attribute__((target("avx512f"))) static void stripes_avx512(u64 *acc, const u8 *src, u8 *dst, size_t count, size_t first)
{
    if (dst)
        stripes_avx512_body(acc, src, dst, count, first, 1);
    else
        stripes_avx512_body(acc, src, dst, count, first, 0);
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

static u64 hash_large(stripes_fn stripes, const u8 *pre, size_t plen, const u8 *src, u8 *dst, size_t slen)
{
    u64 acc[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    size_t total = plen + slen;
    size_t full = (total - 1) / STRIPE; /* stripes before the last one, which is handled apart */
    u8 tmp[STRIPE];
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
    const u8 *last = tmp;
    if (slen >= STRIPE)
        last = src + slen - STRIPE;
    else
        gather(tmp, pre, plen, src, total - STRIPE, STRIPE);
    accumulate_scalar(acc, last, SECRET + LAST_STRIPE_AT);
    u64 result = (u64)total * PRIME64_1;
    for (int i = 0; i < 4; i++)
        result += mul_fold(acc[2 * i] ^ read64(SECRET + MERGE_AT + 16 * i), acc[2 * i + 1] ^ read64(SECRET + MERGE_AT + 16 * i + 8));
    return avalanche(result);
}

static u64 xxh3_copy(stripes_fn stripes, const u8 *pre, size_t plen, const u8 *src, u8 *dst, size_t slen)
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

/* ---- Python binding ---------------------------------------------------------------------- */

/* Passes over this many bytes or more run without the GIL (a 16 KiB pass takes about 1 us;
   below, handing the GIL over and taking it back, perhaps after another thread's turn, would
   cost more than the pass). */
#define RELEASE_GIL_AT (16 * 1024)

static stripes_fn best_stripes = stripes_scalar;
static const char *best_name = "scalar";

static stripes_fn stripes_named(const char *name)
{
    if (strcmp(name, "scalar") == 0)
        return stripes_scalar;
#if XXC_HAVE_AVX2
    if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2"))
        return stripes_avx2;
    if (strcmp(name, "avx512") == 0 && __builtin_cpu_supports("avx512f"))
        return stripes_avx512;
#endif
    return NULL;
}

static int get_readable(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) == 0)
        return 0;
    if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear(); /* numpy says ValueError for a strided array, memoryview BufferError */
        PyErr_Format(PyExc_ValueError, "%s: expected a contiguous buffer (%.100s is not)", what, Py_TYPE(obj)->tp_name);
    } else if (PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a bytes-like object, got %.100s", what, Py_TYPE(obj)->tp_name);
    }
    return -1;
}

static int get_writable(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE | PyBUF_WRITABLE) == 0)
        return 0;
    if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_TypeError)
        && !PyErr_ExceptionMatches(PyExc_ValueError))
        return -1;
    PyErr_Clear();
    Py_buffer probe;
    if (PyObject_GetBuffer(obj, &probe, PyBUF_SIMPLE) == 0) {
        int readonly = probe.readonly;
        PyBuffer_Release(&probe);
        if (readonly) {
            PyErr_Format(PyExc_TypeError, "dst: expected a writable buffer (this %.100s is read-only)", Py_TYPE(obj)->tp_name);
            return -1;
        }
    } else if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "dst: expected a contiguous buffer (%.100s is not)", Py_TYPE(obj)->tp_name);
        return -1;
    } else {
        PyErr_Clear();
    }
    PyErr_Format(PyExc_TypeError, "dst: expected a writable bytes-like object, got %.100s", Py_TYPE(obj)->tp_name);
    return -1;
}

static PyObject *run(stripes_fn stripes, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "expected (prefix, src[, dst]), got %zd arguments", nargs);
        return NULL;
    }
    Py_buffer pre, src, dst;
    int have_dst = nargs == 3 && args[2] != Py_None;
    if (get_readable(args[0], &pre, "prefix") < 0)
        return NULL;
    if (get_readable(args[1], &src, "src") < 0) {
        PyBuffer_Release(&pre);
        return NULL;
    }
    if (have_dst) {
        if (get_writable(args[2], &dst) < 0)
            goto fail;
        if (dst.len != src.len) {
            PyErr_Format(PyExc_ValueError, "dst: holds %zd bytes, src %zd: they must be the same size", dst.len, src.len);
            PyBuffer_Release(&dst);
            goto fail;
        }
        const u8 *s = src.buf;
        u8 *d = dst.buf;
        if (src.len > 0 && d < s + src.len && s < d + src.len) {
            PyErr_SetString(PyExc_ValueError, "dst: overlaps src");
            PyBuffer_Release(&dst);
            goto fail;
        }
    }
    u64 digest;
    if (src.len >= RELEASE_GIL_AT) {
        Py_BEGIN_ALLOW_THREADS
        digest = xxh3_copy(stripes, pre.buf, (size_t)pre.len, src.buf, have_dst ? dst.buf : NULL, (size_t)src.len);
        Py_END_ALLOW_THREADS
    } else {
        digest = xxh3_copy(stripes, pre.buf, (size_t)pre.len, src.buf, have_dst ? dst.buf : NULL, (size_t)src.len);
    }
    if (have_dst)
        PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&pre);
    return PyLong_FromUnsignedLongLong(digest);
fail:
    PyBuffer_Release(&src);
    PyBuffer_Release(&pre);
    return NULL;
}

static PyObject *py_xxh3_64_copy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    return run(best_stripes, args, nargs);
}

static PyObject *py_xxh3_64_copy_with(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 1 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "path: expected the name of a path (a str) first");
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8(args[0]);
    if (name == NULL)
        return NULL;
    stripes_fn stripes = stripes_named(name);
    if (stripes == NULL) {
        PyErr_Format(PyExc_ValueError, "path: %R is not one this build and CPU run (see paths())", args[0]);
        return NULL;
    }
    return run(stripes, args + 1, nargs - 1);
}

/* xxh3_64_joined(head, key, src) -> bytes: head + the little-endian 8-byte XXH3-64 of
   head + key + src + src, in one new bytes object; src is copied into it in the hash's pass. */
static PyObject *py_xxh3_64_joined(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "expected (head, key, src), got %zd arguments", nargs);
        return NULL;
    }
    Py_buffer head, key, src;
    if (get_readable(args[0], &head, "head") < 0)
        return NULL;
    if (get_readable(args[1], &key, "key") < 0) {
        PyBuffer_Release(&head);
        return NULL;
    }
    if (get_readable(args[2], &src, "src") < 0) {
        PyBuffer_Release(&key);
        PyBuffer_Release(&head);
        return NULL;
    }
    PyObject *out = NULL;
    size_t hlen = (size_t)head.len, klen = (size_t)key.len, slen = (size_t)src.len;
    u8 *prefix = PyMem_Malloc(hlen + klen + 1);
    if (prefix == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(hlen + 8 + slen));
    if (out == NULL) {
        PyMem_Free(prefix);
        goto done;
    }
    u8 *body = (u8 *)PyBytes_AS_STRING(out);
    memcpy(prefix, head.buf, hlen);
    memcpy(prefix + hlen, key.buf, klen);
    memcpy(body, head.buf, hlen);
    u64 digest;
    if (src.len >= RELEASE_GIL_AT) {
        Py_BEGIN_ALLOW_THREADS
        digest = xxh3_copy(best_stripes, prefix, hlen + klen, src.buf, body + hlen + 8, slen);
        Py_END_ALLOW_THREADS
    } else {
        digest = xxh3_copy(best_stripes, prefix, hlen + klen, src.buf, body + hlen + 8, slen);
    }
    for (int i = 0; i < 8; i++)
        body[hlen + i] = (u8)(digest >> (8 * i));
    PyMem_Free(prefix);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&key);
    PyBuffer_Release(&head);
    return out;
}

/* Outcomes of xxh3_64_check_copy, in the order it checks (the Python wrapper names them). */
#define CHECK_GOOD 0   /* copied into dst, and the checksum matches */
#define CHECK_SHAPE 1  /* stored or payload is not the length a record for dst has: dst untouched */
#define CHECK_HEAD 2   /* the stored head differs from the expected one: dst untouched */
#define CHECK_SUM 3    /* copied, and the checksum differs: dst holds garbage */

/* A record's head and key are hashed first; longer ones than this go through the heap. */
#define CHECK_PREFIX_MAX 256

/* xxh3_64_check_copy(head, key, stored, dst, payload=None) -> int: one raw record checked
   and copied into dst (dst None: checked only, the payload read where it is). stored starts with the stored head (len(head) bytes) and its 8-byte
   little-endian checksum; the payload follows them in stored (payload None: a joined record,
   stored is then exactly len(head) + 8 + len(dst) bytes) or is given apart (exactly len(dst)
   bytes; stored then exactly len(head) + 8). The stored head must equal head; the checksum,
   the XXH3-64 of head + key + payload, is taken in the pass that copies the payload into dst. */
static PyObject *py_xxh3_64_check_copy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 4 || nargs > 5) {
        PyErr_Format(PyExc_TypeError, "expected (head, key, stored, dst[, payload]), got %zd arguments", nargs);
        return NULL;
    }
    int apart = nargs == 5 && args[4] != Py_None, have_dst = args[3] != Py_None;
    PyObject *result = NULL;
    Py_buffer head, key, stored, dst, payload;
    if (get_readable(args[0], &head, "head") < 0)
        return NULL;
    if (get_readable(args[1], &key, "key") < 0)
        goto release_head;
    if (get_readable(args[2], &stored, "stored") < 0)
        goto release_key;
    if (have_dst && get_writable(args[3], &dst) < 0)
        goto release_stored;
    if (apart && get_readable(args[4], &payload, "payload") < 0)
        goto release_dst;
    size_t hlen = (size_t)head.len, klen = (size_t)key.len, slen = (size_t)stored.len;
    /* the payload's length: the row's, else what the record holds after its head and checksum */
    size_t n = have_dst ? (size_t)dst.len : apart ? (size_t)payload.len : slen >= hlen + 8 ? slen - hlen - 8 : 0;
    const u8 *rec = stored.buf;
    const u8 *src = apart ? (const u8 *)payload.buf : rec + hlen + 8;
    int status;
    if (apart ? slen != hlen + 8 || (size_t)payload.len != n : slen != hlen + 8 + n) {
        status = CHECK_SHAPE;
    } else if (memcmp(rec, head.buf, hlen) != 0) {
        status = CHECK_HEAD;
    } else {
        u8 *d = have_dst ? dst.buf : NULL;
        if (d != NULL && n > 0 && d < src + n && src < d + n) {
            PyErr_SetString(PyExc_ValueError, "dst: overlaps the payload");
            goto release_payload;
        }
        u8 small[CHECK_PREFIX_MAX];
        u8 *prefix = hlen + klen <= CHECK_PREFIX_MAX ? small : PyMem_Malloc(hlen + klen);
        if (prefix == NULL) {
            PyErr_NoMemory();
            goto release_payload;
        }
        memcpy(prefix, head.buf, hlen);
        memcpy(prefix + hlen, key.buf, klen);
        u64 digest;
        if (n >= RELEASE_GIL_AT) {
            Py_BEGIN_ALLOW_THREADS
            digest = xxh3_copy(best_stripes, prefix, hlen + klen, src, d, n);
            Py_END_ALLOW_THREADS
        } else {
            digest = xxh3_copy(best_stripes, prefix, hlen + klen, src, d, n);
        }
        if (prefix != small)
            PyMem_Free(prefix);
        status = digest == read64(rec + hlen) ? CHECK_GOOD : CHECK_SUM;
    }
    result = PyLong_FromLong(status);
release_payload:
    if (apart)
        PyBuffer_Release(&payload);
release_dst:
    if (have_dst)
        PyBuffer_Release(&dst);
release_stored:
    PyBuffer_Release(&stored);
release_key:
    PyBuffer_Release(&key);
release_head:
    PyBuffer_Release(&head);
    return result;
}

static PyObject *py_paths(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
#if XXC_HAVE_AVX2
    if (__builtin_cpu_supports("avx512f"))
        return Py_BuildValue("(sss)", "scalar", "avx2", "avx512");
    if (__builtin_cpu_supports("avx2"))
        return Py_BuildValue("(ss)", "scalar", "avx2");
#endif
    return Py_BuildValue("(s)", "scalar");
}

static PyMethodDef methods[] = {
    {"xxh3_64_copy", (PyCFunction)(void (*)(void))py_xxh3_64_copy, METH_FASTCALL,
     "xxh3_64_copy(prefix, src, dst=None) -> int\n\n"
     "XXH3-64 (seed 0) of prefix + src, as xxhash.xxh3_64(prefix + src).intdigest(); copies src\n"
     "into dst (writable, contiguous, the same size, not overlapping src) in the same pass.\n"
     "Runs on the fastest path this CPU has (see path), without the GIL from 16 KiB."},
    {"xxh3_64_copy_with", (PyCFunction)(void (*)(void))py_xxh3_64_copy_with, METH_FASTCALL,
     "xxh3_64_copy_with(path, prefix, src, dst=None) -> int\n\n"
     "xxh3_64_copy on the named path (one of paths()), to compare them."},
    {"xxh3_64_joined", (PyCFunction)(void (*)(void))py_xxh3_64_joined, METH_FASTCALL,
     "xxh3_64_joined(head, key, src) -> bytes\n\n"
     "head + the XXH3-64 of head + key + src (8 bytes, little-endian) + src, as one new bytes\n"
     "object: src is copied into it in the hash's pass (a whole record, header then payload)."},
    {"xxh3_64_check_copy", (PyCFunction)(void (*)(void))py_xxh3_64_check_copy, METH_FASTCALL,
     "xxh3_64_check_copy(head, key, stored, dst, payload=None) -> int\n\n"
     "One raw record checked and copied into dst: 0 good, 1 not a record of len(dst) bytes\n"
     "(dst untouched), 2 its stored head differs from head (dst untouched), 3 its checksum\n"
     "(XXH3-64 of head + key + payload, little-endian after the stored head) differs (dst\n"
     "written). stored is the stored head and checksum, then the payload unless given apart.\n"
     "dst None: the record is checked, not copied (its payload's length is then its own)."},
    {"paths", py_paths, METH_NOARGS, "paths() -> tuple of the path names this build and CPU run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_xxcopy",
    "XXH3-64 of a prefix and a payload, copying the payload in the same pass (native).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__xxcopy(void)
{
#if XXC_HAVE_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        best_stripes = stripes_avx2;
        best_name = "avx2";
    }
#endif
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "path", best_name) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
