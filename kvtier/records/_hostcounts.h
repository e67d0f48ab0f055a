/*
 * A tier's counters added to from several threads at once, none of the adds lost: one job's adds
 * (counters.name += by, for each pair) in one step. Shared by kvtier.records._xxcopy (its
 * counts_add, which the Python adds call, and the file tier's job read) and
 * kvtier.backends._rowguard (the lmdb tier's straight reads). Each source that includes it gets
 * its own static copy.
 *
 * Where counters' type reads and writes its attributes the generic way and each name is an int
 * slot of that type (host_member_slot), every sum is made and stored straight, the GIL held from
 * the first read to the last store: an exact int's add and the old int's release run no Python
 * code, so no other thread runs in between. Anything else (counters of a type with its own
 * __getattribute__ or __setattr__, a slot not holding an int, a build without the GIL) goes to
 * kvtier.records.counts.counts_add_python, which makes the adds holding one lock of the whole
 * process: every add to such counters, native or Python, takes that lock.
 */
#ifndef KVTIER_HOSTCOUNTS_H
#define KVTIER_HOSTCOUNTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_hostrow.h"

/* The pairs one call keeps on its stack (the counters of one backend are fewer); a call of more
   takes room for them from the heap and is added the same way. */
#define HOST_COUNTS_MAX 16

/* counts_add_python(counters, *pairs): the locked form, imported at its first use. ``call`` is
   its arguments: call[0] free for counters, then the n pairs. */
static inline int host_counts_locked(PyObject *counters, PyObject **call, Py_ssize_t n)
{
    static PyObject *locked;
    if (locked == NULL) {
        PyObject *module = PyImport_ImportModule("kvtier.records.counts");
        PyObject *found = module == NULL ? NULL : PyObject_GetAttrString(module, "counts_add_python");
        Py_XDECREF(module);
        if (found == NULL)
            return -1;
        if (locked == NULL) /* (the import may let another thread take it first) */
            locked = found;
        else
            Py_DECREF(found);
    }
    call[0] = counters;
    PyObject *done = PyObject_Vectorcall(locked, call, (size_t)(1 + 2 * n), NULL);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* counters.pairs[2i] += pairs[2i + 1] for each of the n pairs (names and ints, as the Python
   call gives them), as one step against every other add made this way. 0, or -1 with the error
   set: TypeError for a value that is not an int (nothing added), what getattr or setattr raise
   for a name counters has not. */
static inline int host_counts_add(PyObject *counters, PyObject *const *pairs, Py_ssize_t n)
{
    PyObject *call_kept[1 + 2 * HOST_COUNTS_MAX], **call = call_kept, **items, ***slots, **slots_kept[HOST_COUNTS_MAX];
    if (n > HOST_COUNTS_MAX) { /* (a count past any counters' own: no overflow in the sizes) */
        call = n < PY_SSIZE_T_MAX / (Py_ssize_t)(4 * sizeof(PyObject *)) ? PyMem_Malloc((size_t)(1 + 2 * n) * sizeof(PyObject *)) : NULL;
        slots = call == NULL ? NULL : PyMem_Malloc((size_t)n * sizeof(PyObject **));
        if (slots == NULL) {
            PyMem_Free(call);
            PyErr_NoMemory();
            return -1;
        }
    }
    else
        slots = slots_kept;
    items = call + 1; /* the pairs, their values made ints; call[0]: the locked form's counters */
    Py_ssize_t got = 0;
    int rc = 0, straight = 1;
    for (; got < n; got++) { /* the values made ints first: __index__ may run Python code */
        PyObject *by = pairs[2 * got + 1];
        items[2 * got] = pairs[2 * got];
        if ((items[2 * got + 1] = PyLong_CheckExact(by) ? Py_NewRef(by) : PyNumber_Index(by)) == NULL) {
            rc = -1;
            goto done;
        }
    }
#ifdef Py_GIL_DISABLED
    straight = 0;
#endif
    for (Py_ssize_t i = 0; straight && i < n; i++) {
        PyObject *name = items[2 * i];
        slots[i] = PyUnicode_CheckExact(name) ? host_member_slot(counters, name) : NULL;
        straight = slots[i] != NULL && *slots[i] != NULL && PyLong_CheckExact(*slots[i]);
    }
    if (!straight) {
        rc = host_counts_locked(counters, call, n);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* no Python code from here to the last store */
        PyObject *sum = PyNumber_Add(*slots[i], items[2 * i + 1]);
        if (sum == NULL) {
            rc = -1;
            break;
        }
        Py_SETREF(*slots[i], sum);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        Py_DECREF(items[2 * i + 1]);
    if (call != call_kept) {
        PyMem_Free(call);
        PyMem_Free(slots);
    }
    return rc;
}

/* host_counts_add of names[i] by counts[i] (C counts), for the native reads. */
static inline int host_counts_add_n(PyObject *counters, PyObject *const *names, const Py_ssize_t *counts, Py_ssize_t n)
{
    PyObject *pairs[2 * HOST_COUNTS_MAX];
    Py_ssize_t made = 0;
    int rc = n > HOST_COUNTS_MAX ? (PyErr_SetString(PyExc_TypeError, "counts_add: too many counters"), -1) : 0;
    for (; rc == 0 && made < n; made++) {
        pairs[2 * made] = names[made];
        if ((pairs[2 * made + 1] = PyLong_FromSsize_t(counts[made])) == NULL)
            rc = -1;
    }
    if (rc == 0)
        rc = host_counts_add(counters, pairs, n);
    for (Py_ssize_t i = 0; i < made; i++)
        Py_XDECREF(pairs[2 * i + 1]);
    return rc;
}

#endif
