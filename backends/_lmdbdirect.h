/*
 * What the sources of kvtier.backends._rowguard that read python-lmdb's objects share
 * (_lmdbdirect.c, the lookups and the job saves' writer; _lmdbkeep.c, the read transaction the
 * lookups keep): python-lmdb 3.0.0's structs and what direct_probe found sound.
 */
#ifndef KVTIER_LMDBDIRECT_H
#define KVTIER_LMDBDIRECT_H

#include "_rowguard.h"

#include <pthread.h>
#include <sys/types.h>

#include "../kvtier/records/_xxh3.h"

#pragma GCC visibility push(hidden)

/* python-lmdb 3.0.0's structs, field for field (lmdb/cpython.c without HAVE_MEMSINK, which its
   builds leave undefined; lmdb/mdb_api.h). Only the fields up to the last one read matter, and
   direct_probe checks each type's size against them. */
typedef struct {
    size_t mv_size;
    void *mv_data;
} pl_val;

typedef struct {
    int major, minor, patch;
    unsigned int data_version;
    void *env_create, *env_open, *env_close, *env_copy2, *env_copyfd2, *env_copy3, *env_copyfd3, *env_sync, *env_stat, *env_info;
    void *env_get_flags, *env_set_flags, *env_get_maxkeysize, *env_get_maxreaders, *env_get_path, *env_set_mapsize,
        *env_set_maxdbs, *env_set_maxreaders, *reader_check, *reader_list;
    void *txn_begin, *txn_commit, *txn_abort, *txn_reset, *txn_renew;
    size_t (*txn_id)(void *txn);
    void *dbi_open, *dbi_flags, *dbi_close, *drop;
    int (*get)(void *txn, unsigned int dbi, pl_val *key, pl_val *data);
    int (*put)(void *txn, unsigned int dbi, pl_val *key, pl_val *data, unsigned int flags);
    int (*del)(void *txn, unsigned int dbi, pl_val *key, pl_val *data);
} pl_api;

struct pl_list_head {
    void *prev, *next;
};

#define PL_HEAD                                                                                                                    \
    PyObject_HEAD struct pl_list_head siblings;                                                                                    \
    struct pl_list_head children;                                                                                                  \
    int valid;

struct pl_env;

typedef struct {
    PL_HEAD
    struct pl_env *env;
    unsigned int dbi;
    unsigned int flags;
} pl_db;

typedef struct pl_env {
    PL_HEAD
    PyObject *weaklist;
    void *env;
    const pl_api *libv;
    pl_db *main_db;
    int readonly;
    void *spare_txn;
    int max_spare_txns;
    pid_t pid;
    unsigned long write_txn_tid;
    PyObject *open_keys;
    int active_ops;
    int ops_waiters;
    int write_begins;
    int resizing;
    unsigned long resize_tid;
    int ops_sync_ready;
    pthread_mutex_t ops_mutex;
    pthread_cond_t ops_cond;
} pl_env;

typedef struct {
    PL_HEAD
    PyObject *weaklist;
    pl_env *env;
    void *parent;
    const pl_api *libv;
    void *txn;
    int flags;
    pl_db *db;
    int mutations;
} pl_txn;

#define PL_NOTFOUND (-30798) /* MDB_NOTFOUND, the same in both engines */
#define PL_RESERVE 0x10000   /* MDB_RESERVE, the same in both engines */
#define PL_PAGE 4096         /* python-lmdb's preload stride */
#define CAPSULE_NAME "kvtier.backends._rowguard.direct"

/* What direct_probe found sound, kept in the capsule a store's parts hold. */
typedef struct {
    PyTypeObject *env_type, *txn_type, *db_type; /* python-lmdb's types, held */
    const pl_api *libv;                          /* the engine checked */
    PyObject *check;                             /* xxcopy's native check-copy, held: the one check_c is */
    xxc_check_copy_fn check_c;
    /* The read transaction the jobs keep (_lmdbkeep.c): of env (held, so never another
       object at its address), on the engine's env the probe saw, in the process it ran in. */
    PyObject *env;
    void *mdb_env;
    unsigned long forks;
    int (*txn_begin)(void *env, void *parent, unsigned int flags, void **txn);
    void (*txn_reset)(void *txn);
    int (*txn_renew)(void *txn);
    void (*txn_abort)(void *txn);
    int dropped;  /* the store is closing: nothing is kept from now on */
    void *spare;  /* a reset read transaction, or NULL */
} direct_t;

/* Whether python-lmdb's own get would start now (see _lmdbdirect.c). */
int env_usable(const pl_env *e);

/* The kept read transaction (_lmdbkeep.c): keep_init at the probe (0, or -1 with a
   RuntimeError naming what failed), keep_take a renewed or new read transaction of d's env
   (NULL: none, nothing set), keep_give it back once a job is done with it, keep_drop the spare
   aborted where that is sound. keep_take and keep_give with the GIL held and the job counted in
   the environment's in-flight operations. */
int keep_init(direct_t *d, pl_env *e, PyObject *meta_key, unsigned int meta_dbi, PyObject *value);
void *keep_take(direct_t *d);
void keep_give(direct_t *d, void *txn);
void keep_drop(direct_t *d);

#pragma GCC visibility pop

#endif
