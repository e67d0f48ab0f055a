/*
 * kvtier.backends._filesync: the syncs of a file tier's commit (kvtier.backends.file_commit),
 * side by side on threads of this module's own, in one call that holds no GIL.
 *
 * sync_all(fds, data) -> list: fdatasync (data true) or fsync of every descriptor, each on a
 * thread of a small pool while the calling thread takes its share too; returns once every sync
 * has returned, the errno of each (0: synced). On Python's thread pool each sync was a task
 * handed over and a result handed back, and every hand-off took the GIL, contended by the
 * other callers' threads; here a sync is taken from a list under a mutex and counted back.
 *
 * The pool's threads are made when a call finds too few of them idle (at most POOL_MAX), with
 * every signal blocked (a signal goes to the interpreter's threads), and they wait for work for
 * the life of the process. A child made by fork has none of them: its first call makes its own.
 * A thread that cannot be made is no error: the calling thread syncs what is left.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

/* Threads at most in the pool (file_commit.SYNC_THREADS, the Python pool's size). */
#define POOL_MAX 16
/* Descriptors one call takes on the stack; more go through the heap. */
#define SMALL 64

/* A call's syncs: taken in order (next), counted back (left) under the pool's mutex. */
typedef struct batch {
    const int *fds;
    int *errs;
    int n, next, left, data;
    pthread_cond_t done;
    struct batch *prev, *after; /* in the list of batches with syncs not yet taken */
} batch;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work = PTHREAD_COND_INITIALIZER;
static batch *pending;
static int threads, idle;
static pthread_once_t fork_hooks = PTHREAD_ONCE_INIT;

static void unlist(batch *b)
{
    if (b->prev != NULL)
        b->prev->after = b->after;
    else
        pending = b->after;
    if (b->after != NULL)
        b->after->prev = b->prev;
    b->prev = b->after = NULL;
}

/* fdatasync (data) or fsync of fd, again after an interruption: 0 or the errno. */
static int sync_one(int fd, int data)
{
    while ((data ? fdatasync(fd) : fsync(fd)) != 0) {
        if (errno != EINTR)
            return errno;
    }
    return 0;
}

/* With mu held: take b's next sync and run it with mu released; count it back. */
static void run_one(batch *b)
{
    int i = b->next++;
    if (b->next == b->n)
        unlist(b);
    pthread_mutex_unlock(&mu);
    int err = sync_one(b->fds[i], b->data);
    pthread_mutex_lock(&mu);
    b->errs[i] = err;
    if (--b->left == 0)
        pthread_cond_signal(&b->done);
}

static void *pool_thread(void *unused)
{
    (void)unused;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (pending == NULL) {
            idle++;
            pthread_cond_wait(&work, &mu);
            idle--;
        }
        run_one(pending);
    }
    return NULL;
}

static void before_fork(void)
{
    pthread_mutex_lock(&mu);
}

static void after_fork_parent(void)
{
    pthread_mutex_unlock(&mu);
}

/* The child has no pool thread, and no call under way (fork returned on the caller's thread). */
static void after_fork_child(void)
{
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&work, NULL);
    pending = NULL;
    threads = idle = 0;
}

static void install_fork_hooks(void)
{
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

/* With mu held: make up to want more threads (at most POOL_MAX in all). */
static void grow(int want)
{
    for (; want > 0 && threads < POOL_MAX; want--) {
        pthread_attr_t attr;
        sigset_t all, old;
        pthread_t t;
        if (pthread_attr_init(&attr) != 0)
            return;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 128 << 10);
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        int rc = pthread_create(&t, &attr, pool_thread, NULL);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            return;
        threads++;
    }
}

/* Every sync of fds[0..n) side by side (see the module doc); errs[i]: its errno or 0. */
static void sync_side_by_side(const int *fds, int *errs, int n, int data)
{
    if (n == 1) {
        errs[0] = sync_one(fds[0], data);
        return;
    }
    batch b = {fds, errs, n, 0, n, data, PTHREAD_COND_INITIALIZER, NULL, NULL};
    pthread_once(&fork_hooks, install_fork_hooks);
    pthread_mutex_lock(&mu);
    b.after = pending;
    if (pending != NULL)
        pending->prev = &b;
    pending = &b;
    grow(n - 1 - idle);
    pthread_cond_broadcast(&work);
    while (b.next < b.n) /* the calling thread syncs its share too */
        run_one(&b);
    while (b.left > 0)
        pthread_cond_wait(&b.done, &mu);
    pthread_mutex_unlock(&mu);
    pthread_cond_destroy(&b.done);
}

/* sync_all(fds, data) -> list[int]: see the module doc. */
static PyObject *py_sync_all(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "sync_all() takes 2 arguments (fds, data), got %zd", nargs);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "fds: expected a sequence of file descriptors");
    if (seq == NULL)
        return NULL;
    if (PyList_Check(seq)) { /* an item's __index__ may change the list: read a copy of it */
        PyObject *copy = PyList_AsTuple(seq);
        Py_DECREF(seq);
        if (copy == NULL)
            return NULL;
        seq = copy;
    }
    int data = PyObject_IsTrue(args[1]);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (data < 0 || n > INT_MAX / 2) {
        if (data >= 0)
            PyErr_SetString(PyExc_ValueError, "fds: too many");
        Py_DECREF(seq);
        return NULL;
    }
    int small[2 * SMALL];
    int *fds = n <= SMALL ? small : PyMem_Malloc(2 * (size_t)n * sizeof(int));
    if (fds == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    int *errs = fds + n;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (fd == -1 && PyErr_Occurred())
            goto done;
        if (fd < 0 || fd > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "fds[%zd]: expected an open file descriptor, got %ld", i, fd);
            goto done;
        }
        fds[i] = (int)fd;
    }
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        sync_side_by_side(fds, errs, (int)n, data);
        Py_END_ALLOW_THREADS
    }
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *err = PyLong_FromLong(errs[i]);
        if (err == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, err);
    }
done:
    if (fds != small)
        PyMem_Free(fds);
    Py_DECREF(seq);
    return result;
}

/* pool() -> (threads, idle): the pool's threads made so far in this process, and those idle. */
static PyObject *py_pool(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    int made, waiting;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&mu);
    made = threads;
    waiting = idle;
    pthread_mutex_unlock(&mu);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ii)", made, waiting);
}

static PyMethodDef methods[] = {
    {"sync_all", (PyCFunction)(void (*)(void))py_sync_all, METH_FASTCALL,
     "sync_all(fds, data) -> list[int]\n\n"
     "fdatasync (data true) or fsync of every descriptor, side by side on the module's threads,\n"
     "without the GIL; the errno of each (0: synced)."},
    {"pool", py_pool, METH_NOARGS, "pool() -> (threads, idle): the sync threads made in this process, and those idle."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_filesync", "The syncs of a file tier's commit, side by side, without the GIL (native).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__filesync(void)
{
    return PyModule_Create(&module_def);
}
