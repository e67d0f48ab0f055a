/*
 * kvtier.records._gmac: GHASH (the hash of AES-GCM, SP 800-38D) over a prefix and a payload,
 * copying the payload on the way, for the AES-256-GMAC of keyed records (kvtier.records.mac).
 *
 * A keyed record's tag is GMAC: GCM with no plaintext, the record's head, key and payload as
 * its additional data. GMAC = GHASH_H(A) xor E_K(J0), where H = E_K(0^128) and J0 the counter
 * block of the fixed nonce. The two AES blocks are the caller's (one ECB call of two blocks);
 * this module does the GHASH, which is the whole cost of a large record, and does it in the
 * pass that copies the payload into the caller's row: each 64-byte piece is loaded once,
 * stored to the row and folded into the hash from the same register, so the bytes hashed are
 * exactly the bytes the row holds. Bytes not folded from a stored register are hashed from the
 * row after they were written to it, never from the source a second time.
 *
 * Only on x86-64 with AVX-512 (F, BW), VPCLMULQDQ and AES-NI (each asked of the CPU): 16 blocks (256 bytes) a step, each lane
 * multiplied by its own power of H, the 256-bit products summed and reduced once a step.
 * Elsewhere path is "none" and the Python side keeps the general path (the cryptography
 * package), with the same tags.
 *
 * Field arithmetic: the blocks are byte-reversed into registers, multiplied carry-less and the
 * 256-bit product shifted left by one and reduced modulo x^128 + x^7 + x^2 + x + 1 (the
 * bit-reflected form of GCM's field; Gueron and Kounavis, "Intel Carry-Less Multiplication
 * Instruction and its Usage for Computing the GCM Mode"). Every step after the products is
 * linear, so products are summed before it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define GM_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define GM_X86 0
#endif

typedef unsigned char u8;

/* Passes of this many bytes or more run without the GIL. */
#define RELEASE_GIL_AT (16 * 1024)
/* Source and destination lines are asked for this far ahead (as the plain records' pass). */
#define PREFETCH_AHEAD 1024

static int have_vector = 0;
static int prefetch_writes = 0;

#if GM_X86

#define TARGET __attribute__((target("avx512f,avx512bw,vpclmulqdq,pclmul,aes,sse4.1,ssse3")))

/* Blocks a step of the long loops: 32 (512 bytes), as eight vectors of four. */
#define STEP_BLOCKS 32

typedef struct {
    __m128i h1;      /* H (byte-reversed form) */
    __m128i table[STEP_BLOCKS]; /* H^32, H^31, ..., H^1: lane j of vector v multiplies block 4v+j */
    __m128i y;       /* the running hash (byte-reversed form) */
    u8 pend[16];     /* bytes of a block not yet complete */
    size_t pend_len;
    uint64_t total;  /* bytes fed so far */
} ghash_t;

/* ---- AES-256: the two blocks GMAC needs of it (H = E_K(0), E_K(J0)) ---------------------- */

TARGET static inline __m128i key_step(__m128i key, __m128i assist)
{
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
    return _mm_xor_si128(key, assist);
}

/* Round keys 2i and 2i+1 from the two before each (FIPS-197 key expansion, Nk = 8). */
#define EXPAND_PAIR(rk, i, rcon)                                                                  \
    do {                                                                                          \
        rk[2 * (i)] = key_step(rk[2 * (i) - 2], _mm_shuffle_epi32(_mm_aeskeygenassist_si128(rk[2 * (i) - 1], rcon), 0xff)); \
        if ((i) < 7)                                                                              \
            rk[2 * (i) + 1] = key_step(rk[2 * (i) - 1], _mm_shuffle_epi32(_mm_aeskeygenassist_si128(rk[2 * (i)], 0), 0xaa)); \
    } while (0)

/* out[0] = E_K(0^128) (H), out[1] = E_K(J0), J0 = the 12-byte zero nonce, then the counter 1. */
TARGET static void aes256_gmac_blocks(const u8 *key, __m128i out[2])
{
    __m128i rk[15];
    rk[0] = _mm_loadu_si128((const __m128i *)key);
    rk[1] = _mm_loadu_si128((const __m128i *)(key + 16));
    EXPAND_PAIR(rk, 1, 0x01);
    EXPAND_PAIR(rk, 2, 0x02);
    EXPAND_PAIR(rk, 3, 0x04);
    EXPAND_PAIR(rk, 4, 0x08);
    EXPAND_PAIR(rk, 5, 0x10);
    EXPAND_PAIR(rk, 6, 0x20);
    EXPAND_PAIR(rk, 7, 0x40);
    __m128i a = _mm_setzero_si128(), b = _mm_set_epi8(1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    a = _mm_xor_si128(a, rk[0]);
    b = _mm_xor_si128(b, rk[0]);
    for (int i = 1; i < 14; i++) {
        a = _mm_aesenc_si128(a, rk[i]);
        b = _mm_aesenc_si128(b, rk[i]);
    }
    out[0] = _mm_aesenclast_si128(a, rk[14]);
    out[1] = _mm_aesenclast_si128(b, rk[14]);
}

/* ---- GHASH ----------------------------------------------------------------------------------- */

TARGET static inline __m128i bswap128(__m128i x)
{
    return _mm_shuffle_epi8(x, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

TARGET static inline __m512i bswap512(__m512i x)
{
    const __m512i rev = _mm512_broadcast_i32x4(_mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    return _mm512_shuffle_epi8(x, rev);
}

/* The 256-bit product lo (low half) and hi, shifted left by one and reduced to 128 bits. */
TARGET static inline __m128i reduce(__m128i lo, __m128i hi)
{
    __m128i c_lo = _mm_srli_epi32(lo, 31), c_hi = _mm_srli_epi32(hi, 31);
    lo = _mm_slli_epi32(lo, 1);
    hi = _mm_slli_epi32(hi, 1);
    __m128i cross = _mm_srli_si128(c_lo, 12);
    c_hi = _mm_slli_si128(c_hi, 4);
    c_lo = _mm_slli_si128(c_lo, 4);
    lo = _mm_or_si128(lo, c_lo);
    hi = _mm_or_si128(_mm_or_si128(hi, c_hi), cross);
    __m128i a = _mm_slli_epi32(lo, 31), b = _mm_slli_epi32(lo, 30), c = _mm_slli_epi32(lo, 25);
    a = _mm_xor_si128(_mm_xor_si128(a, b), c);
    __m128i top = _mm_srli_si128(a, 4);
    a = _mm_slli_si128(a, 12);
    lo = _mm_xor_si128(lo, a);
    __m128i d = _mm_srli_epi32(lo, 1), e = _mm_srli_epi32(lo, 2), f = _mm_srli_epi32(lo, 7);
    d = _mm_xor_si128(_mm_xor_si128(d, e), _mm_xor_si128(f, top));
    lo = _mm_xor_si128(lo, d);
    return _mm_xor_si128(hi, lo);
}

TARGET static inline __m128i gfmul(__m128i a, __m128i b)
{
    __m128i lo = _mm_clmulepi64_si128(a, b, 0x00);
    __m128i hi = _mm_clmulepi64_si128(a, b, 0x11);
    __m128i mid = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x10), _mm_clmulepi64_si128(a, b, 0x01));
    lo = _mm_xor_si128(lo, _mm_slli_si128(mid, 8));
    hi = _mm_xor_si128(hi, _mm_srli_si128(mid, 8));
    return reduce(lo, hi);
}

TARGET static void ghash_init(ghash_t *g, __m128i h_block)
{
    __m128i h = bswap128(h_block), p = h;
    g->h1 = h;
    for (int i = STEP_BLOCKS - 1; i >= 0; i--) {
        g->table[i] = p; /* table[i] = H^(STEP_BLOCKS - i) */
        p = gfmul(p, h);
    }
    g->y = _mm_setzero_si128();
    g->pend_len = 0;
    g->total = 0;
}

/* One block (16 bytes at p). */
TARGET static inline void ghash_block(ghash_t *g, const u8 *p)
{
    g->y = gfmul(_mm_xor_si128(g->y, bswap128(_mm_loadu_si128((const __m128i *)p))), g->h1);
}

TARGET static inline __m128i fold_lanes(__m512i v)
{
    __m256i x = _mm256_xor_si256(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    return _mm_xor_si128(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

/* 4 * nv blocks, as nv vectors in stream order (not yet byte-reversed), after y: y times
   H^(4 nv) plus each block times its power, reduced once. y's own product is summed in after
   the data's are folded, so the chain from one step's y to the next is one product and the
   reduction (the data's products and folds overlap it). table: H^(4 nv), ..., H^1. */
TARGET __attribute__((always_inline)) static inline __m128i ghash_step(__m128i y, const __m128i *table, const __m512i *v, const int nv)
{
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512(), mid = _mm512_setzero_si512();
    for (int j = 0; j < nv; j++) {
        __m512i x = bswap512(v[j]), t = _mm512_loadu_si512((const void *)(table + 4 * j));
        lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(x, t, 0x00));
        hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(x, t, 0x11));
        mid = _mm512_xor_si512(mid, _mm512_xor_si512(_mm512_clmulepi64_epi128(x, t, 0x10), _mm512_clmulepi64_epi128(x, t, 0x01)));
    }
    __m128i top = table[0];
    __m128i l = _mm_xor_si128(fold_lanes(lo), _mm_clmulepi64_si128(y, top, 0x00));
    __m128i h = _mm_xor_si128(fold_lanes(hi), _mm_clmulepi64_si128(y, top, 0x11));
    __m128i m = _mm_xor_si128(fold_lanes(mid), _mm_xor_si128(_mm_clmulepi64_si128(y, top, 0x10), _mm_clmulepi64_si128(y, top, 0x01)));
    l = _mm_xor_si128(l, _mm_slli_si128(m, 8));
    h = _mm_xor_si128(h, _mm_srli_si128(m, 8));
    return reduce(l, h);
}

/* Feed n bytes at p (read in place). */
TARGET static void ghash_feed(ghash_t *g, const u8 *p, size_t n)
{
    g->total += n;
    if (g->pend_len) {
        size_t take = 16 - g->pend_len;
        if (take > n)
            take = n;
        memcpy(g->pend + g->pend_len, p, take);
        g->pend_len += take;
        p += take;
        n -= take;
        if (g->pend_len < 16)
            return;
        ghash_block(g, g->pend);
        g->pend_len = 0;
    }
    __m128i y = g->y;
    __m512i v[8];
    for (; n >= 512; p += 512, n -= 512) {
        for (int j = 0; j < 8; j++)
            v[j] = _mm512_loadu_si512((const void *)(p + 64 * j));
        y = ghash_step(y, g->table, v, 8);
    }
    for (; n >= 64; p += 64, n -= 64) {
        v[0] = _mm512_loadu_si512((const void *)p);
        y = ghash_step(y, g->table + STEP_BLOCKS - 4, v, 1);
    }
    g->y = y;
    for (; n >= 16; p += 16, n -= 16)
        ghash_block(g, p);
    memcpy(g->pend, p, n);
    g->pend_len = n;
}

/* The tag: GHASH of what was fed (zero-padded, then the length block) xor ej0. */
TARGET static void ghash_tag(ghash_t *g, __m128i ej0, u8 *tag)
{
    if (g->pend_len) {
        memset(g->pend + g->pend_len, 0, 16 - g->pend_len);
        ghash_block(g, g->pend);
        g->pend_len = 0;
    }
    /* len(A) || len(C) in bits, big-endian; byte-reversed: len(C) low, len(A) high. */
    __m128i lengths = _mm_set_epi64x((long long)(g->total * 8), 0);
    __m128i y = gfmul(_mm_xor_si128(g->y, lengths), g->h1);
    y = _mm_xor_si128(bswap128(y), ej0);
    _mm_storeu_si128((__m128i *)tag, y);
}

#define PREFETCH_LINES(s, d)                                                                     \
    do {                                                                                         \
        for (int q_ = 0; q_ < 8; q_++) {                                                         \
            _mm_prefetch((const char *)((uintptr_t)(s) + PREFETCH_AHEAD + 64 * q_), _MM_HINT_T0); \
            uintptr_t at_ = (uintptr_t)(d) + PREFETCH_AHEAD + 64 * q_;                           \
            if (prefetch_writes)                                                                 \
                __asm__ volatile("prefetchw (%0)" : : "r"(at_));                                 \
            else                                                                                 \
                _mm_prefetch((const char *)at_, _MM_HINT_T0);                                    \
        }                                                                                        \
    } while (0)

/* One 64-byte piece loaded and stored; the register is what the hash takes. */
TARGET static inline __m512i move64(const u8 *s, u8 *d)
{
    __m512i v = _mm512_loadu_si512((const void *)s);
    _mm512_storeu_si512((void *)d, v);
    return v;
}

/* Copy n bytes src -> dst and feed them, in one pass where the stream's block boundary falls
   0 or 8 bytes into the payload (a record's head and key are 56 bytes: 8); else the whole copy,
   then the hash of dst. Each step loads 512 bytes, stores them and hashes the same registers
   (shifted by 8 bytes, with the last vector of the step before, where the boundary is 8 in). */
TARGET static void ghash_copy(ghash_t *g, const u8 *src, u8 *dst, size_t n)
{
    size_t k = (16 - g->pend_len) % 16; /* payload bytes that complete the pending block */
    size_t off = 0;                     /* dst[0, off) written from registers, ... */
    size_t hashed = 0;                  /* ... and payload[0, hashed) fed */
    __m512i a[8], v[8];
    if (k == 0 && n >= 512) {
        __m128i y = g->y;
        for (; off + 512 <= n; off += 512) {
            PREFETCH_LINES(src + off, dst + off);
            for (int j = 0; j < 8; j++)
                a[j] = move64(src + off + 64 * j, dst + off + 64 * j);
            y = ghash_step(y, g->table, a, 8);
        }
        g->y = y;
        g->total += off;
        hashed = off;
    } else if (k == 8 && n >= 64 + 512) {
        __m512i carry = _mm512_loadu_si512((const void *)src);
        _mm512_storeu_si512((void *)dst, carry);
        u8 first[64];
        _mm512_storeu_si512((void *)first, carry);
        ghash_feed(g, first, 8); /* completes the pending block from the stored register */
        __m128i y = g->y;
        size_t done = 0;
        for (; done + 64 + 512 <= n; done += 512) {
            const u8 *s = src + done + 64;
            u8 *d = dst + done + 64;
            PREFETCH_LINES(s, d);
            for (int j = 0; j < 8; j++)
                a[j] = move64(s + 64 * j, d + 64 * j);
            v[0] = _mm512_alignr_epi64(a[0], carry, 1);
            for (int j = 1; j < 8; j++)
                v[j] = _mm512_alignr_epi64(a[j], a[j - 1], 1);
            y = ghash_step(y, g->table, v, 8);
            carry = a[7];
        }
        g->y = y;
        g->total += done;
        off = done + 64;
        hashed = done + 8;
    }
    memcpy(dst + off, src + off, n - off);
    ghash_feed(g, dst + hashed, n - hashed); /* the rest, read back from the row */
}

#endif /* GM_X86 */

/* ---- Python binding ---------------------------------------------------------------------- */

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE | (writable ? PyBUF_WRITABLE : 0)) == 0)
        return 0;
    if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError)
        || PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous%s bytes-like object, got %.100s", what,
                     writable ? " writable" : "", Py_TYPE(obj)->tp_name);
    }
    return -1;
}

static PyObject *py_gmac_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs < 3 || nargs > 4) {
        PyErr_Format(PyExc_TypeError, "gmac_copy(key, prefix, src, dst=None): expected 3 or 4 arguments, got %zd", nargs);
        return NULL;
    }
    if (!have_vector) {
        PyErr_SetString(PyExc_RuntimeError, "gmac_copy: this CPU has no AVX-512 VPCLMULQDQ path (path is 'none')");
        return NULL;
    }
    Py_buffer key = {0}, prefix = {0}, src = {0}, dst = {0};
    PyObject *result = NULL;
    int have_dst = nargs == 4 && args[3] != Py_None;
    if (get_buffer(args[0], &key, 0, "key") < 0)
        return NULL;
    if (get_buffer(args[1], &prefix, 0, "prefix") < 0)
        goto done;
    if (get_buffer(args[2], &src, 0, "src") < 0)
        goto done;
    if (have_dst && get_buffer(args[3], &dst, 1, "dst") < 0)
        goto done;
    if (key.len != 32) {
        PyErr_Format(PyExc_ValueError, "key: expected a 32-byte AES-256 key, got %zd bytes", key.len);
        goto done;
    }
    if (have_dst) {
        if (dst.len != src.len) {
            PyErr_Format(PyExc_ValueError, "dst: holds %zd bytes, src %zd: they must be the same size", dst.len, src.len);
            goto done;
        }
        uintptr_t s = (uintptr_t)src.buf, d = (uintptr_t)dst.buf;
        if (src.len && s < d + (uintptr_t)dst.len && d < s + (uintptr_t)src.len) {
            PyErr_SetString(PyExc_ValueError, "dst: overlaps src");
            goto done;
        }
    }
    {
        u8 tag[16];
#if GM_X86
        ghash_t g;
        __m128i blocks[2];
        aes256_gmac_blocks((const u8 *)key.buf, blocks);
        ghash_init(&g, blocks[0]);
        ghash_feed(&g, (const u8 *)prefix.buf, (size_t)prefix.len);
        if (src.len >= RELEASE_GIL_AT) {
            Py_BEGIN_ALLOW_THREADS
            if (have_dst)
                ghash_copy(&g, (const u8 *)src.buf, (u8 *)dst.buf, (size_t)src.len);
            else
                ghash_feed(&g, (const u8 *)src.buf, (size_t)src.len);
            Py_END_ALLOW_THREADS
        } else if (have_dst) {
            ghash_copy(&g, (const u8 *)src.buf, (u8 *)dst.buf, (size_t)src.len);
        } else {
            ghash_feed(&g, (const u8 *)src.buf, (size_t)src.len);
        }
        ghash_tag(&g, blocks[1], tag);
        memset(blocks, 0, sizeof blocks);
        memset(&g, 0, sizeof g);
#else
        memset(tag, 0, sizeof tag);
#endif
        result = PyBytes_FromStringAndSize((const char *)tag, 16);
    }
done:
    PyBuffer_Release(&key);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&src);
    if (have_dst)
        PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"gmac_copy", (PyCFunction)(void (*)(void))py_gmac_copy, METH_FASTCALL,
     "gmac_copy(key, prefix, src, dst=None) -> bytes\n\n"
     "The 16-byte AES-256-GMAC tag (GCM with the 12-byte zero nonce and no plaintext) of the\n"
     "additional data prefix + src under key (32 bytes). Copies src into dst (writable,\n"
     "contiguous, the same size, not overlapping src) in the same pass, hashing what it stores.\n"
     "Without the GIL from 16 KiB. RuntimeError where path is 'none'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gmac", "AES-256-GMAC record tags, their GHASH fused with the copy.", -1, methods};

PyMODINIT_FUNC PyInit__gmac(void)
{
#if GM_X86
    __builtin_cpu_init();
    /* Every set TARGET names: AES-NI can be off where the rest is on (firmware, a VM). */
    have_vector = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                  && __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul")
                  && __builtin_cpu_supports("aes") && __builtin_cpu_supports("sse4.1") && __builtin_cpu_supports("ssse3");
    unsigned int a, b, c, d;
    if (__get_cpuid(0x80000001U, &a, &b, &c, &d))
        prefetch_writes = (c >> 8) & 1; /* PRFCHW */
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "path", have_vector ? "avx512" : "none") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
