/*
 * kvtier.transfer._blockcopy: a small host job's whole copy in one native call.
 *
 * ``BlockCopier(addresses, blocks, piece_bytes, offsets, row_bytes, keep)`` describes a host KV
 * cache once: per KV tensor, the address of its first block, its bytes per block
 * (``piece_bytes``) and where its share of a record starts (``offsets``); every tensor holds
 * ``blocks`` blocks, a record is ``row_bytes`` long. ``keep`` (the tensors) is held for the
 * copier's life, so the addresses stay valid. ``gather(pool, pool_rows, row_bytes, rows, ids)``
 * copies engine block ``ids[j]`` of every tensor into record ``rows[j]`` of the pool at address
 * ``pool`` (``pool_rows`` records of ``row_bytes``); ``scatter`` copies the other way. Every id
 * and row is checked before the first byte moves (an IndexError or ValueError names the bad one),
 * and the copy runs without the GIL once, over every (block, tensor) piece in the order
 * ``_foreach_copy_`` of the same pieces takes them.
 *
 * A job of COPY_STREAM_MIN bytes or more writes with non-temporal stores (x86-64: AVX-512, else
 * AVX2, else SSE2): a store then does not first read the destination's line, which a cold
 * destination costs a whole extra pass over memory. One thread copying so a 4-block job of
 * 2 MiB blocks here runs at 1.2-1.3 ms against 1.3-1.7 ms for torch's ``_foreach_copy_`` of the
 * same pieces on a team of two threads. Smaller jobs use memcpy, leaving the bytes in cache.
 *
 * ``threads > 1`` (a sixth argument) runs the job on the calling thread's OpenMP team, through
 * the runtime's ``GOMP_parallel`` that ``set_team(address)`` gave (the one torch loaded): every
 * thread of the team takes the job's next block until none is left, so a helper that starts late
 * leaves its share to the others. Right after one of torch's ops the team's helpers are awake
 * (OpenMP spins them between regions, on this 2-CPU host for milliseconds), where a thread of our
 * own found no free CPU and ran after the caller's share, not beside it. Measured here, 16 blocks
 * of 2 MiB after a flush of the caches: 2.0 ms on a team of two against 3.7 ms on one thread and
 * 3.3 ms (save) / 4.3 ms (load) for torch's index ops on the same team. A job whose destinations
 * repeat (two rows of a gather, two ids of a scatter are one) copies in order on the calling thread,
 * so the last one still wins. Both calls return the number of threads that copied. In a child
 * of fork every job copies on the calling thread (the parent's team has no threads there).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define BC_X86 1
#else
#define BC_X86 0
#endif

/* A job this large or larger streams its stores past the caches. */
#define COPY_STREAM_MIN (1 << 20)
/* A job this large or larger copies without the GIL. */
#define RELEASE_GIL_AT (16 * 1024)

typedef void (*stream_fn)(char *dst, const char *src, size_t len);

#if BC_X86
__attribute__((target("avx512f"))) static void stream_avx512(char *dst, const char *src, size_t len)
{
    size_t o = 0;
    for (; o + 256 <= len; o += 256) {
        __m512i a = _mm512_loadu_si512((const void *)(src + o));
        __m512i b = _mm512_loadu_si512((const void *)(src + o + 64));
        __m512i c = _mm512_loadu_si512((const void *)(src + o + 128));
        __m512i d = _mm512_loadu_si512((const void *)(src + o + 192));
        _mm512_stream_si512((void *)(dst + o), a);
        _mm512_stream_si512((void *)(dst + o + 64), b);
        _mm512_stream_si512((void *)(dst + o + 128), c);
        _mm512_stream_si512((void *)(dst + o + 192), d);
    }
    for (; o + 64 <= len; o += 64)
        _mm512_stream_si512((void *)(dst + o), _mm512_loadu_si512((const void *)(src + o)));
    if (o < len)
        memcpy(dst + o, src + o, len - o);
}

__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, size_t len)
{
    size_t o = 0;
    for (; o + 128 <= len; o += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + o));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + o + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + o + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + o + 96));
        _mm256_stream_si256((__m256i *)(dst + o), a);
        _mm256_stream_si256((__m256i *)(dst + o + 32), b);
        _mm256_stream_si256((__m256i *)(dst + o + 64), c);
        _mm256_stream_si256((__m256i *)(dst + o + 96), d);
    }
    for (; o + 32 <= len; o += 32)
        _mm256_stream_si256((__m256i *)(dst + o), _mm256_loadu_si256((const __m256i *)(src + o)));
    if (o < len)
        memcpy(dst + o, src + o, len - o);
}

static void stream_sse2(char *dst, const char *src, size_t len)
{
    size_t o = 0;
    for (; o + 16 <= len; o += 16)
        _mm_stream_si128((__m128i *)(dst + o), _mm_loadu_si128((const __m128i *)(src + o)));
    if (o < len)
        memcpy(dst + o, src + o, len - o);
}
#endif

static stream_fn best_stream = NULL; /* NULL: memcpy */
static const char *best_name = "memcpy";

/* One piece: memcpy up to the destination's 64-byte boundary, then the streaming body. */
static void copy_piece(char *dst, const char *src, size_t len, stream_fn stream)
{
    if (stream == NULL || len < 256) {
        memcpy(dst, src, len);
        return;
    }
    size_t head = (size_t)((64 - ((uintptr_t)dst & 63)) & 63);
    if (head) {
        memcpy(dst, src, head);
        dst += head;
        src += head;
        len -= head;
    }
    stream(dst, src, len);
}

typedef struct {
    PyObject_HEAD
    Py_ssize_t tensors;
    Py_ssize_t blocks;    /* blocks in every tensor */
    Py_ssize_t row_bytes; /* one record */
    Py_ssize_t job_bytes_per_block; /* the sum of piece_bytes */
    char **base;          /* per tensor: its first block */
    Py_ssize_t *piece;    /* per tensor: bytes per block */
    Py_ssize_t *offset;   /* per tensor: its share's start in a record */
    PyObject *keep;
} BlockCopier;

static void copier_dealloc(BlockCopier *self)
{
    PyMem_Free(self->base);
    PyMem_Free(self->piece);
    PyMem_Free(self->offset);
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Each item of ``seq`` (a tuple or list of ints, ``n`` of them) as a Py_ssize_t; -1 with an error. */
static int read_sizes(PyObject *seq, Py_ssize_t n, Py_ssize_t *out, const char *what, int allow_zero)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd values (one per tensor), got %zd", what, n,
                     PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (v < 0 || (v == 0 && !allow_zero)) {
            PyErr_Format(PyExc_ValueError, "%s[%zd]: expected an integer >= %d, got %zd", what, i, allow_zero ? 0 : 1, v);
            Py_DECREF(fast);
            return -1;
        }
        out[i] = v;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *copier_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"addresses", "blocks", "piece_bytes", "offsets", "row_bytes", "keep", NULL};
    PyObject *addresses, *pieces, *offsets, *keep;
    Py_ssize_t blocks, row_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnOOnO", kwlist, &addresses, &blocks, &pieces, &offsets, &row_bytes, &keep))
        return NULL;
    Py_ssize_t n = PySequence_Size(addresses);
    if (n < 0)
        return NULL;
    if (n == 0 || blocks < 1 || row_bytes < 1) {
        PyErr_Format(PyExc_ValueError, "BlockCopier: expected at least one tensor, blocks >= 1 and row_bytes >= 1, got %zd, %zd, %zd",
                     n, blocks, row_bytes);
        return NULL;
    }
    BlockCopier *self = (BlockCopier *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->tensors = n;
    self->blocks = blocks;
    self->row_bytes = row_bytes;
    self->base = PyMem_Calloc((size_t)n, sizeof(char *));
    self->piece = PyMem_Calloc((size_t)n, sizeof(Py_ssize_t));
    self->offset = PyMem_Calloc((size_t)n, sizeof(Py_ssize_t));
    Py_INCREF(keep);
    self->keep = keep;
    if (self->base == NULL || self->piece == NULL || self->offset == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    Py_ssize_t *addr = PyMem_Calloc((size_t)n, sizeof(Py_ssize_t));
    if (addr == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    int bad = read_sizes(addresses, n, addr, "addresses", 0) < 0 || read_sizes(pieces, n, self->piece, "piece_bytes", 0) < 0
              || read_sizes(offsets, n, self->offset, "offsets", 1) < 0;
    for (Py_ssize_t i = 0; !bad && i < n; i++) {
        self->base[i] = (char *)(uintptr_t)addr[i];
        self->job_bytes_per_block += self->piece[i];
        if (self->offset[i] > row_bytes - self->piece[i]) {
            PyErr_Format(PyExc_ValueError, "offsets[%zd]: a piece of %zd bytes at %zd does not fit a record of %zd bytes", i,
                         self->piece[i], self->offset[i], row_bytes);
            bad = 1;
        }
    }
    PyMem_Free(addr);
    if (bad) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* ``seq`` (a list or tuple of ints) into ``out`` (``n`` long), each in [0, limit); -1 with an error naming the bad one. */
static int read_indexes(PyObject *seq, Py_ssize_t n, Py_ssize_t limit, Py_ssize_t *out, const char *what)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_Check(seq) ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i);
        Py_ssize_t v = PyLong_Check(item) ? PyLong_AsSsize_t(item) : -1;
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (!PyLong_Check(item)) {
            PyErr_Format(PyExc_TypeError, "%s[%zd]: expected an int, got %.100s", what, i, Py_TYPE(item)->tp_name);
            return -1;
        }
        if (v < 0 || v >= limit) {
            PyErr_Format(PyExc_IndexError, "%s[%zd]: %zd is out of range [0, %zd)", what, i, v, limit);
            return -1;
        }
        out[i] = v;
    }
    return 0;
}

#define SMALL_JOB 16

/* The OpenMP runtime's entry that runs fn(data) on the calling thread's team (GCC's ABI, which
 * libgomp and LLVM's libomp both export): set by set_team() to the runtime torch loaded, so a
 * job split over "the team" runs on the same threads as torch's own ops on that thread, whose
 * helpers are awake (spinning) right after one. NULL: no team, every job on the calling thread. */
typedef void (*team_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
static team_parallel_fn team_parallel = NULL;

/* In a child of fork the runtime still holds the forking thread's team, but not its threads:
 * a team job there would wait for them for ever (libgomp; torch's own parallel ops on that
 * thread do too). The child's jobs copy on the calling thread. */
static void no_team_after_fork(void)
{
    team_parallel = NULL;
}

typedef struct {
    const BlockCopier *copier;
    char *pool_base;
    const Py_ssize_t *rows;
    const Py_ssize_t *ids;
    Py_ssize_t k;
    int save;
    stream_fn stream;
    Py_ssize_t next; /* the next block to copy, taken atomically by every thread of the team */
} TeamJob;

/* Block j's pieces (every tensor), in _foreach_copy_'s order. */
static void copy_block(const BlockCopier *self, char *pool_base, Py_ssize_t row, Py_ssize_t id, int save, stream_fn stream)
{
    char *record = pool_base + row * self->row_bytes;
    for (Py_ssize_t t = 0; t < self->tensors; t++) {
        Py_ssize_t len = self->piece[t];
        char *block = self->base[t] + id * len;
        char *in_record = record + self->offset[t];
        if (save)
            copy_piece(in_record, block, (size_t)len, stream);
        else
            copy_piece(block, in_record, (size_t)len, stream);
    }
}

/* One thread's part of a team job: the next block not taken yet, until none is left (a helper
 * that starts late finds less to do, and the caller does the rest). */
static void team_share(void *arg)
{
    TeamJob *job = (TeamJob *)arg;
    for (;;) {
        Py_ssize_t j = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (j >= job->k)
            break;
        copy_block(job->copier, job->pool_base, job->rows[j], job->ids[j], job->save, job->stream);
    }
#if BC_X86
    if (job->stream != NULL)
        _mm_sfence(); /* this thread's streamed stores, before the team's closing barrier */
#endif
}

/* Whether two of the k destinations (rows of a gather, ids of a scatter, all < limit) are one:
 * copied in parallel their order would be lost (in order, the last one wins). 1, 0, or -1 with
 * an error. */
static int has_repeat(const Py_ssize_t *dst, Py_ssize_t k, Py_ssize_t limit)
{
    unsigned char *seen = PyMem_Calloc((size_t)(limit + 7) / 8, 1);
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int repeat = 0;
    for (Py_ssize_t j = 0; j < k && !repeat; j++) {
        unsigned char bit = (unsigned char)(1u << (dst[j] & 7));
        repeat = (seen[dst[j] >> 3] & bit) != 0;
        seen[dst[j] >> 3] |= bit;
    }
    PyMem_Free(seen);
    return repeat;
}

static PyObject *copier_run(BlockCopier *self, PyObject *const *args, Py_ssize_t nargs, int save)
{
    if (nargs != 5 && nargs != 6) {
        PyErr_Format(PyExc_TypeError, "%s(pool, pool_rows, row_bytes, rows, ids, threads=1): expected 5 or 6 arguments, got %zd",
                     save ? "gather" : "scatter", nargs);
        return NULL;
    }
    Py_ssize_t pool = PyLong_AsSsize_t(args[0]);
    Py_ssize_t pool_rows = PyLong_AsSsize_t(args[1]);
    Py_ssize_t row_bytes = PyLong_AsSsize_t(args[2]);
    Py_ssize_t threads = nargs == 6 ? PyLong_AsSsize_t(args[5]) : 1;
    if (PyErr_Occurred())
        return NULL;
    PyObject *rows = args[3], *ids = args[4];
    if (!(PyList_Check(rows) || PyTuple_Check(rows)) || !(PyList_Check(ids) || PyTuple_Check(ids))) {
        PyErr_SetString(PyExc_TypeError, "rows, ids: expected lists or tuples of ints");
        return NULL;
    }
    if (row_bytes != self->row_bytes || pool <= 0 || pool_rows < 0) {
        PyErr_Format(PyExc_ValueError, "pool: expected records of %zd bytes at a valid address, got %zd bytes, %zd rows", self->row_bytes,
                     row_bytes, pool_rows);
        return NULL;
    }
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "threads: expected an integer >= 1, got %zd", threads);
        return NULL;
    }
    Py_ssize_t k = Py_SIZE(rows);
    if (Py_SIZE(ids) != k) {
        PyErr_Format(PyExc_ValueError, "ids: expected %zd block ids (one per row), got %zd", k, Py_SIZE(ids));
        return NULL;
    }
    Py_ssize_t small[2 * SMALL_JOB];
    Py_ssize_t *r = small, *b = small + SMALL_JOB;
    Py_ssize_t *heap = NULL;
    if (k > SMALL_JOB) {
        heap = PyMem_Malloc(2 * (size_t)k * sizeof(Py_ssize_t));
        if (heap == NULL)
            return PyErr_NoMemory();
        r = heap;
        b = heap + k;
    }
    if (read_indexes(rows, k, pool_rows, r, "rows") < 0 || read_indexes(ids, k, self->blocks, b, "ids") < 0) {
        PyMem_Free(heap);
        return NULL;
    }
    size_t total = (size_t)k * (size_t)self->job_bytes_per_block;
    stream_fn stream = total >= COPY_STREAM_MIN ? best_stream : NULL;
    char *pool_base = (char *)(uintptr_t)pool;
    if (threads > k)
        threads = k;
    if (threads > 1 && team_parallel != NULL) {
        int repeat = save ? has_repeat(r, k, pool_rows) : has_repeat(b, k, self->blocks);
        if (repeat < 0) {
            PyMem_Free(heap);
            return NULL;
        }
        if (repeat)
            threads = 1;
    } else {
        threads = 1;
    }
    PyThreadState *ts = total >= RELEASE_GIL_AT ? PyEval_SaveThread() : NULL;
    if (threads > 1) {
        TeamJob job = {self, pool_base, r, b, k, save, stream, 0};
        team_parallel(team_share, &job, (unsigned)threads, 0);
    } else {
        for (Py_ssize_t j = 0; j < k; j++)
            copy_block(self, pool_base, r[j], b[j], save, stream);
#if BC_X86
        if (stream != NULL)
            _mm_sfence(); /* the streamed stores are ordered before whatever follows the job */
#endif
    }
    if (ts != NULL)
        PyEval_RestoreThread(ts);
    PyMem_Free(heap);
    return PyLong_FromSsize_t(threads);
}

static PyObject *copier_gather(BlockCopier *self, PyObject *const *args, Py_ssize_t nargs)
{
    return copier_run(self, args, nargs, 1);
}

static PyObject *copier_scatter(BlockCopier *self, PyObject *const *args, Py_ssize_t nargs)
{
    return copier_run(self, args, nargs, 0);
}

static PyMethodDef copier_methods[] = {
    {"gather", (PyCFunction)(void (*)(void))copier_gather, METH_FASTCALL,
     "gather(pool, pool_rows, row_bytes, rows, ids, threads=1) -> the threads that copied\n\n"
     "Copy engine block ids[j] of every tensor into record rows[j] of the pool at address pool; threads > 1: on the "
     "calling thread's OpenMP team of that many (set_team), unless two rows are one."},
    {"scatter", (PyCFunction)(void (*)(void))copier_scatter, METH_FASTCALL,
     "scatter(pool, pool_rows, row_bytes, rows, ids, threads=1) -> the threads that copied\n\n"
     "Copy record rows[j] of the pool at address pool into engine block ids[j] of every tensor; threads > 1: on the "
     "calling thread's OpenMP team of that many (set_team), unless two ids are one."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BlockCopierType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtier.transfer._blockcopy.BlockCopier",
    .tp_basicsize = sizeof(BlockCopier),
    .tp_dealloc = (destructor)copier_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BlockCopier(addresses, blocks, piece_bytes, offsets, row_bytes, keep): a host KV cache's blocks, "
              "copied to and from pools of records in one native call per job.",
    .tp_methods = copier_methods,
    .tp_new = copier_new,
};

static PyObject *py_set_path(PyObject *module, PyObject *arg)
{
    (void)module;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL)
        return NULL;
    if (strcmp(name, "memcpy") == 0) {
        best_stream = NULL;
        best_name = "memcpy";
        Py_RETURN_NONE;
    }
#if BC_X86
    if (strcmp(name, "sse2") == 0) {
        best_stream = stream_sse2;
        best_name = "sse2";
        Py_RETURN_NONE;
    }
    if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2")) {
        best_stream = stream_avx2;
        best_name = "avx2";
        Py_RETURN_NONE;
    }
    if (strcmp(name, "avx512") == 0 && __builtin_cpu_supports("avx512f")) {
        best_stream = stream_avx512;
        best_name = "avx512";
        Py_RETURN_NONE;
    }
#endif
    PyErr_Format(PyExc_ValueError, "path: %R is not one this build and CPU run", arg);
    return NULL;
}

static PyObject *py_set_team(PyObject *module, PyObject *arg)
{
    (void)module;
    Py_ssize_t address = PyLong_AsSsize_t(arg);
    if (address == -1 && PyErr_Occurred())
        return NULL;
    if (address < 0) {
        PyErr_Format(PyExc_ValueError, "set_team: expected the address of GOMP_parallel (or 0: none), got %zd", address);
        return NULL;
    }
    team_parallel = (team_parallel_fn)(uintptr_t)address;
    Py_RETURN_NONE;
}

static PyObject *py_team(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyBool_FromLong(team_parallel != NULL);
}

static PyObject *py_path(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyUnicode_FromString(best_name);
}

static PyObject *py_paths(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
#if BC_X86
    if (__builtin_cpu_supports("avx512f"))
        return Py_BuildValue("(ssss)", "memcpy", "sse2", "avx2", "avx512");
    if (__builtin_cpu_supports("avx2"))
        return Py_BuildValue("(sss)", "memcpy", "sse2", "avx2");
    return Py_BuildValue("(ss)", "memcpy", "sse2");
#else
    return Py_BuildValue("(s)", "memcpy");
#endif
}

static PyMethodDef methods[] = {
    {"path", py_path, METH_NOARGS, "path() -> the name of the stores large jobs stream with (memcpy: none)."},
    {"paths", py_paths, METH_NOARGS, "paths() -> tuple of the path names this build and CPU run."},
    {"set_team", py_set_team, METH_O,
     "set_team(address): the OpenMP runtime's GOMP_parallel, which runs a job of threads > 1 on the calling thread's team "
     "(0: none, every job on the calling thread)."},
    {"team", py_team, METH_NOARGS, "team() -> whether set_team gave a team runner."},
    {"set_path", py_set_path, METH_O, "set_path(name): stream large jobs' stores on the named path (one of paths()), to compare them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_blockcopy", "A small host job's whole copy in one native call.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__blockcopy(void)
{
#if BC_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        best_stream = stream_avx512;
        best_name = "avx512";
    } else if (__builtin_cpu_supports("avx2")) {
        best_stream = stream_avx2;
        best_name = "avx2";
    } else {
        best_stream = stream_sse2;
        best_name = "sse2";
    }
#endif
    if (pthread_atfork(NULL, NULL, no_team_after_fork) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "_blockcopy: pthread_atfork failed");
        return NULL;
    }
    if (PyType_Ready(&BlockCopierType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    Py_INCREF(&BlockCopierType);
    if (PyModule_AddObject(m, "BlockCopier", (PyObject *)&BlockCopierType) < 0) {
        Py_DECREF(&BlockCopierType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
