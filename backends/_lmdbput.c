/*
 * kvtier.backends._rowguard, its fifth source: the straight save of a job of several keys of an
 * lmdb tier (lmdb_lone.LoneSave.save_job) writes each record straight into its page. python-lmdb
 * has no reserved put: through it a record is built into a bytes object and LMDB then copies it
 * into its page, two copies of every block, plus a call, a parse and a GIL hand-over a put. Here
 * each key's value is put by the engine's own put with MDB_RESERVE, on the write transaction
 * python-lmdb began (direct_writer, _lmdbdirect.c: only where the store's open probed that
 * sound), and the record (head, checksum, block) is written into the reserved space in the one
 * pass that copies and hashes the block (_xxcopy's joined_into_c: the bytes xxh3_joined builds).
 * The reserved space is the record's until the next put of the transaction, which is the next
 * key's, after it is written.
 */
#include "_rowguard.h"

#include "../kvtier/records/_xxh3.h"

/* Records of this many bytes or more are written without the GIL (as xxh3_64_joined builds them). */
#define RELEASE_GIL_AT (16 * 1024)
#define ON_STACK 16

static xxc_joined_into_fn joined_into;
static unsigned long reserved_jobs;

/* The job's rows' buffers, each contiguous, of one length: 1 (all held), 0 (not so: none held,
   no error set), -1 (an error set, none held). */
static int row_buffers(PyObject *const *views, Py_ssize_t count, Py_buffer *rows)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        int got = PyMemoryView_Check(views[i]) ? PyObject_GetBuffer(views[i], &rows[i], PyBUF_C_CONTIGUOUS) : 1;
        if (got == 0 && rows[i].len != rows[0].len) {
            PyBuffer_Release(&rows[i]);
            got = 1;
        }
        if (got != 0) {
            PyErr_Clear(); /* a released or strided view: not the straight line's */
            while (i-- > 0)
                PyBuffer_Release(&rows[i]);
            return 0;
        }
    }
    return 1;
}

static PyObject *job_put(PyObject *const *args, PyObject *key_tuple, PyObject *view_tuple, int unindex, PyObject *taken_of);

/* put_reserved(direct, env, txn, blocks, index, unindex, head, keys, views[, taken]) -> True,
   False or None: see lmdb_lone.LoneSave._commit_job. taken (None: not asked): what the views
   were taken of, asked again once the transaction is begun (views_stayed): the write lock's wait and
   the begin let the GIL go, in which another thread may have moved them (pool.resize_ frees the
   old memory); from that check to the last copy the GIL is held (records under RELEASE_GIL_AT).
   None where they moved: nothing put. */
PyObject *py_put_reserved(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if ((nargs != 9 && nargs != 10) || !PyBytes_CheckExact(args[6])) {
        PyErr_SetString(PyExc_TypeError, "put_reserved() takes (direct, env, txn, blocks, index, unindex, head, keys, views[, taken]), head a bytes");
        return NULL;
    }
    int unindex = PyObject_IsTrue(args[5]);
    if (unindex < 0)
        return NULL;
    /* the keys and views as they are now (a list's items could go under calls that run Python) */
    PyObject *key_tuple = held(args[7]);
    if (key_tuple == NULL)
        return NULL;
    PyObject *view_tuple = held(args[8]);
    if (view_tuple == NULL) {
        Py_DECREF(key_tuple);
        return NULL;
    }
    PyObject *result = job_put(args, key_tuple, view_tuple, unindex, nargs > 9 ? args[9] : Py_None);
    Py_DECREF(key_tuple);
    Py_DECREF(view_tuple);
    return result;
}

static PyObject *job_put(PyObject *const *args, PyObject *key_tuple, PyObject *view_tuple, int unindex, PyObject *taken_of)
{
    PyObject *head = args[6], *const *keys = &PyTuple_GET_ITEM(key_tuple, 0), *const *views = &PyTuple_GET_ITEM(view_tuple, 0);
    Py_ssize_t count = PyTuple_GET_SIZE(key_tuple);
    if (count != PyTuple_GET_SIZE(view_tuple)) {
        PyErr_Format(PyExc_ValueError, "put_reserved: %zd keys but %zd views", count, PyTuple_GET_SIZE(view_tuple));
        return NULL;
    }
    if (joined_into == NULL) {
        joined_into = (xxc_joined_into_fn)PyCapsule_Import(XXC_JOINED_INTO_CAPSULE, 0);
        if (joined_into == NULL) {
            PyErr_Clear(); /* a build without it: python-lmdb's put */
            Py_RETURN_FALSE;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++)
        if (!PyBytes_CheckExact(keys[i]))
            Py_RETURN_FALSE;
    if (count == 0)
        Py_RETURN_TRUE;
    Py_buffer small[ON_STACK], *rows = count <= ON_STACK ? small : PyMem_Calloc((size_t)count, sizeof *rows);
    if (rows == NULL)
        return PyErr_NoMemory();
    PyObject *result = NULL;
    const u8 *h = (const u8 *)PyBytes_AS_STRING(head);
    size_t hlen = (size_t)PyBytes_GET_SIZE(head), slen = 0;
    int taken = row_buffers(views, count, rows);
    if (taken == 0) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    slen = (size_t)rows[0].len;
    direct_writer_t w;
    taken = direct_writer(args[0], args[1], args[2], args[3], args[4], &w);
    if (taken <= 0) {
        result = taken < 0 ? NULL : Py_NewRef(Py_False);
        goto release;
    }
    if (taken_of != Py_None && !views_stayed(taken_of, views, 0, count)) {
        direct_writer_end(&w);
        result = Py_NewRef(Py_None); /* (moved: nothing put) */
        goto release;
    }
    /* Every record's build known to take its key before the first put: a build refused after its
       put would leave the room reserved unwritten (whatever the page held) in the transaction. */
    for (Py_ssize_t j = 0; j < count; j++) {
        size_t prefix = hlen + (size_t)PyBytes_GET_SIZE(keys[j]);
        if (prefix > XXC_JOIN_PREFIX_MAX) {
            direct_writer_end(&w);
            PyErr_Format(PyExc_ValueError, "put_reserved: keys[%zd]: head and key are %zu bytes, over the %d a build takes", j, prefix,
                         XXC_JOIN_PREFIX_MAX);
            goto release;
        }
    }
    int rc = 0, built = 0;
    Py_ssize_t i = 0;
    PyThreadState *state = slen >= RELEASE_GIL_AT ? PyEval_SaveThread() : NULL;
    for (; i < count; i++) {
        u8 *key = (u8 *)PyBytes_AS_STRING(keys[i]), *space;
        size_t klen = (size_t)PyBytes_GET_SIZE(keys[i]);
        rc = direct_reserve(&w, key, klen, hlen + 8 + slen, &space);
        if (rc != 0)
            break;
        built = joined_into(h, hlen, key, klen, rows[i].buf, slen, space);
        if (built != 0)
            break;
        if (unindex && (rc = direct_unindex(&w, key, klen)) != 0)
            break;
    }
    if (state != NULL)
        PyEval_RestoreThread(state);
    direct_writer_end(&w);
    reserved_jobs++;
    if (rc != 0)
        PyErr_Format(PyExc_RuntimeError, "put_reserved: LMDB's put of keys[%zd] failed (code %d)", i, rc);
    else if (built != 0) /* (never: the lengths were checked before the first put) */
        PyErr_Format(PyExc_RuntimeError, "put_reserved: keys[%zd]: the record's build failed after its put", i);
    else
        result = Py_NewRef(Py_True);
release:
    for (Py_ssize_t j = 0; j < count; j++)
        PyBuffer_Release(&rows[j]);
done:
    if (rows != small)
        PyMem_Free(rows);
    return result;
}

/* Jobs written here so far (reserved_jobs(): what the tests read to know this path ran). */
PyObject *py_reserved_jobs(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLong(reserved_jobs);
}
