/*
 * kvtier.backends._rowguard, its second source: a warm job of several keys of an lmdb tier read in
 * one call (job_read), as lmdb_one.StraightRead.job reads it: every row's checks and view, the
 * count, the file guard, the lookups in one read transaction, each record's check and copy, the
 * cold rule, and the counters once a job. In Python the calls around each record (a row's
 * checks, a lookup, a check and copy, a list append) cost more than a 4 KiB record's copy.
 * And the counters' adds both straight reads make (add_to, add_counts: _hostcounts.h).
 */
#include "_rowguard.h"
#include "../kvtier/records/_hostcounts.h"
#include "../kvtier/records/_hostrow.h"

#include <pythread.h>
#include <structmember.h>

/* counters.name += by, and a job's several adds in one step (pairs: n names and values): no add
   lost to another thread's (../kvtier/records/_hostcounts.h). */
int add_to(PyObject *counters, PyObject *name, PyObject *by)
{
    PyObject *pair[2] = {name, by};
    return host_counts_add(counters, pair, 1);
}

int add_counts(PyObject *counters, PyObject *const *pairs, Py_ssize_t n)
{
    return host_counts_add(counters, pairs, n);
}

/* Whether the error set is one the straight read hands over on (an lmdb error, TypeError or
   ValueError: StraightRead.job's except); if so it is cleared. */
static int handed_over(PyObject *lmdb_error)
{
    if (PyErr_ExceptionMatches(lmdb_error) || PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* The lookups of a counted job in one read transaction, each record checked and copied into its
   row's view: found[i] set for each key. 1: every key read; 0: the job is the general path's (a
   record not raw and sound, a split record with no entry); -1: an error is set. The cold rule
   after the last lookup, as StraightRead.job's. The lookups are LMDB's own get where the store
   was probed for it (direct_lookups), else python-lmdb's. The transaction is aborted on every
   way out. */
static int job_lookups(PyObject *const *parts, PyObject *env, PyObject *const *keys, PyObject *const *views, Py_ssize_t n,
                       PyObject *clock, double cold_s, PyObject *check, PyObject *found, const host_kept *kept, PyObject *const *rows)
{
    Py_ssize_t joined, at;
    if (record_sizes(parts, &joined, &at) < 0)
        return -1;
    double start = read_clock(clock);
    if (start == -1.0 && PyErr_Occurred())
        return -1;
    int direct = direct_lookups(parts, env, keys, views, n, check, found, kept, rows); /* by LMDB's own get, in its own transaction, where probed */
    if (direct != 2) {
        if (direct == 1 && cold_rule(parts[P_TEMPERATURE], clock, start, cold_s) < 0)
            direct = -1;
        return direct;
    }
    PyObject *begin_args[5] = {env, Py_None, Py_None, Py_False, Py_True}; /* buffers=True, by position */
    PyObject *txn = PyObject_VectorcallMethod(s_begin, begin_args, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (txn == NULL)
        return -1;
    int rc = -1;
    PyObject *get = NULL;
    get = PyObject_GetAttr(txn, s_get); /* once a job, as StraightRead.job binds it */
    if (get == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *get_args[4] = {NULL, keys[i], Py_None, parts[P_BLOCKS]}; /* [0]: room for the call's own use */
        PyObject *value = PyObject_Vectorcall(get, get_args + 1, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (value == NULL)
            goto done;
        if (value == Py_None) {
            Py_DECREF(value);
            continue; /* found[i] stays the False it was filled with */
        }
        PyObject *status;
        Py_ssize_t length = PyObject_Length(value);
        /* python-lmdb's get let the GIL go: the row's address asked again (rows_stayed), the
           GIL held from here to its copy; a row moved meanwhile: the general path's job */
        int stayed = length < 0 ? -1 : rows_stayed(kept, rows, views, i, i + 1);
        if (stayed <= 0) {
            Py_DECREF(value);
            rc = stayed;
            goto done;
        }
        if (length == joined) { /* joined: no index lookup */
            PyObject *check_args[4] = {parts[P_HEAD], keys[i], value, views[i]};
            status = PyObject_Vectorcall(check, check_args, 4, NULL);
        } else {
            get_args[3] = parts[P_INDEX];
            PyObject *entry = PyObject_Vectorcall(get, get_args + 1, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            if (entry == NULL || entry == Py_None) { /* no entry: not plain, the general path's */
                Py_DECREF(value);
                Py_XDECREF(entry);
                rc = entry == NULL ? -1 : 0;
                goto done;
            }
            PyObject *stored = PySequence_GetSlice(entry, at, PY_SSIZE_T_MAX);
            Py_DECREF(entry);
            if (stored == NULL) {
                Py_DECREF(value);
                goto done;
            }
            PyObject *check_args[5] = {parts[P_HEAD], keys[i], stored, views[i], value};
            status = PyObject_Vectorcall(check, check_args, 5, NULL);
            Py_DECREF(stored);
        }
        Py_DECREF(value);
        if (status == NULL)
            goto done;
        int bad = PyObject_IsTrue(status);
        Py_DECREF(status);
        if (bad != 0) { /* anything but good: the general path's job */
            rc = bad < 0 ? -1 : 0;
            goto done;
        }
        Py_SETREF(((PyListObject *)found)->ob_item[i], Py_NewRef(Py_True)); /* the False filled in released */
    }
    if (cold_rule(parts[P_TEMPERATURE], clock, start, cold_s) < 0)
        goto done;
    rc = 1;
done:
    Py_XDECREF(get);
    if (abort_read(txn) < 0)
        rc = -1;
    return rc;
}

/* job_read(parts, env, keys, out, clock, cold_s, check): lmdb_one.StraightRead.job's read of a
   warm job of several keys in one call, with the same outcome, counters and errors: each key's
   hit; None (the general path's job, nothing counted); False, before anything moved, where the
   Python form must read it (the thread's first job, whose faults it marks; the data file's size
   moved, which its guard tells); None while a torch function mode is on. Every row's checks and
   view (host_view) before the job is counted, then the guard, the lookups in one read
   transaction and the counters once. */
PyObject *py_job_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double cold_s;
    if (read_args(args, nargs, "job_read(parts, env, keys, out, clock, cold_s, check)", &cold_s) < 0)
        return NULL;
    PyObject *const *parts = &PyTuple_GET_ITEM(args[0], 0);
    PyObject *jobs = parts[P_JOBS], *marks = parts[P_MARKS];
    PyObject *env = args[1], *clock = args[4], *check = args[6];
    Py_ssize_t key_bytes = PyLong_AsSsize_t(parts[P_KEY_BYTES]);
    if (key_bytes == -1 && PyErr_Occurred())
        return NULL;
    /* A tuple of the keys as they are now (a list's own item array would be freed under the
       lookups, which call Python and let the GIL go, were the list emptied or grown meanwhile). */
    PyObject *keys = PyTuple_CheckExact(args[2]) ? Py_NewRef(args[2]) : PySequence_Tuple(args[2]);
    if (keys == NULL)
        return NULL;
    /* The rows likewise: a row's checks may run Python (a torch function mode's handler). Rows
       of one pool (a PoolRows) are kept as they are: its pool is checked once (row_views). */
    Py_ssize_t rows;
    PyObject *out = job_rows(args[3], &rows);
    if (out == NULL) {
        Py_DECREF(keys);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), got = 0, hits = 0;
    PyObject **views = NULL, *found = NULL, *result = NULL;
    host_kept kept = HOST_KEPT_NONE; /* the pool's memory and where it was, held to the last copy */
    int held = 0;
    if (n != rows) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    int cold = attr_is_true(parts[P_TEMPERATURE], s_cold);
    if (cold != 0) {
        if (cold > 0)
            result = Py_NewRef(Py_None); /* read cold: the job reader's */
        goto done;
    }
    PyObject *ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (ident == NULL)
        goto done;
    int marked = PyDict_Contains(marks, ident);
    Py_DECREF(ident);
    if (marked <= 0) {
        if (marked == 0)
            result = Py_NewRef(Py_False); /* the thread's first job: the Python form marks it */
        goto done;
    }
    /* A torch function mode on: its handler runs Python in each row's checks, which may free the
       memory of a row whose view is taken already. The general path's job: its copies take each
       row's memory as they write it. */
    PyObject *moded = PyObject_CallNoArgs(parts[P_MODES]);
    int hooked = moded == NULL ? -1 : PyObject_IsTrue(moded);
    Py_XDECREF(moded);
    if (hooked != 0) {
        if (hooked > 0)
            result = Py_NewRef(Py_None);
        goto done;
    }
    views = PyMem_Calloc(n ? (size_t)n : 1, sizeof *views);
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *const *key = PySequence_Fast_ITEMS(keys);
    PyObject *view_args[4] = {parts[P_TENSOR], parts[P_DTYPE], parts[P_SHAPE], parts[P_VIEWS]};
    rows_hold(); /* no collection from the first row's checks to the last copy (_hostrow.h) */
    held = 1;
    int viewed = row_views(key, out, n, view_args, key_bytes, views, &kept);
    if (viewed <= 0) { /* a key or row not such, or one not seen yet: the general path makes its view */
        if (viewed == 0)
            result = Py_NewRef(Py_None);
        goto done;
    }
    got = n;
    found = PyList_New(n);
    if (found == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        PyList_SET_ITEM(found, i, Py_NewRef(Py_False));
    /* Counted among the jobs being read before the guard is read: a close closes the guard
       first, then waits for the jobs counted. */
    if (PyList_Append(jobs, Py_None) < 0)
        goto done;
    int read = -1;
    PyObject *fd = host_slot(parts[P_GUARD], s_fd);
    PyObject *seen = fd == NULL ? NULL : host_slot(parts[P_GUARD], s_seen);
    if (seen != NULL) {
        PyObject *size_args[2] = {fd, seen};
        PyObject *same = py_same_size(self, size_args, 2);
        if (same == Py_False)
            result = Py_NewRef(Py_False); /* the size moved: grown, cut short or closed; the Python form's guard tells */
        else if (same != NULL)
            read = job_lookups(parts, env, key, views, n, clock, cold_s, check, found, &kept,
                               PyTuple_CheckExact(out) ? &PyTuple_GET_ITEM(out, 0) : NULL);
        Py_XDECREF(same);
    }
    Py_XDECREF(fd);
    Py_XDECREF(seen);
    rows_let_go(); /* the copies are done */
    held = 0;
    if (read == 0 || (read < 0 && result == NULL && handed_over(parts[P_ERROR])))
        result = Py_NewRef(Py_None);
    /* jobs.pop(), whatever happened (an error raised stays set across it) */
    Py_ssize_t counted = PyList_GET_SIZE(jobs);
    if (counted > 0) {
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        if (PyList_SetSlice(jobs, counted - 1, counted, NULL) < 0)
            PyErr_Clear();
        PyErr_Restore(exc_type, exc_value, exc_tb);
    }
    if (read != 1)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        hits += PyList_GET_ITEM(found, i) == Py_True;
    PyObject *counters = parts[P_COUNTERS];
    PyObject *hit_count = PyLong_FromSsize_t(hits);
    PyObject *hit_bytes = hit_count == NULL ? NULL : PyNumber_Multiply(hit_count, parts[P_SIZE]);
    PyObject *misses = hit_bytes == NULL ? NULL : PyLong_FromSsize_t(n - hits);
    PyObject *pairs[6] = {s_blocks_read, hit_count, s_bytes_read, hit_bytes, s_read_misses, misses}; /* the job's adds in one step */
    int counted_ok = misses != NULL && add_counts(counters, pairs, 3) == 0;
    Py_XDECREF(hit_count);
    Py_XDECREF(hit_bytes);
    Py_XDECREF(misses);
    if (counted_ok)
        result = Py_NewRef(found);
done:
    if (held)
        rows_let_go();
    if (views != NULL) {
        for (Py_ssize_t i = 0; i < got; i++)
            Py_DECREF(views[i]);
        PyMem_Free(views);
    }
    Py_XDECREF(found);
    host_kept_drop(&kept);
    Py_DECREF(keys);
    Py_DECREF(out);
    return result;
}

/* straight_read(parts, env, keys, out, clock, cold_s, check): lmdb_one.StraightRead.read in one
   call, from the tier's read_blocks (no Python frame between): None where devices.locate is set
   or the store was opened before a fork of this process (parts' count against the
   pthread_atfork count); else one_read for a job of one key and one row, job_read for any
   other, whose answers it gives (False: StraightRead.read's lines must read it). */
PyObject *py_straight_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (read_args(args, nargs, "straight_read(parts, env, keys, out, clock, cold_s, check)", NULL) < 0)
        return NULL;
    PyObject *const *parts = &PyTuple_GET_ITEM(args[0], 0);
    /* devices.locate: read from the module's dict where it is there (what getattr reads first) */
    PyObject *devices = parts[P_DEVICES];
    PyObject *locate = PyModule_CheckExact(devices) ? PyDict_GetItemWithError(PyModule_GetDict(devices), s_locate) : NULL;
    if (locate != NULL)
        Py_INCREF(locate);
    else if (PyErr_Occurred() || (locate = PyObject_GetAttr(devices, s_locate)) == NULL)
        return NULL;
    int hosted = locate == Py_None;
    Py_DECREF(locate);
    unsigned long opened = PyLong_AsUnsignedLong(parts[P_FORKS]);
    if (opened == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (!hosted || opened != rowguard_forks())
        Py_RETURN_NONE; /* rows a device's stand-ins, or another process's environment: the general path's */
    Py_ssize_t n = PyObject_Length(args[2]);
    if (n < 0)
        return NULL;
    Py_ssize_t rows;
    PyObject *taken = job_rows_count(args[3], &rows); /* (a PoolRows: its numbers' count, no Python call) */
    if (taken == NULL)
        return NULL;
    Py_DECREF(taken);
    if (n != 1 || rows != 1)
        return py_job_read(self, args, 7);
    PyObject *key = PySequence_GetItem(args[2], 0);
    if (key == NULL)
        return NULL;
    /* Rows of one pool (a PoolRows): its pool checked, no view of a row made (one_read_in) */
    int pooled = host_pool_rows_type(args[3]);
    PyObject *row = pooled ? Py_NewRef(args[3]) : PySequence_GetItem(args[3], 0);
    if (row == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *one_args[7] = {args[0], args[1], key, row, args[4], args[5], args[6]};
    PyObject *found = one_read_in(self, one_args, 7, pooled);
    Py_DECREF(key);
    Py_DECREF(row);
    return found;
}
