/* KeyOrder (_keyorder.c), added to the extension kvtier.manager._probe by its init; HeldTouch
 * (_heldtouch.c) moves its keys through the calls below. */
#ifndef KVTIER_KEYORDER_H
#define KVTIER_KEYORDER_H

#include <Python.h>

#if defined(__GNUC__) || defined(__clang__)
#define KEYORDER_INTERNAL __attribute__((visibility("hidden")))
#else
#define KEYORDER_INTERNAL
#endif

/* Ready the type and add it to ``module`` as ``KeyOrder``; 0, or -1 with an error set. */
KEYORDER_INTERNAL int keyorder_add(PyObject *module);

/* Whether ``obj`` is exactly a KeyOrder. */
KEYORDER_INTERNAL int keyorder_check(PyObject *obj);

/* 1 if ``order`` (a KeyOrder) holds ``key``, 0 if not, -1 with an error set. */
KEYORDER_INTERNAL int keyorder_holds(PyObject *order, PyObject *key);

/* Move ``key`` to the newest end of ``order``; 0, or -1 with an error set (KeyError if not held). */
KEYORDER_INTERNAL int keyorder_move_last(PyObject *order, PyObject *key);

#endif
