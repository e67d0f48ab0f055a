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
 * ``closed(key)``. Its ``lookup`` method is ``lookup(keys)`` for a tuple or list of one key, the
 * rest handed to ``keys_fallback`` (the closure). Counts are C integers, read with ``counts()``; the GIL orders them.
 * ``KeyIndex`` (_keyindex.c) is the tiers' index that a probe consults on a miss; ``HeldTouch``
 * (_heldtouch.c), a one-tier LRU manager's ``touch``, is part of the same extension.
 */
#define PY_SSIZE_T_CLEAN
#include "_heldtouch.h"
#include "_keyorder.h"
#include "_keyindex.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *sources; /* tuple: an exact dict (probed) or a callable (called), fastest tier first */
    PyObject *bad_key; /* raises InvalidKeyError naming what is wrong with a key */
    PyObject *closed;  /* raises ClosedError */
    PyObject *keys_fallback; /* lookup(keys) for what the C ``lookup`` leaves: the Python closure */
    Py_ssize_t key_bytes;
    int is_closed;
    unsigned long long hits;
    unsigned long long misses;
    unsigned long long filtered; /* misses a KeyIndex's filter answered (no dict probe) */
    unsigned int miss_score;     /* recent misses, weighed against hits: the filter is consulted while > 0 */
} KeyProbe;

/* The filter costs a hit one more memory access (5-8% of a hit of a cold 200k-key index
 * here) and saves a miss most of its dict probe (half to two thirds of it): it is consulted
 * only while misses are common enough to repay it. A miss adds MISS_WEIGHT to the score, a hit
 * takes one off: the score stays above zero when more than about one call in
 * (MISS_WEIGHT + 1) misses. Which path answers never changes the answer. */
#define MISS_WEIGHT 5u
#define SCORE_CAP 255u

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

/* 1 if ``source`` holds ``key`` with a truthy value (or answers truthy), 0 if not, -1 on error.
 * ``filter``: a KeyIndex's filter may answer "absent" first. */
static int
probe_one(KeyProbe *self, PyObject *source, PyObject *key, int filter)
{
    PyObject *value;
    int truth;
    if (PyDict_CheckExact(source) || Py_IS_TYPE(source, &KeyIndexType)) {
        if (Py_IS_TYPE(source, &KeyIndexType)) {
            if (filter && index_surely_absent((KeyIndex *)source, key)) {
                self->filtered++;
                return 0;
            }
            truth = index_ready_answer((KeyIndex *)source, key);
            if (truth != 0)
                return truth > 0; /* READY is truthy, an absent key a miss: what the dict probe below would answer */
        }
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

/* 1 if ``key`` is ready in some tier, 0 if not, -1 on error (a TypeError: not a key). */
static int
probe_all(KeyProbe *self, PyObject *key)
{
    Py_ssize_t i, n = PyTuple_GET_SIZE(self->sources);
    int filter = self->miss_score > 0;
    for (i = 0; i < n; i++) {
        int found = probe_one(self, PyTuple_GET_ITEM(self->sources, i), key, filter);
        if (found > 0 && self->miss_score > 0)
            self->miss_score--;
        if (found != 0)
            return found;
    }
    self->miss_score = self->miss_score < SCORE_CAP - MISS_WEIGHT ? self->miss_score + MISS_WEIGHT : SCORE_CAP;
    return 0;
}

static int
is_key(KeyProbe *self, PyObject *key)
{
    return PyBytes_CheckExact(key) && PyBytes_GET_SIZE(key) == self->key_bytes;
}

static PyObject *
probe_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    KeyProbe *self = (KeyProbe *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *key;
    int found;
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_Format(PyExc_TypeError, "lookup_key() takes exactly one positional argument, the key (%zd given)",
                     nargs + (kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0));
        return NULL;
    }
    key = args[0];
    if (self->is_closed)
        return raise_through(self->closed, key);
    found = probe_all(self, key);
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
    if (!is_key(self, key))
        return raise_through(self->bad_key, key);
    self->misses++;
    Py_RETURN_FALSE;
}

/* ``lookup(keys)``: a tuple or list of one key is answered here (1 or 0); anything else, and
 * any key this would refuse, goes to ``keys_fallback``, which answers, counts and raises as
 * the closure does (it probes again: nothing was counted here). */
static PyObject *
probe_lookup(KeyProbe *self, PyObject *keys)
{
    PyObject *key;
    int found;
    if (self->is_closed || self->keys_fallback == NULL)
        goto fallback;
    if (PyTuple_CheckExact(keys) && PyTuple_GET_SIZE(keys) == 1)
        key = PyTuple_GET_ITEM(keys, 0);
    else if (PyList_CheckExact(keys) && PyList_GET_SIZE(keys) == 1)
        key = PyList_GET_ITEM(keys, 0);
    else
        goto fallback;
    Py_INCREF(key); /* a list may change while a key's __eq__ runs */
    found = probe_all(self, key);
    if (found > 0) {
        Py_DECREF(key);
        self->hits++;
        return PyLong_FromLong(1);
    }
    if (found == 0 && is_key(self, key)) {
        Py_DECREF(key);
        self->misses++;
        return PyLong_FromLong(0);
    }
    Py_DECREF(key);
    if (found < 0) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError))
            return NULL;
        PyErr_Clear(); /* an unhashable key: the closure names it */
    }
fallback:
    if (self->keys_fallback == NULL)
        return raise_through(self->closed, keys);
    return PyObject_CallOneArg(self->keys_fallback, keys);
}

static PyObject *
probe_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"sources", "key_bytes", "bad_key", "closed", "keys_fallback", NULL};
    PyObject *sources, *bad_key, *closed, *keys_fallback;
    Py_ssize_t key_bytes, i;
    KeyProbe *self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!nOOO:KeyProbe", names, &PyTuple_Type, &sources, &key_bytes, &bad_key,
                                     &closed, &keys_fallback))
        return NULL;
    if (PyTuple_GET_SIZE(sources) == 0) {
        PyErr_SetString(PyExc_ValueError, "sources: expected at least one tier's index or getter, got none");
        return NULL;
    }
    for (i = 0; i < PyTuple_GET_SIZE(sources); i++) {
        PyObject *s = PyTuple_GET_ITEM(sources, i);
        if (!PyDict_CheckExact(s) && !Py_IS_TYPE(s, &KeyIndexType) && !PyCallable_Check(s)) {
            PyErr_Format(PyExc_TypeError, "sources[%zd]: expected a dict or a callable, got %.100s", i, Py_TYPE(s)->tp_name);
            return NULL;
        }
    }
    if (key_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "key_bytes: expected a length >= 0, got %zd", key_bytes);
        return NULL;
    }
    if (!PyCallable_Check(bad_key) || !PyCallable_Check(closed) || !PyCallable_Check(keys_fallback)) {
        PyErr_SetString(PyExc_TypeError, "bad_key, closed, keys_fallback: expected callables");
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
    Py_INCREF(keys_fallback);
    self->keys_fallback = keys_fallback;
    self->key_bytes = key_bytes;
    return (PyObject *)self;
}

static int
probe_traverse(KeyProbe *self, visitproc visit, void *arg)
{
    Py_VISIT(self->sources);
    Py_VISIT(self->bad_key);
    Py_VISIT(self->closed);
    Py_VISIT(self->keys_fallback);
    return 0;
}

static int
probe_clear(KeyProbe *self)
{
    Py_CLEAR(self->sources);
    Py_CLEAR(self->bad_key);
    Py_CLEAR(self->closed);
    Py_CLEAR(self->keys_fallback);
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
probe_filtered(KeyProbe *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(self->filtered);
}

static PyObject *
probe_close(KeyProbe *self, PyObject *unused)
{
    self->is_closed = 1;
    Py_RETURN_NONE;
}

static PyMethodDef probe_methods[] = {
    {"lookup", (PyCFunction)probe_lookup, METH_O, "lookup(keys) -> int: the manager's lookup, one key in C."},
    {"counts", (PyCFunction)probe_counts, METH_NOARGS, "(hits, misses) counted so far."},
    {"filtered", (PyCFunction)probe_filtered, METH_NOARGS, "Misses answered by an index's filter, with no dict probe."},
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
    .tp_doc = "KeyProbe(sources, key_bytes, bad_key, closed, keys_fallback): lookup_key(key) -> bool over the tiers' indexes.",
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
    if (PyType_Ready(&KeyProbeType) < 0 || keyindex_type_ready() < 0)
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
    Py_INCREF(&KeyIndexType);
    if (PyModule_AddObject(m, "KeyIndex", (PyObject *)&KeyIndexType) < 0) {
        Py_DECREF(&KeyIndexType);
        Py_DECREF(m);
        return NULL;
    }
    if (heldtouch_add(m) < 0 || keyorder_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
