/*
 * What the sources of kvtier.backends._rowguard share: the one-key read's checks and calls
 * (_rowguard.c), which the read of a job of several keys (_rowjob.c) makes too.
 */
#ifndef KVTIER_ROWGUARD_H
#define KVTIER_ROWGUARD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../kvtier/records/_hostkept.h"

#pragma GCC visibility push(hidden)

/* What one_read takes from its parts tuple (built once per store by lmdb_one.StraightRead). */
enum {
    P_VIEWS, P_SHAPE, P_TENSOR, P_DTYPE, P_KEY_BYTES, P_GUARD, P_TEMPERATURE, P_JOBS, P_MARKS, P_COUNTERS,
    P_BLOCKS, P_INDEX, P_HEAD, P_SIZE, P_ERROR, P_JOINED_SIZE, P_ENTRY_HEAD, P_DEVICES, P_MODES, P_FORKS, P_DIRECT, P_COUNT
};

/* Attribute names, interned at import (_rowguard.c). */
extern PyObject *s_locate, *s_fd, *s_seen, *s_begin, *s_get, *s_abort, *s_slow, *s_cold, *s_read_misses, *s_blocks_read, *s_bytes_read;

/* The rows' hold (../kvtier/records/_hostrow.h): kvtier.records._xxcopy's, shared by the whole
   process, taken at import by take_rows_hold (_rowhold.c; where that extension is not built,
   kvtier.records.xxcopy's Python count). */
void rows_hold(void);
void rows_let_go(void);
void take_rows_hold(void);
/* Whether obj.name is true (1), is not (0), or raised (-1). */
int attr_is_true(PyObject *obj, PyObject *name);
/* counters.name += by, and n such adds (names and values in pairs) as one step: see _rowjob.c. */
int add_to(PyObject *counters, PyObject *name, PyObject *by);
int add_counts(PyObject *counters, PyObject *const *pairs, Py_ssize_t n);
/* clock()'s reading (-1.0 with an error set when it fails). */
double read_clock(PyObject *clock);
/* The cold rule after a read's lookups, and a read transaction's abort: see _rowguard.c. */
int cold_rule(PyObject *temperature, PyObject *clock, double start, double cold_s);
int abort_read(PyObject *txn);
/* parts' joined record size and a split record's head's place in its entry: see _rowguard.c. */
int record_sizes(PyObject *const *parts, Py_ssize_t *joined, Py_ssize_t *at);
/* The arguments every straight read takes, checked: see _rowguard.c. */
int read_args(PyObject *const *args, Py_ssize_t nargs, const char *call, double *cold_s);
/* host_view(row, tensor_type, dtype, shape, views) and same_size(fd, seen): see _rowguard.c. */
PyObject *py_host_view(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_same_size(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* Every key's and row's checks and view for a job of n keys: 1 with views[0..n) set (new
   references); 0 where a key is not bytes of key_bytes or host_view(row, *view_args) is None
   (view_args: tensor_type, dtype, shape, views), -1 with an error set: then none is kept.
   rows: what job_rows made of the job's rows (a tuple, or rows of one pool whose pool is
   checked once: host_job_views, ../kvtier/records/_hostrow.h); kept (or NULL) as there: what
   holds the pool's memory and where it was, to be dropped after the last copy. */
int row_views(PyObject *const *keys, PyObject *rows, Py_ssize_t n, PyObject *const *view_args, Py_ssize_t key_bytes, PyObject **views,
              host_kept *kept);
/* Whether rows [first, end) of a job are still where row_views took their views
   (host_rows_stayed, asked after a step that let the GIL go): 1, 0 where any moved, -1 with an
   error set. rows: the job's rows as row_views took them (tensors) where kept holds no pool. */
int rows_stayed(const host_kept *kept, PyObject *const *rows, PyObject *const *views, Py_ssize_t first, Py_ssize_t end);
/* A job's rows as row_views takes them, a new reference: a kvtier.pool_rows.PoolRows (exact
   type) itself, anything else a tuple of its items as they are now (held); *n their count. NULL
   with the error set. */
PyObject *job_rows(PyObject *rows, Py_ssize_t *n);
/* rows itself (a new reference) and *n its count, len(rows) (a PoolRows: its numbers' count,
   no Python call); NULL with the error set. */
PyObject *job_rows_count(PyObject *rows, Py_ssize_t *n);
/* Whether type(rows) is kvtier.pool_rows.PoolRows (exactly). */
int host_pool_rows_type(PyObject *rows);
/* A tuple of seq's items as they are now: seq itself where a tuple, new reference (_rowsave.c). */
PyObject *held(PyObject *seq);
/* job_views(keys, rows, tensor_type, dtype, shape, views, key_bytes[, held]) and
   put_joined(put, delete, index, head, keys, views, joined[, taken]): see _rowsave.c. */
PyObject *py_job_views(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_put_joined(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* pool_views(keys, rows, tensor_type, dtype, shape, views, key_bytes, unseen_at): see _rowsave.c;
   its pool checks: host_pool_take with the row names interned in _rowguard.c. */
PyObject *py_pool_views(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
int pool_take(PyObject *rows, PyObject *const *view_args, void *pool); /* pool: a host_pool (_hostrow.h) */
/* one_read(parts, env, key, row, clock, cold_s, check) and the fork count: see _rowguard.c. */
PyObject *py_one_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* one_read, its row given as the job's rows where pooled (a PoolRows of one row). */
PyObject *one_read_in(PyObject *self, PyObject *const *args, Py_ssize_t nargs, int pooled);
unsigned long rowguard_forks(void);
/* job_read(parts, env, keys, out, clock, cold_s, check) and straight_read (the same arguments):
   see _rowjob.c. */
PyObject *py_job_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_straight_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* The lookups by LMDB's own get, and its check at a store's open: see _lmdbdirect.c. */
int direct_lookups(PyObject *const *parts, PyObject *env, PyObject *const *keys, PyObject *const *views, Py_ssize_t n, PyObject *check,
                   PyObject *found, const host_kept *kept, PyObject *const *rows);
PyObject *py_direct_probe(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_direct_jobs(PyObject *self, PyObject *unused);
PyObject *py_direct_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_direct_park(PyObject *self, PyObject *on);
PyObject *py_direct_parked(PyObject *self, PyObject *unused);
PyObject *py_direct_release(PyObject *self, PyObject *unused);
PyObject *py_direct_ops(PyObject *self, PyObject *env);
/* The read transaction the direct lookups keep: see _lmdbkeep.c. */
PyObject *py_direct_drop(PyObject *self, PyObject *capsule);
PyObject *py_direct_kept(PyObject *self, PyObject *capsule);

/* A job save's writes by LMDB's own put, on the transaction python-lmdb began: see
   _lmdbdirect.c (the writer) and _lmdbput.c (put_reserved). */
typedef struct {
    void *env, *txn; /* python-lmdb's objects, as probed */
    unsigned int blocks, index;
} direct_writer_t;
int direct_writer(PyObject *direct, PyObject *env, PyObject *txn, PyObject *blocks, PyObject *index, direct_writer_t *w);
int direct_reserve(direct_writer_t *w, void *key, size_t klen, size_t size, unsigned char **space);
int direct_unindex(direct_writer_t *w, void *key, size_t klen);
void direct_writer_end(direct_writer_t *w);
PyObject *py_put_reserved(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* Whether views[first..end) still point at the rows they were taken of, asked again after a
   step that let the GIL go (a pool grown in place, pool.resize_, frees the old memory): by
   rows_stayed, of what they were taken of (taken: the capsule job_views' held form keeps, whose
   pool is asked once; a tuple or list of tensors; a PoolRows, its rows one by one; or the one
   row of a job of one). 1, or 0 (also where a row cannot be asked: no error kept).
   views_stayed(taken, views) is its Python form (_rowsave.c). */
int views_stayed(PyObject *taken, PyObject *const *views, Py_ssize_t first, Py_ssize_t end);
PyObject *py_views_stayed(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_reserved_jobs(PyObject *self, PyObject *unused);

#pragma GCC visibility pop

#endif
