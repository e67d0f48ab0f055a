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

/* The host_kept of a job's views taken as one pool, held by a capsule (what the copies ask the
   rows by again: views_stayed); its destructor lets the pool and its memory go. */
#define KEPT_CAPSULE "kvtier.backends._rowguard.kept"

static void kept_free(PyObject *capsule)
{
    host_kept *kept = PyCapsule_GetPointer(capsule, KEPT_CAPSULE);
    if (kept != NULL) {
        host_kept_drop(kept);
        PyMem_Free(kept);
    }
}

/* A capsule holding *kept (moved into it: *kept left empty), or NULL with the error set (*kept
   dropped). */
static PyObject *kept_capsule(host_kept *kept)
{
    host_kept *own = PyMem_Malloc(sizeof *own);
    PyObject *capsule = own == NULL ? NULL : PyCapsule_New(own, KEPT_CAPSULE, kept_free);
    if (capsule == NULL) {
        PyMem_Free(own);
        host_kept_drop(kept);
        return own == NULL ? PyErr_NoMemory() : NULL;
    }
    *own = *kept;
    *kept = HOST_KEPT_NONE;
    return capsule;
}

static PyObject *s_memory, *s_taken; /* HeldViews' slots, interned at the first held job_views */

/* obj.name = value (a new reference taken): the slot written straight where host_member_slot
   finds it, else setattr. 0, or -1 with the error set. */
static int slot_set(PyObject *obj, PyObject *name, PyObject *value)
{
    PyObject **slot = host_member_slot(obj, name);
    if (slot == NULL) {
        int rc = PyObject_SetAttr(obj, name, value);
        Py_DECREF(value);
        return rc;
    }
    Py_XSETREF(*slot, value);
    return 0;
}

/* held(views) with its memory and taken slots set to the capsule of kept (a new reference), or
   NULL with the error set; views (a list just made, no other reference) and kept released. A
   list subclass is made empty by its type's own allocation (no __init__ of its own runs for
   one: a list's items are given, not iterated) and given views' item array, views left empty. */
static PyObject *held_of(PyObject *held_type, PyObject *views, host_kept *kept)
{
    if (s_memory == NULL && ((s_memory = PyUnicode_InternFromString("memory")) == NULL || (s_taken = PyUnicode_InternFromString("taken")) == NULL)) {
        Py_DECREF(views);
        host_kept_drop(kept);
        return NULL;
    }
    PyObject *capsule = kept_capsule(kept), *got = NULL;
    if (capsule == NULL) {
        Py_DECREF(views);
        return NULL;
    }
    PyTypeObject *type = PyType_Check(held_type) ? (PyTypeObject *)held_type : NULL;
    if (type != NULL && PyType_IsSubtype(type, &PyList_Type) && type->tp_init == PyList_Type.tp_init && PyList_CheckExact(views)) {
        if ((got = type->tp_alloc(type, 0)) != NULL) {
            PyListObject *to = (PyListObject *)got, *from = (PyListObject *)views;
            to->ob_item = from->ob_item;
            to->allocated = from->allocated;
            Py_SET_SIZE(to, Py_SIZE(from));
            from->ob_item = NULL;
            from->allocated = 0;
            Py_SET_SIZE(from, 0);
        }
    } else
        got = PyObject_CallOneArg(held_type, views);
    Py_DECREF(views);
    if (got != NULL && (slot_set(got, s_memory, Py_NewRef(capsule)) < 0 || slot_set(got, s_taken, Py_NewRef(capsule)) < 0))
        Py_CLEAR(got);
    Py_DECREF(capsule);
    return got;
}

/* job_views(keys, rows, tensor_type, dtype, shape, views, key_bytes[, held]): each row's view, as
   lmdb_plain.job_views_python answers: None when the counts differ, a key is not bytes of
   key_bytes, or host_view(row, ...) is None (not such a row, or one not seen yet). held (a list
   subclass with memory and taken slots, lmdb_plain.HeldViews), where given and rows is a
   PoolRows: the views as held(views), both slots the capsule of what the pool's checks kept
   (host_kept: its memory held, the rows asked again by it: views_stayed). */
PyObject *py_job_views(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7 && nargs != 8) {
        PyErr_Format(PyExc_TypeError, "job_views() takes 7 or 8 arguments (keys, rows, tensor_type, dtype, shape, views, key_bytes[, held]), got %zd",
                     nargs);
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
    host_kept kept = HOST_KEPT_NONE;
    int keeping = nargs > 7 && host_pool_rows_type(args[1]);
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
    int rc = row_views(&PyTuple_GET_ITEM(keys, 0), rows, n, args + 2, key_bytes, ((PyListObject *)got)->ob_item, keeping ? &kept : NULL);
    if (rc <= 0) /* (row_views left no view in the list) */
        Py_SETREF(got, rc < 0 ? NULL : Py_NewRef(Py_None));
    else if (keeping)
        got = held_of(args[7], got, &kept);
done:
    host_kept_drop(&kept);
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

/* put_joined(put, delete, index, head, keys, views, joined[, taken]): for each key, in order,
   put(key, joined(head, key, view)) and, where delete is not None, delete(key, b"", index): as
   lmdb_plain.put_joined_python; True. ValueError when the counts differ, before any call; an
   error raised by a call propagates, with the keys before it put. taken (None: not asked): what
   the views were taken of, asked again before each build (views_stayed: the put before it, and
   the transaction's begin before the first, let the GIL go, in which another thread may move
   the rows); None where a row moved, its record not built, the keys before it put. */
PyObject *py_put_joined(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7 && nargs != 8) {
        PyErr_Format(PyExc_TypeError, "put_joined() takes 7 or 8 arguments (put, delete, index, head, keys, views, joined[, taken]), got %zd", nargs);
        return NULL;
    }
    PyObject *put = args[0], *delete = args[1], *index = args[2], *head = args[3], *joined = args[6], *taken = nargs > 7 ? args[7] : Py_None;
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
        if (taken != Py_None && !views_stayed(taken, &PyTuple_GET_ITEM(views, 0), i, i + 1)) {
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

/* What a job's views were taken of, asked again (host_rows_stayed, through rows_stayed):
   taken a capsule of host_kept (job_views' held form: the pool's address against where it was,
   one call) or the tuple (pool, address) its Python form keeps, a tuple or list of the rows, a
   PoolRows (its rows one by one, pool[n] each), or else the one row of a job of one. 1, or 0 (also where a row cannot be
   asked, or a view is not a memoryview: no error kept). */
int views_stayed(PyObject *taken, PyObject *const *views, Py_ssize_t first, Py_ssize_t end)
{
    if (first >= end)
        return 1;
    for (Py_ssize_t i = first; i < end; i++)
        if (!PyMemoryView_Check(views[i]))
            return 0;
    int is;
    if (PyCapsule_IsValid(taken, KEPT_CAPSULE)) {
        const host_kept *kept = PyCapsule_GetPointer(taken, KEPT_CAPSULE);
        is = kept->pool == NULL && (kept->items == NULL || PyTuple_GET_SIZE(kept->items) < end) ? 0 : rows_stayed(kept, NULL, views, first, end);
    }
    else if (PyTuple_CheckExact(taken) && PyTuple_GET_SIZE(taken) == 2 && PyLong_CheckExact(PyTuple_GET_ITEM(taken, 1))) {
        /* (pool, address): what the checks' Python form kept (lmdb_plain.held_views) */
        host_kept kept = {NULL, PyTuple_GET_ITEM(taken, 0), NULL, PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(taken, 1))};
        is = kept.base == (unsigned long long)-1 && PyErr_Occurred() ? -1 : rows_stayed(&kept, NULL, views, first, end);
    } else if (PyTuple_CheckExact(taken) || PyList_CheckExact(taken) || host_pool_rows_type(taken)) {
        PyObject *rows = held(taken); /* (a list's items as they are now; a PoolRows' rows made) */
        is = rows == NULL ? -1 : PyTuple_GET_SIZE(rows) >= end ? rows_stayed(NULL, &PyTuple_GET_ITEM(rows, 0), views, first, end) : 0;
        Py_XDECREF(rows);
    } else
        is = first == 0 && end == 1 ? rows_stayed(NULL, &taken, views, 0, 1) : 0;
    if (is < 0)
        PyErr_Clear(); /* a row that cannot be asked is not where its view was */
    return is > 0;
}

/* views_stayed(taken, views) -> bool: see _rowguard.h (the general path's and the tests' form). */
PyObject *py_views_stayed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "views_stayed() takes 2 arguments (taken, views), got %zd", nargs);
        return NULL;
    }
    PyObject *views = held(args[1]);
    if (views == NULL)
        return NULL;
    int is = views_stayed(args[0], &PyTuple_GET_ITEM(views, 0), 0, PyTuple_GET_SIZE(views));
    Py_DECREF(views);
    return PyBool_FromLong(is);
}
