/* The tier manager's single-key lookup, ``lookup_key(key)``, as a callable object in C.
 *
 * kvtier.manager.lookups builds one per manager (when this module is built) over the tiers'
 * index getters: a getter that is the bound ``get`` of an exact dict is handed in as the dict
 * itself and probed here directly; any other getter is handed in as it is and called. The
 * answer, the counting and the errors are the Python closure's (``one_tier_key`` /
 * ``any_tier_key``): True when some tier's answer for the key is truthy (hits + 1); else the key
 * must be exactly ``bytes`` of the key length, or ``bad_key(key)`` raises naming what is wrong,
 * and the miss is counted (misses + 1). A TypeError while probing (an unhashable key) also goes
 * to ``bad_key``; other errors propagate. After ``close()`` every call raises through
 * ``closed(key)``. Counts are C integers, read with ``counts()``; the GIL orders them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *sources; /* tuple: an exact dict (probed) or a callable (called), fastest tier first */
    PyObject *bad_key; /* raises InvalidKeyError naming what is wrong with a key */
    PyObject *closed;  /* raises ClosedError */
    Py_ssize_t key_bytes;
    int is_closed;
    unsigned long long hits;
    unsigned long long misses;
} KeyProbe;

/* Call ``fn(key)``, which must raise; NULL with the error set. */
static PyObject *
raise_through(PyObject *fn, PyObject *key)
{
    PyObject *r;
    if (fn == NULL) { /* cleared by the cycle collector: nothing left to answer with */
        PyErr_SetString(PyExc_ReferenceError, "the lookup was cleared");
        return NULL;
    }
    r = PyObject_CallOneArg(fn, key);
    if (r != NULL) {
        Py_DECREF(r);
        PyErr_Format(PyExc_SystemError, "%R returned instead of raising", fn);
    }
    return NULL;
}

/* 1 if ``source`` holds ``key`` with a truthy value (or answers truthy), 0 if not, -1 on error. */
static int
probe_one(PyObject *source, PyObject *key)
{
    PyObject *value;
    int truth;
    if (PyDict_CheckExact(source)) {
        value = PyDict_GetItemWithError(source, key); /* borrowed */
        if (value == NULL)
            return PyErr_Occurred() ? -1 : 0;
        if (PyLong_CheckExact(value) || PyBool_Check(value))
            return PyObject_IsTrue(value); /* runs no Python code: the borrowed value stays alive */
        Py_INCREF(value);
        truth = PyObject_IsTrue(value);
        Py_DECREF(value);
        return truth;
    }
    value = PyObject_Vectorcall(source, &key, 1, NULL);
    if (value == NULL)
        return -1;
    truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

static PyObject *
probe_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    KeyProbe *self = (KeyProbe *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t i, n;
    PyObject *key;
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_Format(PyExc_TypeError, "lookup_key() takes exactly one positional argument, the key (%zd given)",
                     nargs + (kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0));
        return NULL;
    }
    key = args[0];
    if (self->is_closed)
        return raise_through(self->closed, key);
    n = PyTuple_GET_SIZE(self->sources);
    for (i = 0; i < n; i++) {
        int found = probe_one(PyTuple_GET_ITEM(self->sources, i), key);
        if (found > 0) {
            self->hits++;
            Py_RETURN_TRUE;
        }
        if (found < 0) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError))
                return NULL;
            PyErr_Clear(); /* an unhashable key: bad_key names it */
            return raise_through(self->bad_key, key);
        }
    }
    if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != self->key_bytes)
        return raise_through(self->bad_key, key);
    self->misses++;
    Py_RETURN_FALSE;
}

static PyObject *
probe_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"sources", "key_bytes", "bad_key", "closed", NULL};
    PyObject *sources, *bad_key, *closed;
    Py_ssize_t key_bytes, i;
    KeyProbe *self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!nOO:KeyProbe", names, &PyTuple_Type, &sources, &key_bytes, &bad_key,
                                     &closed))
        return NULL;
    if (PyTuple_GET_SIZE(sources) == 0) {
        PyErr_SetString(PyExc_ValueError, "sources: expected at least one tier's index or getter, got none");
        return NULL;
    }
    for (i = 0; i < PyTuple_GET_SIZE(sources); i++) {
        PyObject *s = PyTuple_GET_ITEM(sources, i);
        if (!PyDict_CheckExact(s) && !PyCallable_Check(s)) {
            PyErr_Format(PyExc_TypeError, "sources[%zd]: expected a dict or a callable, got %.100s", i, Py_TYPE(s)->tp_name);
            return NULL;
        }
    }
    if (key_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "key_bytes: expected a length >= 0, got %zd", key_bytes);
        return NULL;
    }
    if (!PyCallable_Check(bad_key) || !PyCallable_Check(closed)) {
        PyErr_SetString(PyExc_TypeError, "bad_key, closed: expected callables");
        return NULL;
    }
    self = (KeyProbe *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = probe_vectorcall;
    Py_INCREF(sources);
    self->sources = sources;
    Py_INCREF(bad_key);
    self->bad_key = bad_key;
    Py_INCREF(closed);
    self->closed = closed;
    self->key_bytes = key_bytes;
    return (PyObject *)self;
}

static int
probe_traverse(KeyProbe *self, visitproc visit, void *arg)
{
    Py_VISIT(self->sources);
    Py_VISIT(self->bad_key);
    Py_VISIT(self->closed);
    return 0;
}

static int
probe_clear(KeyProbe *self)
{
    Py_CLEAR(self->sources);
    Py_CLEAR(self->bad_key);
    Py_CLEAR(self->closed);
    self->is_closed = 1; /* a cleared probe has nothing to probe: it answers as a closed one */
    return 0;
}

static void
probe_dealloc(KeyProbe *self)
{
    PyObject_GC_UnTrack(self);
    probe_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
probe_counts(KeyProbe *self, PyObject *unused)
{
    return Py_BuildValue("(KK)", self->hits, self->misses);
}

static PyObject *
probe_close(KeyProbe *self, PyObject *unused)
{
    self->is_closed = 1;
    Py_RETURN_NONE;
}

static PyMethodDef probe_methods[] = {
    {"counts", (PyCFunction)probe_counts, METH_NOARGS, "(hits, misses) counted so far."},
    {"close", (PyCFunction)probe_close, METH_NOARGS, "Every later call raises through ``closed``."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KeyProbeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.manager._probe.KeyProbe",
    .tp_basicsize = sizeof(KeyProbe),
    .tp_dealloc = (destructor)probe_dealloc,
    .tp_vectorcall_offset = offsetof(KeyProbe, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "KeyProbe(sources, key_bytes, bad_key, closed): lookup_key(key) -> bool over the tiers' indexes.",
    .tp_traverse = (traverseproc)probe_traverse,
    .tp_clear = (inquiry)probe_clear,
    .tp_methods = probe_methods,
    .tp_new = probe_new,
};

static struct PyModuleDef probe_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier.manager._probe",
    .m_doc = "The tier manager's single-key lookup in C (see kvtier.manager.lookups).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__probe(void)
{
    PyObject *m;
    if (PyType_Ready(&KeyProbeType) < 0)
        return NULL;
    m = PyModule_Create(&probe_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&KeyProbeType);
    if (PyModule_AddObject(m, "KeyProbe", (PyObject *)&KeyProbeType) < 0) {
        Py_DECREF(&KeyProbeType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
