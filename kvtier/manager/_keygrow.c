/* The growth of a KeyIndex's counts (see _keyindex.h), spread over the mutations that call for it.
 *
 * Recounted whole the moment the keys outgrew the slots, the counts cost one store call a walk
 * over every key of the dict (a cache miss or two a key): 26-85 ms in the one call that
 * crossed 524,288 keys of a memory tier's index here, against a median store call of 9 us. Now
 * the larger table is made when the keys pass three quarters of what the slots allow (or when
 * too many counters are stuck at TOP, a fresh table of the size the keys need), and each later
 * mutation through the type counts GROW_STEP more of the dict's entries into it, in the dict's
 * own order (``PyDict_Next``'s position). While it grows, the counts in use stay exact and
 * answer; every key added meanwhile is counted into both tables, so the new one misses no key:
 * one the walk had not reached is counted by the walk, one it had is counted as it comes (one
 * added past the walk is counted twice: a "maybe", never a wrong answer). A key removed
 * meanwhile stays counted in the new table, for the same reason. Once the walk has passed the
 * last entry the new table takes over; counts at or above the keys each slot holds are all the
 * filter needs (it says absent only at zero).
 *
 * The walk's position is an index into the dict's entries, valid while the dict keeps its entry
 * table: a dict that resizes (as it grows, or to drop deleted entries) moves every entry, so
 * the walk starts over, on a fresh table, from the first entry. With the walk started at three
 * quarters of the limit and GROW_STEP entries a mutation, it passes the dict's entries (at most
 * about twice its keys) in fewer mutations than the keys take to reach the limit, and a dict
 * growing without removals does not resize inside that span (its resizes come at two thirds
 * of a power of two, the limit is a power of two). Had the keys outgrown the slots first, the
 * counts in use would still be exact, only fuller: more "maybe" answers until it is done.
 */
#define PY_SSIZE_T_CLEAN
#include "_keyindex.h"

#define GROW_STEP 8    /* dict entries counted into the growing table per key added or removed */
#define ZERO_STEP 1024 /* bytes of it zeroed per key added or removed, before the count starts */

void
keyindex_grow_drop(KeyIndex *self)
{
    PyMem_Free(self->next_cells);
    self->next_cells = NULL;
}

/* Start counting into ``slots`` new slots, to take over past ``after`` keys; -1 (no error set)
 * where there is no memory. The table is zeroed ZERO_STEP bytes a mutation first (not by
 * calloc: out of a heap that malloc keeps, that is a memset of megabytes in one call, 1 ms at
 * 2 MiB here), and counted only then: the walk starts once it is zeroed, so it counts every
 * key added meanwhile. */
static int
grow_start(KeyIndex *self, Py_ssize_t slots, int shift, Py_ssize_t after)
{
    uint8_t *cells = PyMem_Malloc((size_t)slots / 4);
    if (cells == NULL)
        return -1;
    self->next_cells = cells;
    self->next_slots = slots;
    self->next_shift = shift;
    self->next_after = after;
    self->next_zeroed = 0;
    return 0;
}

/* Zero (or zero again) the growing table from its start, and count the dict into it from its first entry. */
static void
grow_restart(KeyIndex *self)
{
    self->next_zeroed = 0;
    self->next_saturated = 0;
    self->next_pos = 0;
}

/* Whether the counts in use call for a larger or fresh table: the slots for it (and its shift),
 * and the keys past which it takes over (the limit of the counts in use where they only near
 * it: the filter's size, and so its bytes a key, are those of a recount at the limit). */
static int
grow_due(KeyIndex *self, Py_ssize_t *slots, int *shift, Py_ssize_t *after)
{
    Py_ssize_t n = PyDict_GET_SIZE(self), limit = self->slots / slots_per_key(self);
    if (n <= limit - limit / 4 && self->saturated <= self->slots / 32)
        return 0;
    *slots = self->slots;
    *shift = self->shift;
    *after = 0;
    if (n > limit - limit / 4) { /* twice the slots, at least (more where an update added many) */
        *slots *= 2;
        *shift -= 1;
        *after = limit;
    }
    while (*slots / slots_per_key(self) < n + 1) {
        *slots *= 2;
        *shift -= 1;
    }
    return 1;
}

void
keyindex_grow(KeyIndex *self, Py_ssize_t mutations)
{
    Py_ssize_t budget = mutations * GROW_STEP, size;
    PyObject *key, *value;
    if (self->next_cells == NULL) {
        Py_ssize_t slots, after;
        int shift;
        if (!grow_due(self, &slots, &shift, &after) || grow_start(self, slots, shift, after) < 0)
            return; /* no memory: the counts in use stay exact, and are asked again next mutation */
        grow_restart(self);
    }
    size = self->next_slots / 4;
    if (self->next_zeroed == size && self->next_pos >= 0 && self->next_keys != (const void *)((PyDictObject *)self)->ma_keys)
        grow_restart(self); /* the dict moved its entries under the walk: some may now lie behind it */
    if (self->next_zeroed < size) {
        Py_ssize_t part = size - self->next_zeroed < mutations * ZERO_STEP ? size - self->next_zeroed : mutations * ZERO_STEP;
        memset(self->next_cells + self->next_zeroed, 0, (size_t)part);
        self->next_zeroed += part;
        if (self->next_zeroed < size)
            return;
        self->next_keys = ((PyDictObject *)self)->ma_keys; /* the walk's positions are in this table of the dict's */
    }
    while (self->next_pos >= 0 && budget-- > 0) {
        if (!PyDict_Next((PyObject *)self, &self->next_pos, &key, &value)) {
            self->next_pos = -1; /* every entry counted: later keys are counted as they come */
            break;
        }
        self->recounted++;
        if (PyBytes_CheckExact(key)) /* any other key made the counts stale, which dropped the growth */
            self->next_saturated +=
                cell_add(self->next_cells, key_mix(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)) >> self->next_shift);
    }
    if (self->next_pos < 0 && PyDict_GET_SIZE(self) > self->next_after) {
        PyMem_Free(self->cells); /* the new table takes over */
        self->cells = self->next_cells;
        self->slots = self->next_slots;
        self->shift = self->next_shift;
        self->saturated = self->next_saturated;
        self->next_cells = NULL;
    }
}
