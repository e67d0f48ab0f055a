/*
 * A second core for a job's records (kvtier.records._xxcopy): one persistent worker thread that
 * takes records of a job from the same counter as the caller, so two records are read and
 * hashed at once. The worker is woken once a job (a condition variable), never started per
 * job; it touches no Python object and runs only while the caller, GIL released, waits for it.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>

#include "_xxh3.h"

/* A job shared with the worker: items [0, n) claimed one at a time from next, each run by
   one(ctx, i); worker_done once the worker has claimed past the end. */
typedef struct {
    xxc_item_fn one;
    void *ctx;
    size_t n;
    atomic_size_t next;
    int worker_done;
} pair_job;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t posted_cond = PTHREAD_COND_INITIALIZER, done_cond = PTHREAD_COND_INITIALIZER;
static pair_job *posted; /* the job offered to the worker (NULL: none; another caller runs alone) */
static int taken;        /* whether the worker has begun the posted job */
static int started;      /* whether the worker thread runs in this process */
static int forks_seen;   /* whether pthread_atfork has our handlers */

/* Row length from which a job of two or more records is shared (0: never): set by
   xxc_pair_set_min (xxh3_64_pair_reads). */
static atomic_size_t pair_min = 65536;
static atomic_size_t worker_items; /* items the worker has run since import */

/* Items claimed from job's counter and run until none is left; how many this thread ran. */
static size_t run_items(pair_job *job)
{
    for (size_t ran = 0;; ran++) {
        size_t i = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
        if (i >= job->n)
            return ran;
        job->one(job->ctx, i);
    }
}

static void *worker_main(void *unused)
{
    (void)unused;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (posted == NULL || taken)
            pthread_cond_wait(&posted_cond, &lock);
        pair_job *job = posted;
        taken = 1;
        pthread_mutex_unlock(&lock);
        size_t ran = run_items(job);
        atomic_fetch_add_explicit(&worker_items, ran, memory_order_relaxed);
        pthread_mutex_lock(&lock);
        job->worker_done = 1;
        pthread_cond_signal(&done_cond);
    }
    return NULL;
}

/* The lock held across fork, so the child's copy of it is in a known state; the child, which
   has no worker, starts a new one at its first shared job. */
static void before_fork(void) { pthread_mutex_lock(&lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&lock); }
static void after_fork_child(void)
{
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&posted_cond, NULL);
    pthread_cond_init(&done_cond, NULL);
    posted = NULL;
    taken = 0;
    started = 0;
}

/* The worker started (lock held); 0, or -1 where it could not be (the job then runs alone). */
static int start_worker(void)
{
    if (!forks_seen) {
        if (pthread_atfork(before_fork, after_fork_parent, after_fork_child) != 0)
            return -1;
        forks_seen = 1;
    }
    pthread_attr_t attr;
    sigset_t all, was;
    pthread_t thread;
    if (pthread_attr_init(&attr) != 0)
        return -1;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &was); /* the worker takes no signal: Python's stay with its threads */
    int rc = pthread_create(&thread, &attr, worker_main, NULL);
    pthread_sigmask(SIG_SETMASK, &was, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0)
        return -1;
    started = 1;
    return 0;
}

XXC_INTERNAL size_t xxc_pair_set_min(size_t bytes) { return atomic_exchange(&pair_min, bytes); }

XXC_INTERNAL size_t xxc_pair_worker_items(void) { return atomic_load(&worker_items); }

XXC_INTERNAL int xxc_pair_wanted(size_t n, size_t row_bytes)
{
    size_t min = atomic_load_explicit(&pair_min, memory_order_relaxed);
    return n >= 2 && min != 0 && row_bytes >= min;
}

XXC_INTERNAL void xxc_pair_run(xxc_item_fn one, void *ctx, size_t n)
{
    pair_job job = {one, ctx, n, 0, 0};
    pthread_mutex_lock(&lock);
    int shared = posted == NULL && (started || start_worker() == 0);
    if (shared) {
        posted = &job;
        taken = 0;
        pthread_cond_signal(&posted_cond);
    }
    pthread_mutex_unlock(&lock);
    run_items(&job);
    if (!shared)
        return;
    pthread_mutex_lock(&lock);
    if (taken) /* the worker may be in an item still: the job's rows stay in use until it is out */
        while (!job.worker_done)
            pthread_cond_wait(&done_cond, &lock);
    posted = NULL; /* (not taken: withdrawn, the worker never sees it) */
    taken = 0;
    pthread_mutex_unlock(&lock);
}
