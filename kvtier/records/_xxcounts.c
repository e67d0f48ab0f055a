/*
 * kvtier.records._xxcopy's counts_add: a job's adds to a tier's counters in one call, none lost
 * to another thread's add (_hostcounts.h says how). kvtier.records.counts hands it out.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_hostcounts.h"
#include "_xxh3.h"

/* counts_add(counters, name, by, ...) -> None (see methods). */
static PyObject *py_counts_add(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 1 || nargs % 2 != 1) {
        PyErr_Format(PyExc_TypeError, "counts_add(counters, name, by, ...): expected the counters then name and value pairs, got %zd arguments",
                     nargs);
        return NULL;
    }
    if (host_counts_add(args[0], args + 1, nargs / 2) < 0)
        return NULL;
    Py_RETURN_NONE;
}

XXC_INTERNAL PyMethodDef xxc_counts_methods[] = {
    {"counts_add", (PyCFunction)(void (*)(void))py_counts_add, METH_FASTCALL,
     "counts_add(counters, name, by, ...) -> None\n\n"
     "counters.name += by for each pair, as one step against every other add made by this call\n"
     "(or by kvtier.records.counts.counts_add_python): where counters' type has its attributes as\n"
     "plain int slots, with the GIL held from the first read to the last store; else under that\n"
     "function's lock. TypeError for a value that is not an int (nothing added)."},
    {NULL, NULL, 0, NULL},
};
