/*
 * A destination row's checks and its kept view, as kvtier.backends.lmdb_plain.host_view makes
 * them: shared by the two extensions that check rows natively, kvtier.backends._rowguard (the
 * lmdb tier's straight reads) and kvtier.records._xxcopy (the file tier's job read, _xxjob.c).
 * Each includes this header once; its functions are static to that source. A job's rows given
 * as one pool (kvtier.pool_rows.PoolRows) are checked once a job, the pool's checks, each row
 * found by its address (host_job_views).
 */
#ifndef KVTIER_HOSTROW_H
#define KVTIER_HOSTROW_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "_hostkept.h"

/* The attribute names a row's checks ask for, interned once (host_row_names_init), and the
   class of a job's rows given as one pool (kvtier.pool_rows.PoolRows; None where it cannot be
   imported: then no job's rows are taken as one). */
typedef struct {
    PyObject *dtype, *shape, *is_cpu, *is_contiguous, *data_ptr, *pool, *numbers, *itemsize, *start, *step, *untyped_storage, *ndim, *nbytes,
        *pool_rows;
} host_row_names;

/* 0 with every name interned and the class imported (again a no-op), or -1 with the error set. */
static inline int host_row_names_init(host_row_names *names)
{
    if (names->pool_rows != NULL)
        return 0;
    PyObject **slots[] = {&names->dtype, &names->shape, &names->is_cpu, &names->is_contiguous, &names->data_ptr, &names->pool, &names->numbers,
                          &names->itemsize, &names->start, &names->step, &names->untyped_storage, &names->ndim, &names->nbytes};
    const char *texts[] = {"dtype", "shape", "is_cpu", "is_contiguous", "data_ptr", "pool", "numbers", "itemsize", "start", "step", "untyped_storage",
                           "ndim", "nbytes"};
    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++)
        if (*slots[i] == NULL && (*slots[i] = PyUnicode_InternFromString(texts[i])) == NULL)
            return -1;
    PyObject *module = PyImport_ImportModule("kvtier.pool_rows");
    PyObject *type = module == NULL ? NULL : PyObject_GetAttrString(module, "PoolRows");
    Py_XDECREF(module);
    if (type == NULL || !PyType_Check(type)) {
        Py_XDECREF(type);
        PyErr_Clear(); /* no such class: every job's rows are checked one by one */
        type = Py_NewRef(Py_None);
    }
    names->pool_rows = type;
    return 0;
}

/* row.name, asked of the descriptor that row's type holds for it where that is a C getter: the
   getter called straight (no lookup of the row's own dict, as the generic lookup makes for a
   method, and no bound method made). What a generic lookup answers for any other descriptor. */
static inline PyObject *host_row_get(PyObject *row, PyObject *name)
{
    PyObject *described = _PyType_Lookup(Py_TYPE(row), name); /* borrowed; the type's method cache */
    if (described != NULL && Py_IS_TYPE(described, &PyGetSetDescr_Type))
        return Py_TYPE(described)->tp_descr_get(described, row, (PyObject *)Py_TYPE(row));
    return PyObject_GetAttr(row, name);
}

/* row.name(), likewise: a C method of row's type called straight. */
static inline PyObject *host_row_call(PyObject *row, PyObject *name)
{
    PyObject *described = _PyType_Lookup(Py_TYPE(row), name); /* borrowed; the type's method cache */
    if (described != NULL && Py_IS_TYPE(described, &PyMethodDescr_Type)) {
        Py_INCREF(described); /* held across the call */
        PyObject *got = PyObject_Vectorcall(described, &row, 1, NULL);
        Py_DECREF(described);
        return got;
    }
    return PyObject_CallMethodNoArgs(row, name);
}

/* Whether v (a new reference, or NULL with an error set) is true: 1, 0, or -1; v released. */
static inline int host_row_truth(PyObject *v)
{
    if (v == NULL)
        return -1;
    int is = PyObject_IsTrue(v);
    Py_DECREF(v);
    return is;
}

/* views[at] (at: a new reference, released; NULL: an error set), a new reference: the kept view,
   None where views holds none at that address, or NULL with the error set. */
static inline PyObject *host_view_at(PyObject *views, PyObject *at)
{
    if (at == NULL)
        return NULL;
    PyObject *view = PyDict_GetItemWithError(views, at); /* borrowed: owned before anything else runs */
    Py_XINCREF(view);
    Py_DECREF(at);
    if (view == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    return view;
}

static inline int host_shape_is(PyObject *t, PyObject *shape, PyObject *dtype, const host_row_names *names);

/* views[row.data_ptr()] when type(row) is tensor_type, row.dtype is dtype, row.shape == shape,
   row.is_cpu and row.is_contiguous(); None when any of them is not so or the address is not in
   views (a dict). Asked in that order, as the Python form asks them, each of the C getter or
   method tensor_type holds for it (a row's own dict, which no tensor's C code reads, is not
   asked); an error raised by one of them propagates (NULL). A new reference. */
static inline PyObject *host_row_view(PyObject *row, PyObject *tensor_type, PyObject *dtype, PyObject *shape, PyObject *views,
                                      const host_row_names *names)
{
    if ((PyObject *)Py_TYPE(row) != tensor_type)
        Py_RETURN_NONE;
    PyObject *v = host_row_get(row, names->dtype);
    if (v == NULL)
        return NULL;
    int ok = v == dtype;
    Py_DECREF(v);
    if (!ok)
        Py_RETURN_NONE;
    ok = host_shape_is(row, shape, dtype, names);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    ok = host_row_truth(host_row_get(row, names->is_cpu));
    if (ok > 0)
        ok = host_row_truth(host_row_call(row, names->is_contiguous));
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    return host_view_at(views, host_row_call(row, names->data_ptr));
}

/* A job's rows given as one pool (kvtier.pool_rows.PoolRows: rows[i] is pool[numbers[i]]),
   the pool's checks asked once: what host_pool_take found, held until host_pool_drop. */
typedef struct {
    PyObject *pool, *numbers, *storage; /* held (storage: pool.untyped_storage(), its memory as checked) */
    unsigned long long base;  /* pool.data_ptr() */
    Py_ssize_t rows, row_bytes, count, start, step;
    int ranged; /* numbers a range (start, step), else a tuple of ints */
} host_pool;

static inline void host_pool_drop(host_pool *p)
{
    Py_CLEAR(p->pool);
    Py_CLEAR(p->numbers);
    Py_CLEAR(p->storage);
}

/* Whether type(rows) is the PoolRows class (exactly: a subclass may answer its rows otherwise). */
static inline int host_pool_rows(PyObject *rows, const host_row_names *names)
{
    return (PyObject *)Py_TYPE(rows) == names->pool_rows;
}

/* v (a new reference, or NULL with an error set) as a Py_ssize_t into *to: 1, 0 where it is not
   an int or does not fit (no error kept), -1 with an error set; v released. */
static inline int host_pool_size(PyObject *v, Py_ssize_t *to)
{
    if (v == NULL)
        return -1;
    int ok = PyLong_CheckExact(v);
    *to = ok ? PyLong_AsSsize_t(v) : -1;
    Py_DECREF(v);
    if (ok && *to == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        ok = 0;
    }
    return ok;
}

/* The last dtype asked for its itemsize (held: its identity stays its own) and the answer. */
static PyObject *host_sized_dtype;
static Py_ssize_t host_sized_itemsize;

/* dtype.itemsize into *itemsize, asked once for the dtype asked last: 1, 0 where it is not an
   int (or does not fit), -1 with an error set. */
static inline int host_dtype_itemsize(PyObject *dtype, const host_row_names *names, Py_ssize_t *itemsize)
{
    if (dtype == host_sized_dtype) {
        *itemsize = host_sized_itemsize;
        return 1;
    }
    int ok = host_pool_size(PyObject_GetAttr(dtype, names->itemsize), itemsize);
    if (ok > 0) {
        Py_XSETREF(host_sized_dtype, Py_NewRef(dtype));
        host_sized_itemsize = *itemsize;
    }
    return ok;
}

/* Where shape is a tuple of one int (a row's shape, as the tiers give it) and dtype's itemsize
   is known: 1 with *width (that int) and *itemsize set; else 0 (no error kept). */
static inline int host_row_width(PyObject *shape, PyObject *dtype, const host_row_names *names, Py_ssize_t *width, Py_ssize_t *itemsize)
{
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != 1 || host_pool_size(Py_NewRef(PyTuple_GET_ITEM(shape, 0)), width) <= 0 || *width < 0) {
        PyErr_Clear();
        return 0;
    }
    if (host_dtype_itemsize(dtype, names, itemsize) <= 0 || *itemsize <= 0 || *width > PY_SSIZE_T_MAX / *itemsize) {
        PyErr_Clear(); /* (dtype.itemsize not an int: the shape getter answers) */
        return 0;
    }
    return 1;
}

/* Whether t's type holds a C getter for name (what host_row_get then calls straight). */
static inline int host_c_getter(PyObject *t, PyObject *name)
{
    PyObject *described = _PyType_Lookup(Py_TYPE(t), name); /* borrowed; the type's method cache */
    return described != NULL && Py_IS_TYPE(described, &PyGetSetDescr_Type);
}

/* Whether t.shape == shape (t a tensor of dtype, its type's C getters asked): 1, 0, or -1 with
   the error set. Where shape is a row's (host_row_width) and t's type holds C getters for shape,
   ndim and nbytes, asked as t.ndim == 1 and t.nbytes == width * itemsize, the same answer
   (nbytes is numel times dtype's itemsize) without the shape getter, which builds a torch.Size;
   else the shapes compared (a shape of a subclass's own is asked as before). */
static inline int host_shape_is(PyObject *t, PyObject *shape, PyObject *dtype, const host_row_names *names)
{
    Py_ssize_t width, itemsize, ndim, nbytes;
    if (host_c_getter(t, names->shape) && host_c_getter(t, names->ndim) && host_c_getter(t, names->nbytes)
        && host_row_width(shape, dtype, names, &width, &itemsize)) {
        int ok = host_pool_size(host_row_get(t, names->ndim), &ndim);
        if (ok > 0 && ndim != 1)
            return 0;
        if (ok > 0)
            ok = host_pool_size(host_row_get(t, names->nbytes), &nbytes);
        if (ok != 0)
            return ok < 0 ? -1 : nbytes == width * itemsize;
    }
    PyObject *v = host_row_get(t, names->shape);
    if (v == NULL)
        return -1;
    int same = PyObject_RichCompareBool(v, shape, Py_EQ);
    Py_DECREF(v);
    return same;
}

/* The slot of obj that obj's type's descriptor for name reads and writes, where that is a
   writable object member (a __slots__ entry: what getattr and setattr of name then use too, a
   data descriptor coming before any instance dict) of obj's own type; NULL where it is anything
   else (a descriptor of another class set on it, whose offset is another layout's), or where
   obj's type reads or writes its attributes by code of its own (__getattribute__, __getattr__,
   __setattr__: what getattr and setattr would then run). */
static inline PyObject **host_member_slot(PyObject *obj, PyObject *name)
{
    PyTypeObject *type = Py_TYPE(obj);
    if (type->tp_getattro != PyObject_GenericGetAttr || type->tp_setattro != PyObject_GenericSetAttr)
        return NULL;
    PyObject *described = _PyType_Lookup(type, name); /* borrowed; the type's method cache */
    if (described == NULL || !Py_IS_TYPE(described, &PyMemberDescr_Type))
        return NULL;
    const PyMemberDef *member = ((PyMemberDescrObject *)described)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & READONLY) || ((PyDescrObject *)described)->d_type != type)
        return NULL;
    return (PyObject **)((char *)obj + member->offset);
}

/* obj.name, a new reference (NULL with the error set): the slot read straight where
   host_member_slot finds it (and it is set), else getattr. */
static inline PyObject *host_slot(PyObject *obj, PyObject *name)
{
    PyObject **slot = host_member_slot(obj, name);
    if (slot != NULL && *slot != NULL)
        return Py_NewRef(*slot);
    return PyObject_GetAttr(obj, name);
}

/* CPython's range object as Objects/rangeobject.c lays it out (the same since 3.2), read straight
   where the type's size is this struct's: start, step and length without three attribute calls. */
typedef struct {
    PyObject_HEAD
    PyObject *start, *stop, *step, *length;
} host_range;

/* The checks of a job's rows given as one pool (host_pool_rows(rows)), asked once of the pool
   as it is now, each of the C getter or method tensor_type holds for it: type(pool) is
   tensor_type, pool.dtype is dtype, pool.shape is 2-D and pool.shape[1:] == shape (a row's
   shape), pool.is_cpu, pool.is_contiguous(); then pool.data_ptr() and the row count
   pool.shape[0]. numbers a range or a tuple of ints. 1 with *p filled (pool and numbers held:
   host_pool_drop); 0 where any of these is not so (nothing held: the caller checks the rows one
   by one, as a list of pool[n] each); -1 with the error set (nothing held). */
static inline int host_pool_take(PyObject *rows, PyObject *tensor_type, PyObject *dtype, PyObject *shape, const host_row_names *names,
                                 host_pool *p)
{
    p->pool = p->numbers = p->storage = NULL;
    PyObject *pool = host_slot(rows, names->pool), *v = NULL;
    if (pool == NULL)
        return -1;
    p->pool = pool;
    int ok = (PyObject *)Py_TYPE(pool) == tensor_type && PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == 1;
    if (ok) {
        v = host_row_get(pool, names->dtype);
        if (v == NULL)
            goto failed;
        ok = v == dtype;
        Py_DECREF(v);
    }
    if (ok) {
        v = host_row_get(pool, names->shape);
        if (v == NULL)
            goto failed;
        ok = PyTuple_Check(v) && PyTuple_GET_SIZE(v) == 2;
        int same = ok ? PyObject_RichCompareBool(PyTuple_GET_ITEM(v, 1), PyTuple_GET_ITEM(shape, 0), Py_EQ) : 0;
        if (same > 0)
            ok = host_pool_size(Py_NewRef(PyTuple_GET_ITEM(v, 0)), &p->rows) > 0 && host_pool_size(Py_NewRef(PyTuple_GET_ITEM(v, 1)), &p->row_bytes) > 0;
        Py_DECREF(v);
        if (same < 0 || PyErr_Occurred())
            goto failed;
        ok = ok && same;
    }
    if (ok && (ok = host_row_truth(host_row_get(pool, names->is_cpu))) > 0)
        ok = host_row_truth(host_row_call(pool, names->is_contiguous));
    if (ok < 0)
        goto failed;
    Py_ssize_t itemsize = 0;
    if (ok && (ok = host_dtype_itemsize(dtype, names, &itemsize)) > 0) {
        v = host_row_call(pool, names->data_ptr);
        if (v == NULL)
            goto failed;
        ok = PyLong_CheckExact(v);
        p->base = ok ? PyLong_AsUnsignedLongLong(v) : 0;
        Py_DECREF(v);
        if (PyErr_Occurred())
            goto failed;
        /* The memory at that address held for the job: a pool moved meanwhile (pool.set_(...)
           from another thread while the job's copies let the GIL go) leaves it to this job, not
           to the allocator (as a list of views of the pool's rows holds it). */
        if (ok && (p->storage = host_row_call(pool, names->untyped_storage)) == NULL)
            goto failed;
    }
    if (ok < 0)
        goto failed;
    if (!ok || p->rows < 0 || itemsize <= 0 || p->row_bytes < 0 || p->row_bytes > PY_SSIZE_T_MAX / itemsize)
        goto other;
    p->row_bytes *= itemsize;
    /* The row numbers: a range (start and step) or a tuple of ints, as they are now. */
    PyObject *numbers = host_slot(rows, names->numbers);
    if (numbers == NULL)
        goto failed;
    p->numbers = numbers;
    p->ranged = PyRange_Check(numbers);
    if (p->ranged && PyRange_Type.tp_basicsize == (Py_ssize_t)sizeof(host_range)) {
        const host_range *range = (const host_range *)numbers; /* (its fields exact ints) */
        if ((ok = host_pool_size(Py_NewRef(range->start), &p->start)) > 0)
            ok = host_pool_size(Py_NewRef(range->step), &p->step);
        if (ok > 0 && (ok = host_pool_size(Py_NewRef(range->length), &p->count)) == 0)
            p->count = 0; /* (more than a Py_ssize_t holds: not such a job) */
        if (ok < 0)
            goto failed;
    } else if (p->ranged) {
        if ((ok = host_pool_size(PyObject_GetAttr(numbers, names->start), &p->start)) > 0)
            ok = host_pool_size(PyObject_GetAttr(numbers, names->step), &p->step);
        if (ok < 0)
            goto failed;
        p->count = ok ? PyObject_Length(numbers) : 0;
        if (p->count < 0) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                goto failed;
            PyErr_Clear();
            ok = 0;
        }
    } else if ((ok = PyTuple_CheckExact(numbers))) {
        p->count = PyTuple_GET_SIZE(numbers);
        for (Py_ssize_t i = 0; ok && i < p->count; i++)
            ok = PyLong_CheckExact(PyTuple_GET_ITEM(numbers, i));
    }
    if (ok)
        return 1;
other:
    host_pool_drop(p);
    return 0;
failed:
    host_pool_drop(p);
    return -1;
}

/* The address of row i of the job (pool's row numbers[i]) into *at: 1, or 0 where that number is
   not one of the pool's rows now (not in [0, rows)). */
static inline int host_pool_at(const host_pool *p, Py_ssize_t i, unsigned long long *at)
{
    Py_ssize_t row;
    if (p->ranged) {
        /* start + i * step, overflow checked: a number outside [0, rows) is not a row */
        long long lo = (long long)p->start, by = (long long)p->step, n = (long long)i, got;
        if (__builtin_mul_overflow(n, by, &got) || __builtin_add_overflow(lo, got, &got))
            return 0;
        row = got < 0 || got >= (long long)p->rows ? -1 : (Py_ssize_t)got;
    } else {
        PyObject *number = PyTuple_GET_ITEM(p->numbers, i);
        row = PyLong_AsSsize_t(number);
        if (row == -1 && PyErr_Occurred())
            PyErr_Clear(); /* too large either way: not a row */
        if (row >= p->rows)
            row = -1;
    }
    if (row < 0)
        return 0;
    *at = p->base + (unsigned long long)row * (unsigned long long)p->row_bytes;
    return 1;
}

/* views[address of row i] of a job's rows as one pool (host_pool_take): a new reference to the
   kept view, or None where row i is not one of the pool's rows now or views holds no view at
   its address (not seen yet); NULL with the error set. */
static inline PyObject *host_pool_view(const host_pool *p, Py_ssize_t i, PyObject *views)
{
    unsigned long long at;
    if (!host_pool_at(p, i, &at))
        Py_RETURN_NONE;
    return host_view_at(views, PyLong_FromUnsignedLongLong(at));
}

/* Each row's kept view for a job of n keys, each key bytes of key_bytes: 1 with views[0..n)
   set (new references); 0 where a key is not so, or a row's view is None; -1 with the error
   set; on 0 and -1 no view is kept. rows: the job's rows, a tuple, or a PoolRows (exact type)
   whose pool's checks are asked once (host_pool_take) and each row's view found by its address
   (host_pool_view); where its pool is not one those checks take, its rows one by one (a tuple
   of iter(rows)), as a list of pool[n] each. Each row one by one: host_row_view of it, each
   key's check before its row's. kept (NULL: not asked): on 1, where the rows were taken as one
   pool, the pool's storage, the pool and its address (_hostkept.h; the caller holds them until
   its last copy: host_kept_drop); else left empty. */
static inline int host_job_views(PyObject *const *keys, Py_ssize_t n, PyObject *rows, PyObject *tensor_type, PyObject *dtype, PyObject *shape,
                                 PyObject *views_dict, Py_ssize_t key_bytes, const host_row_names *names, PyObject **views, host_kept *kept)
{
    if (kept != NULL)
        *kept = HOST_KEPT_NONE;
    Py_ssize_t got = 0;
    int rc = 0;
    PyObject *items = NULL;
    host_pool p = {0};
    int pooled = 0;
    if (host_pool_rows(rows, names)) {
        pooled = host_pool_take(rows, tensor_type, dtype, shape, names, &p);
        if (pooled < 0)
            return -1;
        if (pooled && p.count != n) {
            host_pool_drop(&p);
            return 0;
        }
        if (!pooled && (items = PySequence_Tuple(rows)) == NULL)
            return -1;
    } else
        items = Py_NewRef(rows);
    if (!pooled && (!PyTuple_CheckExact(items) || PyTuple_GET_SIZE(items) != n))
        goto done; /* (rows changed meanwhile: not such a job) */
    for (; got < n; got++) {
        if (!PyBytes_CheckExact(keys[got]) || PyBytes_GET_SIZE(keys[got]) != key_bytes)
            goto done;
        PyObject *view = pooled ? host_pool_view(&p, got, views_dict)
                                : host_row_view(PyTuple_GET_ITEM(items, got), tensor_type, dtype, shape, views_dict, names);
        if (view == NULL || view == Py_None) {
            rc = view == NULL ? -1 : 0;
            Py_XDECREF(view);
            goto done;
        }
        views[got] = view;
    }
    rc = 1;
    if (pooled && kept != NULL) {
        *kept = (host_kept){p.storage, p.pool, NULL, p.base};
        p.storage = p.pool = NULL;
    } else if (items != rows && kept != NULL)
        kept->items = Py_NewRef(items); /* (a PoolRows' rows, checked one by one) */
done:
    if (rc != 1)
        for (Py_ssize_t i = 0; i < got; i++)
            Py_CLEAR(views[i]);
    host_pool_drop(&p);
    Py_XDECREF(items);
    return rc;
}

/* Whether v (a new reference, or NULL with an error set) is the address at: 1, 0 (also where
   v is not an int that fits), -1; v released. */
static inline int host_address_is(PyObject *v, unsigned long long at)
{
    if (v == NULL)
        return -1;
    unsigned long long got = PyLong_CheckExact(v) ? PyLong_AsUnsignedLongLong(v) : 0;
    Py_DECREF(v);
    if (got == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* not an address: not where it was */
        return 0;
    }
    return got == at;
}

/* Whether a job's rows are still where host_job_views took their views, asked again after a
   step that let the GIL go: another thread may have moved them meanwhile (pool.resize_ to more
   rows reallocates the pool's memory and frees the old, which no hold keeps). 1 where they are,
   0 where any moved, -1 with an error set. Rows taken as one pool (kept->pool): the pool's
   address against kept->base, one call; else each of rows[first..end) (the rows the views were
   taken of, each a tensor whose checks passed; kept->items' where set) by its address against
   its view's (views: the memoryviews host_job_views gave). */
static inline int host_rows_stayed(const host_kept *kept, PyObject *const *rows, PyObject *const *views, Py_ssize_t first, Py_ssize_t end,
                                   const host_row_names *names)
{
    if (kept != NULL && kept->pool != NULL)
        return host_address_is(host_row_call(kept->pool, names->data_ptr), kept->base);
    if (kept != NULL && kept->items != NULL)
        rows = &PyTuple_GET_ITEM(kept->items, 0);
    for (Py_ssize_t i = first; i < end; i++) {
        int is = host_address_is(host_row_call(rows[i], names->data_ptr), (unsigned long long)(uintptr_t)PyMemoryView_GET_BUFFER(views[i])->buf);
        if (is <= 0)
            return is;
    }
    return 1;
}

/* Automatic garbage collection held off while a job's rows' views are in use: from the first
   row's checks to the last copy into (or out of) a view. A view is a row's address, taken once
   its checks passed, and holds nothing; a collection run meanwhile (a later row's checks or the
   job's own objects allocate) runs finalizers and weakref callbacks, Python that may free or
   move a row whose view is taken (row.set_(...)), and the copy then writes or reads memory the
   row no longer owns. Counted for the whole process (kvtier.records._xxcopy keeps the count,
   under the GIL; the lmdb tier's extension takes it through this capsule): the last of the
   jobs held lets collection go again where it was on before the first. A collection asked for
   explicitly (gc.collect()) still runs. */
typedef struct {
    void (*hold)(void);
    void (*let_go)(void);
} host_rows_hold_api;
#define HOST_ROWS_HOLD_CAPSULE "kvtier.records._xxcopy.rows_hold_c"

#endif
