/*
 * kvtier.records._xxcopy: the Python bindings of the fused copy + XXH3-64 pass (_xxh3.c, through
 * _xxh3.h). A pass of 16 KiB or more runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_xxh3.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

/* Passes over this many bytes or more run without the GIL (a 16 KiB pass takes about 1 us;
   below, handing the GIL over and taking it back, perhaps after another thread's turn, would
   cost more than the pass). */
#define RELEASE_GIL_AT (16 * 1024)

static stripes_fn best_stripes = stripes_scalar;
static const char *best_name = "scalar";
/* A pass of HASH_WIDE_AT bytes or more that hashes without copying (a row checked where a read
   put it) takes AVX-512 where the CPU has it: 256 KiB in the core's cache hashed in 5.4 us
   against 8.2 on AVX2 (2 MiB: 57 against 71; 64 KiB 1.56 against 2.27), where the copying pass
   runs slower on it (docs/tiers.md). Below, the file tier's 4 KiB reads, each between system
   calls, took 0.3 us more a record on it. */
#define HASH_WIDE_AT (64 * 1024)
static stripes_fn hash_stripes = stripes_scalar;
static const char *hash_name = "scalar";

XXC_INTERNAL stripes_fn stripes_for(int copies, size_t n)
{
    return copies || n < HASH_WIDE_AT ? best_stripes : hash_stripes;
}

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

static int get_writable(PyObject *obj, Py_buffer *view, const char *what)
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
            PyErr_Format(PyExc_TypeError, "%s: expected a writable buffer (this %.100s is read-only)", what, Py_TYPE(obj)->tp_name);
            return -1;
        }
    } else if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected a contiguous buffer (%.100s is not)", what, Py_TYPE(obj)->tp_name);
        return -1;
    } else {
        PyErr_Clear();
    }
    PyErr_Format(PyExc_TypeError, "%s: expected a writable bytes-like object, got %.100s", what, Py_TYPE(obj)->tp_name);
    return -1;
}

/* A record's head and key (args[0], args[1]) as readable buffers: 0 with both held, or -1
   with neither held and the error set. */
static int get_head_key(PyObject *const *args, Py_buffer *head, Py_buffer *key)
{
    if (get_readable(args[0], head, "head") < 0)
        return -1;
    if (get_readable(args[1], key, "key") < 0) {
        PyBuffer_Release(head);
        return -1;
    }
    return 0;
}

static void release_head_key(Py_buffer *head, Py_buffer *key)
{
    PyBuffer_Release(key);
    PyBuffer_Release(head);
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
        if (get_writable(args[2], &dst, "dst") < 0)
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
    if (stripes == NULL) /* the default path for this pass */
        stripes = stripes_for(have_dst, (size_t)src.len);
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
    return run(NULL, args, nargs);
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
    if (get_head_key(args, &head, &key) < 0)
        return NULL;
    if (get_readable(args[2], &src, "src") < 0) {
        release_head_key(&head, &key);
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
    release_head_key(&head, &key);
    return out;
}

/* Outcomes of xxh3_64_check_copy, in the order it checks (the Python wrapper names them):
   XXC_CHECK_GOOD, copied into dst and the checksum matches; _SHAPE, stored or payload is not
   the length a record for dst has (dst untouched); _HEAD, the stored head differs from the
   expected one (dst untouched); _SUM, copied, and the checksum differs (dst holds garbage). */

/* A record's head and key are hashed first; longer ones than this go through the heap. */
#define CHECK_PREFIX_MAX 256

/* Whether the n bytes at d (none where d is NULL) overlap the len bytes at s, which the copy
   reads or compares with: 1 with ValueError(what) set, else 0. */
static int refuse_overlap(const u8 *d, size_t n, const u8 *s, size_t len, const char *what)
{
    if (d == NULL || n == 0 || !(d < s + len && s < d + n))
        return 0;
    PyErr_SetString(PyExc_ValueError, what);
    return 1;
}

/* head + key, the bytes a record's checksum covers before its payload: in small (of
   CHECK_PREFIX_MAX bytes) when they fit, else in a PyMem buffer the caller frees (prefix !=
   small); NULL, with MemoryError set, where none could be had. */
static u8 *join_prefix(u8 *small, const Py_buffer *head, const Py_buffer *key)
{
    size_t hlen = (size_t)head->len, klen = (size_t)key->len;
    u8 *prefix = hlen + klen <= CHECK_PREFIX_MAX ? small : PyMem_Malloc(hlen + klen);
    if (prefix == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(prefix, head->buf, hlen);
    memcpy(prefix + hlen, key->buf, klen);
    return prefix;
}

/* xxh3_64_check_copy's work on plain buffers (payload NULL: joined, in stored; dst NULL: checked
   only): an XXC_CHECK_ outcome, or -1 with an error set (dst overlapping, no memory). GIL held;
   a pass of RELEASE_GIL_AT bytes or more lets it go. Also the capsule check_copy_c. */
static int check_copy_raw(const u8 *head, size_t hlen, const u8 *key, size_t klen, const u8 *rec, size_t slen, u8 *d, size_t n,
                          const u8 *payload, size_t plen)
{
    int apart = payload != NULL;
    const u8 *src = apart ? payload : rec + hlen + 8;
    if (apart ? slen != hlen + 8 || plen != n : slen != hlen + 8 + n)
        return XXC_CHECK_SHAPE;
    if (memcmp(rec, head, hlen) != 0)
        return XXC_CHECK_HEAD;
    /* nor the stored head and checksum: the copy would change what it is compared with */
    if (refuse_overlap(d, n, src, n, "dst: overlaps the payload") || refuse_overlap(d, n, rec, slen, "dst: overlaps stored"))
        return -1;
    u8 small[CHECK_PREFIX_MAX];
    Py_buffer head_buf = {.buf = (void *)head, .len = (Py_ssize_t)hlen}, key_buf = {.buf = (void *)key, .len = (Py_ssize_t)klen};
    u8 *prefix = join_prefix(small, &head_buf, &key_buf);
    if (prefix == NULL)
        return -1;
    u64 digest;
    if (n >= RELEASE_GIL_AT) {
        Py_BEGIN_ALLOW_THREADS
        digest = xxh3_copy(stripes_for(d != NULL, n), prefix, hlen + klen, src, d, n);
        Py_END_ALLOW_THREADS
    } else {
        digest = xxh3_copy(stripes_for(d != NULL, n), prefix, hlen + klen, src, d, n);
    }
    if (prefix != small)
        PyMem_Free(prefix);
    return digest == read64(rec + hlen) ? XXC_CHECK_GOOD : XXC_CHECK_SUM;
}

/* xxh3_64_check_copy(head, key, stored, dst, payload=None) -> int: one raw record checked
   and copied into dst (dst None: checked only, the payload read where it is). stored starts with the stored head (len(head) bytes) and its 8-byte
   little-endian checksum; the payload follows them in stored (payload None: a joined record,
   stored is then exactly len(head) + 8 + len(dst) bytes) or is given apart (exactly len(dst)
   bytes; stored then exactly len(head) + 8). The stored head must equal head; the checksum,
   the XXH3-64 of head + key + payload, is taken in the pass that copies the payload into dst
   (check_copy_raw). */
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
    if (get_head_key(args, &head, &key) < 0)
        return NULL;
    if (get_readable(args[2], &stored, "stored") < 0)
        goto release_key;
    if (have_dst && get_writable(args[3], &dst, "dst") < 0)
        goto release_stored;
    if (apart && get_readable(args[4], &payload, "payload") < 0)
        goto release_dst;
    size_t hlen = (size_t)head.len, slen = (size_t)stored.len;
    /* the payload's length: the row's, else what the record holds after its head and checksum */
    size_t n = have_dst ? (size_t)dst.len : apart ? (size_t)payload.len : slen >= hlen + 8 ? slen - hlen - 8 : 0;
    int status = check_copy_raw(head.buf, hlen, key.buf, (size_t)key.len, stored.buf, slen, have_dst ? dst.buf : NULL, n,
                                apart ? payload.buf : NULL, apart ? (size_t)payload.len : 0);
    if (status >= 0)
        result = PyLong_FromLong(status);
    if (apart)
        PyBuffer_Release(&payload);
release_dst:
    if (have_dst)
        PyBuffer_Release(&dst);
release_stored:
    PyBuffer_Release(&stored);
release_key:
    release_head_key(&head, &key);
    return result;
}

/* The checks and the call of the xxh3_64_read_check* functions: args are (head, key, stored, row,
   piece), stored NULL for a buffer of the call's own; the record is fd, or where fd < 0 the file
   name (bytes) opened beneath dir_fd (O_NOFOLLOW) and closed here; shown: it, for an error. */
static PyObject *read_check(PyObject *const *args, int fd, int dir_fd, PyObject *name, PyObject *shown)
{
    Py_ssize_t piece = PyLong_AsSsize_t(args[4]);
    if (piece == -1 && PyErr_Occurred())
        return NULL;
    if (piece < 0) {
        PyErr_Format(PyExc_ValueError, "piece: expected a count of bytes >= 0, got %zd", piece);
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer head, key, stored, row;
    if (get_head_key(args, &head, &key) < 0)
        return NULL;
    u8 own[CHECK_PREFIX_MAX + 8]; /* stored NULL: the stored head and checksum go here (not released below) */
    int mine = args[2] == NULL && (size_t)head.len <= CHECK_PREFIX_MAX;
    if (mine)
        stored = (Py_buffer){.buf = own, .len = head.len + 8};
    else if (args[2] == NULL)
        PyErr_Format(PyExc_ValueError, "head: holds %zd bytes, at most %d here", head.len, CHECK_PREFIX_MAX);
    if (!mine && (args[2] == NULL || get_writable(args[2], &stored, "stored") < 0))
        goto release_key;
    if (get_writable(args[3], &row, "row") < 0)
        goto release_stored;
    size_t hlen = (size_t)head.len, klen = (size_t)key.len, n = (size_t)row.len;
    u8 *s = stored.buf, *r = row.buf;
    if ((size_t)stored.len != hlen + 8) {
        PyErr_Format(PyExc_ValueError, "stored: holds %zd bytes, expected len(head) + 8 = %zu", stored.len, hlen + 8);
        goto release_row;
    }
    if (refuse_overlap(r, n, s, hlen + 8, "row: overlaps stored"))
        goto release_row;
    u8 small[CHECK_PREFIX_MAX];
    u8 *prefix = join_prefix(small, &head, &key);
    if (prefix == NULL)
        goto release_row;
    int status, opened = fd >= 0;
    const char *path = name != NULL ? PyBytes_AS_STRING(name) : NULL;
    Py_BEGIN_ALLOW_THREADS
    if (!opened) {
        do
            fd = openat(dir_fd, path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK); /* a FIFO: no wait */
        while (fd < 0 && errno == EINTR);
    }
    if (fd < 0) {
        status = -errno;
    } else {
        status = xxc_read_check(stripes_for(0, n), fd, head.buf, hlen, prefix, hlen + klen, s, r, n, (size_t)piece);
        if (!opened)
            close(fd);
    }
    Py_END_ALLOW_THREADS
    if (prefix != small)
        PyMem_Free(prefix);
    if (status < 0) {
        errno = -status;
        if (fd < 0) /* the open failed: named, as os.open names it (ENOENT: FileNotFoundError) */
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, shown);
        else
            PyErr_SetFromErrno(PyExc_OSError);
    } else {
        result = PyLong_FromLong(status);
    }
release_row:
    PyBuffer_Release(&row);
release_stored:
    if (args[2] != NULL)
        PyBuffer_Release(&stored);
release_key:
    release_head_key(&head, &key);
    return result;
}

static int get_fd(PyObject *obj, const char *what)
{
    long fd = PyLong_AsLong(obj);
    if (fd == -1 && PyErr_Occurred())
        return -1;
    if (fd < 0 || fd > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: expected an open file descriptor, got %ld", what, fd);
        return -1;
    }
    return (int)fd;
}

/* The argument checks of xxh3_64_read_check (the record open at fd), then the read. */
static PyObject *read_check_entry(PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "expected (fd, head, key, stored, row, piece), got %zd arguments", nargs);
        return NULL;
    }
    int fd = get_fd(args[0], "fd");
    if (fd < 0)
        return NULL;
    return read_check(args + 1, fd, -1, NULL, NULL);
}

/* xxh3_64_read_check(fd, head, key, stored, row, piece) -> int (see methods; _xxread.c reads). */
static PyObject *py_xxh3_64_read_check(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    return read_check_entry(args, nargs);
}

/* xxh3_64_read_check_key(dir_fd, head, key, row, piece) -> int (see methods): the name made here
   and the stored head read into the call's own buffer (no Python object a record but the name). */
static PyObject *py_xxh3_64_read_check_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    Py_buffer key;
    int dir_fd = nargs == 5 ? get_fd(args[0], "dir_fd") : -1;
    if (nargs != 5)
        PyErr_Format(PyExc_TypeError, "expected (dir_fd, head, key, row, piece), got %zd arguments", nargs);
    if (dir_fd < 0 || get_readable(args[2], &key, "key") < 0)
        return NULL;
    PyObject *name = PyBytes_FromStringAndSize(NULL, 2 * key.len + 4), *result = NULL;
    char *at = name != NULL ? PyBytes_AS_STRING(name) : NULL;
    for (const u8 *k = key.buf, *end = k + key.len; at != NULL && k < end; k++, at += 2)
        at[0] = "0123456789abcdef"[*k >> 4], at[1] = "0123456789abcdef"[*k & 15];
    PyBuffer_Release(&key);
    if (at != NULL) {
        memcpy(at, ".kvb", 4);
        PyObject *const call[5] = {args[1], args[2], NULL, args[3], args[4]};
        result = read_check(call, -1, dir_fd, name, name);
    }
    Py_XDECREF(name);
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

static PyObject *py_prefetch_writes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "expected (on=None), got %zd arguments", nargs);
        return NULL;
    }
    int was = xxc_prefetch_writes;
    if (nargs == 1 && args[0] != Py_None) {
        int on = PyObject_IsTrue(args[0]);
        if (on < 0)
            return NULL;
        if (on && !xxc_cpu_has_prefetchw()) {
            PyErr_SetString(PyExc_ValueError, "on: this CPU has no PREFETCHW");
            return NULL;
        }
        xxc_prefetch_writes = on;
    }
    return PyBool_FromLong(was);
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
     "xxh3_64_check_copy(head, key, stored, dst, payload=None) -> int\n\nOne raw record checked and copied into\n"
     "dst: 0 good, 1 not a record of len(dst) bytes (dst untouched), 2 its stored head differs from head (dst\n"
     "untouched), 3 its checksum (XXH3-64 of head + key + payload, little-endian after the stored head) differs\n"
     "(dst written). stored is the stored head and checksum, then the payload unless given apart. dst None:\n"
     "the record is checked, not copied (its payload's length is then its own)."},
    {"xxh3_64_read_check", (PyCFunction)(void (*)(void))py_xxh3_64_read_check, METH_FASTCALL,
     "xxh3_64_read_check(fd, head, key, stored, row, piece) -> int\n\n"
     "One raw record read from fd and checked, without the GIL: its stored head and checksum\n"
     "into stored (len(head) + 8 bytes), then its payload into row, piece bytes a pread (0: one\n"
     "pread), each piece hashed as it lands. 0 good, 1 a read came short or long (the file is not\n"
     "a record of len(row) bytes), 2 the stored head differs from head, 3 the checksum (XXH3-64\n"
     "of head + key + payload) differs. OSError where a pread failed."},
    {"xxh3_64_read_check_key", (PyCFunction)(void (*)(void))py_xxh3_64_read_check_key, METH_FASTCALL,
     "xxh3_64_read_check_key(dir_fd, head, key, row, piece) -> int\n\n"
     "xxh3_64_read_check of the file key.hex() + '.kvb' opened beneath dir_fd (O_NOFOLLOW) and\n"
     "closed in the same call, its head read into a buffer of its own; OSError naming the file\n"
     "where it cannot be opened."},
    {"paths", py_paths, METH_NOARGS, "paths() -> tuple of the path names this build and CPU run."},
    {"prefetch_writes", (PyCFunction)(void (*)(void))py_prefetch_writes, METH_FASTCALL,
     "prefetch_writes(on=None) -> bool\n\nWhether the copying AVX2 / AVX-512 passes prefetch the\n"
     "destination for writing (PREFETCHW, on at import where the CPU has it) rather than for reading;\n"
     "with on given, sets it (ValueError for True on a CPU without it). Returns the setting before\n"
     "the call. The bytes copied and the digests are the same either way."},
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
    hash_stripes = best_stripes;
    hash_name = best_name;
    if (__builtin_cpu_supports("avx512f")) {
        hash_stripes = stripes_avx512;
        hash_name = "avx512";
    }
    xxc_prefetch_writes = xxc_cpu_has_prefetchw();
#endif
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL || PyModule_AddFunctions(m, xxc_job_methods) < 0 || PyModule_AddFunctions(m, xxc_counts_methods) < 0) {
        Py_XDECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "path", best_name) < 0 || PyModule_AddStringConstant(m, "hash_path", hash_name) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* check_copy_raw, the rows' hold and xxc_joined_into for C callers (the lmdb tier's native job read and save). */
    if (xxc_add_capsule(m, "check_copy_c", (void *)check_copy_raw, XXC_CHECK_COPY_CAPSULE) < 0 || xxc_add_rows_hold(m) < 0
        || xxc_add_capsule(m, "joined_into_c", (void *)xxc_joined_into, XXC_JOINED_INTO_CAPSULE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
