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
 *
 * ``KeyIndex`` is the tiers' index: a dict (a subclass, every read is dict's own) that also
 * keeps a membership filter, so that a miss is mostly answered without hashing the key or
 * touching the dict's table (which, at 10^5 keys and more, is a few cache misses). The filter
 * is one 2-bit counter per slot, four slots a byte, at least two slots per key (0.5-1 byte a
 * key), each key counted in the slot a cheap mix of all its bytes picks. A zero slot means no
 * exact-bytes key with those bytes is in the dict: KeyProbe answers such a key's lookup as a
 * miss with no dict probe (while misses are common: see MISS_WEIGHT). A counter that reaches 3
 * stays there (never decremented: it can only say "maybe"); enough of them, or a dict past half
 * the slots, and the filter is rebuilt from the dict. Every mutation through the type (item set and delete, ``pop``,
 * ``update``, ``clear``) keeps the counts exact when every key is exact ``bytes``; anything
 * else (another key type, a mutation through dict's own methods or C API, an error) leaves the
 * filter marked stale, and the dict's version tag (changed by every mutation, whoever makes
 * it) catches what bypassed the type: a stale filter is rebuilt before it is next consulted.
 * So the filter never says absent for a key the dict holds; at worst it says "maybe" and the
 * dict answers. Where the version tag is gone (CPython 3.14) the filter is never consulted.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if PY_VERSION_HEX < 0x030E0000
#define KEYINDEX_GUARDED 1
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wdeprecated-declarations" /* ma_version_tag, deprecated since 3.12 */
#endif
#define DICT_VERSION(d) (((PyDictObject *)(d))->ma_version_tag)
#else
#define KEYINDEX_GUARDED 0
#define DICT_VERSION(d) ((uint64_t)0)
#endif

#define MIN_SLOTS 256   /* 64 bytes */
#define LOAD 2          /* slots per key, at least: a dict past slots / LOAD keys gets twice the slots */
#define TOP 3u          /* a counter that reached it stays (it can only say "maybe") */

typedef struct {
    PyDictObject dict;
    uint8_t *cells;        /* 2-bit counters, four a byte; NULL until first built */
    Py_ssize_t slots;      /* counters: a power of two, >= 4 per key when built */
    int shift;             /* 64 - log2(slots): the mix's top bits pick a slot */
    int stale;             /* the counts may not match the dict: rebuild before use */
    Py_ssize_t saturated;  /* counters at TOP */
    Py_ssize_t foreign;    /* keys that are not exact bytes (while any, no filter) */
    uint64_t synced;       /* the dict's version when the counts last matched it */
} KeyIndex;

static PyTypeObject KeyIndexType;

/* A cheap mix of every byte of a key (all four words of a 32-byte one: keys made elsewhere may
 * share a prefix), not a defence against chosen keys: a collision only costs a dict probe. A
 * 32-byte key takes four independent multiplies (a few cycles: a hit pays for it too). */
static inline uint64_t
key_mix(const char *p, Py_ssize_t n)
{
    uint64_t w[4], h;
    if (n == 32) {
        memcpy(w, p, 32);
        return (w[0] * 0x9E3779B97F4A7C15ull + w[1] * 0xC2B2AE3D27D4EB4Full) ^
               (w[2] * 0xFF51AFD7ED558CCDull + w[3] * 0xC4CEB9FE1A85EC53ull);
    }
    h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    for (; n >= 8; p += 8, n -= 8) {
        memcpy(w, p, 8);
        h = (h ^ w[0]) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
    }
    if (n > 0) {
        w[0] = 0;
        memcpy(w, p, (size_t)n);
        h = (h ^ w[0]) * 0xFF51AFD7ED558CCDull;
    }
    return h ^ (h >> 29);
}

static inline uint64_t
slot_of(const KeyIndex *self, PyObject *key)
{
    return key_mix(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)) >> self->shift;
}

static inline unsigned
cell_get(const uint8_t *cells, uint64_t i)
{
    return (cells[i >> 2] >> ((i & 3) * 2)) & 3u;
}

/* Count one more key in slot i; 1 if that counter just reached TOP. */
static inline int
cell_add(uint8_t *cells, uint64_t i)
{
    unsigned c = cell_get(cells, i);
    if (c == TOP)
        return 0;
    cells[i >> 2] = (uint8_t)(cells[i >> 2] + (1u << ((i & 3) * 2)));
    return c + 1 == TOP;
}

static void
mark_stale(KeyIndex *self)
{
    self->stale = 1;
    self->foreign = 0; /* recounted by the rebuild that a stale filter gets before it is used */
}

/* Count every key of the dict afresh into slots enough for it; 0, or -1 with MemoryError. */
static int
index_rebuild(KeyIndex *self)
{
    Py_ssize_t n = PyDict_GET_SIZE(self), slots = MIN_SLOTS, pos = 0, foreign = 0, saturated = 0;
    int shift = 64 - 8;
    PyObject *key, *value;
    uint8_t *cells;
    while (slots / LOAD < n + 1) {
        slots *= 2;
        shift--;
    }
    cells = PyMem_Calloc((size_t)slots / 4, 1);
    if (cells == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->shift = shift; /* slot_of reads it */
    while (PyDict_Next((PyObject *)self, &pos, &key, &value)) {
        if (PyBytes_CheckExact(key))
            saturated += cell_add(cells, slot_of(self, key));
        else
            foreign++;
    }
    PyMem_Free(self->cells);
    self->cells = cells;
    self->slots = slots;
    self->saturated = saturated;
    self->foreign = foreign;
    self->stale = 0;
    self->synced = DICT_VERSION(self);
    return 0;
}

/* Whether the counts match the dict now (rebuilding them if not); 0 when they cannot be used. */
static int
index_ready(KeyIndex *self)
{
    if (!KEYINDEX_GUARDED)
        return 0;
    if (self->stale || self->cells == NULL || self->synced != DICT_VERSION(self)) {
        if (index_rebuild(self) < 0) {
            PyErr_Clear(); /* no memory for the filter: the dict answers */
            return 0;
        }
    }
    return self->foreign == 0;
}

/* 1 if ``key`` is surely not in the dict (no dict probe needed), else 0. Never an error. */
static inline int
index_surely_absent(KeyIndex *self, PyObject *key)
{
    if (!PyBytes_CheckExact(key) || self->foreign != 0 || !index_ready(self))
        return 0;
    return cell_get(self->cells, slot_of(self, key)) == 0;
}

/* Whether the counts match the dict now, as they are (no rebuild). */
static inline int
index_synced(KeyIndex *self)
{
    return KEYINDEX_GUARDED && !self->stale && self->foreign == 0 && self->cells != NULL && self->synced == DICT_VERSION(self);
}

/* Before a mutation by ``key``: whether its effect can be counted exactly. */
static inline int
index_exact(KeyIndex *self, PyObject *key)
{
    return PyBytes_CheckExact(key) && index_synced(self);
}

/* After a mutation by ``key`` that took the dict from ``before`` keys to its size now. */
static void
index_settle(KeyIndex *self, PyObject *key, int exact, Py_ssize_t before)
{
    Py_ssize_t after = PyDict_GET_SIZE(self);
    if (!exact) {
        mark_stale(self);
        return;
    }
    if (after == before + 1) {
        self->saturated += cell_add(self->cells, slot_of(self, key));
        if (after > self->slots / LOAD || self->saturated > self->slots / 32) {
            self->synced = DICT_VERSION(self);
            if (index_rebuild(self) < 0) {
                PyErr_Clear(); /* the old slots still count every key: keep them */
                return;
            }
        }
    }
    else if (after == before - 1) {
        uint64_t i = slot_of(self, key);
        unsigned c = cell_get(self->cells, i);
        if (c == 0) { /* never: the counts were exact */
            mark_stale(self);
            return;
        }
        if (c != TOP)
            self->cells[i >> 2] = (uint8_t)(self->cells[i >> 2] - (1u << ((i & 3) * 2)));
    }
    else if (after != before) {
        mark_stale(self);
        return;
    }
    self->synced = DICT_VERSION(self);
}

static int
index_ass_sub(KeyIndex *self, PyObject *key, PyObject *value)
{
    int exact = index_exact(self, key), r;
    Py_ssize_t before = PyDict_GET_SIZE(self);
    r = PyDict_Type.tp_as_mapping->mp_ass_subscript((PyObject *)self, key, value);
    index_settle(self, key, exact, before);
    return r;
}

/* ``pop(key[, default])``, as dict's. */
static PyObject *
index_pop(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *key, *value;
    int exact;
    Py_ssize_t before;
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "pop expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    key = args[0];
    exact = index_exact(self, key);
    before = PyDict_GET_SIZE(self);
    value = PyDict_GetItemWithError((PyObject *)self, key);
    if (value == NULL) { /* nothing removed (what a foreign key's __eq__ did is the version tag's) */
        if (PyErr_Occurred())
            return NULL;
        if (nargs == 2)
            return Py_NewRef(args[1]);
        value = PyTuple_Pack(1, key); /* as dict's: KeyError(key), a tuple key kept whole */
        if (value != NULL) {
            PyErr_SetObject(PyExc_KeyError, value);
            Py_DECREF(value);
        }
        return NULL;
    }
    Py_INCREF(value);
    if (PyDict_DelItem((PyObject *)self, key) < 0) {
        mark_stale(self);
        Py_DECREF(value);
        return NULL;
    }
    index_settle(self, key, exact, before);
    return value;
}

/* ``update(...)``, as dict's: a dict of keys all new is counted key by key, else rebuilt. */
static PyObject *
index_update(KeyIndex *self, PyObject *args, PyObject *kwds)
{
    static PyObject *dict_update = NULL;
    PyObject *other = NULL, *r, *key, *value;
    Py_ssize_t before = PyDict_GET_SIZE(self), pos = 0;
    int exact = index_synced(self);
    uint64_t other_version = 0;
    if (dict_update == NULL) {
        dict_update = PyObject_GetAttrString((PyObject *)&PyDict_Type, "update");
        if (dict_update == NULL)
            return NULL;
    }
    if (PyTuple_GET_SIZE(args) == 1)
        other = PyTuple_GET_ITEM(args, 0);
    if (other != NULL && PyDict_CheckExact(other))
        other_version = DICT_VERSION(other);
    {
        PyObject *full = PyTuple_New(PyTuple_GET_SIZE(args) + 1);
        Py_ssize_t i;
        if (full == NULL)
            return NULL;
        Py_INCREF(self);
        PyTuple_SET_ITEM(full, 0, (PyObject *)self);
        for (i = 0; i < PyTuple_GET_SIZE(args); i++)
            PyTuple_SET_ITEM(full, i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
        r = PyObject_Call(dict_update, full, kwds);
        Py_DECREF(full);
    }
    if (exact && r != NULL && (kwds == NULL || PyDict_GET_SIZE(kwds) == 0) && other != NULL && PyDict_CheckExact(other) &&
        PyDict_GET_SIZE(self) == before + PyDict_GET_SIZE(other) && DICT_VERSION(other) == other_version) {
        /* every key of ``other`` (unchanged meanwhile) was new: count each (a foreign one makes the
         * counts stale) */
        while (PyDict_Next(other, &pos, &key, &value)) {
            if (!PyBytes_CheckExact(key)) {
                mark_stale(self);
                return r;
            }
            self->saturated += cell_add(self->cells, slot_of(self, key));
        }
        self->synced = DICT_VERSION(self);
        if ((PyDict_GET_SIZE(self) > self->slots / LOAD || self->saturated > self->slots / 32) && index_rebuild(self) < 0) {
            PyErr_Clear();
            mark_stale(self);
        }
        return r;
    }
    mark_stale(self);
    return r;
}

static PyObject *
index_clear(KeyIndex *self, PyObject *unused)
{
    PyDict_Clear((PyObject *)self);
    PyMem_Free(self->cells);
    self->cells = NULL; /* an empty dict's filter is rebuilt small when next consulted */
    mark_stale(self);
    Py_RETURN_NONE;
}

static PyObject *
index_maybe(KeyIndex *self, PyObject *key)
{
    return PyBool_FromLong(!index_surely_absent(self, key));
}

static PyObject *
index_filter_state(KeyIndex *self, PyObject *unused)
{
    return Py_BuildValue("{s:O,s:n,s:n,s:n}", "synced", index_synced(self) ? Py_True : Py_False, "slots", self->slots,
                         "saturated", self->saturated, "foreign", self->foreign);
}

static PyObject *
index_sizeof(KeyIndex *self, PyObject *unused)
{
    static PyObject *dict_sizeof = NULL;
    PyObject *base;
    Py_ssize_t n;
    if (dict_sizeof == NULL) {
        dict_sizeof = PyObject_GetAttrString((PyObject *)&PyDict_Type, "__sizeof__");
        if (dict_sizeof == NULL)
            return NULL;
    }
    base = PyObject_CallOneArg(dict_sizeof, (PyObject *)self);
    if (base == NULL)
        return NULL;
    n = PyLong_AsSsize_t(base);
    Py_DECREF(base);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(n + (Py_ssize_t)(sizeof(KeyIndex) - sizeof(PyDictObject)) + (self->cells ? self->slots / 4 : 0));
}

static void
index_dealloc(KeyIndex *self)
{
    PyMem_Free(self->cells);
    self->cells = NULL;
    PyDict_Type.tp_dealloc((PyObject *)self);
}

static PyMappingMethods index_as_mapping = {
    .mp_ass_subscript = (objobjargproc)index_ass_sub, /* length and reads: dict's, inherited */
};

static PyMethodDef index_methods[] = {
    {"pop", (PyCFunction)(void (*)(void))index_pop, METH_FASTCALL, "pop(key[, default]): as dict's."},
    {"update", (PyCFunction)(void (*)(void))index_update, METH_VARARGS | METH_KEYWORDS, "update(...): as dict's."},
    {"clear", (PyCFunction)index_clear, METH_NOARGS, "clear(): as dict's."},
    {"maybe", (PyCFunction)index_maybe, METH_O,
     "maybe(key) -> bool: False only where the filter says ``key`` is surely absent (never for a key held)."},
    {"filter_state", (PyCFunction)index_filter_state, METH_NOARGS,
     "The filter as it stands: synced (its counts match the dict, no rebuild due), slots, saturated, foreign."},
    {"__sizeof__", (PyCFunction)index_sizeof, METH_NOARGS, "Size in memory, in bytes, the filter's included."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KeyIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.manager._probe.KeyIndex",
    .tp_basicsize = sizeof(KeyIndex),
    .tp_dealloc = (destructor)index_dealloc,
    .tp_as_mapping = &index_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "KeyIndex(): a dict that keeps a membership filter of its bytes keys, which a KeyProbe consults on a miss.",
    .tp_methods = index_methods,
};

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
        if (filter && Py_IS_TYPE(source, &KeyIndexType) && index_surely_absent((KeyIndex *)source, key)) {
            self->filtered++;
            return 0;
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
    KeyIndexType.tp_base = &PyDict_Type;
    KeyIndexType.tp_traverse = PyDict_Type.tp_traverse;
    KeyIndexType.tp_clear = PyDict_Type.tp_clear; /* a mutation past the type: the version tag catches it */
    if (PyType_Ready(&KeyProbeType) < 0 || PyType_Ready(&KeyIndexType) < 0)
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
    return m;
}
