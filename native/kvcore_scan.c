/* kvcore._scan: one-pass C scans over the sequences a hook value carries.
 *
 * Why C: building a hook value checks every item it carries (exact int block ids >= 0,
 * exact bytes hashes of one length), and those sequences grow with the context. A
 * preempted 128K-token DeepSeek-V4 request resends 51,712 block ids; the Python checks
 * (a set of the items' types, then min, then max) cost about 2 ms of that step, and the
 * 32,768 hashes of a 128K prompt about 1.3 ms of its first lookup. These loops read each
 * item once, run no Python code (so a list cannot change under them) and allocate nothing
 * but the answer.
 *
 * They only vouch: a scan answers a number when the input is certainly fine and -1
 * otherwise, and the Python checks in kvcore.spec.hooks (the definition, which raise the
 * errors) run whenever a scan does not vouch. A scan may therefore be stricter than the
 * definition (ints beyond 2**63 are not vouched for) but never looser;
 * tests/unit/test_scan.py holds them to that on hostile inputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

/* The items of an exact tuple or list in *items and *n, and 1; 0 for anything else (a
 * subclass could override __getitem__ or __iter__, so what the scan read would not be what
 * Python code reads). An empty list's item pointer is NULL: *n says how many to read. */
static int items_of(PyObject *seq, PyObject ***items, Py_ssize_t *n)
{
    if (PyTuple_CheckExact(seq)) {
        *n = PyTuple_GET_SIZE(seq);
        *items = ((PyTupleObject *)seq)->ob_item;
        return 1;
    }
    if (PyList_CheckExact(seq)) {
        *n = PyList_GET_SIZE(seq);
        *items = ((PyListObject *)seq)->ob_item;
        return 1;
    }
    return 0;
}

/* An id's value when x is an exact int in 0..2**63-1; -1 otherwise (no exception). */
static long long id_value(PyObject *x)
{
    if (!PyLong_CheckExact(x))
        return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    /* An int beyond the long long range comes back as -1 with overflow set and no
     * exception (an exact int raises nothing here), so the sign alone decides. */
    return v < 0 ? -1 : v;
}

/* ids_max(seq) -> int: the largest item when seq is an exact tuple, list, set or frozenset
 * of exact ints, each 0 <= x < 2**63 (0 when empty); -1 otherwise. A bool or an int
 * subclass is not an exact int. (A set is read through its iterator: no Python code runs
 * while it is read, so it cannot change.) */
static PyObject *ids_max(PyObject *self, PyObject *seq)
{
    (void)self;
    long long top = 0;
    Py_ssize_t n = 0;
    PyObject **items = NULL;
    if (items_of(seq, &items, &n)) {
        for (Py_ssize_t i = 0; i < n; i++) {
            long long v = id_value(items[i]);
            if (v < 0)
                return PyLong_FromLong(-1);
            if (v > top)
                top = v;
        }
        return PyLong_FromLongLong(top);
    }
    if (!PyAnySet_CheckExact(seq))
        return PyLong_FromLong(-1);
    PyObject *it = PyObject_GetIter(seq);
    if (it == NULL)
        return NULL;
    PyObject *x;
    while ((x = PyIter_Next(it)) != NULL) {
        long long v = id_value(x);
        Py_DECREF(x);
        if (v < 0) {
            Py_DECREF(it);
            return PyLong_FromLong(-1);
        }
        if (v > top)
            top = v;
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLongLong(top);
}

/* ids_distinct(seq) -> bool: True when seq is an exact tuple or list of exact ints in
 * 0..2**63-1, no two equal; False otherwise (a repeat, or an item the scan does not
 * vouch for: the caller's Python test decides then). An open-addressing table of twice
 * the items, freed before returning: a resumed 128K-token request's 16K FULL-group ids
 * cost a Python set about 0.5 ms. */
static PyObject *ids_distinct(PyObject *self, PyObject *seq)
{
    (void)self;
    Py_ssize_t n = 0;
    PyObject **items = NULL;
    if (!items_of(seq, &items, &n))
        Py_RETURN_FALSE;
    if (n < 2) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (id_value(items[i]) < 0)
                Py_RETURN_FALSE;
        Py_RETURN_TRUE;
    }
    size_t size = 4;
    unsigned shift = 62; /* 64 - log2(size) */
    while (size < (size_t)n * 2) {
        size <<= 1;
        shift--;
    }
    long long *table = PyMem_Malloc(size * sizeof(long long));
    if (table == NULL)
        return PyErr_NoMemory();
    for (size_t i = 0; i < size; i++)
        table[i] = -1; /* empty: no id is negative */
    int distinct = 1;
    for (Py_ssize_t i = 0; i < n && distinct; i++) {
        long long v = id_value(items[i]);
        if (v < 0) {
            distinct = 0;
            break;
        }
        size_t at = (size_t)(((unsigned long long)v * 0x9E3779B97F4A7C15ULL) >> shift);
        while (table[at] != -1) {
            if (table[at] == v) {
                distinct = 0;
                break;
            }
            at = (at + 1) & (size - 1);
        }
        table[at] = v;
    }
    PyMem_Free(table);
    if (distinct)
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

/* hashes_len(seq, max_len) -> int: the common length when seq is an exact tuple or list
 * of exact bytes, all of one length in 1..max_len (0 when empty); -1 otherwise. */
static PyObject *hashes_len(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hashes_len(seq, max_len) takes 2 arguments");
        return NULL;
    }
    Py_ssize_t max_len = PyLong_AsSsize_t(args[1]);
    if (max_len == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t n = 0;
    PyObject **items = NULL;
    if (!items_of(args[0], &items, &n))
        return PyLong_FromLong(-1);
    if (n == 0)
        return PyLong_FromLong(0);
    if (!PyBytes_CheckExact(items[0]))
        return PyLong_FromLong(-1);
    Py_ssize_t size = PyBytes_GET_SIZE(items[0]);
    if (size < 1 || size > max_len)
        return PyLong_FromLong(-1);
    for (Py_ssize_t i = 1; i < n; i++) {
        PyObject *h = items[i];
        if (!PyBytes_CheckExact(h) || PyBytes_GET_SIZE(h) != size)
            return PyLong_FromLong(-1);
    }
    return PyLong_FromSsize_t(size);
}

/* pack_ids(seq) -> bytes: the items as native C ints (array('i').frombytes takes them),
 * for ids already validated. Anything but an exact tuple or list of exact ints in
 * 0..INT_MAX raises ValueError: never a silent truncation. */
_Static_assert(sizeof(int) <= sizeof(PyObject *), "pack_ids sizes its bytes by the item count");

static PyObject *pack_ids(PyObject *self, PyObject *seq)
{
    (void)self;
    Py_ssize_t n = 0;
    PyObject **items = NULL;
    if (!items_of(seq, &items, &n)) {
        PyErr_SetString(PyExc_ValueError, "pack_ids takes a tuple or list of ints");
        return NULL;
    }
    /* No overflow check on n * sizeof(int): a tuple or list holds at most
     * PY_SSIZE_T_MAX / sizeof(PyObject *) items (CPython refuses more), and an int is no
     * wider than a pointer, so the product fits. Asserted where the compiler can see it
     * (a runtime test of it could never fire, and no test could tell it was gone). */
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int));
    if (out == NULL)
        return NULL;
    int *dst = (int *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = id_value(items[i]);
        if (v < 0 || v > INT_MAX) {
            Py_DECREF(out);
            PyErr_Format(PyExc_ValueError,
                         "pack_ids: item %zd is not an int in 0..%d", i, INT_MAX);
            return NULL;
        }
        dst[i] = (int)v;
    }
    return out;
}

/* suffixed(seq, suffix) -> list: each item + suffix, for an exact tuple or list of exact
 * bytes and an exact bytes suffix; ValueError otherwise. A lookup derives a group's chunk
 * keys a block at a time (hash + group suffix): 8,192 of them for a 128K-token Llama
 * prompt, about 60 ns each as a Python concatenation. */
static PyObject *suffixed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_ssize_t n = 0;
    PyObject **items = NULL;
    if (nargs != 2 || !items_of(args[0], &items, &n) || !PyBytes_CheckExact(args[1])) {
        PyErr_SetString(PyExc_ValueError, "suffixed(seq, suffix) takes a tuple or list of "
                        "bytes and a bytes suffix");
        return NULL;
    }
    const char *tail = PyBytes_AS_STRING(args[1]);
    Py_ssize_t tail_len = PyBytes_GET_SIZE(args[1]);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    /* Allocating the list may run a garbage collection, and Python code there may change
     * the input: read its items again, after it. Nothing below runs Python code (bytes
     * objects are not collected), so what is checked is what is copied. */
    Py_ssize_t again = 0;
    if (!items_of(args[0], &items, &again) || again != n) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_RuntimeError, "suffixed: the sequence changed while read");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(items[i])) {
            Py_DECREF(out);
            PyErr_Format(PyExc_ValueError, "suffixed: item %zd is not bytes", i);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = PyBytes_GET_SIZE(items[i]);
        if (len > PY_SSIZE_T_MAX - tail_len) {
            Py_DECREF(out);
            return PyErr_NoMemory();
        }
        PyObject *key = PyBytes_FromStringAndSize(NULL, len + tail_len);
        if (key == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        memcpy(PyBytes_AS_STRING(key), PyBytes_AS_STRING(items[i]), (size_t)len);
        memcpy(PyBytes_AS_STRING(key) + len, tail, (size_t)tail_len);
        PyList_SET_ITEM(out, i, key);
    }
    return out;
}

/* same_tail(seq, n) -> bool: True when seq is an exact tuple or list of exact bytes, each
 * at least n bytes long and ending with the first item's last n bytes (True when empty);
 * False otherwise. The tier's touch routes a batch to one group's pool whole when every
 * key carries one group suffix: the scheduler touches one group at a time. */
static PyObject *same_tail(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "same_tail(seq, n) takes 2 arguments");
        return NULL;
    }
    Py_ssize_t tail = PyLong_AsSsize_t(args[1]);
    if (tail == -1 && PyErr_Occurred())
        return NULL;
    if (tail < 0) {
        PyErr_SetString(PyExc_ValueError, "same_tail: n must be >= 0");
        return NULL;
    }
    Py_ssize_t n = 0;
    PyObject **items = NULL;
    if (!items_of(args[0], &items, &n))
        Py_RETURN_FALSE;
    if (n == 0)
        Py_RETURN_TRUE;
    if (!PyBytes_CheckExact(items[0]) || PyBytes_GET_SIZE(items[0]) < tail)
        Py_RETURN_FALSE;
    const char *want = PyBytes_AS_STRING(items[0]) + PyBytes_GET_SIZE(items[0]) - tail;
    for (Py_ssize_t i = 1; i < n; i++) {
        PyObject *k = items[i];
        if (!PyBytes_CheckExact(k) || PyBytes_GET_SIZE(k) < tail ||
            memcmp(PyBytes_AS_STRING(k) + PyBytes_GET_SIZE(k) - tail, want, (size_t)tail) != 0)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef scan_methods[] = {
    {"suffixed", (PyCFunction)(void (*)(void))suffixed, METH_FASTCALL,
     "suffixed(seq, suffix) -> [item + suffix for item in seq] for bytes items."},
    {"same_tail", (PyCFunction)(void (*)(void))same_tail, METH_FASTCALL,
     "same_tail(seq, n) -> True when every bytes item ends with the first one's last n "
     "bytes."},
    {"ids_max", (PyCFunction)ids_max, METH_O,
     "ids_max(seq) -> the largest item of a tuple/list/set/frozenset of exact ints in "
     "0..2**63-1 (0 when empty), else -1."},
    {"ids_distinct", (PyCFunction)ids_distinct, METH_O,
     "ids_distinct(seq) -> True when a tuple/list holds exact ints in 0..2**63-1, no two "
     "equal; else False."},
    {"hashes_len", (PyCFunction)(void (*)(void))hashes_len, METH_FASTCALL,
     "hashes_len(seq, max_len) -> the common length of a tuple/list of exact bytes, all "
     "of one length in 1..max_len (0 when empty), else -1."},
    {"pack_ids", (PyCFunction)pack_ids, METH_O,
     "pack_ids(seq) -> bytes of native C ints; ValueError unless every item is an exact "
     "int in 0..INT_MAX."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef scan_module = {
    PyModuleDef_HEAD_INIT, "kvcore._scan",
    "One-pass C scans over hook sequences (block ids, hashes); see native/kvcore_scan.c.",
    -1, scan_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&scan_module); }
