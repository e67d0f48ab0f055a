/* HeldTouch (_heldtouch.c), added to the extension kvtier.manager._probe by its init. */
#ifndef KVTIER_HELDTOUCH_H
#define KVTIER_HELDTOUCH_H

#include <Python.h>

#if defined(__GNUC__) || defined(__clang__)
__attribute__((visibility("hidden")))
#endif
/* Ready the type and add it to ``module`` as ``HeldTouch``; 0, or -1 with an error set. */
int heldtouch_add(PyObject *module);

#endif
