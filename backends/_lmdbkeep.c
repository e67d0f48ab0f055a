/*
 * kvtier.backends._rowguard, its fifth source: the read transaction an lmdb tier's direct
 * lookups (_lmdbdirect.c) keep between jobs. Beginning and aborting one through python-lmdb made a
 * Python object and two method calls a job: about a fifth of a 4 KiB record's read. python-lmdb
 * opens every environment MDB_NOTLS, so a read transaction reset after one job (it then holds no
 * snapshot: the writer may reuse every page it read) is renewed by the next, on any thread, and
 * reads the last commit made before that renewal, like a new one.
 *
 * One transaction is kept a store (a spare, as python-lmdb keeps its own): a job takes it, or
 * begins one where another job holds it, and gives it back reset (a second one is aborted). The
 * spare is taken, given and dropped with the GIL held, and always inside the environment's
 * in-flight count, which python-lmdb's close and resize wait for. It is dropped (aborted) by the
 * store's close before the environment closes, and by the capsule's end; it is never touched
 * in a process other than the one it was begun in (a fork's child: its reader slot is the
 * parent's), nor after the environment was closed under the store (that close released the
 * process's reader slots; the few bytes of the struct are left).
 */
#include <string.h>

#include "_lmdbdirect.h"

#define PL_RDONLY 0x20000 /* MDB_RDONLY, the same in both engines */
#define PL_NOTLS 0x200000 /* MDB_NOTLS */

static int refuse_keep(const char *what)
{
    PyErr_Format(PyExc_RuntimeError, "direct_probe: %s", what);
    return -1;
}

/* Whether the spare may be touched: this process's, its environment still the one it was begun
   on and open. */
static int spare_sound(const direct_t *d)
{
    const pl_env *e = (const pl_env *)d->env;
    return e != NULL && d->forks == rowguard_forks() && e->valid && e->env != NULL && e->env == d->mdb_env;
}

int keep_init(direct_t *d, pl_env *e, PyObject *meta_key, unsigned int meta_dbi, PyObject *value)
{
    const pl_api *v = e->libv;
    d->txn_begin = (int (*)(void *, void *, unsigned int, void **))v->txn_begin;
    d->txn_reset = (void (*)(void *))v->txn_reset;
    d->txn_renew = (int (*)(void *))v->txn_renew;
    d->txn_abort = (void (*)(void *))v->txn_abort;
    d->env = Py_NewRef((PyObject *)e);
    d->mdb_env = e->env;
    d->forks = rowguard_forks();
    d->spare = NULL;
    d->dropped = 0;
    unsigned int flags = 0;
    if (((int (*)(void *, unsigned int *))v->env_get_flags)(e->env, &flags) != 0 || !(flags & PL_NOTLS))
        return refuse_keep("env: not opened MDB_NOTLS (a reset read transaction could not be renewed on another thread)");
    /* The meta record read by a transaction begun here, then again once it is reset and renewed:
       the bytes python-lmdb's get found. */
    Py_buffer key, want;
    if (PyObject_GetBuffer(meta_key, &key, PyBUF_SIMPLE) < 0)
        return -1;
    if (PyObject_GetBuffer(value, &want, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&key);
        return -1;
    }
    void *txn = NULL;
    int same = 0;
    if (d->txn_begin(e->env, NULL, PL_RDONLY, &txn) == 0) {
        same = 1;
        for (int pass = 0; pass < 2 && same; pass++) {
            pl_val k = {(size_t)key.len, key.buf}, got = {0, NULL};
            same = v->get(txn, meta_dbi, &k, &got) == 0 && got.mv_size == (size_t)want.len && memcmp(got.mv_data, want.buf, got.mv_size) == 0;
            if (pass == 0 && same) {
                d->txn_reset(txn);
                same = d->txn_renew(txn) == 0;
            }
        }
        d->txn_abort(txn);
    }
    PyBuffer_Release(&want);
    PyBuffer_Release(&key);
    return same ? 0 : refuse_keep("a read transaction begun, reset and renewed by the engine does not read what python-lmdb's get read");
}

void *keep_take(direct_t *d)
{
    void *txn = d->spare;
    d->spare = NULL;
    if (txn != NULL) {
        if (d->txn_renew(txn) == 0)
            return txn;
        d->txn_abort(txn);
    }
    txn = NULL;
    return d->txn_begin(d->mdb_env, NULL, PL_RDONLY, &txn) == 0 ? txn : NULL;
}

void keep_give(direct_t *d, void *txn)
{
    if (d->spare == NULL && !d->dropped) {
        d->txn_reset(txn); /* no snapshot held from here: the writer may reuse what it read */
        d->spare = txn;
    } else {
        d->txn_abort(txn);
    }
}

void keep_drop(direct_t *d)
{
    d->dropped = 1;
    void *spare = d->spare;
    d->spare = NULL;
    if (spare != NULL && spare_sound(d))
        d->txn_abort(spare);
}

/* direct_drop(direct): the store closes: its kept read transaction aborted (where sound), and
   none kept from now on. direct_kept(direct): whether one is kept now. */
PyObject *py_direct_drop(PyObject *self, PyObject *capsule)
{
    (void)self;
    direct_t *d = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (d == NULL)
        return NULL;
    keep_drop(d);
    Py_RETURN_NONE;
}

PyObject *py_direct_kept(PyObject *self, PyObject *capsule)
{
    (void)self;
    direct_t *d = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (d == NULL)
        return NULL;
    return PyBool_FromLong(d->spare != NULL);
}
