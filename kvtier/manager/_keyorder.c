/* ``KeyOrder`` (kvtier.manager._probe.KeyOrder): the LRU policy's order of keys, oldest first, in
 * C: the part of ``collections.OrderedDict``'s interface the policy uses (``k in o``, ``len``,
 * iteration oldest first, ``o[k] = None``, ``del o[k]``, ``o[k]``, ``pop``, ``move_to_end``,
 * ``clear``), with the same answers and errors, for keys that are exact ``bytes``.
 *
 * Why not the ordered dict: its nodes are found through an array parallel to its dict's table,
 * which every growth of the table rebuilds by looking each key up again (a probe, mostly a cache
 * miss, per key held: 50-100 ns a stored key over a tier's fill), and each node is an
 * allocation of its own. Here the nodes are one array of {key, hash, prev, next} (24 bytes a
 * key; a growth is a realloc), and the table is an array of node numbers (4 bytes a slot, at
 * most half full, linear probing, deletion by shifting back: no tombstones), rebuilt on growth
 * from the nodes' stored hashes, without touching a key.
 *
 * Keys stored are exact ``bytes`` (``o[k] = v`` of any other key raises ``TypeError`` naming its
 * type, and ``v`` must be ``None``). A key looked up is compared by its bytes when it is
 * ``bytes`` or a subclass that keeps bytes' own hash and equality (as the ordered dict would
 * find it equal); any other key is hashed (an unhashable one raises ``TypeError``, as a dict's
 * probe does) and compared with ``==``, the order checked unchanged after each compare. Nothing
 * that the order holds can form a cycle, so it is not tracked by the collector.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_keyorder.h"

#define NONE (-1)
#define MIN_TABLE 16
#define MAX_NODES ((Py_ssize_t)INT32_MAX - 1)

typedef struct {
    PyObject *key;   /* exact bytes (a new reference); NULL while the node is free */
    Py_hash_t hash;
    int32_t prev, next; /* neighbours in the order, or the free list's next */
} Node;

typedef struct {
    PyObject_HEAD
    Node *nodes;
    Py_ssize_t allocated;  /* nodes allocated */
    Py_ssize_t top;        /* nodes ever used (the rest never were) */
    int32_t free;          /* a free node below top, or NONE */
    int32_t *table;        /* node numbers, NONE where empty */
    size_t mask;           /* table size - 1 (a power of two) */
    Py_ssize_t len;
    int32_t head, tail;    /* oldest, newest */
    uint64_t version;      /* changed by every change of the order: iterators check it */
} KeyOrder;

PyTypeObject KeyOrderType;

/* Whether ``key`` is compared by its bytes (exact bytes, or a subclass with bytes' own hash and
 * equality). */
static inline int
bytes_like(PyObject *key)
{
    PyTypeObject *t = Py_TYPE(key);
    return t == &PyBytes_Type ||
           (PyBytes_Check(key) && t->tp_hash == PyBytes_Type.tp_hash && t->tp_richcompare == PyBytes_Type.tp_richcompare);
}

static inline int
same_bytes(PyObject *a, PyObject *b)
{
    Py_ssize_t n = PyBytes_GET_SIZE(a);
    return a == b || (n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)n) == 0);
}

/* The slot of the table that holds ``key``'s node (``*found`` 1), or the empty slot where it
 * would go (``*found`` 0); (size_t)-1 with an error set (an unhashable key, or a compare that
 * raised or changed the order). */
static size_t
find_slot(KeyOrder *self, PyObject *key, Py_hash_t hash, int *found)
{
    size_t i = (size_t)hash & self->mask;
    int plain = bytes_like(key);
    for (;; i = (i + 1) & self->mask) {
        int32_t n = self->table[i];
        Node *node;
        if (n == NONE) {
            *found = 0;
            return i;
        }
        node = &self->nodes[n];
        if (node->hash != hash)
            continue;
        if (plain) {
            if (same_bytes(node->key, key)) {
                *found = 1;
                return i;
            }
        }
        else {
            uint64_t version = self->version;
            PyObject *held = Py_NewRef(node->key);
            int eq = PyObject_RichCompareBool(held, key, Py_EQ);
            Py_DECREF(held);
            if (eq < 0)
                return (size_t)-1;
            if (self->version != version) {
                PyErr_SetString(PyExc_RuntimeError, "KeyOrder changed during a key's comparison");
                return (size_t)-1;
            }
            if (eq) {
                *found = 1;
                return i;
            }
        }
    }
}

/* The node number of ``key``, NONE if it is not held, or -2 with an error set. */
static int32_t
find(KeyOrder *self, PyObject *key, size_t *slot)
{
    Py_hash_t hash = PyObject_Hash(key);
    int found;
    size_t i;
    if (hash == -1)
        return -2;
    if (self->len == 0)
        return NONE;
    i = find_slot(self, key, hash, &found);
    if (i == (size_t)-1)
        return -2;
    if (slot != NULL)
        *slot = i;
    return found ? self->table[i] : NONE;
}

static void
unlink_node(KeyOrder *self, int32_t n)
{
    Node *node = &self->nodes[n];
    if (node->prev != NONE)
        self->nodes[node->prev].next = node->next;
    else
        self->head = node->next;
    if (node->next != NONE)
        self->nodes[node->next].prev = node->prev;
    else
        self->tail = node->prev;
}

static void
link_last(KeyOrder *self, int32_t n)
{
    Node *node = &self->nodes[n];
    node->prev = self->tail;
    node->next = NONE;
    if (self->tail != NONE)
        self->nodes[self->tail].next = n;
    else
        self->head = n;
    self->tail = n;
}

static void
link_first(KeyOrder *self, int32_t n)
{
    Node *node = &self->nodes[n];
    node->next = self->head;
    node->prev = NONE;
    if (self->head != NONE)
        self->nodes[self->head].prev = n;
    else
        self->tail = n;
    self->head = n;
}

/* A table of ``size`` slots (a power of two) filled from the nodes held; -1 with MemoryError. */
static int
rebuild_table(KeyOrder *self, size_t size)
{
    int32_t *table = PyMem_Malloc(size * sizeof(int32_t)), n;
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(table, 0xff, size * sizeof(int32_t)); /* NONE in every slot */
    for (n = self->head; n != NONE; n = self->nodes[n].next) {
        size_t i = (size_t)self->nodes[n].hash & (size - 1);
        while (table[i] != NONE)
            i = (i + 1) & (size - 1);
        table[i] = n;
    }
    PyMem_Free(self->table);
    self->table = table;
    self->mask = size - 1;
    return 0;
}

/* Room for one more key: a free node and a table at most half full after it; 0, or -1 with an
 * error set. */
static int
make_room(KeyOrder *self)
{
    if (self->table == NULL || (size_t)(self->len + 1) * 2 > self->mask + 1) {
        size_t size = MIN_TABLE;
        while ((size_t)(self->len + 1) * 2 > size)
            size *= 2;
        if (rebuild_table(self, size) < 0)
            return -1;
    }
    if (self->free == NONE && self->top == self->allocated) {
        Py_ssize_t more = self->allocated < 8 ? 8 : self->allocated * 2;
        Node *nodes;
        if (more > MAX_NODES)
            more = MAX_NODES;
        if (more <= self->allocated) {
            PyErr_SetString(PyExc_OverflowError, "KeyOrder: too many keys");
            return -1;
        }
        nodes = PyMem_Realloc(self->nodes, (size_t)more * sizeof(Node));
        if (nodes == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->nodes = nodes;
        self->allocated = more;
    }
    return 0;
}

/* Add ``key`` (exact bytes, not held) as the newest; 0, or -1 with an error set. */
static int
add_key(KeyOrder *self, PyObject *key, Py_hash_t hash)
{
    int32_t n;
    size_t i;
    if (make_room(self) < 0)
        return -1;
    if (self->free != NONE) {
        n = self->free;
        self->free = self->nodes[n].next;
    }
    else
        n = (int32_t)self->top++;
    self->nodes[n].key = Py_NewRef(key);
    self->nodes[n].hash = hash;
    link_last(self, n);
    for (i = (size_t)hash & self->mask; self->table[i] != NONE; i = (i + 1) & self->mask)
        ;
    self->table[i] = n;
    self->len++;
    self->version++;
    return 0;
}

/* Drop the node in table slot ``slot``: unlinked, its slot emptied and the run after it shifted
 * back (so every key stays reachable from its home slot), the node freed. The key is returned
 * (the caller's reference). */
static PyObject *
drop_at(KeyOrder *self, size_t slot)
{
    int32_t n = self->table[slot];
    Node *node = &self->nodes[n];
    PyObject *key = node->key;
    size_t hole = slot, i = slot;
    unlink_node(self, n);
    for (;;) {
        int32_t m;
        size_t home;
        i = (i + 1) & self->mask;
        m = self->table[i];
        if (m == NONE)
            break;
        home = (size_t)self->nodes[m].hash & self->mask;
        /* m may move to the hole when its home is not in (hole, i], cyclically */
        if ((i > hole && (home <= hole || home > i)) || (i < hole && home <= hole && home > i)) {
            self->table[hole] = m;
            hole = i;
        }
    }
    self->table[hole] = NONE;
    node->key = NULL;
    node->next = self->free;
    self->free = n;
    self->len--;
    self->version++;
    return key;
}

int
keyorder_check(PyObject *obj)
{
    return Py_TYPE(obj) == &KeyOrderType;
}

int
keyorder_holds(PyObject *order, PyObject *key)
{
    int32_t n = find((KeyOrder *)order, key, NULL);
    return n == -2 ? -1 : n != NONE;
}

int
keyorder_move_last(PyObject *order, PyObject *key)
{
    KeyOrder *self = (KeyOrder *)order;
    int32_t n = find(self, key, NULL);
    if (n < 0) {
        if (n == NONE)
            PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    if (self->tail != n) {
        unlink_node(self, n);
        link_last(self, n);
        self->version++;
    }
    return 0;
}

/* ---- the Python-facing methods ---- */

static Py_ssize_t
order_length(KeyOrder *self)
{
    return self->len;
}

static int
order_contains(KeyOrder *self, PyObject *key)
{
    return keyorder_holds((PyObject *)self, key);
}

static PyObject *
order_subscript(KeyOrder *self, PyObject *key)
{
    int32_t n = find(self, key, NULL);
    if (n == -2)
        return NULL;
    if (n == NONE) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    Py_RETURN_NONE;
}

static int
order_ass_subscript(KeyOrder *self, PyObject *key, PyObject *value)
{
    size_t slot = 0;
    int32_t n;
    if (value != NULL && !PyBytes_CheckExact(key)) {
        PyErr_Format(PyExc_TypeError, "KeyOrder key: expected bytes, got %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    if (value != NULL && value != Py_None) {
        PyErr_Format(PyExc_TypeError, "KeyOrder value: expected None, got %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    n = find(self, key, &slot);
    if (n == -2)
        return -1;
    if (value != NULL) /* a key held keeps its place, as in an ordered dict */
        return n == NONE ? add_key(self, key, PyObject_Hash(key)) : 0;
    if (n == NONE) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    Py_DECREF(drop_at(self, slot));
    return 0;
}

static PyObject *
order_pop(KeyOrder *self, PyObject *const *args, Py_ssize_t nargs)
{
    size_t slot = 0;
    int32_t n;
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "pop expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    n = find(self, args[0], &slot);
    if (n == -2)
        return NULL;
    if (n == NONE) {
        if (nargs == 2)
            return Py_NewRef(args[1]);
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    Py_DECREF(drop_at(self, slot));
    Py_RETURN_NONE; /* the value every key holds */
}

/* ``move_to_end(key, last=True)``, as an ordered dict's; the common call (one positional
 * argument) parses nothing. */
static PyObject *
order_move_to_end(KeyOrder *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *last_arg = NULL;
    int last = 1;
    int32_t n;
    if (nargs < 1 || nargs + nkw > 2 || (nkw == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "last") != 0)) {
        PyErr_Format(PyExc_TypeError, "move_to_end expected (key, last=True), got %zd positional and %zd keyword arguments",
                     nargs, nkw);
        return NULL;
    }
    if (nargs + nkw == 2)
        last_arg = args[1];
    if (last_arg != NULL && (last = PyObject_IsTrue(last_arg)) < 0)
        return NULL;
    if (last) {
        if (keyorder_move_last((PyObject *)self, args[0]) < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    n = find(self, args[0], NULL);
    if (n < 0) {
        if (n == NONE)
            PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    if (self->head != n) {
        unlink_node(self, n);
        link_first(self, n);
        self->version++;
    }
    Py_RETURN_NONE;
}

static void
release_all(KeyOrder *self)
{
    Node *nodes = self->nodes;
    Py_ssize_t top = self->top, i;
    self->nodes = NULL; /* emptied first: a key's release runs no code that could see it, but be plain */
    PyMem_Free(self->table);
    self->table = NULL;
    self->allocated = self->top = self->len = 0;
    self->free = self->head = self->tail = NONE;
    self->mask = 0;
    self->version++;
    for (i = 0; i < top; i++)
        Py_XDECREF(nodes[i].key);
    PyMem_Free(nodes);
}

static PyObject *
order_clear(KeyOrder *self, PyObject *unused)
{
    release_all(self);
    Py_RETURN_NONE;
}

static PyObject *
order_sizeof(KeyOrder *self, PyObject *unused)
{
    return PyLong_FromSize_t(sizeof(KeyOrder) + (size_t)self->allocated * sizeof(Node) +
                             (self->table != NULL ? (self->mask + 1) * sizeof(int32_t) : 0));
}

static PyObject *
order_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    KeyOrder *self;
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "KeyOrder() takes no arguments");
        return NULL;
    }
    self = (KeyOrder *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->free = self->head = self->tail = NONE;
    return (PyObject *)self;
}

static void
order_dealloc(KeyOrder *self)
{
    release_all(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- iteration, oldest first ---- */

typedef struct {
    PyObject_HEAD
    KeyOrder *order; /* NULL once exhausted */
    int32_t at;
    uint64_t version;
} KeyOrderIter;

static PyTypeObject KeyOrderIterType;

static PyObject *
order_iter(KeyOrder *self)
{
    KeyOrderIter *it = PyObject_New(KeyOrderIter, &KeyOrderIterType);
    if (it == NULL)
        return NULL;
    it->order = (KeyOrder *)Py_NewRef(self);
    it->at = self->head;
    it->version = self->version;
    return (PyObject *)it;
}

static PyObject *
iter_next(KeyOrderIter *it)
{
    KeyOrder *order = it->order;
    PyObject *key;
    if (order == NULL)
        return NULL;
    if (it->at == NONE) { /* past the last key: the end, changed since or not, as an ordered dict's */
        it->order = NULL;
        Py_DECREF(order);
        return NULL;
    }
    if (order->version != it->version) {
        PyErr_SetString(PyExc_RuntimeError, "KeyOrder mutated during iteration");
        return NULL;
    }
    key = Py_NewRef(order->nodes[it->at].key);
    it->at = order->nodes[it->at].next;
    return key;
}

static void
iter_dealloc(KeyOrderIter *it)
{
    Py_XDECREF(it->order);
    PyObject_Free(it);
}

static PyTypeObject KeyOrderIterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.manager._probe.KeyOrderIterator",
    .tp_basicsize = sizeof(KeyOrderIter),
    .tp_dealloc = (destructor)iter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)iter_next,
};

static PySequenceMethods order_as_sequence = {
    .sq_contains = (objobjproc)order_contains,
};

static PyMappingMethods order_as_mapping = {
    .mp_length = (lenfunc)order_length,
    .mp_subscript = (binaryfunc)order_subscript,
    .mp_ass_subscript = (objobjargproc)order_ass_subscript,
};

static PyMethodDef order_methods[] = {
    {"pop", (PyCFunction)(void (*)(void))order_pop, METH_FASTCALL, "pop(key[, default]): as an ordered dict's (a key held gives None)."},
    {"move_to_end", (PyCFunction)(void (*)(void))order_move_to_end, METH_FASTCALL | METH_KEYWORDS,
     "move_to_end(key, last=True): as an ordered dict's."},
    {"clear", (PyCFunction)order_clear, METH_NOARGS, "clear(): forget every key."},
    {"__sizeof__", (PyCFunction)order_sizeof, METH_NOARGS, "Size in memory, in bytes, the nodes and table included."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject KeyOrderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.manager._probe.KeyOrder",
    .tp_basicsize = sizeof(KeyOrder),
    .tp_dealloc = (destructor)order_dealloc,
    .tp_as_sequence = &order_as_sequence,
    .tp_as_mapping = &order_as_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_iter = (getiterfunc)order_iter,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KeyOrder(): exact bytes keys, oldest first, with an ordered dict's interface as the LRU policy uses it.",
    .tp_methods = order_methods,
    .tp_new = order_new,
};

int
keyorder_add(PyObject *module)
{
    if (PyType_Ready(&KeyOrderType) < 0 || PyType_Ready(&KeyOrderIterType) < 0)
        return -1;
    Py_INCREF(&KeyOrderType);
    if (PyModule_AddObject(module, "KeyOrder", (PyObject *)&KeyOrderType) < 0) {
        Py_DECREF(&KeyOrderType);
        return -1;
    }
    return 0;
}
