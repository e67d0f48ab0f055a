/*
 * kvtier.records._xxcopy's rows' hold (host_rows_hold_api, _hostrow.h): automatic garbage
 * collection held off from a job's first row view to its last copy, counted for the whole
 * process. This extension's own jobs (_xxjob.c) take it as xxc_rows_hold/xxc_rows_let_go, the
 * lmdb tier's extension through the capsule rows_hold_c, Python through rows_hold() and
 * rows_let_go() (kvtier.records.xxcopy).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_hostrow.h"
#include "_xxh3.h"

#include <time.h>

/* Holds overlapping without a break (jobs on several threads, each starting before the last
   ends) keep the count above zero, and automatic collection would never run: cyclic garbage
   would grow without bound. So once the count has stayed above zero for HOLD_RUN_LIMIT_NS, a
   hold from a thread that holds none waits, GIL released, up to DRAIN_WAIT_NS for the count
   to drain (the other jobs end; new holds from threads holding none wait likewise), then runs
   the collection that was due, the oldest generation whose count passed its threshold, as the
   automatic one would, before it holds. A thread already holding (a nested hold) never waits,
   and no collection runs while any job holds; a hold waiting while such a collection runs waits
   for its end (COLLECT_WAIT_NS at most), and so does one from a thread holding none while any
   collection runs in another thread (gc_running: an automatic one begun before any hold). A
   wait that times out (a job longer than
   DRAIN_WAIT_NS, or a holder waiting on something the waiter has) holds as before, and the
   next wait comes a limit later: at worst DRAIN_WAIT_NS of waiting a thread per
   HOLD_RUN_LIMIT_NS of holds. */
#define HOLD_RUN_LIMIT_NS 100000000LL /* 100 ms */
#define DRAIN_WAIT_NS 5000000LL       /* 5 ms */
#define DRAIN_POLL_NS 50000L          /* 50 us between looks at the count */
/* A waiter's collection running (its finalizers let other threads run): the holds waiting wait
   for it to end, else they would take views while its finalizers may still move rows. Longer
   than DRAIN_WAIT_NS, since it ends without any job's help; bounded all the same, against a
   finalizer waiting on something a waiting thread has. */
#define COLLECT_WAIT_NS 200000000LL /* 200 ms */

/* The jobs held now, and whether automatic collection was on before the first of them; changed
   only with the GIL held, read without it by a waiting hold (relaxed loads and stores: the GIL
   orders the writers). held_runs counts the runs of holds (the count leaving zero); run_seen and
   run_seen_at, the run a hold from a thread holding none last saw and when (a monotonic coarse
   clock, read only by such holds). draining: the holds waiting for the count to drain; while
   any does, holds from threads holding none wait too, else one ending its job and holding again
   at once would start a new run before a waiter sees the count at zero. collecting: a waiter's
   due collection runs (its finalizers may let other threads run); waiters wait for it too. */
static Py_ssize_t rows_held;
static int collecting_before;
static unsigned long held_runs, run_seen;
static long long run_seen_at;
static int collecting, draining;
/* This thread's holds (nested ones never wait). Initial-exec: a plain load; the default model
   calls __tls_get_addr at each hold and let-go, ~3 ns of a pair's ~37 (measured alternated). */
static _Thread_local Py_ssize_t thread_holds __attribute__((tls_model("initial-exec")));
static PyObject *gc_get_count, *gc_get_threshold, *gc_collect;
/* A collection running (gc.callbacks' start to its stop: an automatic one, or one asked for),
   and the thread it runs in. Its finalizers may let the GIL go, and one may move a row while
   another thread's job has its view: so a hold from a thread holding none, in any other thread,
   first waits for its end (COLLECT_WAIT_NS at most). Set and cleared with the GIL held; read
   without it by that wait. */
static int gc_running;
static unsigned long gc_thread;
/* gc.callbacks (the list the interpreter calls) and this module's entry in it: a wait that times
   out with gc_running still set looks for the entry there. Taken out by someone (the list
   cleared mid-collection), the collection's stop never reaches gc_running: it is cleared then,
   and the entry added again, else every later hold would wait COLLECT_WAIT_NS for an end that
   never comes. */
static PyObject *gc_callbacks, *gc_phase_entry;
/* Where the entry was last found in gc.callbacks (phase_entry_listed looks there first). */
static Py_ssize_t gc_phase_at;

#ifndef CLOCK_MONOTONIC_COARSE
#define CLOCK_MONOTONIC_COARSE CLOCK_MONOTONIC
#endif

/* clock's time in ns: CLOCK_MONOTONIC_COARSE (a tick's resolution, a few ns a read) for the
   run's limit, CLOCK_MONOTONIC for the wait's. */
static long long clock_ns(clockid_t clock)
{
    struct timespec t;
    clock_gettime(clock, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Whether a hold from a thread holding none should wait: another's collection runs, or the
   holds have run without a break for HOLD_RUN_LIMIT_NS with collection on before them. */
static int hold_should_wait(void)
{
    if (draining)
        return 1;
    if (!collecting_before)
        return 0; /* the engine keeps collection off itself: nothing is due */
    long long now = clock_ns(CLOCK_MONOTONIC_COARSE);
    if (run_seen != held_runs) {
        run_seen = held_runs;
        run_seen_at = now;
        return 0;
    }
    return now - run_seen_at > HOLD_RUN_LIMIT_NS;
}

/* The collection automatic collection would run now (the oldest generation whose count passed
   its threshold), if any. Its errors are reported as unraisable: a hold never raises. */
static void collect_due(void)
{
    __atomic_store_n(&collecting, 1, __ATOMIC_RELAXED); /* from the counts' look to the collection's end */
    PyObject *count = PyObject_CallNoArgs(gc_get_count), *threshold = count == NULL ? NULL : PyObject_CallNoArgs(gc_get_threshold);
    Py_ssize_t due = -1;
    if (threshold != NULL && PyTuple_Check(count) && PyTuple_Check(threshold)) {
        Py_ssize_t n = Py_MIN(PyTuple_GET_SIZE(count), PyTuple_GET_SIZE(threshold));
        for (Py_ssize_t g = n - 1; g >= 0 && due < 0; g--) {
            long c = PyLong_AsLong(PyTuple_GET_ITEM(count, g)), t = PyLong_AsLong(PyTuple_GET_ITEM(threshold, g));
            if (t > 0 && c > t)
                due = g;
        }
    }
    Py_XDECREF(count);
    Py_XDECREF(threshold);
    if (due >= 0 && !PyErr_Occurred())
        Py_XDECREF(PyObject_CallFunction(gc_collect, "n", due));
    __atomic_store_n(&collecting, 0, __ATOMIC_RELAXED);
    if (PyErr_Occurred())
        PyErr_WriteUnraisable(gc_collect);
}

/* The wait of a hold from a thread holding none (GIL held on entry and on return): GIL released,
   until no job holds (DRAIN_WAIT_NS at most) and no waiter's collection runs (COLLECT_WAIT_NS at
   most); then the due collection. */
static void drain_and_collect(void)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback); /* a hold is taken on error paths too */
    long long start = clock_ns(CLOCK_MONOTONIC);
    draining++;
    for (;;) {
        int timed_out = 0;
        Py_BEGIN_ALLOW_THREADS
        struct timespec poll = {0, DRAIN_POLL_NS};
        for (;;) {
            int held = __atomic_load_n(&rows_held, __ATOMIC_RELAXED) > 0, running = __atomic_load_n(&collecting, __ATOMIC_RELAXED);
            if (!held && !running)
                break;
            if ((timed_out = clock_ns(CLOCK_MONOTONIC) - start >= (running ? COLLECT_WAIT_NS : DRAIN_WAIT_NS)))
                break;
            nanosleep(&poll, NULL);
        }
        Py_END_ALLOW_THREADS
        if (rows_held == 0 && !collecting) {
            collect_due();
            break;
        }
        if (timed_out || !collecting) {
            run_seen_at = clock_ns(CLOCK_MONOTONIC_COARSE); /* not drained: the next wait a limit later */
            break;
        }
        /* another waiter's collection began while this one took the GIL back: wait for its end */
    }
    draining--;
    PyErr_Restore(type, value, traceback);
}

/* After a wait for a collection's end that timed out: where this module's entry is no longer in
   gc.callbacks, the stop it waited for can never come, so gc_running is cleared and the entry
   added again (the next collection's start and stop are seen). Never raises. */
static void phase_entry_kept(void)
{
    if (gc_callbacks == NULL || !PyList_Check(gc_callbacks))
        return;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    int present = PySequence_Contains(gc_callbacks, gc_phase_entry);
    if (present == 0) {
        __atomic_store_n(&gc_running, 0, __ATOMIC_RELAXED);
        present = PyList_Append(gc_callbacks, gc_phase_entry);
    }
    if (present < 0)
        PyErr_WriteUnraisable(gc_callbacks);
    PyErr_Restore(type, value, traceback);
}

/* Where no collection is known to run: this module's entry found in gc.callbacks (by identity,
   at its last place first: no Python runs), and added again where it is gone (the list put back
   to an earlier copy, or cleared, between collections), else no later collection would be seen.
   A collection begun before the entry is back is not seen. With gc_running set, the entry is
   left to wait_collection_end (phase_entry_kept: the flag cleared with it). Never raises. */
static void phase_entry_readded(void)
{
    Py_ssize_t n = PyList_GET_SIZE(gc_callbacks);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyList_GET_ITEM(gc_callbacks, i) == gc_phase_entry) {
            gc_phase_at = i;
            return;
        }
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (PyList_Append(gc_callbacks, gc_phase_entry) < 0)
        PyErr_WriteUnraisable(gc_callbacks);
    else
        gc_phase_at = n;
    PyErr_Restore(type, value, traceback);
}

static inline void phase_entry_listed(void)
{
    if (gc_callbacks == NULL || gc_running)
        return;
    Py_ssize_t at = gc_phase_at;
    if (at >= PyList_GET_SIZE(gc_callbacks) || PyList_GET_ITEM(gc_callbacks, at) != gc_phase_entry)
        phase_entry_readded();
}

/* The wait of a hold from a thread holding none while a collection runs in another thread
   (GIL held on entry and on return): GIL released between looks, until it ends
   (COLLECT_WAIT_NS at most). Each look is taken with the GIL held, so a collection that starts
   between the last look and the GIL's return (another thread's allocation) is seen, and one
   cannot start between the last look and the hold (its count and PyGC_Disable, GIL held). */
static void wait_collection_end(void)
{
    long long start = clock_ns(CLOCK_MONOTONIC);
    unsigned long me = PyThread_get_thread_ident();
    struct timespec poll = {0, DRAIN_POLL_NS};
    while (gc_running && gc_thread != me && clock_ns(CLOCK_MONOTONIC) - start < COLLECT_WAIT_NS) {
        Py_BEGIN_ALLOW_THREADS
        nanosleep(&poll, NULL);
        Py_END_ALLOW_THREADS
    }
    if (gc_running && gc_thread != me)
        phase_entry_kept();
}

XXC_INTERNAL void xxc_rows_hold(void)
{
    if (thread_holds++ == 0) {
        phase_entry_listed();
        if ((rows_held > 0 || draining) && hold_should_wait())
            drain_and_collect();
        if (gc_running) /* (after the drain, which lets the GIL go: a collection begun meanwhile) */
            wait_collection_end();
    }
    Py_ssize_t held = rows_held;
    __atomic_store_n(&rows_held, held + 1, __ATOMIC_RELAXED);
    if (held == 0) {
        collecting_before = PyGC_Disable();
        held_runs++;
    }
}

XXC_INTERNAL void xxc_rows_let_go(void)
{
    if (thread_holds > 0)
        thread_holds--;
    Py_ssize_t held = rows_held;
    if (held > 0) {
        __atomic_store_n(&rows_held, held - 1, __ATOMIC_RELAXED);
        if (held == 1 && collecting_before)
            PyGC_Enable();
    }
}

static PyObject *py_rows_hold(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    xxc_rows_hold();
    Py_RETURN_NONE;
}

static PyObject *py_rows_let_go(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    xxc_rows_let_go();
    Py_RETURN_NONE;
}

/* rows_hold_flag(held) and rows_let_go_flag(held): the hold taken, and let go, together with
   its flag held[0] (a list of one bool) in one call, for a hold let go early by whichever of the
   job's steps gets there first. Taken as the first line of a ``try`` whose ``finally`` lets it go
   by the flag, no instruction runs between the hold and its flag: an asynchronous exception
   (KeyboardInterrupt) lands either before both or after both, never leaving the hold taken
   with no flag to let it go. A flag already set takes no second hold; one unset lets none go. */
static int hold_flag_checked(PyObject *held)
{
    if (PyList_CheckExact(held) && PyList_GET_SIZE(held) == 1)
        return 1;
    PyErr_SetString(PyExc_TypeError, "rows' hold flag: expected a list of one bool");
    return 0;
}

static PyObject *py_rows_hold_flag(PyObject *module, PyObject *held)
{
    (void)module;
    if (!hold_flag_checked(held))
        return NULL;
    if (PyList_GET_ITEM(held, 0) != Py_True) {
        xxc_rows_hold();
        PyObject *was = PyList_GET_ITEM(held, 0);
        PyList_SET_ITEM(held, 0, Py_NewRef(Py_True));
        Py_XDECREF(was);
    }
    Py_RETURN_NONE;
}

static PyObject *py_rows_let_go_flag(PyObject *module, PyObject *held)
{
    (void)module;
    if (!hold_flag_checked(held))
        return NULL;
    if (PyList_GET_ITEM(held, 0) == Py_True) {
        PyList_SET_ITEM(held, 0, Py_NewRef(Py_False));
        Py_DECREF(Py_True);
        xxc_rows_let_go();
    }
    Py_RETURN_NONE;
}

/* rows_exit(*exc_info): rows_let_go() as a context manager's __exit__ (kvtier.records.rowhold's
   rows_held): its arguments are not read, and None lets the block's exception propagate. */
static PyObject *py_rows_exit(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    (void)args;
    (void)nargs;
    xxc_rows_let_go();
    Py_RETURN_NONE;
}

/* rows_forked(): in a child just forked, the holds of the parent's other threads (jobs that do not
   go on here) dropped, and collection on again where it was before the first. */
static PyObject *py_rows_forked(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    thread_holds = 0;
    collecting = draining = gc_running = 0;
    if (rows_held > 0) {
        rows_held = 0;
        if (collecting_before)
            PyGC_Enable();
    }
    Py_RETURN_NONE;
}

/* gc.callbacks' entry: a collection's start and stop (gc_running, gc_thread). */
static PyObject *py_gc_phase(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs >= 1 && PyUnicode_Check(args[0])) {
        int start = PyUnicode_CompareWithASCIIString(args[0], "start") == 0;
        if (start)
            gc_thread = PyThread_get_thread_ident();
        __atomic_store_n(&gc_running, start, __ATOMIC_RELAXED);
    }
    Py_RETURN_NONE;
}

static PyMethodDef gc_phase_def = {"rows_gc_phase", (PyCFunction)(void (*)(void))py_gc_phase, METH_FASTCALL,
                                   "rows_gc_phase(phase, info): gc.callbacks' entry of the rows' hold (a collection's start and stop)."};

static const host_rows_hold_api hold_api = {xxc_rows_hold, xxc_rows_let_go};

static PyMethodDef hold_methods[] = {
    {"rows_hold", py_rows_hold, METH_NOARGS, "rows_hold(): automatic garbage collection held off, counted (see _hostrow.h)."},
    {"rows_let_go", py_rows_let_go, METH_NOARGS, "rows_let_go(): one rows_hold() ended; the last lets collection go again."},
    {"rows_exit", (PyCFunction)(void (*)(void))py_rows_exit, METH_FASTCALL,
     "rows_exit(*exc_info): rows_let_go() as a context manager's __exit__; returns None (an exception propagates)."},
    {"rows_hold_flag", py_rows_hold_flag, METH_O, "rows_hold_flag(held): rows_hold() and held[0] = True in one call (none if already set)."},
    {"rows_let_go_flag", py_rows_let_go_flag, METH_O, "rows_let_go_flag(held): where held[0], held[0] = False and rows_let_go() in one call."},
    {"rows_forked", py_rows_forked, METH_NOARGS, "rows_forked(): in a child just forked, every hold dropped (collection as before the first)."},
    {NULL, NULL, 0, NULL},
};

XXC_INTERNAL int xxc_add_rows_hold(PyObject *module)
{
    PyObject *gc = PyImport_ImportModule("gc");
    if (gc == NULL)
        return -1;
    gc_get_count = PyObject_GetAttrString(gc, "get_count");
    gc_get_threshold = gc_get_count == NULL ? NULL : PyObject_GetAttrString(gc, "get_threshold");
    gc_collect = gc_get_threshold == NULL ? NULL : PyObject_GetAttrString(gc, "collect");
    PyObject *callbacks = gc_collect == NULL ? NULL : PyObject_GetAttrString(gc, "callbacks");
    Py_DECREF(gc);
    PyObject *phase = callbacks == NULL ? NULL : PyCFunction_NewEx(&gc_phase_def, NULL, NULL);
    int added_phase = phase == NULL ? -1 : PyList_Append(callbacks, phase); /* (gc.callbacks: a list) */
    if (added_phase < 0) {
        Py_XDECREF(phase);
        Py_XDECREF(callbacks);
        return -1;
    }
    gc_callbacks = callbacks; /* (both kept for the process: phase_entry_kept, phase_entry_listed) */
    gc_phase_entry = phase;
    gc_phase_at = PyList_GET_SIZE(callbacks) - 1;
    PyObject *capsule = PyCapsule_New((void *)&hold_api, HOST_ROWS_HOLD_CAPSULE, NULL);
    int added = capsule == NULL ? -1 : PyModule_AddObjectRef(module, "rows_hold_c", capsule);
    Py_XDECREF(capsule);
    return added < 0 ? -1 : PyModule_AddFunctions(module, hold_methods);
}
