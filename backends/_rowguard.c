/*
 * kvtier.backends._rowguard: the two checks an lmdb tier's one-key straight read makes before
 * its lookup, each one call (kvtier.backends.lmdb_plain: host_view, same_size). In Python the
 * row's five checks and its view's lookup cost about 0.5 us of a 4 KiB job of 3, the file guard
 * 0.4 (os.lseek hands the GIL over and takes it back around a call that never blocks).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <sys/types.h>
#include <unistd.h>

static PyObject *s_dtype, *s_shape, *s_is_cpu, *s_is_contiguous, *s_data_ptr;

/* Whether obj.name is true (1), is not (0), or raised (-1). */
static int attr_is_true(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    int is = PyObject_IsTrue(v);
    Py_DECREF(v);
    return is;
}

/* host_view(row, tensor_type, dtype, shape, views): views[row.data_ptr()] when type(row) is
   tensor_type, row.dtype is dtype, row.shape == shape, row.is_cpu and row.is_contiguous();
   None when any of them is not so or the address is not in views. Asked in that order, as
   the Python form asks them; an error raised by one of them propagates. */
static PyObject *py_host_view(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "host_view() takes 5 arguments (row, tensor_type, dtype, shape, views), got %zd", nargs);
        return NULL;
    }
    PyObject *row = args[0], *dtype = args[2], *shape = args[3], *views = args[4];
    if (!PyDict_Check(views)) {
        PyErr_Format(PyExc_TypeError, "views: expected a dict, got %.100s", Py_TYPE(views)->tp_name);
        return NULL;
    }
    if ((PyObject *)Py_TYPE(row) != args[1])
        Py_RETURN_NONE;
    PyObject *v = PyObject_GetAttr(row, s_dtype);
    if (v == NULL)
        return NULL;
    int ok = v == dtype;
    Py_DECREF(v);
    if (!ok)
        Py_RETURN_NONE;
    v = PyObject_GetAttr(row, s_shape);
    if (v == NULL)
        return NULL;
    int differ = PyObject_RichCompareBool(v, shape, Py_NE);
    Py_DECREF(v);
    if (differ != 0)
        return differ < 0 ? NULL : Py_NewRef(Py_None);
    ok = attr_is_true(row, s_is_cpu);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    v = PyObject_CallMethodNoArgs(row, s_is_contiguous);
    if (v == NULL)
        return NULL;
    ok = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *at = PyObject_CallMethodNoArgs(row, s_data_ptr);
    if (at == NULL)
        return NULL;
    PyObject *view = PyDict_GetItemWithError(views, at); /* borrowed: owned before anything else runs */
    Py_XINCREF(view);
    Py_DECREF(at);
    if (view == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    return view;
}

/* same_size(fd, seen): whether the file open at fd ends at seen bytes now (lseek to its end,
   with the GIL held: it never waits); False also when fd cannot be asked (closed). */
static PyObject *py_same_size(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "same_size() takes 2 arguments (fd, seen), got %zd", nargs);
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    long long seen = PyLong_AsLongLong(args[1]);
    if (seen == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT_MAX)
        Py_RETURN_FALSE;
    off_t end = lseek((int)fd, 0, SEEK_END);
    return PyBool_FromLong(end >= 0 && (long long)end == seen);
}

/* one_row(key, key_bytes, row, tensor_type, dtype, shape, views, fd, seen): a one-key read's
   checks before its lookup in one call. None when key is not bytes of key_bytes or the row is
   not one host_view takes; False when the file at fd is not seen bytes long now (same_size);
   else the row's view. The key first, then the row, then the file. */
static PyObject *py_one_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError,
                     "one_row() takes 9 arguments (key, key_bytes, row, tensor_type, dtype, shape, views, fd, seen), got %zd", nargs);
        return NULL;
    }
    Py_ssize_t key_bytes = PyLong_AsSsize_t(args[1]);
    if (key_bytes == -1 && PyErr_Occurred())
        return NULL;
    if (!PyBytes_CheckExact(args[0]) || PyBytes_GET_SIZE(args[0]) != key_bytes)
        Py_RETURN_NONE;
    PyObject *view = py_host_view(self, args + 2, 5);
    if (view == NULL || view == Py_None)
        return view;
    PyObject *same = py_same_size(self, args + 7, 2);
    if (same == NULL) {
        Py_DECREF(view);
        return NULL;
    }
    if (same == Py_True) {
        Py_DECREF(same);
        return view;
    }
    Py_DECREF(same);
    Py_DECREF(view);
    Py_RETURN_FALSE;
}

static PyMethodDef methods[] = {
    {"one_row", (PyCFunction)(void (*)(void))py_one_row, METH_FASTCALL,
     "one_row(key, key_bytes, row, tensor_type, dtype, shape, views, fd, seen) -> view, None or False\n\n"
     "None when key is not bytes of key_bytes or host_view(row, ...) is None; False when\n"
     "same_size(fd, seen) is not; else the row's view."},
    {"host_view", (PyCFunction)(void (*)(void))py_host_view, METH_FASTCALL,
     "host_view(row, tensor_type, dtype, shape, views) -> the view or None\n\n"
     "views[row.data_ptr()] when type(row) is tensor_type, row.dtype is dtype, row.shape == shape,\n"
     "row.is_cpu and row.is_contiguous(); else None (also for an address views does not hold)."},
    {"same_size", (PyCFunction)(void (*)(void))py_same_size, METH_FASTCALL,
     "same_size(fd, seen) -> bool\n\n"
     "Whether the file open at fd is seen bytes long now (False too where fd cannot be asked)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_rowguard",
    "The checks of an lmdb tier's one-key read before its lookup, one call each (native).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rowguard(void)
{
    if ((s_dtype = PyUnicode_InternFromString("dtype")) == NULL
        || (s_shape = PyUnicode_InternFromString("shape")) == NULL
        || (s_is_cpu = PyUnicode_InternFromString("is_cpu")) == NULL
        || (s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) == NULL
        || (s_data_ptr = PyUnicode_InternFromString("data_ptr")) == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
