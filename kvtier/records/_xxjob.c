/*
 * kvtier.records._xxcopy's xxh3_64_read_check_keys: a job of the file tier's flat records, each
 * opened by its key's name beneath a directory, read and checked as xxh3_64_read_check_key
 * reads one (_xxread.c), the whole job in one call and one hand-over of the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_hostcounts.h"
#include "_hostrow.h"
#include "_xxh3.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#define HEAD_MAX 64 /* a stored head this long at most (the file tier's is 24 bytes) */
#define KEY_MAX 64  /* a key this long at most (the file tier's are 32) */
#define LOCAL_RECORDS 2 /* a job of this many records at most keeps them (and its rows' views) on the stack */

/* What became of one record: read and checked; absent (its open's ENOENT, a miss); left to the
   general read (any other outcome, and every record from the directory's close on). */
enum { JOB_GOOD, JOB_MISS, JOB_REST };

typedef struct {
    u8 prefix[HEAD_MAX + KEY_MAX]; /* head + key: what the checksum begins with */
    char name[2 * KEY_MAX + 5];    /* key.hex() + ".kvb" */
    size_t klen;
    Py_buffer row;
    int status;
} job_record;

/* The name of keys[i] or rows[i] in an error (what: "key" or "row"; i < 0: what alone), made only
   when one is raised: a snprintf a record cost 0.2 us of a 4 KiB read's 2. */
static const char *taken_name(char *name, size_t size, const char *what, Py_ssize_t i)
{
    if (i < 0)
        return what;
    snprintf(name, size, "%ss[%zd]", what, i);
    return name;
}

/* A record's name and prefix from key and its row from row, taken while the GIL is held; 0 with
   the row held, or -1 with the error set, naming keys[i] / rows[i] (i < 0: key / row). */
static int take_record(job_record *r, PyObject *key_obj, PyObject *row_obj, const Py_buffer *head, Py_ssize_t i)
{
    static const char hex[] = "0123456789abcdef";
    char name[32];
    Py_buffer key;
    if (PyObject_GetBuffer(key_obj, &key, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a bytes-like object", taken_name(name, sizeof name, "key", i));
        return -1;
    }
    if (key.len > KEY_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: holds %zd bytes, at most %d here", taken_name(name, sizeof name, "key", i), key.len, KEY_MAX);
        PyBuffer_Release(&key);
        return -1;
    }
    const u8 *k = key.buf;
    r->klen = (size_t)key.len;
    memcpy(r->prefix, head->buf, (size_t)head->len);
    memcpy(r->prefix + head->len, k, r->klen);
    for (size_t j = 0; j < r->klen; j++)
        r->name[2 * j] = hex[k[j] >> 4], r->name[2 * j + 1] = hex[k[j] & 15];
    memcpy(r->name + 2 * r->klen, ".kvb", 5);
    PyBuffer_Release(&key);
    if (PyObject_GetBuffer(row_obj, &r->row, PyBUF_SIMPLE | PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a writable, contiguous bytes-like object", taken_name(name, sizeof name, "row", i));
        return -1;
    }
    return 0;
}

/* Each record's name, prefix and row (take_record); 0, or -1 with the error set (rows[0..*held)
   are held either way, for the caller to release). */
static int take_records(job_record *recs, PyObject *const *keys, PyObject *const *rows, const Py_buffer *head, Py_ssize_t n, Py_ssize_t *held)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (take_record(&recs[i], keys[i], rows[i], head, i) < 0)
            return -1;
        *held = i + 1;
    }
    return 0;
}

/* The job's reads, without the GIL: the directory's descriptor is read from *dir before each
   open, and once it is negative (the root is closing) no record is opened any more. */
static void read_records(job_record *recs, Py_ssize_t n, const int *dir, const u8 *head, size_t hlen, size_t piece)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        job_record *r = &recs[i];
        int dir_fd = __atomic_load_n(dir, __ATOMIC_ACQUIRE), fd;
        if (dir_fd < 0) {
            for (; i < n; i++)
                recs[i].status = JOB_REST;
            return;
        }
        do
            fd = openat(dir_fd, r->name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK); /* a FIFO: no wait */
        while (fd < 0 && errno == EINTR);
        if (fd < 0) {
            r->status = errno == ENOENT ? JOB_MISS : JOB_REST;
            continue;
        }
        u8 stored[HEAD_MAX + 8];
        size_t len = (size_t)r->row.len;
        int got = xxc_read_check(stripes_for(0, len), fd, head, hlen, r->prefix, hlen + r->klen, stored, r->row.buf, len, piece);
        close(fd);
        r->status = got == XXC_CHECK_GOOD ? JOB_GOOD : JOB_REST;
    }
}

/* piece as a count of bytes >= 0, or -1 with the error set. */
static Py_ssize_t take_piece(PyObject *obj)
{
    Py_ssize_t piece = PyLong_AsSsize_t(obj);
    if (piece < 0 && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "piece: expected a count of bytes >= 0, got %zd", piece);
    return piece < 0 ? -1 : piece;
}

/* The directory's C int (dir_obj) and the stored head (head_obj), each checked: 0 with both
   held, or -1 with the error set and neither held. */
static int take_dir_head(PyObject *dir_obj, PyObject *head_obj, Py_buffer *dir, Py_buffer *head)
{
    if (PyObject_GetBuffer(dir_obj, dir, PyBUF_SIMPLE) < 0)
        return -1;
    if (dir->len != (Py_ssize_t)sizeof(int) || ((uintptr_t)dir->buf % _Alignof(int)) != 0) {
        PyErr_Format(PyExc_ValueError, "dir_at: expected an aligned C int holding the directory's descriptor, got %zd bytes", dir->len);
        PyBuffer_Release(dir);
        return -1;
    }
    if (PyObject_GetBuffer(head_obj, head, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(dir);
        return -1;
    }
    if (head->len > HEAD_MAX) {
        PyErr_Format(PyExc_ValueError, "head: holds %zd bytes, at most %d here", head->len, HEAD_MAX);
        PyBuffer_Release(head);
        PyBuffer_Release(dir);
        return -1;
    }
    return 0;
}

/* read_records of a job counted among under_way's (a list: one entry appended before the
   directory is looked at, as BeneathRoot.enter counts a job, and one popped after, as leave
   does; NULL: not counted): 0, or -1 with the error set (nothing read when the count failed). */
static int read_counted(PyObject *under_way, job_record *recs, Py_ssize_t n, const Py_buffer *dir, const Py_buffer *head, Py_ssize_t piece)
{
    if (under_way != NULL && PyList_Append(under_way, Py_None) < 0)
        return -1;
    Py_BEGIN_ALLOW_THREADS
    read_records(recs, n, dir->buf, head->buf, (size_t)head->len, (size_t)piece);
    Py_END_ALLOW_THREADS
    if (under_way == NULL)
        return 0;
    Py_ssize_t counted = PyList_GET_SIZE(under_way);
    return counted == 0 ? 0 : PyList_SetSlice(under_way, counted - 1, counted, NULL);
}

/* found[i] set True for each record read and checked, and the list of the positions left to the
   general read (NULL with the error set); where none is left and as_list is 0, the empty tuple
   instead (no new list for the collector to count: a job of all hits or misses makes none). */
static PyObject *job_outcome(const job_record *recs, Py_ssize_t n, PyObject *found, int as_list)
{
    Py_ssize_t left = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        left += recs[i].status == JOB_REST;
    PyObject *rest = left == 0 && !as_list ? PyTuple_New(0) : PyList_New(0);
    for (Py_ssize_t i = 0; rest != NULL && i < n; i++) {
        int failed = 0; /* (the empty tuple: no record is JOB_REST) */
        if (recs[i].status == JOB_GOOD)
            failed = PyList_SetItem(found, i, Py_NewRef(Py_True)) < 0; /* (IndexError if another thread cut it) */
        else if (recs[i].status == JOB_REST) {
            PyObject *at = PyLong_FromSsize_t(i);
            failed = at == NULL || PyList_Append(rest, at) < 0;
            Py_XDECREF(at);
        }
        if (failed)
            Py_CLEAR(rest);
    }
    return rest;
}

/* The records of keys[0..n) read into rows[0..n) (read_counted): found[i] set for each record
   read and checked, and the positions left to the general read returned (job_outcome, as_list);
   NULL with the error set. */
static PyObject *read_job(PyObject *under_way, PyObject *const *keys, PyObject *const *rows, Py_ssize_t n, const Py_buffer *dir,
                          const Py_buffer *head, Py_ssize_t piece, PyObject *found, int as_list)
{
    PyObject *rest = NULL;
    Py_ssize_t held = 0;
    job_record local[LOCAL_RECORDS]; /* a small job's records on the stack: no allocation a job */
    job_record *recs = n <= LOCAL_RECORDS ? memset(local, 0, sizeof local) : PyMem_Calloc((size_t)n, sizeof *recs);
    if (recs == NULL)
        return PyErr_NoMemory();
    if (take_records(recs, keys, rows, head, n, &held) == 0 && read_counted(under_way, recs, n, dir, head, piece) == 0)
        rest = job_outcome(recs, n, found, as_list);
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&recs[i].row);
    if (recs != local)
        PyMem_Free(recs);
    return rest;
}

/* xxh3_64_read_check_keys(dir_at, head, keys, rows, piece, found) -> list of int (see methods). */
static PyObject *xxc_read_check_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "expected (dir_at, head, keys, rows, piece, found), got %zd arguments", nargs);
        return NULL;
    }
    Py_ssize_t piece = take_piece(args[4]);
    if (piece < 0)
        return NULL;
    if (!PyList_Check(args[5]))
        return PyErr_Format(PyExc_TypeError, "found: expected a list, got %.100s", Py_TYPE(args[5])->tp_name);
    PyObject *keys = PySequence_Fast(args[2], "keys: expected a sequence"), *rows = NULL, *rest = NULL;
    if (keys == NULL || (rows = PySequence_Fast(args[3], "rows: expected a sequence")) == NULL) {
        Py_XDECREF(keys);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    Py_buffer dir, head;
    if (PySequence_Fast_GET_SIZE(rows) != n || PyList_GET_SIZE(args[5]) != n) {
        PyErr_Format(PyExc_ValueError, "rows, found: expected %zd each (one per key), got %zd and %zd", n, PySequence_Fast_GET_SIZE(rows),
                     PyList_GET_SIZE(args[5]));
        goto release_seqs;
    }
    if (take_dir_head(args[0], args[1], &dir, &head) < 0)
        goto release_seqs;
    rest = read_job(NULL, PySequence_Fast_ITEMS(keys), PySequence_Fast_ITEMS(rows), n, &dir, &head, piece, args[5], 1);
    PyBuffer_Release(&head);
    PyBuffer_Release(&dir);
release_seqs:
    Py_DECREF(rows);
    Py_DECREF(keys);
    return rest;
}

/* xxh3_64_read_one(under_way, dir_at, head, key, row, piece) -> int (see methods): one record,
   counted among under_way's jobs (a list: one entry appended for the call, one popped after),
   as BeneathRoot.enter and leave count a job. 0 read and checked, 1 absent, 2 the general
   read's (the directory closing, a check or a read that failed, an open that failed else). */
static PyObject *xxc_read_one(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "expected (under_way, dir_at, head, key, row, piece), got %zd arguments", nargs);
        return NULL;
    }
    if (!PyList_CheckExact(args[0]))
        return PyErr_Format(PyExc_TypeError, "under_way: expected a list, got %.100s", Py_TYPE(args[0])->tp_name);
    Py_ssize_t piece = take_piece(args[5]);
    if (piece < 0)
        return NULL;
    PyObject *result = NULL;
    Py_buffer dir, head;
    job_record rec;
    if (take_dir_head(args[1], args[2], &dir, &head) < 0)
        return NULL;
    if (take_record(&rec, args[3], args[4], &head, -1) == 0) {
        if (read_counted(args[0], &rec, 1, &dir, &head, piece) == 0)
            result = PyLong_FromLong(rec.status == JOB_GOOD ? 0 : rec.status == JOB_MISS ? 1 : 2);
        PyBuffer_Release(&rec.row);
    }
    PyBuffer_Release(&head);
    PyBuffer_Release(&dir);
    return result;
}

/* The rows' kind, xxh3_64_read_rows's kind tuple: what host_row_view asks of each row, and each
   key's length. */
enum { KIND_TENSOR, KIND_DTYPE, KIND_SHAPE, KIND_VIEWS, KIND_KEY_BYTES, KIND_COUNT };

static host_row_names row_names;

/* The job from its rows' checks to its reads: keys and out (sequences, taken as tuples as they
   are now: a row's checks may run Python that changes the caller's lists; rows of one pool, a
   kvtier.pool_rows.PoolRows, kept as they are: its pool is checked once), each row viewed as
   host_row_view of kind views it and each key bytes of kind's length (host_job_views), then
   read (read_job, as_list) into found. The positions left to the general read; None, with nothing
   read or counted, at the first key or row that is not so; NULL with the error set. */
static PyObject *rows_job(PyObject *under_way, PyObject *dir_obj, PyObject *head_obj, PyObject *keys_obj, PyObject *out_obj,
                          PyObject *const *kind, Py_ssize_t piece, PyObject *found, int as_list)
{
    Py_ssize_t key_bytes = PyLong_AsSsize_t(kind[KIND_KEY_BYTES]);
    if ((key_bytes == -1 && PyErr_Occurred()) || host_row_names_init(&row_names) < 0)
        return NULL;
    PyObject *keys = PySequence_Tuple(keys_obj), *out = NULL, *result = NULL;
    host_kept kept = HOST_KEPT_NONE; /* the pool's memory, held to the last read */
    Py_ssize_t rows = -1;
    if (keys != NULL && host_pool_rows(out_obj, &row_names)) {
        PyObject *numbers = host_slot(out_obj, row_names.numbers);
        rows = numbers == NULL ? -1 : PyObject_Length(numbers);
        Py_XDECREF(numbers);
        out = rows < 0 ? NULL : Py_NewRef(out_obj);
    } else if (keys != NULL && (out = PySequence_Tuple(out_obj)) != NULL)
        rows = PyTuple_GET_SIZE(out);
    if (out == NULL) {
        Py_XDECREF(keys);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(keys), got = 0;
    PyObject *local[LOCAL_RECORDS] = {NULL}, **views = n <= LOCAL_RECORDS ? local : PyMem_Calloc((size_t)n, sizeof *views);
    if (views == NULL) {
        PyErr_NoMemory();
        goto release;
    }
    int viewed = 0;
    xxc_rows_hold(); /* no collection from the first row's checks to the last copy (_xxhold.c) */
    if (rows == n && PyList_GET_SIZE(found) == n) {
        viewed = host_job_views(&PyTuple_GET_ITEM(keys, 0), n, out, kind[KIND_TENSOR], kind[KIND_DTYPE], kind[KIND_SHAPE], kind[KIND_VIEWS],
                                key_bytes, &row_names, views, &kept);
        got = viewed > 0 ? n : 0; /* (none kept otherwise) */
    }
    if (viewed == 0)
        result = Py_NewRef(Py_None); /* a key or a row the job's general checks take */
    else if (viewed > 0) {
        Py_buffer dir, head;
        if (take_dir_head(dir_obj, head_obj, &dir, &head) == 0) {
            result = read_job(under_way, &PyTuple_GET_ITEM(keys, 0), views, n, &dir, &head, piece, found, as_list);
            PyBuffer_Release(&head);
            PyBuffer_Release(&dir);
        }
    }
    xxc_rows_let_go();
    host_kept_drop(&kept);
release:
    for (Py_ssize_t i = 0; i < got; i++)
        Py_DECREF(views[i]);
    if (views != local)
        PyMem_Free(views);
    Py_DECREF(keys);
    Py_DECREF(out);
    return result;
}

/* Whether kind is xxh3_64_read_rows's kind tuple; 0 with a TypeError set if not. */
static int kind_ok(PyObject *kind)
{
    if (PyTuple_CheckExact(kind) && PyTuple_GET_SIZE(kind) == KIND_COUNT && PyDict_Check(PyTuple_GET_ITEM(kind, KIND_VIEWS)))
        return 1;
    PyErr_Format(PyExc_TypeError, "kind: expected a tuple (tensor_type, dtype, shape, views: dict, key_bytes)");
    return 0;
}

/* xxh3_64_read_rows(under_way, dir_at, head, keys, out, kind, piece, found) -> list of int or
   None (see methods): the file tier's flat job from its rows' checks to its records' reads. */
static PyObject *xxc_read_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "expected (under_way, dir_at, head, keys, out, kind, piece, found), got %zd arguments", nargs);
        return NULL;
    }
    PyObject *under_way = args[0], *found = args[7];
    if (!PyList_CheckExact(under_way))
        return PyErr_Format(PyExc_TypeError, "under_way: expected a list, got %.100s", Py_TYPE(under_way)->tp_name);
    if (!kind_ok(args[5]))
        return NULL;
    Py_ssize_t piece = take_piece(args[6]);
    if (piece < 0)
        return NULL;
    if (!PyList_Check(found))
        return PyErr_Format(PyExc_TypeError, "found: expected a list, got %.100s", Py_TYPE(found)->tp_name);
    return rows_job(under_way, args[1], args[2], args[3], args[4], &PyTuple_GET_ITEM(args[5], 0), piece, found, 1);
}

/* xxh3_64_read_job's parts: a flat store's, in the order PlainReads.job_parts makes them. */
enum { PART_UNDER_WAY, PART_DIR_AT, PART_HEAD, PART_KIND, PART_PIECE, PART_COUNTERS, PART_SIZE, PART_DEVICES, PART_FUNCTION_MODE,
       PART_DISPATCH_MODES, PART_COUNT };

static PyObject *s_locate, *s_blocks_read, *s_bytes_read, *s_read_misses;

/* 0 with the names above interned (again a no-op), or -1 with the error set. */
static int job_names_init(void)
{
    PyObject **slots[] = {&s_locate, &s_blocks_read, &s_bytes_read, &s_read_misses};
    const char *texts[] = {"locate", "blocks_read", "bytes_read", "read_misses"};
    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++)
        if (*slots[i] == NULL && (*slots[i] = PyUnicode_InternFromString(texts[i])) == NULL)
            return -1;
    return 0;
}

/* 1 where nothing but torch's own code runs in a row's getters: devices.locate is None (no
   stand-in device map) and no torch function or dispatch mode is on in this thread (a mode's
   handler, run in a later row's checks, may free a row whose view is taken); 0 if not; -1 with
   the error set. */
static int torch_plain(PyObject *const *parts)
{
    PyObject *locate = PyObject_GetAttr(parts[PART_DEVICES], s_locate);
    if (locate == NULL)
        return -1;
    int plain = locate == Py_None;
    Py_DECREF(locate);
    for (int p = PART_FUNCTION_MODE; plain && p <= PART_DISPATCH_MODES; p++)
        plain = host_row_truth(PyObject_CallNoArgs(parts[p])) == 0 ? 1 : PyErr_Occurred() ? -1 : 0;
    return plain;
}

/* The job's counters once, where every record was read or absent (rest empty): blocks_read and
   bytes_read by the hits, read_misses by the rest. 0, or -1 with the error set. */
static int count_job(PyObject *const *parts, PyObject *found)
{
    Py_ssize_t n = PyList_GET_SIZE(found), hits = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        hits += PyList_GET_ITEM(found, i) == Py_True;
    Py_ssize_t size = PyLong_AsSsize_t(parts[PART_SIZE]);
    if (size == -1 && PyErr_Occurred())
        return -1;
    PyObject *names[3] = {s_blocks_read, s_bytes_read, s_read_misses};
    Py_ssize_t counts[3] = {hits, hits * size, n - hits};
    return host_counts_add_n(parts[PART_COUNTERS], names, counts, 3); /* the job's adds in one step */
}

/* xxh3_64_read_job(parts, keys, out) -> list, (found, rest) or None (see methods): the file tier's
   flat job, its modes' checks, its rows' checks, its reads and its counters in one call. */
static PyObject *xxc_read_job(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "expected (parts, keys, out), got %zd arguments", nargs);
    PyObject *parts_obj = args[0];
    if (!PyTuple_CheckExact(parts_obj) || PyTuple_GET_SIZE(parts_obj) != PART_COUNT || !PyList_CheckExact(PyTuple_GET_ITEM(parts_obj, PART_UNDER_WAY)))
        return PyErr_Format(PyExc_TypeError, "parts: expected the tuple PlainReads.job_parts makes (%d items)", PART_COUNT);
    PyObject *const *parts = &PyTuple_GET_ITEM(parts_obj, 0);
    if (!kind_ok(parts[PART_KIND]))
        return NULL;
    Py_ssize_t piece = take_piece(parts[PART_PIECE]);
    if (piece < 0)
        return NULL;
    if (job_names_init() < 0)
        return NULL;
    int plain = torch_plain(parts);
    if (plain <= 0)
        return plain < 0 ? NULL : Py_NewRef(Py_None);
    Py_ssize_t n = PyObject_Length(args[1]);
    if (n < 0) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError))
            return NULL;
        PyErr_Clear();
        Py_RETURN_NONE; /* keys of no length: the general checks refuse them by name */
    }
    PyObject *found = PyList_New(n);
    if (found == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyList_SET_ITEM(found, i, Py_NewRef(Py_False));
    PyObject *rest = rows_job(parts[PART_UNDER_WAY], parts[PART_DIR_AT], parts[PART_HEAD], args[1], args[2], &PyTuple_GET_ITEM(parts[PART_KIND], 0),
                              piece, found, 0);
    if (rest == NULL || rest == Py_None) {
        Py_DECREF(found);
        return rest;
    }
    if (!PyList_CheckExact(rest)) { /* the empty tuple: every record read or absent */
        Py_DECREF(rest);
        if (count_job(parts, found) == 0)
            return found;
        Py_DECREF(found);
        return NULL;
    }
    PyObject *pair = PyTuple_Pack(2, found, rest);
    Py_DECREF(found);
    Py_DECREF(rest);
    return pair;
}

XXC_INTERNAL PyMethodDef xxc_job_methods[] = {
    {"xxh3_64_read_check_keys", (PyCFunction)(void (*)(void))xxc_read_check_keys, METH_FASTCALL,
     "xxh3_64_read_check_keys(dir_at, head, keys, rows, piece, found) -> list\n\n"
     "xxh3_64_read_check_key of each key into its row, in one call without the GIL: dir_at is a C int\n"
     "holding the directory's descriptor, read before each open (negative: no more opens). Sets\n"
     "found[i] True for each record read and checked; returns the positions left to the general\n"
     "read (all but those and the absent records)."},
    {"xxh3_64_read_one", (PyCFunction)(void (*)(void))xxc_read_one, METH_FASTCALL,
     "xxh3_64_read_one(under_way, dir_at, head, key, row, piece) -> int\n\nxxh3_64_read_check_keys of one key,\n"
     "counted in the list under_way (an entry appended for the call): 0 read and checked, 1 absent, 2 else."},
    {"xxh3_64_read_rows", (PyCFunction)(void (*)(void))xxc_read_rows, METH_FASTCALL,
     "xxh3_64_read_rows(under_way, dir_at, head, keys, out, kind, piece, found) -> list or None\n\nxxh3_64_read_check_keys into the\n"
     "views host_view keeps of out's rows (kind: tensor_type, dtype, shape, views, key_bytes), counted as xxh3_64_read_one counts."},
    {"xxh3_64_read_job", (PyCFunction)(void (*)(void))xxc_read_job, METH_FASTCALL,
     "xxh3_64_read_job(parts, keys, out) -> list, tuple or None\n\nA flat store's job in one call: None where\n"
     "devices.locate is set, a torch function or dispatch mode is on, or a key or row is not one xxh3_64_read_rows\n"
     "takes (nothing read or counted); else xxh3_64_read_rows into a new found list: found, its hits and misses\n"
     "counted in parts' counters, where every record was read or absent; else (found, rest), uncounted."},
    {NULL, NULL, 0, NULL},
};
