/*
 * kvtier.backends._rowguard, its third source: what the straight save of a job of several keys
 * of an lmdb tier (lmdb_lone.LoneSave.save_job) does once per key, one call each a job:
 * job_views, every key's and row's checks and view (the loop job_read makes: row_views in
 * _rowguard.c); put_joined, each record built just before its put, in the write transaction.
 * In Python the calls around each record (the row's checks, the build, the put, a list append)
 * cost 0.2-0.3 us a record beside a 4 KiB record's 1.7 us put. And pool_views, the views of a
 * job's rows of one pool (lmdb_plain.RowViews.of), seen before or not, its pool checked once.
 */
#include "_rowguard.h"
#include "../kvtier/records/_hostrow.h"

/* A tuple of seq's items as they are now (a list's own item array would be freed under calls
   that run Python, were the list emptied or grown meanwhile). */
PyObject *held(PyObject *seq)
{
    return PyTuple_CheckExact(seq) ? Py_NewRef(seq) : PySequence_Tuple(seq);
}

/* job_views(keys, rows, tensor_type, dtype, shape, views, key_bytes): each row's view, as
   lmdb_plain.job_views_python answers: None when the counts differ, a key is not bytes of
   key_bytes, or host_view(row, ...) is None (not such a row, or one not seen yet). */
PyObject *py_job_views(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "job_views() takes 7 arguments (keys, rows, tensor_type, dtype, shape, views, key_bytes), got %zd", nargs);
        return NULL;
    }
    Py_ssize_t key_bytes = PyLong_AsSsize_t(args[6]);
    if (key_bytes == -1 && PyErr_Occurred())
        return NULL;
    PyObject *keys = held(args[0]);
    if (keys == NULL)
        return NULL;
    Py_ssize_t count;
    PyObject *rows = job_rows(args[1], &count), *got = NULL; /* (a PoolRows kept: its pool checked once) */
    if (rows == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (n != count) {
        got = Py_NewRef(Py_None);
        goto done;
    }
    got = PyList_New(n);
    if (got == NULL)
        goto done;
    int rc = row_views(&PyTuple_GET_ITEM(keys, 0), rows, n, args + 2, key_bytes, ((PyListObject *)got)->ob_item, NULL);
    if (rc <= 0) /* (row_views left no view in the list) */
        Py_SETREF(got, rc < 0 ? NULL : Py_NewRef(Py_None));
done:
    Py_DECREF(keys);
    Py_XDECREF(rows);
    return got;
}

/* pool_views(keys, rows, tensor_type, dtype, shape, views, key_bytes, unseen_at): the views of a
   job's rows given as one pool (a PoolRows), its pool's checks asked once (host_pool_take), as
   lmdb_plain.pool_views_python answers: for each key (bytes of key_bytes, checked before its
   row), its row's kept view views[address], else unseen_at(address) (a row not seen yet: its
   view made there), in one pass, the pool checked no second time for rows not seen yet. None
   where the counts differ, a key is not such, a number is not one of the pool's rows now, or
   unseen_at gives None; NotImplemented where rows is not a PoolRows or its pool is not one those
   checks take (its rows are then checked one by one). */
PyObject *py_pool_views(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "pool_views() takes 8 arguments (keys, rows, tensor_type, dtype, shape, views, key_bytes, unseen_at), got %zd",
                     nargs);
        return NULL;
    }
    PyObject *views = args[5], *unseen_at = args[7];
    if (!PyDict_Check(views)) {
        PyErr_Format(PyExc_TypeError, "views: expected a dict, got %.100s", Py_TYPE(views)->tp_name);
        return NULL;
    }
    Py_ssize_t key_bytes = PyLong_AsSsize_t(args[6]);
    if (key_bytes == -1 && PyErr_Occurred())
        return NULL;
    if (!host_pool_rows_type(args[1]))
        return Py_NewRef(Py_NotImplemented);
    PyObject *keys = held(args[0]);
    if (keys == NULL)
        return NULL;
    host_pool p;
    PyObject *got = NULL;
    int pooled = pool_take(args[1], args + 2, &p);
    if (pooled <= 0) {
        got = pooled < 0 ? NULL : Py_NewRef(Py_NotImplemented);
        goto done;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (n != p.count) {
        got = Py_NewRef(Py_None);
        goto done;
    }
    if ((got = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        unsigned long long at;
        if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != key_bytes || !host_pool_at(&p, i, &at)) {
            Py_SETREF(got, Py_NewRef(Py_None));
            goto done;
        }
        PyObject *address = PyLong_FromUnsignedLongLong(at), *view = NULL;
        if (address != NULL && (view = PyDict_GetItemWithError(views, address)) != NULL)
            Py_INCREF(view); /* (borrowed: owned before anything else runs) */
        else if (address != NULL && !PyErr_Occurred())
            view = PyObject_CallOneArg(unseen_at, address); /* not seen yet: made there */
        Py_XDECREF(address);
        if (view == NULL || view == Py_None) {
            Py_SETREF(got, view == NULL ? NULL : view); /* (the list's items set so far released with it) */
            goto done;
        }
        PyList_SET_ITEM(got, i, view);
    }
done:
    host_pool_drop(&p);
    Py_DECREF(keys);
    return got;
}

/* put_joined(put, delete, index, head, keys, views, joined[, rows]): for each key, in order,
   put(key, joined(head, key, view)) and, where delete is not None, delete(key, b"", index): as
   lmdb_plain.put_joined_python; True. ValueError when the counts differ, before any call; an
   error raised by a call propagates, with the keys before it put. rows (None: not asked): the
   rows the views were taken of, asked again before each build (views_stayed: the put before it,
   and the transaction's begin before the first, let the GIL go, in which another thread may
   move them); None where a row moved, its record not built, the keys before it put. */
PyObject *py_put_joined(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7 && nargs != 8) {
        PyErr_Format(PyExc_TypeError, "put_joined() takes 7 or 8 arguments (put, delete, index, head, keys, views, joined[, rows]), got %zd", nargs);
        return NULL;
    }
    PyObject *put = args[0], *delete = args[1], *index = args[2], *head = args[3], *joined = args[6], *rows = nargs > 7 ? args[7] : Py_None;
    PyObject *keys = held(args[4]);
    if (keys == NULL)
        return NULL;
    PyObject *views = held(args[5]), *empty = NULL, *result = NULL;
    if (views == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (n != PyTuple_GET_SIZE(views)) {
        PyErr_Format(PyExc_ValueError, "put_joined: %zd keys but %zd views", n, PyTuple_GET_SIZE(views));
        goto done;
    }
    empty = PyBytes_FromStringAndSize(NULL, 0);
    if (empty == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        if (rows != Py_None && !views_stayed(rows, &PyTuple_GET_ITEM(views, 0), i, i + 1)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *build_args[3] = {head, key, PyTuple_GET_ITEM(views, i)};
        PyObject *record = PyObject_Vectorcall(joined, build_args, 3, NULL);
        if (record == NULL)
            goto done;
        PyObject *put_args[2] = {key, record};
        PyObject *done_put = PyObject_Vectorcall(put, put_args, 2, NULL);
        Py_DECREF(record);
        if (done_put == NULL)
            goto done;
        Py_DECREF(done_put);
        if (delete != Py_None) {
            PyObject *delete_args[3] = {key, empty, index};
            PyObject *deleted = PyObject_Vectorcall(delete, delete_args, 3, NULL);
            if (deleted == NULL)
                goto done;
            Py_DECREF(deleted);
        }
    }
    result = Py_NewRef(Py_True);
done:
    Py_DECREF(keys);
    Py_XDECREF(views);
    Py_XDECREF(empty);
    return result;
}

/* The row names interned for views_stayed (host_row_names_init: once). */
static host_row_names stay_names;

/* Whether view (a memoryview) starts where row (a new reference, or NULL) is now: 1 or 0 (no
   error kept: a row that cannot be asked is not where its view was). */
static int row_at_view(PyObject *row, PyObject *view)
{
    if (row == NULL || !PyMemoryView_Check(view)) {
        Py_XDECREF(row);
        PyErr_Clear();
        return 0;
    }
    int is = host_address_is(host_row_call(row, stay_names.data_ptr), (unsigned long long)(uintptr_t)PyMemoryView_GET_BUFFER(view)->buf);
    Py_DECREF(row);
    if (is < 0)
        PyErr_Clear();
    return is > 0;
}

/* The number of a pool's row i of a job (numbers: a range or a tuple of ints) into *n: 1, or 0
   where not known (no error kept). */
static int pool_number(PyObject *numbers, Py_ssize_t i, Py_ssize_t *n)
{
    if (PyTuple_CheckExact(numbers))
        return i < PyTuple_GET_SIZE(numbers) && host_pool_size(Py_NewRef(PyTuple_GET_ITEM(numbers, i)), n) > 0;
    int is = host_pool_size(PySequence_GetItem(numbers, i), n) > 0;
    PyErr_Clear();
    return is;
}

/* Whether views[first..end) of rows of one pool (a PoolRows) start where the pool's rows are now,
   the pool asked once (pool.data_ptr()), each row's place by its number (views taken as one
   pool, host_pool_view: a contiguous pool of rows of a view's length): 1; 0 where any is not so
   or not known (its rows are then asked one by one). */
static int pool_stayed(PyObject *rows, PyObject *const *views, Py_ssize_t first, Py_ssize_t end)
{
    PyObject *numbers = host_slot(rows, stay_names.numbers), *pool = numbers != NULL ? host_slot(rows, stay_names.pool) : NULL;
    unsigned long long base = 0;
    int is = pool != NULL;
    if (is) {
        PyObject *at = host_row_call(pool, stay_names.data_ptr);
        is = at != NULL && PyLong_CheckExact(at);
        base = is ? PyLong_AsUnsignedLongLong(at) : 0;
        Py_XDECREF(at);
        is = is && !PyErr_Occurred();
    }
    for (Py_ssize_t i = first; is && i < end; i++) {
        Py_ssize_t number;
        is = PyMemoryView_Check(views[i]) && pool_number(numbers, i, &number) && number >= 0;
        const Py_buffer *b = is ? PyMemoryView_GET_BUFFER(views[i]) : NULL;
        is = is && (unsigned long long)(uintptr_t)b->buf == base + (unsigned long long)number * (unsigned long long)b->len;
    }
    Py_XDECREF(numbers);
    Py_XDECREF(pool);
    PyErr_Clear();
    return is;
}

int views_stayed(PyObject *rows, PyObject *const *views, Py_ssize_t first, Py_ssize_t end)
{
    if (first >= end)
        return 1;
    if (host_row_names_init(&stay_names) < 0) {
        PyErr_Clear();
        return 0;
    }
    int pooled = host_pool_rows(rows, &stay_names);
    if (pooled && pool_stayed(rows, views, first, end))
        return 1;
    int listed = PyTuple_CheckExact(rows) || PyList_CheckExact(rows);
    if (!pooled && !listed && (first != 0 || end != 1))
        return 0; /* one row: a job of one */
    for (Py_ssize_t i = first; i < end; i++) {
        PyObject *row = pooled ? PySequence_GetItem(rows, i) /* (a pool the one-pool checks do not take) */
                        : listed ? (i < PySequence_Fast_GET_SIZE(rows) ? Py_NewRef(PySequence_Fast_GET_ITEM(rows, i)) : NULL)
                                 : Py_NewRef(rows);
        if (!row_at_view(row, views[i]))
            return 0;
    }
    return 1;
}

/* views_stayed(rows, views) -> bool: see _rowguard.h (the general path's and the tests' form). */
PyObject *py_views_stayed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "views_stayed() takes 2 arguments (rows, views), got %zd", nargs);
        return NULL;
    }
    PyObject *views = held(args[1]);
    if (views == NULL)
        return NULL;
    int is = views_stayed(args[0], &PyTuple_GET_ITEM(views, 0), 0, PyTuple_GET_SIZE(views));
    Py_DECREF(views);
    return PyBool_FromLong(is);
}
