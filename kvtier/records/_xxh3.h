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

/* The XXH3-64 of pre[0:plen] + src[0:slen] (plen + slen > 240) taken while src fills in, front
   to back: begin, feed with the count of src bytes there so far (as often as wanted, never
   fewer than before), end once all slen are there (it feeds the rest). Each stripe is hashed
   once all its bytes are there: a read's piece is hashed just after it lands. The result
   equals xxh3_copy's without dst. */
typedef struct {
    u64 acc[8];
    stripes_fn stripes;
    const u8 *pre;
    const u8 *src;
    size_t plen, slen;
    size_t next; /* the next stripe to hash */
    size_t full; /* stripes hashed before the last one */
} xxh3_run;

#define XXH3_RUN_MIN 241 /* plen + slen a run takes: longer than the short forms' 240 */

XXC_INTERNAL void xxh3_run_begin(xxh3_run *run, stripes_fn stripes, const u8 *pre, size_t plen, const u8 *src, size_t slen);
XXC_INTERNAL void xxh3_run_feed(xxh3_run *run, size_t filled);
XXC_INTERNAL u64 xxh3_run_end(xxh3_run *run);

/* What a record's check found (xxh3_64_check_copy, xxh3_64_read_check), in the order it looks:
   good; not a record of the row's length; another head; a checksum mismatch. */
#define XXC_CHECK_GOOD 0
#define XXC_CHECK_SHAPE 1
#define XXC_CHECK_HEAD 2
#define XXC_CHECK_SUM 3

/* The capsule kvtier.records._xxcopy.check_copy_c holds: one raw record's check and copy on
   plain buffers (xxh3_64_check_copy's whole work; see _xxcopy.c check_copy_raw), called with
   the GIL held. One of the outcomes above, or -1 with an error set. */
#define XXC_CHECK_COPY_CAPSULE "kvtier.records._xxcopy.check_copy_c"
typedef int (*xxc_check_copy_fn)(const u8 *head, size_t hlen, const u8 *key, size_t klen, const u8 *rec, size_t slen, u8 *dst,
                                 size_t n, const u8 *payload, size_t plen);

/* A raw record read from fd at offset 0 and checked (_xxread.c): its stored head and checksum
   (hlen + 8 bytes) into stored, which must equal head in its first hlen bytes, then its n-byte
   payload into row, piece bytes a pread, each piece hashed as it lands (piece 0: one pread);
   the checksum is the XXH3-64 of prefix (head and key, plen bytes) + payload. One of the
   XXC_CHECK_ outcomes, or -errno where a pread failed. Takes no Python object: run it without
   the GIL. */
XXC_INTERNAL int xxc_read_check(stripes_fn stripes, int fd, const u8 *head, size_t hlen, const u8 *prefix, size_t plen,
                                u8 *stored, u8 *row, size_t n, size_t piece);

/* The stripes path a pass over n bytes takes (_xxcopy.c): copies, one that copies as it hashes. */
XXC_INTERNAL stripes_fn stripes_for(int copies, size_t n);

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

/* The capsule kvtier.records._xxcopy.joined_into_c holds: a joined record built into dst
   (hlen + 8 + slen bytes): head, the little-endian XXH3-64 of head + key + src, then src, copied
   in the hash's pass: the bytes xxh3_64_joined returns. 0, or -1 (nothing written) where head
   and key are over XXC_JOIN_PREFIX_MAX bytes together. Takes no Python object (_xxput.c). */
#define XXC_JOIN_PREFIX_MAX 256
#define XXC_JOINED_INTO_CAPSULE "kvtier.records._xxcopy.joined_into_c"
typedef int (*xxc_joined_into_fn)(const u8 *head, size_t hlen, const u8 *key, size_t klen, const u8 *src, size_t slen, u8 *dst);
XXC_INTERNAL int xxc_joined_into(const u8 *head, size_t hlen, const u8 *key, size_t klen, const u8 *src, size_t slen, u8 *dst);

/* The job reads of the file tier's records (_xxjob.c), added to the module in _xxcopy.c. */
#ifdef Py_PYTHON_H
/* The rows' hold (_xxhold.c): added to the module as the capsule rows_hold_c (host_rows_hold_api,
   _hostrow.h) and as rows_hold(), rows_let_go() and rows_forked(); 0, or -1 with an error set.
   xxc_rows_hold and xxc_rows_let_go are the hold for this extension's own jobs (GIL held). */
XXC_INTERNAL int xxc_add_rows_hold(PyObject *module);
XXC_INTERNAL void xxc_rows_hold(void);
XXC_INTERNAL void xxc_rows_let_go(void);
XXC_INTERNAL extern PyMethodDef xxc_job_methods[];
/* counts_add (_xxcounts.c), added to the module in _xxcopy.c. */
XXC_INTERNAL extern PyMethodDef xxc_counts_methods[];
/* fn in a capsule of that name, as the module's attribute attr: 0, or -1 with an error set (_xxput.c). */
XXC_INTERNAL int xxc_add_capsule(PyObject *module, const char *attr, void *fn, const char *name);
#endif

#endif
