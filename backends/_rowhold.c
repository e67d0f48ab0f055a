/*
 * kvtier.backends._rowguard's rows' hold (../kvtier/records/_hostrow.h): its native jobs hold
 * automatic garbage collection off through kvtier.records._xxcopy's count (the capsule
 * rows_hold_c, taken at import); where that extension is not built, through
 * kvtier.records.xxcopy's Python count (rows_hold_python, rows_let_go_python), the one its
 * Python callers keep: two counts would let one of them turn collection on again while the
 * other still holds it. A count of this module's own only where neither can be had.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_rowguard.h"
#include "../kvtier/records/_hostrow.h"

static const host_rows_hold_api *held_api;
static PyObject *python_hold, *python_let_go;
static Py_ssize_t own_holds;
static int own_collecting_before;

/* fn() with whatever exception is set kept as it is (a hold is let go on error paths too); an
   error of its own is reported as unraisable, never raised into the job. */
static void call_count(PyObject *fn)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *r = PyObject_CallNoArgs(fn);
    if (r == NULL)
        PyErr_WriteUnraisable(fn);
    Py_XDECREF(r);
    PyErr_Restore(type, value, traceback);
}

void rows_hold(void)
{
    if (held_api != NULL)
        held_api->hold();
    else if (python_hold != NULL)
        call_count(python_hold);
    else if (own_holds++ == 0)
        own_collecting_before = PyGC_Disable();
}

void rows_let_go(void)
{
    if (held_api != NULL)
        held_api->let_go();
    else if (python_let_go != NULL)
        call_count(python_let_go);
    else if (own_holds > 0 && --own_holds == 0 && own_collecting_before)
        PyGC_Enable();
}

/* held_api, else python_hold and python_let_go, else neither (this module's own count). */
void take_rows_hold(void)
{
    held_api = PyCapsule_Import(HOST_ROWS_HOLD_CAPSULE, 0);
    if (held_api != NULL)
        return;
    PyErr_Clear(); /* _xxcopy not built */
    PyObject *xxcopy = PyImport_ImportModule("kvtier.records.xxcopy");
    if (xxcopy != NULL) {
        python_hold = PyObject_GetAttrString(xxcopy, "rows_hold_python");
        python_let_go = python_hold == NULL ? NULL : PyObject_GetAttrString(xxcopy, "rows_let_go_python");
        Py_DECREF(xxcopy);
    }
    if (python_let_go == NULL) {
        PyErr_Clear();
        Py_CLEAR(python_hold);
    }
}
