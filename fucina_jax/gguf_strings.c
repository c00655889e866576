/*
 * gguf_strings.c: module fucina_jax._gguf_strings, the one hot loop of reading a GGUF header.
 *
 * A vocabulary is an array of up to ~262k strings, each a little-endian uint64 byte length then that many UTF-8
 * bytes. strings(buf, pos, n) walks them and returns (list of str, end position) in ~20 ms where the Python loop
 * takes ~170 ms, or None if anything is odd (a length past the end, invalid UTF-8): the caller then reruns the
 * array through its per-item parser, which raises the precise error. gguf_io.py's _Header.strings is the Python
 * form of the same walk; the tests hold the two to the same answers. index(list) builds the tokenizer's
 * text -> id table from such a list.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

static PyObject *strings(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos, n;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &pos, &n)) return NULL;
    const unsigned char *buf = view.buf;
    const Py_ssize_t size = view.len;
    PyObject *out = NULL;
    if (pos < 0 || n < 0 || n > size / 8) goto odd;  /* each string takes >= 8 bytes */
    out = PyList_New(n);
    if (!out) goto fail;
    for (Py_ssize_t i = 0; i < n; ++i) {
        uint64_t len = 0;
        if (size - pos < 8) goto odd;
        for (int b = 7; b >= 0; --b) len = len << 8 | buf[pos + b];  /* little-endian on any host */
        pos += 8;
        if (len > (uint64_t)(size - pos)) goto odd;
        PyObject *s = PyUnicode_DecodeUTF8((const char *)buf + pos, (Py_ssize_t)len, NULL);
        if (!s) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) goto fail;
            PyErr_Clear();
            goto odd;
        }
        PyList_SET_ITEM(out, i, s);
        pos += (Py_ssize_t)len;
    }
    PyBuffer_Release(&view);
    PyObject *res = Py_BuildValue("(Nn)", out, pos);
    return res;
odd:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    return NULL;
}

/* index(list) -> {text: position}, or None if any item is not a non-empty str or a text repeats: the tokenizer's
 * text -> id table in one pass over a presized dict (dict(zip(texts, range(n))) grows the table ~18 times and walks
 * the 262k cold strings once more to check them; ~2x slower). On None the caller takes its checking Python path,
 * which reports what is wrong. */
static PyObject *index_(PyObject *self, PyObject *list) {
    if (!PyList_CheckExact(list)) Py_RETURN_NONE;
    const Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject *out = _PyDict_NewPresized(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *s = PyList_GET_ITEM(list, i);
        if (!PyUnicode_CheckExact(s) || PyUnicode_GET_LENGTH(s) == 0) goto odd;
        PyObject *id = PyLong_FromSsize_t(i);
        if (!id) goto fail;
        const int added = PyDict_SetDefault(out, s, id) == id;
        Py_DECREF(id);
        if (PyErr_Occurred()) goto fail;
        if (!added) goto odd;  /* a repeated text */
    }
    return out;
odd:
    Py_DECREF(out);
    Py_RETURN_NONE;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"strings", strings, METH_VARARGS,
     "strings(buf, pos, n) -> (list of n str, end position), or None if the array is malformed."},
    {"index", index_, METH_O,
     "index(list) -> {text: position}, or None unless the items are distinct non-empty str."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gguf_strings", "GGUF string arrays.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__gguf_strings(void) { return PyModule_Create(&module); }
