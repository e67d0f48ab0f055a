/*
 * kvtier.backends._rowguard, its third source: an lmdb tier's straight reads look their keys up
 * by the LMDB engine's own get, in a read transaction of the engine's own that the store keeps
 * between jobs (_lmdbkeep.c), with no Python object a key or a job (python-lmdb's
 * Transaction.get parses its arguments, makes a buffer object and hands the GIL over and back
 * for each: about 20 % of a 4 KiB record's read; its begin and abort, a fifth of a job of one).
 *
 * python-lmdb exposes no C interface; this reads its objects' C structs. It is sound only for
 * the python-lmdb whose source was read (3.0.0, lmdb/cpython.c: EnvObject, TransObject,
 * DbObject, and lmdb/mdb_api.h: MdbApi), so it is taken only after direct_probe has checked,
 * at the store's open, everything it relies on (lmdb_direct.direct_gets): the objects' sizes,
 * the engine's entry points against the symbols python-lmdb's extension exports (mdb09_get or
 * mdb10_get: it bundles two engines and picks one per environment), the transaction's id as
 * python-lmdb reads it, and one record read both ways (the same address and length). Anything
 * else, and any job whose transaction, environment or databases are not python-lmdb's own
 * objects, valid, of this environment, reads by python-lmdb's get as before.
 *
 * Around the lookups the job does what python-lmdb does around its get: it refuses to start
 * while the environment is invalid or being resized, and is counted in the environment's
 * in-flight operations (active_ops, which a close and a resize wait for) until its last copy
 * out of the map is done; the lookups run with the GIL handed over once a job, each value's
 * pages touched there as python-lmdb's preload touches them.
 */
#include <dlfcn.h>
#include <string.h>

#include "_lmdbdirect.h"

static void direct_free(PyObject *capsule)
{
    direct_t *d = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (d == NULL)
        return;
    Py_XDECREF(d->env_type);
    Py_XDECREF(d->txn_type);
    Py_XDECREF(d->db_type);
    Py_XDECREF(d->check);
    keep_drop(d);
    Py_XDECREF(d->env);
    PyMem_Free(d);
}

/* Whether python-lmdb's own get would start now: the environment valid, open, not being resized
   by another thread (python-lmdb's ENV_RESIZE_BLOCKED). */
int env_usable(const pl_env *e)
{
    return e->valid && e->env != NULL && !(e->resizing && e->resize_tid != (unsigned long)PyThread_get_thread_ident());
}

/* One engine's symbols, as python-lmdb's extension exports them, against libv's. */
static int engine_is(void *so, const char *prefix, const pl_api *libv)
{
    static const char *const names[] = {"get", "txn_id", "txn_abort", "env_create", "txn_begin", "txn_reset", "txn_renew", "env_get_flags", "put", "del"};
    void *const have[] = {(void *)libv->get, (void *)libv->txn_id, libv->txn_abort, libv->env_create, libv->txn_begin,
                          libv->txn_reset, libv->txn_renew, libv->env_get_flags, (void *)libv->put, (void *)libv->del};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char symbol[64];
        snprintf(symbol, sizeof symbol, "%s_%s", prefix, names[i]);
        void *at = dlsym(so, symbol);
        if (at == NULL || at != have[i])
            return 0;
    }
    return 1;
}

#define PL_MAIN_DBI 1 /* LMDB's main database's handle (0 is its free list's) */
#define PL_TXN_READ 3 /* python-lmdb's TRANS_BUFFERS | TRANS_RDONLY: a read transaction begun with buffers=True */

/* Where a field the direct path reads, or its neighbour, does not hold the value it must hold at
   the probe (a store just opened, in this process, by this thread, no operation in flight, txn
   a top-level read transaction begun with buffers=True on the main database): its name, or NULL
   when every one does. The sizes tell the struct's length only; a build of python-lmdb with
   other options or patches could move a field within the same size, and these values tell each
   offset: the count of operations in flight and its neighbours (what a close waits on), the
   resize flag and thread, the mutex's ready flag, the process id in between, the main
   database's handle, and the transaction's fields around its handle. */
static const char *fields_known(const pl_env *e, const pl_txn *t, PyTypeObject *db_type)
{
    const pl_db *main_db = e->main_db;
    if (e->valid != 1 || t->valid != 1)
        return "env, txn: valid is not 1";
    if (main_db == NULL || Py_TYPE(main_db) != db_type || main_db->env != e || main_db->dbi != PL_MAIN_DBI)
        return "env: main_db is not env's main database";
    if ((e->readonly != 0 && e->readonly != 1) || (e->max_spare_txns != 0 && e->max_spare_txns != 1))
        return "env: readonly or max_spare_txns is not 0 or 1";
    if (e->pid != getpid())
        return "env: pid is not this process's";
    if (e->open_keys != NULL && !PyTuple_Check(e->open_keys))
        return "env: open_keys is not a tuple";
    if (e->write_txn_tid != 0 || e->active_ops != 0 || e->ops_waiters != 0 || e->write_begins != 0)
        return "env: write_txn_tid, active_ops, ops_waiters or write_begins is not 0";
    if (e->resizing != 0 || e->resize_tid != 0)
        return "env: resizing or resize_tid is not 0";
    if (e->ops_sync_ready != 1)
        return "env: ops_sync_ready is not 1";
    if (t->parent != NULL || t->flags != PL_TXN_READ || t->db != main_db || t->mutations != 0)
        return "txn: parent, flags, db or mutations is not a top-level read transaction's";
    return NULL;
}

static PyObject *refuse(const char *what)
{
    PyErr_Format(PyExc_RuntimeError, "direct_probe: %s", what);
    return NULL;
}

/* direct_probe(env, txn, meta, key, value, txn_id, blocks, index, so_path, check, check_c): the
   capsule the straight reads take (parts' P_DIRECT), or RuntimeError naming what does not hold.
   txn: a read transaction of env begun with buffers=True; value: txn.get(key, db=meta), a
   record known to be there; txn_id: txn.id(); so_path: python-lmdb's extension's file;
   check, check_c: xxcopy's native check-copy and its capsule. */
PyObject *py_direct_probe(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 11) {
        PyErr_Format(PyExc_TypeError,
                     "direct_probe() takes 11 arguments (env, txn, meta, key, value, txn_id, blocks, index, so_path, check, check_c), got %zd",
                     nargs);
        return NULL;
    }
    PyObject *env = args[0], *txn = args[1], *key = args[3], *value = args[4];
    PyObject *dbs[3] = {args[2], args[6], args[7]};
    PyTypeObject *env_type = Py_TYPE(env), *txn_type = Py_TYPE(txn), *db_type = Py_TYPE(dbs[0]);
    if (strcmp(env_type->tp_name, "Environment") != 0 || env_type->tp_basicsize != (Py_ssize_t)sizeof(pl_env))
        return refuse("env: not python-lmdb 3.0's Environment (another name or size)");
    if (strcmp(txn_type->tp_name, "Transaction") != 0 || txn_type->tp_basicsize != (Py_ssize_t)sizeof(pl_txn))
        return refuse("txn: not python-lmdb 3.0's Transaction (another name or size)");
    if (strcmp(db_type->tp_name, "_Database") != 0 || db_type->tp_basicsize != (Py_ssize_t)sizeof(pl_db))
        return refuse("meta: not python-lmdb 3.0's _Database (another name or size)");
    const pl_env *e = (const pl_env *)env;
    const pl_txn *t = (const pl_txn *)txn;
    if (!env_usable(e) || e->libv == NULL)
        return refuse("env: not open");
    if (t->env != e || !t->valid || t->txn == NULL || t->libv != e->libv)
        return refuse("txn: not a live transaction of env");
    for (int i = 0; i < 3; i++)
        if (Py_TYPE(dbs[i]) != db_type || ((const pl_db *)dbs[i])->env != e || !((const pl_db *)dbs[i])->valid)
            return refuse("meta, blocks, index: not databases of env");
    const char *field = fields_known(e, t, db_type);
    if (field != NULL)
        return refuse(field);
    PyObject *so_path = PyUnicode_EncodeFSDefault(args[8]);
    if (so_path == NULL)
        return NULL;
    void *so = dlopen(PyBytes_AS_STRING(so_path), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(so_path);
    if (so == NULL)
        return refuse("so_path: not a library this process has loaded");
    int known = engine_is(so, "mdb09", e->libv) || engine_is(so, "mdb10", e->libv);
    dlclose(so);
    if (!known)
        return refuse("env's engine: not one of python-lmdb's exported engines (mdb09_*, mdb10_*)");
    size_t id = PyLong_AsSize_t(args[5]);
    if (id == (size_t)-1 && PyErr_Occurred())
        return NULL;
    if (e->libv->txn_id(t->txn) != id)
        return refuse("txn: its engine's id is not txn.id()");
    Py_buffer key_buf, value_buf;
    if (PyObject_GetBuffer(key, &key_buf, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(value, &value_buf, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&key_buf);
        return NULL;
    }
    pl_val k = {(size_t)key_buf.len, key_buf.buf}, v = {0, NULL}, absent = {0, NULL};
    int rc = e->libv->get(t->txn, ((const pl_db *)dbs[0])->dbi, &k, &v);
    int same = rc == 0 && v.mv_data == value_buf.buf && v.mv_size == (size_t)value_buf.len;
    /* a key one byte longer than the record's: not there */
    unsigned char longer[512];
    int missing = 0;
    if (k.mv_size < sizeof longer) {
        memcpy(longer, k.mv_data, k.mv_size);
        longer[k.mv_size] = 0xff;
        pl_val other = {k.mv_size + 1, longer};
        missing = e->libv->get(t->txn, ((const pl_db *)dbs[0])->dbi, &other, &absent) == PL_NOTFOUND;
    }
    int handles = missing; /* blocks' and index's: handles of databases the engine takes (that key: not found there) */
    for (int i = 1; i < 3 && handles; i++) {
        unsigned int dbi = ((const pl_db *)dbs[i])->dbi;
        pl_val other = {k.mv_size + 1, longer}, none = {0, NULL};
        handles = e->libv->get(t->txn, dbi, &other, &none) == PL_NOTFOUND; /* (a handle the engine does not take: EINVAL) */
    }
    PyBuffer_Release(&value_buf);
    PyBuffer_Release(&key_buf);
    if (!same)
        return refuse("a record read by the engine's get is not where python-lmdb's get found it");
    if (!missing)
        return refuse("a key that is not there was found by the engine's get");
    if (!handles)
        return refuse("blocks, index: their handles are not databases the engine looks keys up in");
    xxc_check_copy_fn check_c = (xxc_check_copy_fn)PyCapsule_GetPointer(args[10], XXC_CHECK_COPY_CAPSULE);
    if (check_c == NULL)
        return NULL;
    direct_t *d = PyMem_Calloc(1, sizeof *d);
    if (d == NULL)
        return PyErr_NoMemory();
    d->env_type = (PyTypeObject *)Py_NewRef(env_type);
    d->txn_type = (PyTypeObject *)Py_NewRef(txn_type);
    d->db_type = (PyTypeObject *)Py_NewRef(db_type);
    d->libv = e->libv;
    d->check = Py_NewRef(args[9]);
    d->check_c = check_c;
    if (keep_init(d, (pl_env *)env, key, ((const pl_db *)dbs[0])->dbi, value) < 0) {
        Py_DECREF(d->env_type);
        Py_DECREF(d->txn_type);
        Py_DECREF(d->db_type);
        Py_DECREF(d->check);
        PyMem_Free(d);
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(d, CAPSULE_NAME, direct_free);
    if (capsule == NULL) {
        d->check_c = NULL;
        Py_DECREF(d->env_type);
        Py_DECREF(d->txn_type);
        Py_DECREF(d->db_type);
        Py_DECREF(d->check);
        keep_drop(d);
        Py_XDECREF(d->env);
        PyMem_Free(d);
    }
    return capsule;
}

/* The database's handle where db is a valid database of e, of the checked type: 0, else -1. */
static int db_handle(const direct_t *d, const pl_env *e, PyObject *db, unsigned int *dbi)
{
    if (Py_TYPE(db) != d->db_type || ((const pl_db *)db)->env != e || !((const pl_db *)db)->valid)
        return -1;
    *dbi = ((const pl_db *)db)->dbi;
    return 0;
}

/* python-lmdb's ACTIVE_OPS_DEC: the in-flight count down, and whoever waits for it woken. */
static void ops_done(pl_env *e)
{
    __atomic_sub_fetch(&e->active_ops, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&e->ops_waiters, __ATOMIC_SEQ_CST) != 0) {
        pthread_mutex_lock(&e->ops_mutex);
        pthread_cond_broadcast(&e->ops_cond);
        pthread_mutex_unlock(&e->ops_mutex);
    }
}

/* The tests' park point: with parking switched on (direct_park(True)), each job waits, counted in
   flight and without the GIL, between its lookups and its copies out of the map, until
   direct_release(); what proves that python-lmdb's close and resize wait for it. Off, a job
   reads one flag. */
static int park_on, parked, released;
static pthread_mutex_t park_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t park_cond = PTHREAD_COND_INITIALIZER;

static void park(void)
{
    pthread_mutex_lock(&park_mutex);
    parked++;
    pthread_cond_broadcast(&park_cond);
    while (!released)
        pthread_cond_wait(&park_cond, &park_mutex);
    parked--;
    pthread_mutex_unlock(&park_mutex);
}

/* direct_park(on): jobs park (see park) from now on, or not; switching it on or off clears a
   release. direct_parked(): how many jobs are parked now. direct_release(): every parked job,
   and any that parks later while parking is on, goes on. */
PyObject *py_direct_park(PyObject *self, PyObject *on)
{
    (void)self;
    int truth = PyObject_IsTrue(on);
    if (truth < 0)
        return NULL;
    pthread_mutex_lock(&park_mutex);
    released = 0;
    __atomic_store_n(&park_on, truth, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&park_mutex);
    Py_RETURN_NONE;
}

PyObject *py_direct_parked(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    pthread_mutex_lock(&park_mutex);
    int n = parked;
    pthread_mutex_unlock(&park_mutex);
    return PyLong_FromLong(n);
}

PyObject *py_direct_release(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    pthread_mutex_lock(&park_mutex);
    released = 1;
    pthread_cond_broadcast(&park_cond);
    pthread_mutex_unlock(&park_mutex);
    Py_RETURN_NONE;
}

/* direct_ops(env): python-lmdb's (active_ops, ops_waiters) of env, a python-lmdb 3.0
   Environment: its in-flight operations, and how many threads wait for them to end. */
PyObject *py_direct_ops(PyObject *self, PyObject *env)
{
    (void)self;
    if (strcmp(Py_TYPE(env)->tp_name, "Environment") != 0 || Py_TYPE(env)->tp_basicsize != (Py_ssize_t)sizeof(pl_env)) {
        PyErr_SetString(PyExc_TypeError, "direct_ops: env must be python-lmdb 3.0's Environment");
        return NULL;
    }
    pl_env *e = (pl_env *)env;
    return Py_BuildValue("(ii)", __atomic_load_n(&e->active_ops, __ATOMIC_SEQ_CST), __atomic_load_n(&e->ops_waiters, __ATOMIC_SEQ_CST));
}

/* Jobs looked up here so far (direct_jobs(): what the tests read to know this path ran). */
static unsigned long direct_jobs;

PyObject *py_direct_jobs(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLong(direct_jobs);
}

/* A key's lookups: its value in blocks and, for a split record, its entry in index. */
typedef struct {
    pl_val key, value, entry;
    int rc, entry_rc;
} lookup_t;

#define ON_STACK 16

/* The lookups of a counted job by the engine's get (see the file's doc), in the read transaction
   the store keeps (_lmdbkeep.c: renewed, so it reads the last commit), each record checked and
   copied into its row's view (views: memoryviews) by check_c: found[i] set True for each key
   read. kept and rows: where the views were taken (rows_stayed), asked again after the lookups.
   1: every key read or absent; 0: the job is the general path's (an engine error, a split
   record with no entry, a record not raw and sound, a row moved); -1: an error is set; 2: not taken (no
   probed capsule in parts, another check, a stand-in environment, anything not as probed, a row
   view not a writable memoryview, no read transaction to be had): python-lmdb's transaction and
   get read the job, nothing done. */
int direct_lookups(PyObject *const *parts, PyObject *env, PyObject *const *keys, PyObject *const *views, Py_ssize_t n, PyObject *check,
                   PyObject *found, const host_kept *kept, PyObject *const *rows)
{
    PyObject *direct = parts[P_DIRECT];
    if (direct == Py_None)
        return 2;
    direct_t *d = PyCapsule_GetPointer(direct, CAPSULE_NAME);
    if (d == NULL)
        return -1;
    if (check != d->check || env != d->env || d->forks != rowguard_forks())
        return 2; /* another check, a stand-in or another environment, another process: python-lmdb's get */
    pl_env *e = (pl_env *)env;
    unsigned int blocks, index;
    if (!env_usable(e) || e->libv != d->libv || e->env != d->mdb_env || db_handle(d, e, parts[P_BLOCKS], &blocks) < 0
        || db_handle(d, e, parts[P_INDEX], &index) < 0)
        return 2;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyMemoryView_Check(views[i]) || PyMemoryView_GET_BUFFER(views[i])->readonly || !PyBuffer_IsContiguous(PyMemoryView_GET_BUFFER(views[i]), 'C'))
            return 2;
    Py_ssize_t joined, at;
    if (record_sizes(parts, &joined, &at) < 0)
        return -1;
    Py_buffer head;
    if (PyObject_GetBuffer(parts[P_HEAD], &head, PyBUF_SIMPLE) < 0)
        return -1;
    lookup_t small[ON_STACK], *look = n <= ON_STACK ? small : PyMem_Calloc((size_t)n, sizeof *look);
    if (look == NULL) {
        PyBuffer_Release(&head);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        look[i].key.mv_size = (size_t)PyBytes_GET_SIZE(keys[i]); /* bytes of KEY_BYTES: the caller checked */
        look[i].key.mv_data = PyBytes_AS_STRING(keys[i]);
    }
    int (*get)(void *, unsigned int, pl_val *, pl_val *) = d->libv->get;
    /* Counted in flight (python-lmdb's ACTIVE_OPS_INC) from the transaction's renewal to its
       reset after the last copy out of the map: a close or a resize waits for it. The GIL is
       held here, as python-lmdb holds it for its increment, so no close has begun since the
       checks above. */
    __atomic_add_fetch(&e->active_ops, 1, __ATOMIC_SEQ_CST);
    void *mdb_txn = keep_take(d);
    if (mdb_txn == NULL) { /* (readers full, say): python-lmdb's begin tells */
        ops_done(e);
        if (look != small)
            PyMem_Free(look);
        PyBuffer_Release(&head);
        return 2;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        lookup_t *l = &look[i];
        l->rc = get(mdb_txn, blocks, &l->key, &l->value);
        l->entry_rc = 0;
        if (l->rc != 0)
            continue;
        for (size_t p = 0; p < l->value.mv_size; p += PL_PAGE) /* faulted in here, without the GIL */
            (void)((volatile const char *)l->value.mv_data)[p];
        if ((Py_ssize_t)l->value.mv_size != joined)
            l->entry_rc = get(mdb_txn, index, &l->key, &l->entry);
    }
    if (__atomic_load_n(&park_on, __ATOMIC_RELAXED))
        park();
    Py_END_ALLOW_THREADS
    /* The rows' addresses asked again now the GIL is back, and it held from here to the last
       copy (but for a copy of RELEASE_GIL_AT bytes or more): a pool grown meanwhile by another
       thread (pool.resize_) has its memory moved and the old freed. Moved: the general path's. */
    int rc = rows_stayed(kept, rows, views, 0, n);
    for (Py_ssize_t i = 0; i < n && rc == 1; i++) {
        const lookup_t *l = &look[i];
        if (l->rc == PL_NOTFOUND)
            continue; /* found[i] stays the False it was filled with */
        if (l->rc != 0 || l->entry_rc != 0) {
            rc = 0; /* an engine error, or a split record with no entry: the general path's */
            break;
        }
        const Py_buffer *row = PyMemoryView_GET_BUFFER(views[i]);
        int status;
        if ((Py_ssize_t)l->value.mv_size == joined) {
            status = d->check_c(head.buf, (size_t)head.len, l->key.mv_data, l->key.mv_size, l->value.mv_data, l->value.mv_size, row->buf,
                                (size_t)row->len, NULL, 0);
        } else {
            size_t from = (size_t)at < l->entry.mv_size ? (size_t)at : l->entry.mv_size;
            status = d->check_c(head.buf, (size_t)head.len, l->key.mv_data, l->key.mv_size, (const u8 *)l->entry.mv_data + from,
                                l->entry.mv_size - from, row->buf, (size_t)row->len, l->value.mv_data, l->value.mv_size);
        }
        if (status != XXC_CHECK_GOOD) {
            rc = status < 0 ? -1 : 0; /* anything but good: the general path's job */
            break;
        }
        Py_SETREF(((PyListObject *)found)->ob_item[i], Py_NewRef(Py_True)); /* the False filled in released */
    }
    keep_give(d, mdb_txn);
    ops_done(e);
    direct_jobs++;
    if (look != small)
        PyMem_Free(look);
    PyBuffer_Release(&head);
    return rc;
}

/* direct_copy(direct, env, txn, db, keys, rows): each key's value in db copied into its row
   (a writable buffer at least as long) by LMDB's get and memcpy, nothing else: no check, no
   count, the GIL held; the number found. What a load by LMDB's own get costs at the least:
   the benchmarks' reference arm (bench_disk_sizes, raw_cget), not a read of the tier. */
PyObject *py_direct_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6 || !PyList_CheckExact(args[4]) || !PyList_CheckExact(args[5]) || PyList_GET_SIZE(args[4]) != PyList_GET_SIZE(args[5])) {
        PyErr_SetString(PyExc_TypeError, "direct_copy() takes (direct, env, txn, db, keys, rows): keys and rows lists of one length");
        return NULL;
    }
    direct_t *d = PyCapsule_GetPointer(args[0], CAPSULE_NAME);
    if (d == NULL)
        return NULL;
    pl_env *e = (pl_env *)args[1];
    const pl_txn *t = (const pl_txn *)args[2];
    unsigned int dbi;
    if (Py_TYPE(args[1]) != d->env_type || Py_TYPE(args[2]) != d->txn_type || !env_usable(e) || e->libv != d->libv || t->env != e || !t->valid
        || t->txn == NULL || t->libv != d->libv || db_handle(d, e, args[3], &dbi) < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "direct_copy: env, txn and db must be the probed python-lmdb's, valid, of one environment of the probed engine");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[4]), found = 0;
    __atomic_add_fetch(&e->active_ops, 1, __ATOMIC_SEQ_CST);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(args[4], i), *row = PyList_GET_ITEM(args[5], i);
        Py_buffer out; /* a row's own buffer, asked of it: a released view or one whose bytes are not one run refuses */
        if (!PyBytes_CheckExact(key) || !PyMemoryView_Check(row) || PyObject_GetBuffer(row, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "direct_copy: keys[%zd] must be bytes and rows[%zd] a writable, contiguous, unreleased memoryview", i, i);
            found = -1;
            break;
        }
        pl_val k = {(size_t)PyBytes_GET_SIZE(key), PyBytes_AS_STRING(key)}, v;
        if (d->libv->get(t->txn, dbi, &k, &v) == 0) {
            memcpy(out.buf, v.mv_data, v.mv_size < (size_t)out.len ? v.mv_size : (size_t)out.len);
            found++;
        }
        PyBuffer_Release(&out);
    }
    ops_done(e);
    return found < 0 ? NULL : PyLong_FromSsize_t(found);
}

/* The job saves' writes by the engine's own put (_lmdbput.c). direct_writer: 1 where direct is a
   probed capsule, env the environment it probed (in this process) and txn python-lmdb's own live transaction of env (the job then counted in
   flight, as python-lmdb counts its put, until direct_writer_end), with blocks and index
   databases of env; 0 where not (nothing done: python-lmdb's put writes the job); -1 with an
   error set. LMDB itself refuses a put into a read-only transaction (EACCES). */
int direct_writer(PyObject *direct, PyObject *env, PyObject *txn, PyObject *blocks, PyObject *index, direct_writer_t *w)
{
    if (direct == Py_None)
        return 0;
    direct_t *d = PyCapsule_GetPointer(direct, CAPSULE_NAME);
    if (d == NULL)
        return -1;
    if (env != d->env || d->forks != rowguard_forks() || Py_TYPE(txn) != d->txn_type)
        return 0; /* another environment than the one probed (as the lookups ask), another process */
    pl_env *e = (pl_env *)env;
    pl_txn *t = (pl_txn *)txn;
    if (!env_usable(e) || e->libv != d->libv || e->env != d->mdb_env || t->env != e || !t->valid || t->txn == NULL || t->libv != d->libv
        || db_handle(d, e, blocks, &w->blocks) < 0 || db_handle(d, e, index, &w->index) < 0)
        return 0;
    w->env = e;
    w->txn = t;
    __atomic_add_fetch(&e->active_ops, 1, __ATOMIC_SEQ_CST);
    return 1;
}

/* key's value in blocks put with room for size bytes, reserved (MDB_RESERVE): the engine's code
   (0 with *space set), as python-lmdb's put counts it among the transaction's changes. */
int direct_reserve(direct_writer_t *w, void *key, size_t klen, size_t size, unsigned char **space)
{
    pl_txn *t = w->txn;
    pl_val k = {klen, key}, v = {size, NULL};
    t->mutations++;
    int rc = t->libv->put(t->txn, w->blocks, &k, &v, PL_RESERVE);
    *space = v.mv_data;
    return rc;
}

/* key's entry in index deleted, as python-lmdb's delete(key, b"", index): the engine's code, 0
   also where there was none. */
int direct_unindex(direct_writer_t *w, void *key, size_t klen)
{
    pl_txn *t = w->txn;
    pl_val k = {klen, key};
    t->mutations++;
    int rc = t->libv->del(t->txn, w->index, &k, NULL);
    return rc == PL_NOTFOUND ? 0 : rc;
}

void direct_writer_end(direct_writer_t *w)
{
    ops_done(w->env);
}
