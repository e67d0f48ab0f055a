/*
 * kvtier.records._xxcopy's rows' hold (host_rows_hold_api, _hostrow.h): automatic garbage
 * collection held off from a job's first row view to its last copy, counted for the whole
 * process. This extension's own jobs (_xxjob.c) take it as xxc_rows_hold/xxc_rows_let_go, the
 * lmdb tier's extension through the capsule rows_hold_c, Python through rows_hold() and
 * rows_let_go() (kvtier.records.xxcopy).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_hostrow.h"
#include "_xxh3.h"

/* The jobs held now, and whether automatic collection was on before the first of them. Changed
   only with the GIL held. */
static Py_ssize_t rows_held;
static int collecting_before;

XXC_INTERNAL void xxc_rows_hold(void)
{
    if (rows_held++ == 0)
        collecting_before = PyGC_Disable();
}

XXC_INTERNAL void xxc_rows_let_go(void)
{
    if (rows_held > 0 && --rows_held == 0 && collecting_before)
        PyGC_Enable();
}

static PyObject *py_rows_hold(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    xxc_rows_hold();
    Py_RETURN_NONE;
}

static PyObject *py_rows_let_go(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    xxc_rows_let_go();
    Py_RETURN_NONE;
}

/* rows_forked(): in a child just forked, the holds of the parent's other threads (jobs that do not
   go on here) dropped, and collection on again where it was before the first. */
static PyObject *py_rows_forked(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    if (rows_held > 0) {
        rows_held = 0;
        if (collecting_before)
            PyGC_Enable();
    }
    Py_RETURN_NONE;
}

static const host_rows_hold_api hold_api = {xxc_rows_hold, xxc_rows_let_go};

static PyMethodDef hold_methods[] = {
    {"rows_hold", py_rows_hold, METH_NOARGS, "rows_hold(): automatic garbage collection held off, counted (see _hostrow.h)."},
    {"rows_let_go", py_rows_let_go, METH_NOARGS, "rows_let_go(): one rows_hold() ended; the last lets collection go again."},
    {"rows_forked", py_rows_forked, METH_NOARGS, "rows_forked(): in a child just forked, every hold dropped (collection as before the first)."},
    {NULL, NULL, 0, NULL},
};

XXC_INTERNAL int xxc_add_rows_hold(PyObject *module)
{
    PyObject *capsule = PyCapsule_New((void *)&hold_api, HOST_ROWS_HOLD_CAPSULE, NULL);
    int added = capsule == NULL ? -1 : PyModule_AddObjectRef(module, "rows_hold_c", capsule);
    Py_XDECREF(capsule);
    return added < 0 ? -1 : PyModule_AddFunctions(module, hold_methods);
}
