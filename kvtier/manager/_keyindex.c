/* ``KeyIndex`` (kvtier.manager._probe.KeyIndex; KeyProbe in _probe.c reads it through
 * _keyindex.h) is the tiers' index: a dict (a subclass, every read is dict's own) that also
 * keeps a membership filter, so that a miss is mostly answered without hashing the key or
 * touching the dict's table (which, at 10^5 keys and more, is a few cache misses). The filter
 * is one 2-bit counter per slot, four slots a byte, at least two slots per key (0.5-1.3 bytes a
 * key; eight, 2-5.3 bytes, in an index that keeps a ready-key table: see slots_per_key), each key
 * counted in the slot a cheap mix of all its bytes picks. A zero slot means no
 * exact-bytes key with those bytes is in the dict: KeyProbe answers such a key's lookup as a
 * miss with no dict probe (while misses are common: see MISS_WEIGHT). A counter that reaches 3
 * stays there (never decremented: it can only say "maybe"); enough of them, or keys nearing what
 * the slots allow, and a new filter is counted from the dict a few entries a mutation
 * (_keygrow.c), so that no one call recounts the whole dict. Every mutation through the type (item set and delete, ``pop``,
 * ``update``, ``clear``) keeps the counts exact when every key is exact ``bytes``; anything
 * else (another key type, a mutation through dict's own methods or C API, an error) leaves the
 * filter marked stale, and the dict's version tag (changed by every mutation, whoever makes
 * it) catches what bypassed the type: a stale filter is rebuilt before it is next consulted.
 * So the filter never says absent for a key the dict holds; at worst it says "maybe" and the
 * dict answers. Where the version tag is gone (CPython 3.14) the filter is never consulted.
 */
#define PY_SSIZE_T_CLEAN
#include "_keyindex.h"

#define MIN_SLOTS 256 /* 64 bytes */

static void
mark_stale(KeyIndex *self)
{
    self->stale = 1;
    self->foreign = 0; /* recounted by the rebuild that a stale filter gets before it is used */
    keyindex_grow_drop(self);
}

/* Count every key afresh; ``table``: rebuild the ready-key table too (it may not match the
 * dict), else keep it (it does: only the counts outgrew their slots). */
static int
counts_rebuild(KeyIndex *self, int table)
{
    Py_ssize_t n = PyDict_GET_SIZE(self), slots = MIN_SLOTS, pos = 0, foreign = 0, saturated = 0;
    int shift = 64 - 8;
    PyObject *key, *value;
    uint8_t *cells;
    while (slots / slots_per_key(self) < n + 1) {
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
    keyindex_grow_drop(self);
    self->recounted += (unsigned long long)n;
    PyMem_Free(self->cells);
    self->cells = cells;
    self->slots = slots;
    self->saturated = saturated;
    self->foreign = foreign;
    self->stale = 0;
    if (table && self->wants_ready && !ready_synced(self))
        ready_rebuild(self);
    self->synced = DICT_VERSION(self);
    return 0;
}

int
keyindex_rebuild(KeyIndex *self)
{
    return counts_rebuild(self, 1);
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
        index_count_key(self, key);
        keyindex_grow(self, 1);
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
        keyindex_grow(self, 1); /* the growing counts keep it: a "maybe" until they are made again */
    }
    else if (after != before) {
        mark_stale(self);
        return;
    }
    self->synced = DICT_VERSION(self);
}

/* The value ``key`` holds now (a new reference, NULL if none), kept alive across a mutation
 * that replaces or deletes it: released inside the dict's mutation it could run Python code
 * (``__del__``) that mutates the dict past the type before the counts are settled. */
static PyObject *
index_hold(KeyIndex *self, PyObject *key)
{
    PyObject *old = PyDict_GetItemWithError((PyObject *)self, key); /* exact bytes: runs no Python code */
    if (old == NULL)
        PyErr_Clear();
    return Py_XNewRef(old);
}

/* Before a mutation by ``key``: whether the ready-key table can follow it. */
static inline int
ready_follows(KeyIndex *self, PyObject *key)
{
    return PyBytes_CheckExact(key) && ready_synced(self);
}

/* After a mutation by ``key``: the table follows it (``followed``: it could; ``old``: the value
 * before; ``known``: it succeeded, leaving ``now``, NULL if deleted), or is dropped. */
static void
ready_settle(KeyIndex *self, PyObject *key, int followed, PyObject *old, PyObject *now, int known)
{
    if (followed)
        ready_note(self, key, old == keyindex_ready_value, now == keyindex_ready_value, known);
    else if (self->ready != NULL && self->ready_synced != DICT_VERSION(self))
        ready_free(self); /* a change it could not follow */
}

static int
index_ass_sub(KeyIndex *self, PyObject *key, PyObject *value)
{
    int exact = index_exact(self, key), followed = ready_follows(self, key), r;
    Py_ssize_t before = PyDict_GET_SIZE(self);
    PyObject *old = exact || followed ? index_hold(self, key) : NULL;
    r = PyDict_Type.tp_as_mapping->mp_ass_subscript((PyObject *)self, key, value);
    ready_settle(self, key, followed, old, r == 0 ? value : NULL, r == 0);
    index_settle(self, key, exact, before);
    Py_XDECREF(old); /* its release, and whatever that does, after the counts are settled */
    return r;
}

/* Whether every key of the dict ``other`` is exact bytes that ``self`` (synced) does not hold:
 * its update then adds them all, replacing (and releasing) no value, so no Python code runs. */
static int
index_all_new(KeyIndex *self, PyObject *other)
{
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(other, &pos, &key, &value)) {
        if (!PyBytes_CheckExact(key))
            return 0;
        if (cell_get(self->cells, slot_of(self, key)) != 0) { /* maybe held: the dict says */
            int has = PyDict_Contains((PyObject *)self, key);
            if (has != 0) {
                if (has < 0)
                    PyErr_Clear();
                return 0;
            }
        }
    }
    return 1;
}

/* ``pop(key[, default])``, as dict's. */
static PyObject *
index_pop(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *key, *value;
    int exact, followed;
    Py_ssize_t before;
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "pop expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    key = args[0];
    exact = index_exact(self, key);
    followed = ready_follows(self, key);
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
        ready_settle(self, key, 0, NULL, NULL, 0);
        Py_DECREF(value);
        return NULL;
    }
    ready_settle(self, key, followed, value, NULL, 1);
    index_settle(self, key, exact, before);
    return value;
}

#if PY_VERSION_HEX < 0x030D0000 /* the hash ``other`` keeps, not asked of the key again (no longer exported since 3.13) */
#define DICT_NEXT_HASH(d, pos, key, value, hash) _PyDict_Next((d), (pos), (key), (value), (hash))
#define DICT_SET_HASH(d, key, value, hash) _PyDict_SetItem_KnownHash((d), (key), (value), (hash))
#else
#define DICT_NEXT_HASH(d, pos, key, value, hash) ((void)(hash), PyDict_Next((d), (pos), (key), (value)))
#define DICT_SET_HASH(d, key, value, hash) PyDict_SetItem((d), (key), (value))
#endif

/* ``update(other)`` of a dict ``other`` of exact bytes keys none of which ``self`` (synced)
 * holds: added and counted key by key, as item sets are (no Python code runs: bytes compare
 * in C, no value is replaced), so the growth of the counts and of the ready-key table goes on
 * as for item sets. Added by one ``dict.update``, the dict's table could move more than once
 * in the call (after the first move, a later table may take the address of the first), which
 * the growth's walk cannot tell from no move: it had to start over after every update, and at
 * one update in a hundred mutations it never finished. */
static PyObject *
index_add_new(KeyIndex *self, PyObject *other, int followed)
{
    Py_ssize_t pos = 0, owed = 0;
    Py_hash_t hash;
    PyObject *key, *value;
    const void *table = ((PyDictObject *)self)->ma_keys;
    while (DICT_NEXT_HASH(other, &pos, &key, &value, &hash)) {
        if (DICT_SET_HASH((PyObject *)self, key, value, hash) < 0) { /* no memory: those before it added */
            mark_stale(self);
            ready_settle(self, NULL, 0, NULL, NULL, 0);
            return NULL;
        }
        index_count_key(self, key);
        if (followed)
            ready_added(self, key, value);
        /* the growth's share, a part at a time, and at once where the dict's table moved (so
         * that it sees every move: one at most since its last call) */
        if (++owed == 64 || ((PyDictObject *)self)->ma_keys != table) {
            keyindex_grow(self, owed);
            owed = 0;
            table = ((PyDictObject *)self)->ma_keys;
        }
    }
    if (owed > 0)
        keyindex_grow(self, owed);
    if (followed && self->ready != NULL)
        self->ready_synced = DICT_VERSION(self);
    else
        ready_settle(self, NULL, 0, NULL, NULL, 0);
    self->synced = DICT_VERSION(self);
    Py_RETURN_NONE;
}

/* ``update(...)``, as dict's: a dict of bytes keys all new is counted key by key, else rebuilt. */
static PyObject *
index_update(KeyIndex *self, PyObject *args, PyObject *kwds)
{
    static PyObject *dict_update = NULL;
    PyObject *other = NULL, *r;
    int exact = index_synced(self), followed = ready_synced(self);
    if (dict_update == NULL) {
        dict_update = PyObject_GetAttrString((PyObject *)&PyDict_Type, "update");
        if (dict_update == NULL)
            return NULL;
    }
    if (PyTuple_GET_SIZE(args) == 1)
        other = PyTuple_GET_ITEM(args, 0);
    if (exact && (kwds == NULL || PyDict_GET_SIZE(kwds) == 0) && other != NULL && PyDict_CheckExact(other) && index_all_new(self, other))
        return index_add_new(self, other, followed);
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
    mark_stale(self);
    ready_settle(self, NULL, 0, NULL, NULL, 0);
    return r;
}

/* Count an index's keys now (an empty one's: MIN_SLOTS, 64 bytes), so that every later
 * mutation through the type keeps the counts exact: left unbuilt, the counts would be made
 * from the whole dict when a miss first consults them, an O(n) pause (3 ms at 200k keys) in
 * the caller's lookup. No memory: left unbuilt (the first consult builds them), no error. */
static void
index_count_now(KeyIndex *self)
{
    if (KEYINDEX_GUARDED && counts_rebuild(self, 1) < 0)
        PyErr_Clear();
}

static PyObject *
index_clear(KeyIndex *self, PyObject *unused)
{
    PyDict_Clear((PyObject *)self);
    PyMem_Free(self->cells);
    self->cells = NULL;
    ready_free(self);
    mark_stale(self); /* and the growth dropped */
    index_count_now(self); /* small again, and counted from the next key on */
    Py_RETURN_NONE;
}

/* ``self[key] = value`` for each key of a list or tuple, in order, as the item set does (the
 * filter kept exact); with ``key_bytes`` >= 0 it first stops at a key that is not exactly bytes
 * of that length. 1 if it set every key, 0 if it stopped at a bad one (those before it set),
 * -1 on an error (raised by that key's set; those before it set). */
static int
index_set_all(KeyIndex *self, PyObject *keys, PyObject *value, Py_ssize_t key_bytes)
{
    Py_ssize_t i;
    PyObject *key;
    int r;
    if (!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys)) {
        PyErr_Format(PyExc_TypeError, "keys: expected a list or tuple, got %.100s", Py_TYPE(keys)->tp_name);
        return -1;
    }
    if (value == keyindex_ready_value && ready_synced(self))
        ready_prefetch(self, keys); /* the keys' table lines, fetched together rather than one by one */
    for (i = 0; (key = seq_item(keys, i)) != NULL; i++) {
        if (key_bytes >= 0 && (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != key_bytes))
            return 0;
        Py_INCREF(key);
        r = index_ass_sub(self, key, value);
        Py_DECREF(key);
        if (r < 0)
            return -1;
    }
    return 1;
}

static PyObject *
index_reserve(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t key_bytes;
    int r;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "reserve expected 3 arguments (keys, value, key_bytes), got %zd", nargs);
        return NULL;
    }
    key_bytes = PyLong_AsSsize_t(args[2]);
    if (key_bytes == -1 && PyErr_Occurred())
        return NULL;
    if (key_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "key_bytes: expected a length >= 0, got %zd", key_bytes);
        return NULL;
    }
    r = index_set_all(self, args[0], args[1], key_bytes);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static PyObject *
index_assign(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "assign expected 2 arguments (keys, value), got %zd", nargs);
        return NULL;
    }
    if (index_set_all(self, args[0], args[1], -1) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
index_maybe(KeyIndex *self, PyObject *key)
{
    return PyBool_FromLong(!index_surely_absent(self, key));
}

static PyObject *
index_keep_ready(KeyIndex *self, PyObject *unused)
{
    self->wants_ready = 1;
    if (self->cells != NULL && self->slots / READY_LOAD < PyDict_GET_SIZE(self) + 1)
        mark_stale(self); /* counted in fewer slots than it now wants: recounted before next consulted */
    if (!ready_synced(self))
        ready_rebuild(self);
    Py_RETURN_NONE;
}

static PyObject *
index_held_ready(KeyIndex *self, PyObject *key)
{
    return PyBool_FromLong(index_surely_ready(self, key));
}

static PyObject *
index_filter_state(KeyIndex *self, PyObject *unused)
{
    return Py_BuildValue("{s:O,s:n,s:n,s:n,s:n,s:O,s:K,s:n,s:O,s:K}", "synced", index_synced(self) ? Py_True : Py_False, "slots", self->slots,
                         "saturated", self->saturated, "foreign", self->foreign, "ready", ready_synced(self) ? self->ready_count : -1,
                         "growing", self->next_cells != NULL ? Py_True : Py_False, "recounted", self->recounted,
                         "ready_slots", self->ready != NULL ? (Py_ssize_t)(self->ready_mask + 1) : -1, "ready_moving",
                         self->ready_old != NULL ? Py_True : Py_False, "ready_moved", self->ready_moved);
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
    return PyLong_FromSsize_t(n + (Py_ssize_t)(sizeof(KeyIndex) - sizeof(PyDictObject)) + (self->cells ? self->slots / 4 : 0) + (self->next_cells ? self->next_slots / 4 : 0) +
                              (self->ready ? (Py_ssize_t)((self->ready_mask + 1) * sizeof(ReadySlot)) : 0) +
                              (self->ready_old ? (Py_ssize_t)((self->ready_old_mask + 1) * sizeof(ReadySlot)) : 0) +
                              (Py_ssize_t)self->ready_spent_bytes);
}

static void
index_dealloc(KeyIndex *self)
{
    PyMem_Free(self->cells);
    self->cells = NULL;
    keyindex_grow_drop(self);
    ready_free(self);
    PyDict_Type.tp_dealloc((PyObject *)self);
}

/* A new index is left to the collector as an exact dict is: untracked while it holds only
 * objects the collector does not follow (bytes keys, int values), and tracked by dict's own
 * insert once it holds one it does. Kept tracked, every full collection would walk all of a
 * tier's keys: a pause in the engine's step loop that grows with the tier. */
static PyObject *
index_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *self = PyDict_Type.tp_new(type, args, kwds);
    if (self != NULL) {
        PyObject_GC_UnTrack(self);
        index_count_now((KeyIndex *)self); /* items passed to __init__ bypass the type: the version tag catches them */
    }
    return self;
}

static PyMappingMethods index_as_mapping = {
    .mp_ass_subscript = (objobjargproc)index_ass_sub, /* length and reads: dict's, inherited */
};

static PyMethodDef index_methods[] = {
    {"pop", (PyCFunction)(void (*)(void))index_pop, METH_FASTCALL, "pop(key[, default]): as dict's."},
    {"update", (PyCFunction)(void (*)(void))index_update, METH_VARARGS | METH_KEYWORDS, "update(...): as dict's."},
    {"clear", (PyCFunction)index_clear, METH_NOARGS, "clear(): as dict's."},
    {"reserve", (PyCFunction)(void (*)(void))index_reserve, METH_FASTCALL,
     "reserve(keys, value, key_bytes) -> bool: self[key] = value for each key of a list or tuple, in order, "
     "stopping at the first that is not exactly bytes of key_bytes (False; those before it set)."},
    {"assign", (PyCFunction)(void (*)(void))index_assign, METH_FASTCALL,
     "assign(keys, value): self[key] = value for each key of a list or tuple, in order."},
    {"maybe", (PyCFunction)index_maybe, METH_O,
     "maybe(key) -> bool: False only where the filter says ``key`` is surely absent (never for a key held)."},
    {"keep_ready", (PyCFunction)index_keep_ready, METH_NOARGS,
     "keep_ready(): keep a table of the keys mapped to READY from now on, which the C lookup reads before the "
     "dict on a hit (16 bytes a slot, at most 3/5 full)."},
    {"held_ready", (PyCFunction)index_held_ready, METH_O,
     "held_ready(key) -> bool: True only where the ready-key table answers that ``key`` maps to READY (never for "
     "another key; False also while the table is stale or not built)."},
    {"filter_state", (PyCFunction)index_filter_state, METH_NOARGS,
     "The filter as it stands: synced (its counts match the dict, no rebuild due), slots, saturated, foreign, "
     "ready (keys in the ready-key table; -1 when there is none), growing (a larger filter is being counted), "
     "recounted (dict entries counted from the dict so far, by rebuilds and growth), ready_slots (the ready-key "
     "table's; -1: none), ready_moving (an old ready-key table is being moved into a larger one), ready_moved "
     "(keys moved so far)."},
    {"__sizeof__", (PyCFunction)index_sizeof, METH_NOARGS, "Size in memory, in bytes, the filter's included."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject KeyIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.manager._probe.KeyIndex",
    .tp_basicsize = sizeof(KeyIndex),
    .tp_dealloc = (destructor)index_dealloc,
    .tp_as_mapping = &index_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "KeyIndex(): a dict that keeps a membership filter of its bytes keys, which a KeyProbe consults on a miss.",
    .tp_methods = index_methods,
    .tp_new = index_new,
};

int
keyindex_type_ready(void)
{
    if (keyindex_ready_value == NULL) {
        keyindex_ready_value = PyLong_FromLong(1); /* kvtier.bulk.READY: a cached small int, one object */
        if (keyindex_ready_value == NULL)
            return -1;
    }
    KeyIndexType.tp_base = &PyDict_Type;
    KeyIndexType.tp_traverse = PyDict_Type.tp_traverse;
    KeyIndexType.tp_clear = PyDict_Type.tp_clear; /* a mutation past the type: the version tag catches it */
    return PyType_Ready(&KeyIndexType);
}
