/* The ready-key table of a ``KeyIndex``: the keys the dict maps to READY, in one open-addressing
 * table of (hash, key) slots, so that a lookup hit reads one cache line of it where the dict's
 * own probe reads its index array and then its entry array (two dependent misses at 10^5 keys
 * and more). KeyProbe (_probe.c) consults it through ``index_ready_answer`` (_keyindex.h); a
 * key it does not hold goes to the dict, unless it holds every key of the dict (then the key is
 * surely absent), so it only ever answers "ready" for a key the dict maps to READY:
 *
 * - it is kept only where asked for (``KeyIndex.keep_ready()``: a tier whose blocks live in
 *   memory, where 27-53 bytes a key are nothing beside the block; not a disk tier's index of
 *   millions of records); it is built then, and every mutation through the type of an exact
 *   bytes key notes its key here; any other mutation (another key type, dict's own methods or
 *   C API, an ``update`` it cannot follow) drops it, and the dict's version tag, changed by
 *   every mutation whoever makes it, keeps it from being consulted once a mutation went past
 *   it (``ready_synced``). A dropped table is rebuilt with the filter's counts (at the next
 *   miss that consults them);
 * - it exists only while every key of the dict is exact bytes (a rebuild over a key of another
 *   type builds none, and a mutation by one drops it): then no mutation it follows can run
 *   Python code midway (bytes compare in C; a replaced or deleted value is held until the
 *   table is settled), so each note sees the key's state before and after its own mutation;
 * - each slot holds a strong reference to its key, so a key object's address cannot be reused
 *   by another object while a slot names it (a hit by identity is a hit of that very key), and
 *   a key asked as another object of the same bytes is compared by its bytes;
 * - where memory runs out the table is dropped and the dict answers every lookup.
 *
 * Linear probing, at most 3/5 full (fuller, an eviction's backward shift and an insert's walk
 * to a free slot cross more lines), deletion by backward shift (no tombstones).
 */
#define PY_SSIZE_T_CLEAN
#include "_keyindex.h"

#define READY_MIN_SLOTS 64
#define READY_FILL 3 /* fifths of the slots that may be taken */

PyObject *keyindex_ready_value;

void
ready_free(KeyIndex *self)
{
    ReadySlot *slots = self->ready;
    size_t i;
    if (slots == NULL)
        return;
    self->ready = NULL; /* first: nothing consults a table being released */
    for (i = 0; i <= self->ready_mask; i++)
        Py_XDECREF(slots[i].key); /* exact bytes: releasing one runs no Python code */
    PyMem_Free(slots);
    self->ready_mask = 0;
    self->ready_count = 0;
}

/* Slots enough for ``n`` keys at most 3/5 full. */
static size_t
ready_slots_for(Py_ssize_t n)
{
    size_t slots = READY_MIN_SLOTS;
    while ((size_t)n * 5 > slots * READY_FILL)
        slots *= 2;
    return slots;
}

/* Put ``key`` (not held yet) into ``slots``, taking a reference. */
static void
ready_place(ReadySlot *slots, size_t mask, PyObject *key, Py_hash_t hash)
{
    size_t i = (size_t)hash & mask;
    while (slots[i].key != NULL)
        i = (i + 1) & mask;
    slots[i].hash = hash;
    slots[i].key = Py_NewRef(key);
}

/* The slot holding ``key``'s bytes, or -1. */
static Py_ssize_t
ready_find(const KeyIndex *self, PyObject *key, Py_hash_t hash)
{
    size_t i, mask = self->ready_mask;
    for (i = (size_t)hash & mask; self->ready[i].key != NULL; i = (i + 1) & mask) {
        if (ready_same(&self->ready[i], key, hash))
            return (Py_ssize_t)i;
    }
    return -1;
}

/* Move the table to ``slots`` slots; 0, or -1 (no memory; the table unchanged). */
static int
ready_resize(KeyIndex *self, size_t slots)
{
    ReadySlot *fresh = PyMem_Calloc(slots, sizeof(ReadySlot)), *old = self->ready;
    size_t i;
    if (fresh == NULL)
        return -1;
    for (i = 0; old != NULL && i <= self->ready_mask; i++) {
        if (old[i].key != NULL) {
            size_t j = (size_t)old[i].hash & (slots - 1);
            while (fresh[j].key != NULL)
                j = (j + 1) & (slots - 1);
            fresh[j] = old[i]; /* the reference moves with it */
        }
    }
    PyMem_Free(old);
    self->ready = fresh;
    self->ready_mask = slots - 1;
    return 0;
}

/* Hold ``key`` (exact bytes, mapped to READY by the dict), unless its bytes are held already:
 * one walk of its probe run, which ends at the slot it takes. */
static void
ready_hold(KeyIndex *self, PyObject *key, Py_hash_t hash)
{
    ReadySlot *slots;
    size_t i, mask;
    if (self->ready == NULL)
        return;
    if ((size_t)(self->ready_count + 1) * 5 > (self->ready_mask + 1) * READY_FILL && ready_resize(self, (self->ready_mask + 1) * 2) < 0) {
        ready_free(self); /* no memory: the dict answers until the next rebuild */
        return;
    }
    slots = self->ready;
    mask = self->ready_mask;
    for (i = (size_t)hash & mask; slots[i].key != NULL; i = (i + 1) & mask) {
        if (ready_same(&slots[i], key, hash))
            return;
    }
    slots[i].hash = hash;
    slots[i].key = Py_NewRef(key);
    self->ready_count++;
}

/* Let go of ``key``'s bytes if held: the slots after it that probed past it move back. */
static void
ready_drop(KeyIndex *self, PyObject *key, Py_hash_t hash)
{
    ReadySlot *slots = self->ready;
    size_t mask = self->ready_mask, i, j, home;
    Py_ssize_t at;
    PyObject *held;
    if (slots == NULL || (at = ready_find(self, key, hash)) < 0)
        return;
    i = (size_t)at;
    held = slots[i].key;
    for (j = (i + 1) & mask; slots[j].key != NULL; j = (j + 1) & mask) {
        home = (size_t)slots[j].hash & mask;
        /* slot j may fill the gap at i unless its home lies cyclically in (i, j] */
        if (i <= j ? (home <= i || home > j) : (home <= i && home > j)) {
            slots[i] = slots[j];
            i = j;
        }
    }
    slots[i].key = NULL;
    self->ready_count--;
    Py_DECREF(held); /* after the table is whole again: exact bytes, no Python code */
}

void
ready_rebuild(KeyIndex *self)
{
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    size_t slots = ready_slots_for(PyDict_GET_SIZE(self)); /* room for every key: one pass */
    ready_free(self);
    while (PyDict_Next((PyObject *)self, &pos, &key, &value)) {
        if (!PyBytes_CheckExact(key))
            return; /* no table while the dict holds a key of another type (see the top) */
    }
    pos = 0;
    self->ready = PyMem_Calloc(slots, sizeof(ReadySlot));
    if (self->ready == NULL)
        return; /* no table: the dict answers */
    self->ready_mask = slots - 1;
    while (PyDict_Next((PyObject *)self, &pos, &key, &value)) {
        if (value == keyindex_ready_value) {
            ready_place(self->ready, self->ready_mask, key, PyObject_Hash(key));
            self->ready_count++;
        }
    }
    self->ready_synced = DICT_VERSION(self);
}

void
ready_note(KeyIndex *self, PyObject *key, int was_ready, int is_ready, int known)
{
    PyObject *type, *error, *trace, *value;
    if (self->ready == NULL)
        return;
    if (!known) {
        PyErr_Fetch(&type, &error, &trace); /* the mutation's own error stays for its caller */
        value = PyDict_GetItemWithError((PyObject *)self, key); /* exact bytes keys only: no Python code */
        if (value == NULL && PyErr_Occurred()) {
            PyErr_Clear();
            ready_free(self);
            PyErr_Restore(type, error, trace);
            return;
        }
        PyErr_Restore(type, error, trace);
        is_ready = value == keyindex_ready_value;
    }
    if (is_ready && !was_ready)
        ready_hold(self, key, PyObject_Hash(key));
    else if (was_ready && !is_ready) /* held (the table was exact): no longer READY */
        ready_drop(self, key, PyObject_Hash(key));
    self->ready_synced = DICT_VERSION(self);
}

void
ready_added(KeyIndex *self, PyObject *key, PyObject *value)
{
    if (value == keyindex_ready_value && self->ready != NULL)
        ready_hold(self, key, PyObject_Hash(key));
}

void
ready_prefetch(KeyIndex *self, PyObject *keys)
{
    Py_ssize_t i;
    PyObject *key;
    for (i = 0; (key = seq_item(keys, i)) != NULL; i++) {
        if (PyBytes_CheckExact(key)) {
#if defined(__GNUC__) || defined(__clang__)
            __builtin_prefetch(&self->ready[(size_t)PyObject_Hash(key) & self->ready_mask], 1);
#endif
        }
    }
}
