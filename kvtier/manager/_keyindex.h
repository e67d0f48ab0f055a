/* KeyIndex as _probe.c and _keyindex.c see it: its layout, its type, and the filter's reads
 * (inline: a probe's miss path runs them). Private to the extension kvtier.manager._probe. */
#ifndef KVTIER_KEYINDEX_H
#define KVTIER_KEYINDEX_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define KEYINDEX_INTERNAL __attribute__((visibility("hidden")))
#else
#define KEYINDEX_INTERNAL
#endif

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

/* One slot of the ready-key table (_keymirror.c): a key of the dict whose value is READY, held
 * by a strong reference (so its address is never reused while the slot names it), and its
 * hash. An empty slot has ``key`` NULL. */
typedef struct {
    Py_hash_t hash;
    PyObject *key;
} ReadySlot;

typedef struct {
    PyDictObject dict;
    uint8_t *cells;        /* 2-bit counters, four a byte; made with the index (NULL: no memory then) */
    Py_ssize_t slots;      /* counters: a power of two, >= 4 per key when built */
    int shift;             /* 64 - log2(slots): the mix's top bits pick a slot */
    int stale;             /* the counts may not match the dict: rebuild before use */
    Py_ssize_t saturated;  /* counters at TOP */
    Py_ssize_t foreign;    /* keys that are not exact bytes (while any, no filter) */
    uint64_t synced;       /* the dict's version when the counts last matched it */
    ReadySlot *ready;      /* the ready keys, open addressing (NULL: none, or dropped) */
    size_t ready_mask;     /* slots - 1 (a power of two) */
    Py_ssize_t ready_count; /* keys held, in ``ready`` and ``ready_old`` together */
    ReadySlot *ready_old;  /* the table ``ready`` grew out of, moved a few slots a mutation (NULL: none) */
    size_t ready_old_mask;
    size_t ready_walk;     /* ``ready_old``'s slots before this one are moved: each key there is in ``ready`` too */
    char *ready_spent;     /* a moved old table's mapping, given back a part a mutation (NULL: none) */
    size_t ready_spent_bytes; /* what is left of it */
    size_t ready_credit;   /* slots to move, or bytes to give back, that the mutations since the last part earned */
    unsigned long long ready_moved; /* keys moved from an old table into a larger one, in all */
    uint64_t ready_synced; /* the dict's version when the table last matched it */
    int wants_ready;       /* keep_ready() was called: counts rebuilt from the dict rebuild the table too */
    uint8_t *next_cells;   /* the counts the index grows into, made a few entries a mutation (_keygrow.c); NULL: none */
    Py_ssize_t next_slots;
    int next_shift;
    Py_ssize_t next_saturated;
    Py_ssize_t next_zeroed; /* bytes of ``next_cells`` zeroed so far: keys are counted into it once all are */
    Py_ssize_t next_pos;   /* the dict's entries before this position are counted into ``next_cells`` (-1: all) */
    const void *next_keys; /* the dict's entry table that position is in (another: its entries moved, start over) */
    Py_ssize_t next_after; /* it takes over once every entry is counted and the dict holds more keys than this */
    unsigned long long recounted; /* dict entries counted from the dict (rebuilds and growth), in all */
} KeyIndex;

#define LOAD 2       /* slots per key, at least: the counts grow to twice the slots before the keys pass slots / LOAD */
#define READY_LOAD 8 /* LOAD of an index that keeps a ready-key table (a memory tier's) */
#define TOP 3u       /* a counter that reached it stays (it can only say "maybe") */

KEYINDEX_INTERNAL extern PyTypeObject KeyIndexType;

/* Ready KeyIndexType (a dict subclass); 0, or -1 with an error set. */
KEYINDEX_INTERNAL int keyindex_type_ready(void);

/* Count every key of the dict afresh into slots enough for it (and rebuild the ready-key
 * table); 0, or -1 with MemoryError. */
KEYINDEX_INTERNAL int keyindex_rebuild(KeyIndex *self);

/* The ready-key table (_keymirror.c), kept up to date by the mutations through the type and
 * consulted only while it matches the dict (ready_synced). READY is the int 1 (kvtier.bulk). */
KEYINDEX_INTERNAL extern PyObject *keyindex_ready_value;
/* Drop the table (its references released). */
KEYINDEX_INTERNAL void ready_free(KeyIndex *self);
/* Build the table afresh from the dict (synced with it); on no memory the index is left without
 * one (no error). */
KEYINDEX_INTERNAL void ready_rebuild(KeyIndex *self);
/* After a mutation by exact-bytes ``key`` (``was_ready``: the dict mapped it to READY before,
 * so the table, exact until then, holds it): hold it when the dict maps it to READY now, else
 * not. ``known``: ``is_ready`` says what the dict maps it to now (else the dict is asked). On
 * no memory the table is dropped (no error); an error already set is kept. */
KEYINDEX_INTERNAL void ready_note(KeyIndex *self, PyObject *key, int was_ready, int is_ready, int known);
/* Fetch the table lines of a list or tuple of keys into the cache, ahead of their notes. */
KEYINDEX_INTERNAL void ready_prefetch(KeyIndex *self, PyObject *keys);
/* ``key`` (exact bytes, its ``value`` just stored by an update that added it): hold it if READY
 * (the caller marks the table synced once every key is noted). */
KEYINDEX_INTERNAL void ready_added(KeyIndex *self, PyObject *key, PyObject *value);

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

/* Slots per key, at least, for this index. A memory tier's index (``keep_ready``) gets four
 * times more: a filter at 2-4 slots a key lets about a third of the misses through to the
 * table's probe (a hash and a cache miss each), one at 8-16 about a tenth, for 1.5-3 bytes a
 * key more, which its ready-key table (27-53 bytes a key) dwarfs. A disk tier's index of
 * millions of records keeps the smaller filter. */
static inline Py_ssize_t
slots_per_key(const KeyIndex *self)
{
    return self->wants_ready ? READY_LOAD : LOAD;
}

/* The growth of the counts (_keygrow.c). Where the keys near the slots' limit (three quarters
 * of it) or too many counters stuck at TOP, a larger (or fresh) table is counted a few dict
 * entries per mutation and takes over once every entry is counted, so that no one call
 * recounts the whole dict. Its counts are never below the keys it holds: every key added
 * meanwhile is counted into it too, a key removed meanwhile is left counted (a "maybe", not a
 * wrong answer), and where the dict's own table is rebuilt (its entries move) the count
 * starts over. ``keyindex_grow``: after a mutation counted in ``cells`` that added or removed
 * ``mutations`` keys, start or go on with that count. ``keyindex_grow_drop``: forget it (the
 * counts are stale or recounted whole). */
KEYINDEX_INTERNAL void keyindex_grow(KeyIndex *self, Py_ssize_t mutations);
KEYINDEX_INTERNAL void keyindex_grow_drop(KeyIndex *self);

/* Count exact-bytes ``key`` (just added to the dict) in the counts, and in those it grows into. */
static inline void
index_count_key(KeyIndex *self, PyObject *key)
{
    uint64_t mix = key_mix(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
    self->saturated += cell_add(self->cells, mix >> self->shift);
    if (self->next_cells != NULL && self->next_zeroed == self->next_slots / 4)
        self->next_saturated += cell_add(self->next_cells, mix >> self->next_shift);
}

/* Whether the counts match the dict now (rebuilding them if not); 0 when they cannot be used. */
static inline int
index_ready(KeyIndex *self)
{
    if (!KEYINDEX_GUARDED)
        return 0;
    if (self->stale || self->cells == NULL || self->synced != DICT_VERSION(self)) {
        if (keyindex_rebuild(self) < 0) {
            PyErr_Clear(); /* no memory for the filter: the dict answers */
            return 0;
        }
    }
    return self->foreign == 0;
}

/* Whether the counts match the dict now, as they are (no rebuild). */
static inline int
index_synced(KeyIndex *self)
{
    return KEYINDEX_GUARDED && !self->stale && self->foreign == 0 && self->cells != NULL && self->synced == DICT_VERSION(self);
}

/* Whether the ready-key table matches the dict now: no mutation since it was last brought up
 * to date (a mutation it did not follow, whoever made it, changed the dict's version). */
static inline int
ready_synced(KeyIndex *self)
{
    return KEYINDEX_GUARDED && self->ready != NULL && self->ready_synced == DICT_VERSION(self);
}

/* Whether ``slot`` (not empty) holds ``key``'s bytes: the same object, or equal bytes. */
static inline int
ready_same(const ReadySlot *slot, PyObject *key, Py_hash_t hash)
{
    PyObject *held = slot->key;
    return held == key || (slot->hash == hash && PyBytes_GET_SIZE(held) == PyBytes_GET_SIZE(key) &&
                           memcmp(PyBytes_AS_STRING(held), PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key)) == 0);
}

/* Whether ``slots`` (a table of ``mask`` + 1 slots) holds ``key``'s bytes. */
static inline int
ready_in(const ReadySlot *slots, size_t mask, PyObject *key, Py_hash_t hash)
{
    size_t i;
    for (i = (size_t)hash & mask; slots[i].key != NULL; i = (i + 1) & mask) {
        if (ready_same(&slots[i], key, hash))
            return 1;
    }
    return 0;
}

/* What the ready-key table says of ``key``, while it matches the dict: 1, the dict surely maps
 * it to READY (one cache line of the table for a key stored as this very object, where the
 * dict's own probe reads its index and then its entries); -1, the dict surely does not hold it
 * (the table misses it and holds every key of the dict, so a miss the filter let through ends
 * here, without the dict's two lines); 0, ask the dict. Never an error. */
static inline int
index_ready_answer(KeyIndex *self, PyObject *key)
{
    Py_hash_t hash;
    if (self->ready == NULL || !PyBytes_CheckExact(key) || !ready_synced(self))
        return 0;
    hash = PyObject_Hash(key); /* bytes: cached after the first, never fails */
    if (ready_in(self->ready, self->ready_mask, key, hash) ||
        (self->ready_old != NULL && ready_in(self->ready_old, self->ready_old_mask, key, hash)))
        return 1; /* while the table grows, a key not moved yet is in the old one */
    return self->ready_count == PyDict_GET_SIZE(self) ? -1 : 0;
}

/* 1 if the dict surely maps ``key`` to READY (the ready-key table says so), else 0. */
static inline int
index_surely_ready(KeyIndex *self, PyObject *key)
{
    return index_ready_answer(self, key) > 0;
}

/* 1 if ``key`` is surely not in the dict (no dict probe needed), else 0. Never an error. */
static inline int
index_surely_absent(KeyIndex *self, PyObject *key)
{
    if (!PyBytes_CheckExact(key) || self->foreign != 0 || !index_ready(self))
        return 0;
    return cell_get(self->cells, slot_of(self, key)) == 0;
}

/* ``keys[i]`` of a list or tuple, borrowed; NULL past its end (a list is read again each time:
 * code run between two reads, a value released or a key probed, may change it). */
static inline PyObject *
seq_item(PyObject *keys, Py_ssize_t i)
{
    if (PyTuple_CheckExact(keys))
        return i < PyTuple_GET_SIZE(keys) ? PyTuple_GET_ITEM(keys, i) : NULL;
    return i < PyList_GET_SIZE(keys) ? PyList_GET_ITEM(keys, i) : NULL;
}

#endif
