/*
 * kvtier.backends._rowguard: the two checks an lmdb tier's one-key straight read makes before
 * its lookup, each one call (kvtier.backends.lmdb_plain: host_view, same_size). In Python the
 * row's five checks and its view's lookup cost about 0.5 us of a 4 KiB job of 3, the file guard
 * 0.4 (os.lseek hands the GIL over and takes it back around a call that never blocks). And that
 * whole read, one call (one_read): the count, the checks, the read transaction, the lookups,
 * the cold rule, the record's check and copy, the counters, as lmdb_one.StraightRead.read. A warm
 * job of several keys, likewise one call: _rowjob.c (job_read).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <pthread.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "_rowguard.h"
#include "../kvtier/records/_hostrow.h"

static host_row_names row_names; /* interned at import */

/* Whether obj.name is true (1), is not (0), or raised (-1). */
int attr_is_true(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    int is = PyObject_IsTrue(v);
    Py_DECREF(v);
    return is;
}

/* host_view(row, tensor_type, dtype, shape, views): host_row_view (../kvtier/records/_hostrow.h),
   the one form of a row's checks that the file tier's job read (_xxjob.c) makes too. */
PyObject *py_host_view(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "host_view() takes 5 arguments (row, tensor_type, dtype, shape, views), got %zd", nargs);
        return NULL;
    }
    PyObject *row = args[0], *dtype = args[2], *shape = args[3], *views = args[4];
    if (!PyDict_Check(views)) {
        PyErr_Format(PyExc_TypeError, "views: expected a dict, got %.100s", Py_TYPE(views)->tp_name);
        return NULL;
    }
    return host_row_view(row, args[1], dtype, shape, views, &row_names);
}

int row_views(PyObject *const *keys, PyObject *rows, Py_ssize_t n, PyObject *const *view_args, Py_ssize_t key_bytes, PyObject **views,
              host_kept *kept)
{
    return host_job_views(keys, n, rows, view_args[0], view_args[1], view_args[2], view_args[3], key_bytes, &row_names, views, kept);
}

int rows_stayed(const host_kept *kept, PyObject *const *rows, PyObject *const *views, Py_ssize_t first, Py_ssize_t end)
{
    return host_rows_stayed(kept, rows, views, first, end, &row_names);
}

int host_pool_rows_type(PyObject *rows)
{
    return host_pool_rows(rows, &row_names);
}

PyObject *job_rows(PyObject *rows, Py_ssize_t *n)
{
    if (!host_pool_rows(rows, &row_names)) {
        PyObject *items = held(rows);
        *n = items == NULL ? -1 : PyTuple_GET_SIZE(items);
        return items;
    }
    return job_rows_count(rows, n);
}

PyObject *job_rows_count(PyObject *rows, Py_ssize_t *n)
{
    if (!host_pool_rows(rows, &row_names)) {
        *n = PyObject_Length(rows);
        return *n < 0 ? NULL : Py_NewRef(rows);
    }
    PyObject *numbers = host_slot(rows, row_names.numbers);
    *n = numbers == NULL ? -1 : PyObject_Length(numbers);
    Py_XDECREF(numbers);
    return *n < 0 ? NULL : Py_NewRef(rows);
}

/* The view of a job's one row: host_view(row, ...) (args: row, tensor_type, dtype, shape,
   views); where pooled, row is the job's rows, a PoolRows of one (host_job_views, without a key),
   and *kept what holds its pool's memory and where it was (see row_views). */
static PyObject *one_view(PyObject *const *args, int pooled, host_kept *kept)
{
    if (!pooled)
        return py_host_view(NULL, args, 5);
    if (!PyDict_Check(args[4])) {
        PyErr_Format(PyExc_TypeError, "views: expected a dict, got %.100s", Py_TYPE(args[4])->tp_name);
        return NULL;
    }
    PyObject *view = NULL, *key = PyBytes_FromStringAndSize(NULL, 0);
    if (key == NULL)
        return NULL;
    int rc = host_job_views(&key, 1, args[0], args[1], args[2], args[3], args[4], 0, &row_names, &view, kept);
    Py_DECREF(key);
    return rc <= 0 ? (rc < 0 ? NULL : Py_NewRef(Py_None)) : view;
}

/* same_size(fd, seen): whether the file open at fd ends at seen bytes now (lseek to its end,
   with the GIL held: it never waits); False also when fd cannot be asked (closed). */
PyObject *py_same_size(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "same_size() takes 2 arguments (fd, seen), got %zd", nargs);
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    long long seen = PyLong_AsLongLong(args[1]);
    if (seen == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT_MAX)
        Py_RETURN_FALSE;
    off_t end = lseek((int)fd, 0, SEEK_END);
    return PyBool_FromLong(end >= 0 && (long long)end == seen);
}

/* one_row(key, key_bytes, row, tensor_type, dtype, shape, views, fd, seen): a one-key read's
   checks before its lookup in one call. None when key is not bytes of key_bytes or the row is
   not one host_view takes; False when the file at fd is not seen bytes long now (same_size);
   else the row's view. The key first, then the row, then the file. */
static PyObject *one_row_in(PyObject *self, PyObject *const *args, int pooled, host_kept *kept)
{
    Py_ssize_t key_bytes = PyLong_AsSsize_t(args[1]);
    if (key_bytes == -1 && PyErr_Occurred())
        return NULL;
    if (!PyBytes_CheckExact(args[0]) || PyBytes_GET_SIZE(args[0]) != key_bytes)
        Py_RETURN_NONE;
    PyObject *view = one_view(args + 2, pooled, kept);
    if (view == NULL || view == Py_None)
        return view;
    PyObject *same = py_same_size(self, args + 7, 2);
    if (same == NULL) {
        Py_DECREF(view);
        return NULL;
    }
    if (same == Py_True) {
        Py_DECREF(same);
        return view;
    }
    Py_DECREF(same);
    Py_DECREF(view);
    Py_RETURN_FALSE;
}

static PyObject *py_one_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError,
                     "one_row() takes 9 arguments (key, key_bytes, row, tensor_type, dtype, shape, views, fd, seen), got %zd", nargs);
        return NULL;
    }
    return one_row_in(self, args, 0, NULL);
}


PyObject *s_locate, *s_fd, *s_seen, *s_begin, *s_get, *s_abort, *s_slow, *s_cold, *s_read_misses, *s_blocks_read, *s_bytes_read;
static PyObject *real_perf_counter; /* time.perf_counter: read here by clock_gettime, as it reads */
static PyObject *one_count;         /* 1, a counter's step */

/* clock(): time.perf_counter's reading (CLOCK_MONOTONIC in seconds, as it reads it) without a
   call where clock is time.perf_counter itself; else clock is called (a test's clock).
   -1.0 with an error set when it fails. */
double read_clock(PyObject *clock)
{
    if (clock == real_perf_counter) {
        struct timespec ts;
        if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0)
            return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    }
    PyObject *v = PyObject_CallNoArgs(clock);
    if (v == NULL)
        return -1.0;
    double at = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return at;
}

/* The arguments of a straight read (one_read, job_read, straight_read; call: its name and
   arguments, for the errors): seven, the first a tuple of P_COUNT parts; where cold_s is given,
   the sixth as a float into it, and parts' jobs a list and marks a dict. 0, or -1 with a
   TypeError naming what is wrong. */
int read_args(PyObject *const *args, Py_ssize_t nargs, const char *call, double *cold_s)
{
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "%s takes 7 arguments, got %zd", call, nargs);
        return -1;
    }
    if (!PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != P_COUNT) {
        PyErr_Format(PyExc_TypeError, "parts: expected a tuple of %d, got %.100s", P_COUNT, Py_TYPE(args[0])->tp_name);
        return -1;
    }
    if (cold_s == NULL)
        return 0;
    *cold_s = PyFloat_AsDouble(args[5]);
    if (*cold_s == -1.0 && PyErr_Occurred())
        return -1;
    PyObject *const *parts = &PyTuple_GET_ITEM(args[0], 0);
    if (!PyList_CheckExact(parts[P_JOBS]) || !PyDict_CheckExact(parts[P_MARKS])) {
        PyErr_SetString(PyExc_TypeError, "parts: jobs must be a list and marks a dict");
        return -1;
    }
    return 0;
}

/* parts' joined record size (a joined value's length) and where a split record's head starts
   in its entry: 0, or -1 with an error set. */
int record_sizes(PyObject *const *parts, Py_ssize_t *joined, Py_ssize_t *at)
{
    *joined = PyLong_AsSsize_t(parts[P_JOINED_SIZE]);
    if (*joined == -1 && PyErr_Occurred())
        return -1;
    *at = PyLong_AsSsize_t(parts[P_ENTRY_HEAD]);
    return *at == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The cold rule after a read's lookups, begun at start: where they took cold_s or more,
   temperature.slow(start) says whether they read from disk, and if so temperature.cold is set
   (the next job is read cold). 0, or -1 with an error set. */
int cold_rule(PyObject *temperature, PyObject *clock, double start, double cold_s)
{
    double now = read_clock(clock);
    if (now == -1.0 && PyErr_Occurred())
        return -1;
    if (now - start < cold_s)
        return 0;
    PyObject *at = PyFloat_FromDouble(start);
    if (at == NULL)
        return -1;
    PyObject *slow_args[2] = {temperature, at};
    PyObject *slow = PyObject_VectorcallMethod(s_slow, slow_args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(at);
    if (slow == NULL)
        return -1;
    int is = PyObject_IsTrue(slow);
    Py_DECREF(slow);
    if (is < 0 || (is && PyObject_SetAttr(temperature, s_cold, Py_True) < 0))
        return -1;
    return 0;
}

/* txn.abort(), whatever happened before (an error set stays set across it), and the reference
   to txn let go. 0, or -1 where the abort raised: its error replaces any other, as a finally's
   does. */
int abort_read(PyObject *txn)
{
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *abort_args[1] = {txn};
    PyObject *aborted = PyObject_VectorcallMethod(s_abort, abort_args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(txn);
    if (aborted == NULL) {
        Py_XDECREF(exc_type);
        Py_XDECREF(exc_value);
        Py_XDECREF(exc_tb);
        return -1;
    }
    Py_DECREF(aborted);
    PyErr_Restore(exc_type, exc_value, exc_tb);
    return 0;
}

/* The read once the job is counted (temperature.jobs) and the row's view is known: the lookups
   in one read transaction, the cold rule, then the record's check and copy. A new list [True] or
   [False], None (the general path's job), or NULL with an error (an lmdb error is None: the
   caller clears it). The transaction is aborted on every way out. */
static PyObject *read_counted(PyObject *const *parts, PyObject *env, PyObject *key, PyObject *view, PyObject *clock,
                              double cold_s, PyObject *check, const host_kept *kept, PyObject *row)
{
    PyObject *txn = NULL, *result = NULL, *value = NULL, *entry = NULL, *stored = NULL;
    double start = read_clock(clock);
    if (start == -1.0 && PyErr_Occurred())
        return NULL;
    result = PyList_New(1);
    if (result == NULL)
        return NULL;
    PyList_SET_ITEM(result, 0, Py_NewRef(Py_False));
    int direct = direct_lookups(parts, env, &key, &view, 1, check, result, kept, &row); /* by LMDB's own get, in its own transaction, where probed */
    if (direct != 2) {
        if (direct == 1 && cold_rule(parts[P_TEMPERATURE], clock, start, cold_s) < 0)
            direct = -1;
        if (direct == 1 && PyList_GET_ITEM(result, 0) == Py_False && add_to(parts[P_COUNTERS], s_read_misses, one_count) < 0)
            direct = -1;
        if (direct != 1)
            Py_SETREF(result, direct == 0 ? Py_NewRef(Py_None) : NULL);
        return result;
    }
    Py_CLEAR(result);
    PyObject *begin_args[5] = {env, Py_None, Py_None, Py_False, Py_True}; /* buffers=True, by position */
    txn = PyObject_VectorcallMethod(s_begin, begin_args, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (txn == NULL)
        return NULL;
    PyObject *get_args[4] = {txn, key, Py_None, parts[P_BLOCKS]};
    value = PyObject_VectorcallMethod(s_get, get_args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (value == NULL)
        goto done;
    if (value != Py_None) {
        Py_ssize_t n = PyObject_Length(value);
        if (n < 0)
            goto done;
        Py_ssize_t joined = PyLong_AsSsize_t(parts[P_JOINED_SIZE]);
        if (joined == -1 && PyErr_Occurred())
            goto done;
        if (n != joined) { /* split: the head is in the index entry */
            get_args[3] = parts[P_INDEX];
            entry = PyObject_VectorcallMethod(s_get, get_args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            if (entry == NULL)
                goto done;
        }
    }
    if (cold_rule(parts[P_TEMPERATURE], clock, start, cold_s) < 0)
        goto done;
    if (value == Py_None) {
        if (add_to(parts[P_COUNTERS], s_read_misses, one_count) == 0)
            result = Py_BuildValue("[O]", Py_False);
        goto done;
    }
    /* python-lmdb's get let the GIL go: the row's address asked again, the GIL held from here
       to the copy (a row moved meanwhile: the general path's job) */
    int stayed = rows_stayed(kept, &row, &view, 0, 1);
    if (stayed <= 0) {
        if (stayed == 0)
            result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *status;
    if (entry == NULL || entry == Py_None) { /* joined (or no entry: refused by its length as not plain) */
        PyObject *check_args[4] = {parts[P_HEAD], key, value, view};
        status = PyObject_Vectorcall(check, check_args, 4, NULL);
    } else {
        Py_ssize_t at = PyLong_AsSsize_t(parts[P_ENTRY_HEAD]);
        if (at == -1 && PyErr_Occurred())
            goto done;
        stored = PySequence_GetSlice(entry, at, PY_SSIZE_T_MAX);
        if (stored == NULL)
            goto done;
        PyObject *check_args[5] = {parts[P_HEAD], key, stored, view, value};
        status = PyObject_Vectorcall(check, check_args, 5, NULL);
    }
    if (status == NULL)
        goto done;
    int bad = PyObject_IsTrue(status);
    Py_DECREF(status);
    if (bad < 0)
        goto done;
    result = bad ? Py_NewRef(Py_None) : Py_BuildValue("[O]", Py_True);
done:
    Py_XDECREF(stored);
    Py_XDECREF(entry);
    Py_XDECREF(value);
    if (abort_read(txn) < 0)
        Py_CLEAR(result);
    return result;
}

/* one_read(parts, env, key, row, clock, cold_s, check): lmdb_one.StraightRead.read's job of one
   key, read in one call with the same outcome, counters and errors (see read_python there).
   False, before anything moved: the Python form must read it (the thread's first job, whose
   faults it marks; the data file's size moved). */
PyObject *py_one_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return one_read_in(self, args, nargs, 0);
}

PyObject *one_read_in(PyObject *self, PyObject *const *args, Py_ssize_t nargs, int pooled)
{
    double cold_s;
    if (read_args(args, nargs, "one_read(parts, env, key, row, clock, cold_s, check)", &cold_s) < 0)
        return NULL;
    PyObject *const *parts = &PyTuple_GET_ITEM(args[0], 0);
    PyObject *jobs = parts[P_JOBS], *marks = parts[P_MARKS];
    PyObject *env = args[1], *key = args[2], *row = args[3], *clock = args[4], *check = args[6];
    PyObject *ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (ident == NULL)
        return NULL;
    int marked = PyDict_Contains(marks, ident);
    Py_DECREF(ident);
    if (marked <= 0)
        return marked < 0 ? NULL : Py_NewRef(Py_False); /* the thread's first job: the Python form marks it */
    /* A torch function mode on: its handler runs Python in the row's checks, which may free the
       row's memory once its address is read (its view then taken). The general path's job. */
    PyObject *moded = PyObject_CallNoArgs(parts[P_MODES]);
    int hooked = moded == NULL ? -1 : PyObject_IsTrue(moded);
    Py_XDECREF(moded);
    if (hooked != 0)
        return hooked > 0 ? Py_NewRef(Py_None) : NULL;
    /* Counted among the jobs being read before the guard is read: a close closes the guard
       first, then waits for the jobs counted. */
    if (PyList_Append(jobs, Py_None) < 0)
        return NULL;
    PyObject *result = NULL;
    PyObject *fd = host_slot(parts[P_GUARD], s_fd);
    PyObject *seen = fd == NULL ? NULL : host_slot(parts[P_GUARD], s_seen);
    if (seen != NULL) {
        PyObject *row_args[9] = {key, parts[P_KEY_BYTES], row, parts[P_TENSOR], parts[P_DTYPE], parts[P_SHAPE], parts[P_VIEWS], fd, seen};
        rows_hold(); /* no collection from the row's checks to its copy (_hostrow.h) */
        host_kept kept = HOST_KEPT_NONE; /* the pool's memory, where pooled, held to the copy */
        PyObject *view = one_row_in(self, row_args, pooled, &kept);
        if (view == Py_False || view == Py_None)
            result = view; /* the size moved: the Python form's; not such a key or row: the general path's */
        else if (view != NULL) {
            result = read_counted(parts, env, key, view, clock, cold_s, check, &kept, row);
            Py_DECREF(view);
        }
        host_kept_drop(&kept);
        rows_let_go();
    }
    Py_XDECREF(fd);
    Py_XDECREF(seen);
    if (result == NULL && PyErr_ExceptionMatches(parts[P_ERROR])) {
        PyErr_Clear(); /* an lmdb error: the general path's job */
        result = Py_NewRef(Py_None);
    }
    /* jobs.pop(), whatever happened (an error raised stays set across it) */
    Py_ssize_t n = PyList_GET_SIZE(jobs);
    if (n > 0) {
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        if (PyList_SetSlice(jobs, n - 1, n, NULL) < 0)
            PyErr_Clear();
        PyErr_Restore(exc_type, exc_value, exc_tb);
    }
    if (result == NULL)
        return NULL;
    if (PyList_CheckExact(result) && PyList_GET_ITEM(result, 0) == Py_True) {
        PyObject *pairs[4] = {s_blocks_read, one_count, s_bytes_read, parts[P_SIZE]};
        if (add_counts(parts[P_COUNTERS], pairs, 2) < 0) {
            Py_DECREF(result);
            return NULL;
        }
    }
    return result;
}

/* Forks of this process so far, counted in each child by a pthread_atfork handler: it runs for
   every fork() through libc, also one Python's os.fork hooks never see (a C library's, ctypes'). */
static volatile unsigned long fork_count;

static void count_fork(void) { fork_count++; }

unsigned long rowguard_forks(void) { return fork_count; }

/* host_pool_take (../kvtier/records/_hostrow.h) of rows with the row names interned here
   (view_args: tensor_type, dtype, shape): pool_views' pool checks (_rowsave.c). */
int pool_take(PyObject *rows, PyObject *const *view_args, void *pool)
{
    return host_pool_take(rows, view_args[0], view_args[1], view_args[2], &row_names, (host_pool *)pool);
}

static PyObject *py_forks(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromUnsignedLong(fork_count);
}

static PyMethodDef methods[] = {
    {"forks", py_forks, METH_NOARGS, "forks() -> the forks of this process so far (a pthread_atfork count)."},
    {"one_row", (PyCFunction)(void (*)(void))py_one_row, METH_FASTCALL,
     "one_row(key, key_bytes, row, tensor_type, dtype, shape, views, fd, seen) -> view, None or False\n\n"
     "None when key is not bytes of key_bytes or host_view(row, ...) is None; False when\n"
     "same_size(fd, seen) is not; else the row's view."},
    {"host_view", (PyCFunction)(void (*)(void))py_host_view, METH_FASTCALL,
     "host_view(row, tensor_type, dtype, shape, views) -> the view or None\n\n"
     "views[row.data_ptr()] when type(row) is tensor_type, row.dtype is dtype, row.shape == shape,\n"
     "row.is_cpu and row.is_contiguous(); else None (also for an address views does not hold)."},
    {"straight_read", (PyCFunction)(void (*)(void))py_straight_read, METH_FASTCALL,
     "straight_read(parts, env, keys, out, clock, cold_s, check) -> [found, ...], None or False\n\n"
     "lmdb_one.StraightRead.read in one call: one_read for a job of one key, job_read for others."},
    {"job_read", (PyCFunction)(void (*)(void))py_job_read, METH_FASTCALL,
     "job_read(parts, env, keys, out, clock, cold_s, check) -> [found, ...], None or False\n\n"
     "A straight read of a warm job of several keys (kvtier.backends.lmdb_one.StraightRead.job) in one call."},
    {"one_read", (PyCFunction)(void (*)(void))py_one_read, METH_FASTCALL,
     "one_read(parts, env, key, row, clock, cold_s, check) -> [found], None or False\n\n"
     "A straight read of a job of one key (kvtier.backends.lmdb_one.StraightRead.read) in one call."},
    {"direct_probe", (PyCFunction)(void (*)(void))py_direct_probe, METH_FASTCALL,
     "direct_probe(env, txn, meta, key, value, txn_id, blocks, index, so_path, check, check_c) -> capsule\n\n"
     "Whether the straight reads of env may look keys up by LMDB's own get on python-lmdb 3.0's\n"
     "objects (see kvtier.backends.lmdb_direct): the capsule they take, or RuntimeError naming\n"
     "what does not hold."},
    {"direct_copy", (PyCFunction)(void (*)(void))py_direct_copy, METH_FASTCALL,
     "direct_copy(direct, env, txn, db, keys, rows) -> found\n\n"
     "Each key's value copied into its row by LMDB's get and memcpy, nothing else (the benchmarks' reference arm)."},
    {"direct_park", py_direct_park, METH_O, "direct_park(on): the tests' park point in each direct job, switched on or off (see _lmdbdirect.c)."},
    {"direct_parked", py_direct_parked, METH_NOARGS, "direct_parked() -> how many direct jobs are parked now."},
    {"direct_release", py_direct_release, METH_NOARGS, "direct_release(): the parked direct jobs go on."},
    {"direct_ops", py_direct_ops, METH_O, "direct_ops(env) -> python-lmdb's (active_ops, ops_waiters) of env."},
    {"direct_drop", py_direct_drop, METH_O, "direct_drop(direct): the store closes: the read transaction its direct lookups keep is aborted, none kept after."},
    {"direct_kept", py_direct_kept, METH_O, "direct_kept(direct) -> whether the direct lookups keep a reset read transaction now."},
    {"direct_jobs", py_direct_jobs, METH_NOARGS, "direct_jobs() -> the straight reads' jobs looked up by LMDB's own get so far."},
    {"job_views", (PyCFunction)(void (*)(void))py_job_views, METH_FASTCALL,
     "job_views(keys, rows, tensor_type, dtype, shape, views, key_bytes[, held]) -> [view, ...] or None\n\n"
     "Each row's view (host_view) when every key is bytes of key_bytes and every row's host_view is one; else None.\n"
     "held (a PoolRows' rows): the views as held(views), its memory and taken slots what the pool's checks kept."},
    {"put_reserved", (PyCFunction)(void (*)(void))py_put_reserved, METH_FASTCALL,
     "put_reserved(direct, env, txn, blocks, index, unindex, head, keys, views[, taken]) -> True, False or None\n\n"
     "Each key's joined record written into the room LMDB's own put reserves for it (see _lmdbput.c);\n"
     "None, nothing put, where the rows taken moved since the views were taken."},
    {"views_stayed", (PyCFunction)(void (*)(void))py_views_stayed, METH_FASTCALL,
     "views_stayed(taken, views) -> bool\n\n"
     "Whether each view still points at its row (what job_views' held form kept: its pool asked once; other rows each)."},
    {"reserved_jobs", py_reserved_jobs, METH_NOARGS, "reserved_jobs() -> the jobs put_reserved wrote so far."},
    {"put_joined", (PyCFunction)(void (*)(void))py_put_joined, METH_FASTCALL,
     "put_joined(put, delete, index, head, keys, views, joined[, taken]) -> True or None\n\n"
     "For each key in order: put(key, joined(head, key, view)), then delete(key, b'', index) unless delete is None;\n"
     "None where the rows taken (unless None) moved before a build (views_stayed)."},
    {"pool_views", (PyCFunction)(void (*)(void))py_pool_views, METH_FASTCALL,
     "pool_views(keys, rows, tensor_type, dtype, shape, views, key_bytes, unseen_at) -> [view, ...], None or NotImplemented\n\n"
     "The views of a job's rows of one pool, its checks once: each row's kept view, else unseen_at(address)."},
    {"same_size", (PyCFunction)(void (*)(void))py_same_size, METH_FASTCALL,
     "same_size(fd, seen) -> bool\n\n"
     "Whether the file open at fd is seen bytes long now (False too where fd cannot be asked)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_rowguard",
    "The checks of an lmdb tier's one-key read before its lookup, one call each (native).", -1, methods,
    NULL, NULL, NULL, NULL,
};

/* The attribute names the calls ask for, interned once at import. */
static const struct {
    PyObject **name;
    const char *text;
} NAMES[] = {
    {&s_locate, "locate"}, {&s_fd, "fd"}, {&s_seen, "seen"}, {&s_begin, "begin"}, {&s_get, "get"},
    {&s_abort, "abort"}, {&s_slow, "slow"}, {&s_cold, "cold"}, {&s_read_misses, "read_misses"},
    {&s_blocks_read, "blocks_read"}, {&s_bytes_read, "bytes_read"},
};

PyMODINIT_FUNC PyInit__rowguard(void)
{
    if (host_row_names_init(&row_names) < 0)
        return NULL;
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
        if ((*NAMES[i].name = PyUnicode_InternFromString(NAMES[i].text)) == NULL)
            return NULL;
    one_count = PyLong_FromLong(1);
    if (one_count == NULL)
        return NULL;
    PyObject *time_module = PyImport_ImportModule("time");
    if (time_module == NULL)
        return NULL;
    real_perf_counter = PyObject_GetAttrString(time_module, "perf_counter");
    Py_DECREF(time_module);
    if (real_perf_counter == NULL)
        return NULL;
    take_rows_hold(); /* _rowhold.c */
    static int counting;
    if (!counting) {
        if (pthread_atfork(NULL, NULL, count_fork) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "_rowguard: pthread_atfork failed");
            return NULL;
        }
        counting = 1;
    }
    return PyModule_Create(&module_def);
}
