/* ``HeldTouch`` (kvtier.manager._probe.HeldTouch): a one-tier manager's ``touch(keys)`` in C,
 * where the tier's policy is exactly ``LRUPolicy`` (kvtier.manager.touch_calls makes it).
 *
 * It does what the Python closure does with ``LRUPolicy.touch_held`` for the common call: a
 * list or tuple of keys, each exactly ``bytes`` and held in the policy's order (its ``KeyOrder``,
 * moved by direct calls, or an ordered dict, by its ``move_to_end``), is moved to its end in
 * order, under the manager's lock, the whole batch checked before the first move.
 * Every other call (another sequence type, a key that is not exact bytes, a key not held, an
 * unhashable key, a closed call) is handed, untouched, to ``fallback`` (the Python closure),
 * which answers, refuses or raises as it does without the extension. With exact bytes keys no
 * Python code runs between the lock's acquire and release (the dict's probes hash and compare
 * bytes in C, and ``move_to_end`` only relinks), so the batch is moved whole or not at all.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

#include "_heldtouch.h"
#include "_keyindex.h"
#include "_keyorder.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *order;    /* the policy's order: an OrderedDict or a KeyOrder */
    PyObject *move;     /* an OrderedDict's bound move_to_end; NULL for a KeyOrder (moved in C) */
    PyObject *acquire;  /* the manager's lock's bound acquire and release */
    PyObject *release;
    PyObject *fallback; /* touch(keys) for everything this leaves: the Python closure */
    int is_closed;
} HeldTouch;

/* Release the lock, keeping any error already set; -1 if the release itself failed. */
static int
release_lock(HeldTouch *self)
{
    PyObject *type, *value, *tb, *r;
    PyErr_Fetch(&type, &value, &tb);
    r = PyObject_CallNoArgs(self->release);
    if (r == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return -1;
    }
    Py_DECREF(r);
    PyErr_Restore(type, value, tb);
    return 0;
}

/* 1 if every key of ``keys`` is exact bytes held in ``order`` (moved, in order), 0 if not (no
 * change), -1 on an error. Each key is held while it is probed or moved. */
static int
touch_held(HeldTouch *self, PyObject *keys)
{
    Py_ssize_t i, n = Py_SIZE(keys);
    PyObject *key;
    for (i = 0; i < n; i++) { /* finding every key first also brings its entry into the cache */
        int held;
        key = seq_item(keys, i);
        if (key == NULL || !PyBytes_CheckExact(key))
            return 0;
        Py_INCREF(key);
        held = self->move == NULL ? keyorder_holds(self->order, key) : PyDict_Contains(self->order, key);
        Py_DECREF(key);
        if (held <= 0) {
            if (held < 0)
                PyErr_Clear(); /* (exact bytes hash and compare without error: never) */
            return 0;
        }
    }
    if (Py_SIZE(keys) != n)
        return 0;
    for (i = 0; i < n; i++) {
        PyObject *r;
        key = seq_item(keys, i);
        if (key == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "touch: the keys changed while they were moved");
            return -1;
        }
        Py_INCREF(key);
        if (self->move == NULL) {
            int moved = keyorder_move_last(self->order, key);
            Py_DECREF(key);
            if (moved < 0)
                return -1;
            continue;
        }
        r = PyObject_Vectorcall(self->move, &key, 1, NULL);
        Py_DECREF(key);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 1;
}

static PyObject *
held_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    HeldTouch *self = (HeldTouch *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *keys, *r;
    int done;
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_Format(PyExc_TypeError, "touch() takes exactly one positional argument, the keys (%zd given)",
                     nargs + (kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0));
        return NULL;
    }
    keys = args[0];
    if (self->is_closed || self->fallback == NULL || (!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys)))
        goto fallback;
    r = PyObject_CallNoArgs(self->acquire);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    /* read again under the lock: a close made while the acquire waited (or ran Python code) is
     * seen, and a closed touch moves nothing */
    if (self->is_closed || self->fallback == NULL) {
        if (release_lock(self) < 0)
            return NULL;
        goto fallback;
    }
    Py_INCREF(keys);
    done = touch_held(self, keys);
    Py_DECREF(keys);
    if (release_lock(self) < 0 || done < 0)
        return NULL;
    if (done)
        Py_RETURN_NONE;
fallback:
    if (self->fallback == NULL) {
        PyErr_SetString(PyExc_ReferenceError, "the touch was cleared");
        return NULL;
    }
    return PyObject_CallOneArg(self->fallback, keys);
}

static PyObject *
held_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"order", "lock", "fallback", NULL};
    PyObject *order, *lock, *fallback;
    HeldTouch *self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:HeldTouch", names, &order, &lock, &fallback))
        return NULL;
    if (!PyODict_CheckExact(order) && !keyorder_check(order)) {
        PyErr_Format(PyExc_TypeError, "order: expected a collections.OrderedDict or a KeyOrder, got %.100s",
                     Py_TYPE(order)->tp_name);
        return NULL;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_Format(PyExc_TypeError, "fallback: expected a callable, got %.100s", Py_TYPE(fallback)->tp_name);
        return NULL;
    }
    self = (HeldTouch *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = held_vectorcall;
    self->order = Py_NewRef(order);
    self->fallback = Py_NewRef(fallback);
    self->move = keyorder_check(order) ? NULL : PyObject_GetAttrString(order, "move_to_end");
    self->acquire = self->move || keyorder_check(order) ? PyObject_GetAttrString(lock, "acquire") : NULL;
    self->release = self->acquire ? PyObject_GetAttrString(lock, "release") : NULL;
    if (self->release == NULL) { /* a lock without acquire and release: named by the AttributeError */
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
held_traverse(HeldTouch *self, visitproc visit, void *arg)
{
    Py_VISIT(self->order);
    Py_VISIT(self->move);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->fallback);
    return 0;
}

static int
held_clear(HeldTouch *self)
{
    Py_CLEAR(self->order);
    Py_CLEAR(self->move);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    Py_CLEAR(self->fallback);
    self->is_closed = 1;
    return 0;
}

static void
held_dealloc(HeldTouch *self)
{
    PyObject_GC_UnTrack(self);
    held_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
held_close(HeldTouch *self, PyObject *unused)
{
    self->is_closed = 1;
    Py_RETURN_NONE;
}

static PyMethodDef held_methods[] = {
    {"close", (PyCFunction)held_close, METH_NOARGS, "Every later call goes to ``fallback``."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HeldTouchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.manager._probe.HeldTouch",
    .tp_basicsize = sizeof(HeldTouch),
    .tp_dealloc = (destructor)held_dealloc,
    .tp_vectorcall_offset = offsetof(HeldTouch, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "HeldTouch(order, lock, fallback): touch(keys) of a one-tier LRU manager, the common call in C.",
    .tp_traverse = (traverseproc)held_traverse,
    .tp_clear = (inquiry)held_clear,
    .tp_methods = held_methods,
    .tp_new = held_new,
};

int
heldtouch_add(PyObject *module)
{
    if (PyType_Ready(&HeldTouchType) < 0)
        return -1;
    Py_INCREF(&HeldTouchType);
    if (PyModule_AddObject(module, "HeldTouch", (PyObject *)&HeldTouchType) < 0) {
        Py_DECREF(&HeldTouchType);
        return -1;
    }
    return 0;
}
