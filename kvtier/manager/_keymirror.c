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
 *
 * It grows without a pause (``ready_step``). Moved whole in the mutation that crossed 3/5, it
 * cost that one store call a walk of the table and a cache miss a key in the new one: up to
 * about 99 ms at 629,146 keys here. Now, past half full, a table of twice the slots is made (a
 * mapping of its own when large: zero pages, no memset) and takes every new key, and the old
 * table is walked MOVE_STEP slots a mutation, each key met put into the new one; the old
 * table's mapping is then given back a part at a time. Until the walk ends, a key is in one
 * table or both, and a lookup and a drop ask both:
 * - every key in the old table's slots behind the walk is in the new one too (the walk put it
 *   there, or the backward shift of a drop that moved it behind the walk, ``ready_cut``); so
 *   once the walk has passed the last slot the old table holds nothing the new one lacks;
 * - a key is held by one object, with one reference: the old table's until the walk moves it,
 *   then the new one's (the old slot keeps the address, borrowed: a drop removes the key from
 *   both tables, so no slot outlives its key); a key a shift put back ahead of the walk after
 *   it was moved is met again there and found already held;
 * - ``ready_count`` counts the keys, wherever they are, so "absent" (the table holds every key
 *   of the dict) stays exact throughout.
 */
#define PY_SSIZE_T_CLEAN
#include "_keyindex.h"

#define READY_MIN_SLOTS 64
#define READY_FILL 3              /* fifths of the slots that may be taken */
#define MOVE_STEP 4               /* slots of an old table moved per mutation */
#define MOVE_PART 32              /* moved in parts of this many slots (their lines fetched together) */
#define MAP_BYTES (1u << 20)      /* a table this large or larger is a mapping of its own */
#define GIVE_STEP 4096            /* bytes of a moved old table's mapping given back per mutation */
#define GIVE_PART (64u << 10)     /* given back in parts of this many bytes */

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#define READY_MAPPED 1
#else
#define READY_MAPPED 0
#endif

PyObject *keyindex_ready_value;

/* A zeroed table of ``slots`` slots (NULL: no memory). A large one is a mapping of its own: its
 * pages are zero until written (no memset of megabytes in one call: calloc out of a heap that
 * malloc keeps memsets it), and it can be given back a part at a time (``ready_give``), where a
 * free of the whole cost one call 68 us a MiB here (17 ms at 2^24 slots). */
static ReadySlot *
ready_alloc(size_t slots)
{
    size_t bytes = slots * sizeof(ReadySlot);
#if READY_MAPPED
    if (bytes >= MAP_BYTES) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
#endif
    return PyMem_Calloc(slots, sizeof(ReadySlot));
}

/* Let go of a table of ``slots`` slots made by ``ready_alloc`` (its keys released or moved). */
static void
ready_dealloc(ReadySlot *table, size_t slots)
{
#if READY_MAPPED
    if (slots * sizeof(ReadySlot) >= MAP_BYTES) {
        munmap(table, slots * sizeof(ReadySlot));
        return;
    }
#endif
    PyMem_Free(table);
}

/* Give back ``bytes`` more of a moved old table's mapping, from its end (all that is left, at
 * most), rounded down to whole parts unless it is the rest. */
static void
ready_give(KeyIndex *self, size_t bytes)
{
#if READY_MAPPED
    size_t left = self->ready_spent_bytes;
    if (bytes >= left)
        bytes = left;
    else
        bytes -= bytes % GIVE_PART;
    if (bytes == 0)
        return;
    munmap(self->ready_spent + left - bytes, bytes);
    self->ready_spent_bytes = left - bytes;
    if (self->ready_spent_bytes == 0)
        self->ready_spent = NULL;
#endif
}

/* Release the references a table of ``mask`` + 1 slots holds, and the table. */
static void
ready_release(ReadySlot *slots, size_t mask)
{
    size_t i;
    for (i = 0; i <= mask; i++)
        Py_XDECREF(slots[i].key); /* exact bytes: releasing one runs no Python code */
    ready_dealloc(slots, mask + 1);
}

void
ready_free(KeyIndex *self)
{
    ReadySlot *slots = self->ready, *old = self->ready_old;
    size_t i;
    if (slots == NULL)
        return;
    self->ready = NULL; /* first: nothing consults a table being released */
    self->ready_old = NULL;
    ready_give(self, (size_t)-1);
    /* an old table's key not moved yet is its own reference, unless a shift put it past the walk
     * after it was moved (then the larger table holds it, by the same object) */
    for (i = self->ready_walk; old != NULL && i <= self->ready_old_mask; i++) {
        if (old[i].key != NULL && !ready_in(slots, self->ready_mask, old[i].key, old[i].hash))
            Py_DECREF(old[i].key);
    }
    if (old != NULL)
        ready_dealloc(old, self->ready_old_mask + 1);
    ready_release(slots, self->ready_mask);
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

/* The slot of ``slots`` holding ``key``'s bytes, or -1. */
static Py_ssize_t
ready_find(const ReadySlot *slots, size_t mask, PyObject *key, Py_hash_t hash)
{
    size_t i;
    for (i = (size_t)hash & mask; slots[i].key != NULL; i = (i + 1) & mask) {
        if (ready_same(&slots[i], key, hash))
            return (Py_ssize_t)i;
    }
    return -1;
}

/* Move ``key`` (a slot of the old table) into the table in use unless its bytes are there
 * already; its reference goes with it: the old slot keeps the address, borrowed, until the old
 * table is let go or the key dropped from both. */
static void
ready_adopt(KeyIndex *self, PyObject *key, Py_hash_t hash)
{
    ReadySlot *slots = self->ready;
    size_t i, mask = self->ready_mask;
    for (i = (size_t)hash & mask; slots[i].key != NULL; i = (i + 1) & mask) {
        if (ready_same(&slots[i], key, hash))
            return;
    }
    slots[i].hash = hash;
    slots[i].key = key;
    self->ready_moved++;
}

/* Move up to ``budget`` more slots of the old table; once every one is, let it go (its slots
 * only borrow then). */
static void
ready_move(KeyIndex *self, size_t budget)
{
    ReadySlot *old = self->ready_old;
#if defined(__GNUC__) || defined(__clang__)
    size_t i;
    for (i = self->ready_walk; budget <= 2 * MOVE_PART && i < self->ready_walk + budget && i <= self->ready_old_mask; i++) {
        if (old[i].key != NULL) /* their lines in the new table, fetched together rather than one by one */
            __builtin_prefetch(&self->ready[(size_t)old[i].hash & self->ready_mask], 1);
    }
#endif
    for (; budget > 0 && self->ready_walk <= self->ready_old_mask; budget--, self->ready_walk++) {
        if (old[self->ready_walk].key != NULL)
            ready_adopt(self, old[self->ready_walk].key, old[self->ready_walk].hash);
    }
    if (self->ready_walk > self->ready_old_mask) {
        size_t bytes = (self->ready_old_mask + 1) * sizeof(ReadySlot);
        self->ready_old = NULL;
        if (!READY_MAPPED || bytes < MAP_BYTES) {
            ready_dealloc(old, self->ready_old_mask + 1);
            return;
        }
        self->ready_spent = (char *)old; /* given back a part a mutation from now on */
        self->ready_spent_bytes = bytes;
        self->ready_credit = 0;
    }
}

/* Start the move into a table of twice the slots, which takes the new keys from now on; -1
 * where no memory (nothing changed). */
static int
ready_grow(KeyIndex *self)
{
    size_t slots = (self->ready_mask + 1) * 2;
    ReadySlot *fresh = ready_alloc(slots);
    if (fresh == NULL)
        return -1;
    self->ready_old = self->ready;
    self->ready_old_mask = self->ready_mask;
    self->ready = fresh;
    self->ready_mask = slots - 1;
    self->ready_walk = 0;
    self->ready_credit = 0;
    return 0;
}

/* The growth's share of one or more mutations: past half full a table of twice the slots
 * takes the new keys, and the old table is moved into it MOVE_STEP slots a mutation, in fewer
 * mutations than the keys take to reach the larger table's limit; then the old table's
 * mapping is given back GIVE_STEP bytes a mutation (in parts of GIVE_PART). So no mutation
 * pays for a whole table (an update steps once a key it adds). While it is moved, the keys are
 * in one table or both (a lookup asks both), the new ones in the larger. */
static void
ready_step(KeyIndex *self, size_t mutations)
{
    if (self->ready == NULL)
        return;
    if (self->ready_old != NULL) {
        self->ready_credit += mutations * MOVE_STEP;
        if (self->ready_credit >= MOVE_PART) {
            ready_move(self, self->ready_credit);
            self->ready_credit = 0;
        }
        return;
    }
    if (self->ready_spent != NULL) {
        self->ready_credit += mutations * GIVE_STEP;
        if (self->ready_credit >= GIVE_PART) {
            ready_give(self, self->ready_credit);
            self->ready_credit = 0;
        }
        return;
    }
    if ((size_t)self->ready_count * 2 > self->ready_mask + 1)
        (void)ready_grow(self); /* no memory: the table in use takes keys up to its limit, and is asked again */
}

/* Room in the table in use for one more key: where it is at its limit (only where the larger
 * table could not be made when due: no memory then), the growth is done whole in this call;
 * -1 where there is still no memory. */
static int
ready_room(KeyIndex *self)
{
    if ((size_t)(self->ready_count + 1) * 5 <= (self->ready_mask + 1) * READY_FILL)
        return 0;
    if (self->ready_old != NULL)
        ready_move(self, (size_t)-1);
    ready_give(self, (size_t)-1);
    if (ready_grow(self) < 0)
        return -1;
    ready_move(self, (size_t)-1);
    return 0;
}

/* Hold ``key`` (exact bytes, mapped to READY by the dict; not held: the dict mapped it to
 * another value, or did not hold it, and the table was exact), unless its bytes are in the
 * table in use already (a check for free: one walk of its probe run, which ends at the slot it
 * takes). The old table of a move is not asked: a key not yet moved is a key held. */
static void
ready_hold(KeyIndex *self, PyObject *key, Py_hash_t hash)
{
    ReadySlot *slots;
    size_t i, mask;
    if (self->ready == NULL)
        return;
    if (ready_room(self) < 0) {
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

/* Empty slot ``i`` of ``slots``: the slots after it that probed past it move back. In the old
 * table of a move (``old``), a key moved back before the walk is moved into the table in use
 * now, as the walk would have (the walk moves each slot once: behind it, a key not moved yet
 * would stay unmoved). */
static void
ready_cut(KeyIndex *self, ReadySlot *slots, size_t mask, size_t i, int old)
{
    size_t j, home;
    for (j = (i + 1) & mask; slots[j].key != NULL; j = (j + 1) & mask) {
        home = (size_t)slots[j].hash & mask;
        /* slot j may fill the gap at i unless its home lies cyclically in (i, j] */
        if (i <= j ? (home <= i || home > j) : (home <= i && home > j)) {
            slots[i] = slots[j];
            if (old && i < self->ready_walk)
                ready_adopt(self, slots[i].key, slots[i].hash);
            i = j;
        }
    }
    slots[i].key = NULL;
}

/* Let go of ``key``'s bytes if held, in the table in use and, while one is moved, the old one
 * (one object, one reference: the old table's own until moved, then the new one's). */
static void
ready_drop(KeyIndex *self, PyObject *key, Py_hash_t hash)
{
    Py_ssize_t at;
    PyObject *held = NULL;
    if (self->ready == NULL)
        return;
    if ((at = ready_find(self->ready, self->ready_mask, key, hash)) >= 0) {
        held = self->ready[at].key;
        ready_cut(self, self->ready, self->ready_mask, (size_t)at, 0);
    }
    if (self->ready_old != NULL && (at = ready_find(self->ready_old, self->ready_old_mask, key, hash)) >= 0) {
        if (held == NULL)
            held = self->ready_old[at].key;
        ready_cut(self, self->ready_old, self->ready_old_mask, (size_t)at, 1);
    }
    if (held == NULL)
        return;
    self->ready_count--;
    Py_DECREF(held); /* after the tables are whole again: exact bytes, no Python code */
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
    self->ready = ready_alloc(slots);
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
    ready_step(self, 1);
    self->ready_synced = DICT_VERSION(self);
}

void
ready_added(KeyIndex *self, PyObject *key, PyObject *value)
{
    if (value == keyindex_ready_value && self->ready != NULL)
        ready_hold(self, key, PyObject_Hash(key));
    ready_step(self, 1);
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
