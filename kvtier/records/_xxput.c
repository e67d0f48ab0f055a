/*
 * kvtier.records._xxcopy, a joined record built where its caller wants it: the lmdb tier's job
 * save writes each record straight into the space LMDB reserved for it in its page
 * (MDB_RESERVE), so the record is copied once, in the hash's pass, and not a second time by
 * LMDB's put. The bytes are those xxh3_64_joined returns (_xxcopy.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_xxh3.h"

XXC_INTERNAL int xxc_joined_into(const u8 *head, size_t hlen, const u8 *key, size_t klen, const u8 *src, size_t slen, u8 *dst)
{
    u8 prefix[XXC_JOIN_PREFIX_MAX]; /* a store's head and key: 24 + 32 */
    if (hlen + klen > sizeof prefix)
        return -1;
    memcpy(prefix, head, hlen);
    memcpy(prefix + hlen, key, klen);
    memcpy(dst, head, hlen);
    u64 digest = xxh3_copy(stripes_for(1, slen), prefix, hlen + klen, src, dst + hlen + 8, slen);
    for (int i = 0; i < 8; i++)
        dst[hlen + i] = (u8)(digest >> (8 * i));
    return 0;
}

XXC_INTERNAL int xxc_add_capsule(PyObject *module, const char *attr, void *fn, const char *name)
{
    PyObject *capsule = PyCapsule_New(fn, name, NULL);
    int added = capsule == NULL ? -1 : PyModule_AddObjectRef(module, attr, capsule);
    Py_XDECREF(capsule);
    return added;
}
