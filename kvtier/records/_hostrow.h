/*
 * A destination row's checks and its kept view, as kvtier.backends.lmdb_plain.host_view makes
 * them: shared by the two extensions that check rows natively, kvtier.backends._rowguard (the
 * lmdb tier's straight reads) and kvtier.records._xxcopy (the file tier's job read, _xxjob.c).
 * Each includes this header once; its functions are static to that source.
 */
#ifndef KVTIER_HOSTROW_H
#define KVTIER_HOSTROW_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The attribute names a row's checks ask for, interned once (host_row_names_init). */
typedef struct {
    PyObject *dtype, *shape, *is_cpu, *is_contiguous, *data_ptr;
} host_row_names;

/* 0 with every name interned (again a no-op), or -1 with the error set. */
static inline int host_row_names_init(host_row_names *names)
{
    if (names->data_ptr != NULL)
        return 0;
    PyObject **slots[] = {&names->dtype, &names->shape, &names->is_cpu, &names->is_contiguous, &names->data_ptr};
    const char *texts[] = {"dtype", "shape", "is_cpu", "is_contiguous", "data_ptr"};
    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++)
        if (*slots[i] == NULL && (*slots[i] = PyUnicode_InternFromString(texts[i])) == NULL)
            return -1;
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
    v = host_row_get(row, names->shape);
    if (v == NULL)
        return NULL;
    int differ = PyObject_RichCompareBool(v, shape, Py_NE);
    Py_DECREF(v);
    if (differ != 0)
        return differ < 0 ? NULL : Py_NewRef(Py_None);
    ok = host_row_truth(host_row_get(row, names->is_cpu));
    if (ok > 0)
        ok = host_row_truth(host_row_call(row, names->is_contiguous));
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *at = host_row_call(row, names->data_ptr);
    if (at == NULL)
        return NULL;
    PyObject *view = PyDict_GetItemWithError(views, at); /* borrowed: owned before anything else runs */
    Py_XINCREF(view);
    Py_DECREF(at);
    if (view == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    return view;
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
