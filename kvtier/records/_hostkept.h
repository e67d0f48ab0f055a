/*
 * What a job's rows' checks (_hostrow.h, host_job_views) leave its copies: where the rows were
 * taken as one pool, the pool, its address then, and its storage, held to the last copy. Apart
 * from _hostrow.h so that a source that copies without asking the checks itself can take it.
 */
#ifndef KVTIER_HOSTKEPT_H
#define KVTIER_HOSTKEPT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* storage: pool.untyped_storage(), taken before the address (a pool set elsewhere meanwhile,
   pool.set_(...), leaves this memory to the job); pool and base: the pool and its data_ptr()
   then, what is asked again after a step that lets the GIL go (a pool grown in place,
   pool.resize_, moves its memory and frees the old: no hold keeps that). All NULL and 0 where
   the rows were not taken as one pool. items: where rows of one pool (a PoolRows) were checked
   one by one instead (a pool those checks do not take), the tuple of those rows, held. */
typedef struct {
    PyObject *storage, *pool, *items;
    unsigned long long base;
} host_kept;

#define HOST_KEPT_NONE ((host_kept){NULL, NULL, NULL, 0})

static inline void host_kept_drop(host_kept *kept)
{
    Py_CLEAR(kept->storage);
    Py_CLEAR(kept->pool);
    Py_CLEAR(kept->items);
    kept->base = 0;
}

#endif
