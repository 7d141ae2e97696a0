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
 *
 * The step passes at the end (step_vouch, step_apply, quiet_step) do the same for the
 * scheduler's per-request loop in build_step, where Python paid a few microseconds a
 * request on every step: step_vouch vouches like the scans, and step_apply, the one
 * function here that changes state, runs only on a step step_vouch vouched for and makes
 * the same calls the Python loop makes (tests/unit/test_step_vouch.py).
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

/* 1 when the n items are exact ints in 0..2**63-1, no two equal; 0 otherwise; -1 with
 * MemoryError set. Two or more go through an open-addressing table of twice the items,
 * freed before returning: a resumed 128K-token request's 16K FULL-group ids cost a Python
 * set about 0.5 ms. (One path for every n >= 2, so the bad-call twins of kvcore check,
 * which repeat one of two ids, exercise the same code a prefill's table does.) */
static int distinct_items(PyObject *const *items, Py_ssize_t n)
{
    if (n < 2) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (id_value(items[i]) < 0)
                return 0;
        return 1;
    }
    size_t size = 4;
    unsigned shift = 62; /* 64 - log2(size) */
    while (size < (size_t)n * 2) {
        size <<= 1;
        shift--;
    }
    long long *table = PyMem_Malloc(size * sizeof(long long));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
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
    return distinct;
}

/* ids_distinct(seq) -> bool: True when seq is an exact tuple or list of exact ints in
 * 0..2**63-1, no two equal; False otherwise (a repeat, or an item the scan does not
 * vouch for: the caller's Python test decides then). */
static PyObject *ids_distinct(PyObject *self, PyObject *seq)
{
    (void)self;
    Py_ssize_t n = 0;
    PyObject **items = NULL;
    if (!items_of(seq, &items, &n))
        Py_RETURN_FALSE;
    int distinct = distinct_items(items, n);
    if (distinct < 0)
        return NULL;
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

/* step_vouch(requests, states, preempted, layout, hash_len) -> int
 *
 * The scheduler's per-request step checks (kvcore/scheduler/scheduler.py,
 * ``_validate_scheduled``, and ``_validate.check_tables``/``hash_length``) for a whole
 * step in one C pass: about 3.6 us a request as Python, most of it attribute reads and
 * calls, and a 256-request decode step pays it every step. Like every scan here it only
 * vouches: it answers the hash length after the step (0: none seen yet) when every
 * scheduled request is certainly fine, and -1 at the first doubt; the Python checks,
 * which raise the errors, then run as if the scan did not exist. It changes nothing.
 *
 * ``layout`` is built once per scheduler: (ScheduledRequest, RequestState, HashChain,
 * array.array, num_gpu_blocks, hash_block_tokens, tokens per block per group, FULL or
 * not per group). Every object read must be of exactly its kvcore type (an exact dict,
 * str, tuple, list, int, bytes, bool or array otherwise), so reading it runs no Python
 * code and what is read is what the Python path would read. ``preempted`` is the step's
 * tuple of request ids (a tuple or list of exact str). */
#define VOUCH_MAX_GROUPS 64

typedef struct {
    PyObject *sr_type, *state_type, *chain_type, *array_type;
    long long limit, hash_block_tokens;
    Py_ssize_t groups;
    long long tokens[VOUCH_MAX_GROUPS];
    int full[VOUCH_MAX_GROUPS];
} VouchLayout;

/* Interned attribute names, made at import. */
static PyObject *a_request_id, *a_scheduled_tokens, *a_computed_tokens, *a_num_tokens,
    *a_new_block_ids, *a_new_hashes, *a_resumed, *a_finished, *a_hashes, *a_size, *a_tables;

/* o.name when it is an exact int in 0..2**63-1, else -1 (a failed read is cleared: the
 * scan declines and the Python path reads it again). */
static long long int_attr(PyObject *o, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) {
        PyErr_Clear();
        return -1;
    }
    long long x = id_value(v);
    Py_DECREF(v);
    return x;
}

/* 1 if layout is well formed (filled into *L), else 0 with ValueError set: a caller's
 * bug, not an engine's input. */
static int vouch_layout(PyObject *layout, VouchLayout *L)
{
    PyObject **f = NULL;
    Py_ssize_t n = 0;
    if (!PyTuple_CheckExact(layout) || !items_of(layout, &f, &n) || n != 8)
        goto bad;
    for (int i = 0; i < 4; i++)
        if (!PyType_Check(f[i]))
            goto bad;
    L->sr_type = f[0];
    L->state_type = f[1];
    L->chain_type = f[2];
    L->array_type = f[3];
    L->limit = id_value(f[4]);
    L->hash_block_tokens = id_value(f[5]);
    PyObject **tokens = NULL, **full = NULL;
    Py_ssize_t nt = 0, nf = 0;
    if (L->limit < 1 || L->hash_block_tokens < 1 || !PyTuple_CheckExact(f[6]) ||
        !PyTuple_CheckExact(f[7]) || !items_of(f[6], &tokens, &nt) ||
        !items_of(f[7], &full, &nf) || nt != nf || nt < 1 || nt > VOUCH_MAX_GROUPS)
        goto bad;
    L->groups = nt;
    for (Py_ssize_t g = 0; g < nt; g++) {
        L->tokens[g] = id_value(tokens[g]);
        if (L->tokens[g] < 1 || (full[g] != Py_True && full[g] != Py_False))
            goto bad;
        L->full[g] = full[g] == Py_True;
    }
    return 1;
bad:
    PyErr_SetString(PyExc_ValueError, "step_vouch: layout must be (ScheduledRequest, "
                    "RequestState, HashChain, array, num_gpu_blocks, hash_block_tokens, "
                    "tokens per block, FULL flags)");
    return 0;
}

/* One group's new ids: 1 when each is an exact int below the limit, and for a FULL
 * group none is the null block 0 and no two are equal; 0 otherwise; -1 on MemoryError. */
static int vouch_ids(const VouchLayout *L, Py_ssize_t group, PyObject *ids, Py_ssize_t *n)
{
    PyObject **items = NULL;
    /* An exact tuple, as the hook builds it (step_apply extends tables only from one). */
    if (!PyTuple_CheckExact(ids) || !items_of(ids, &items, n))
        return 0;
    for (Py_ssize_t i = 0; i < *n; i++) {
        long long v = id_value(items[i]);
        if (v < 0 || v >= L->limit || (L->full[group] && v == 0))
            return 0;
    }
    return L->full[group] ? distinct_items(items, *n) : 1;
}

/* One scheduled request: 1 certainly fine (*hash_len updated), 0 not vouched, -1 on
 * MemoryError. */
static int vouch_request(const VouchLayout *L, PyObject *sr, PyObject *states,
                         PyObject *preempted, long long *hash_len)
{
    int ok = 0;
    PyObject *rid = NULL, *state = NULL, *flag = NULL, *chain = NULL, *hashes = NULL;
    PyObject *ids = NULL, *tables = NULL, *resumed = NULL;
    Py_ssize_t new_len[VOUCH_MAX_GROUPS];
    if ((PyObject *)Py_TYPE(sr) != L->sr_type)
        return 0;
    rid = PyObject_GetAttr(sr, a_request_id);
    if (rid == NULL || !PyUnicode_CheckExact(rid))
        goto done;
    state = PyDict_GetItemWithError(states, rid);
    if (state == NULL || (PyObject *)Py_TYPE(state) != L->state_type)
        goto done;
    Py_INCREF(state);
    /* A finished request is refused as if gone (``_req``). */
    flag = PyObject_GetAttr(state, a_finished);
    if (flag != Py_False)
        goto done;
    /* The new hashes: of the length every earlier hash had, and enough of them for
     * num_tokens. */
    chain = PyObject_GetAttr(state, a_hashes);
    if (chain == NULL || (PyObject *)Py_TYPE(chain) != L->chain_type)
        goto done;
    long long have_hashes = int_attr(chain, a_size);
    hashes = PyObject_GetAttr(sr, a_new_hashes);
    if (have_hashes < 0 || hashes == NULL || !PyTuple_CheckExact(hashes))
        goto done;
    Py_ssize_t new_hashes = PyTuple_GET_SIZE(hashes);
    if (new_hashes) {
        PyObject *first = PyTuple_GET_ITEM(hashes, 0);
        if (!PyBytes_CheckExact(first) || PyBytes_GET_SIZE(first) < 1)
            goto done;
        long long size = PyBytes_GET_SIZE(first);
        if (*hash_len && size != *hash_len)
            goto done;
        *hash_len = size;
    }
    long long num_tokens = int_attr(sr, a_num_tokens);
    if (num_tokens < 0 || num_tokens / L->hash_block_tokens > have_hashes + new_hashes)
        goto done;
    /* The new block ids: none per group, or one list per group, each in range. */
    ids = PyObject_GetAttr(sr, a_new_block_ids);
    if (ids == NULL || !PyTuple_CheckExact(ids))
        goto done;
    Py_ssize_t lists = PyTuple_GET_SIZE(ids);
    if (lists != 0 && lists != L->groups)
        goto done;
    for (Py_ssize_t g = 0; g < lists; g++) {
        int fine = vouch_ids(L, g, PyTuple_GET_ITEM(ids, g), &new_len[g]);
        if (fine != 1) {
            ok = fine;
            goto done;
        }
    }
    /* A preempted request's tables are dropped: no block count to check. */
    PyObject **gone = NULL;
    Py_ssize_t n_gone = 0;
    items_of(preempted, &gone, &n_gone);
    for (Py_ssize_t i = 0; i < n_gone; i++) {
        if (!PyUnicode_CheckExact(gone[i]))
            goto done;
        if (PyUnicode_Compare(gone[i], rid) == 0) {
            ok = 1;
            goto done;
        }
    }
    /* Every group holds blocks for every computed token. */
    long long computed = int_attr(sr, a_computed_tokens);
    long long scheduled = int_attr(sr, a_scheduled_tokens);
    resumed = PyObject_GetAttr(sr, a_resumed);
    tables = PyObject_GetAttr(state, a_tables);
    if (computed < 0 || scheduled < 0 || (resumed != Py_True && resumed != Py_False) ||
        tables == NULL || !PyList_CheckExact(tables) || PyList_GET_SIZE(tables) != L->groups)
        goto done;
    /* The hook bounds each count by MAX_TOKENS, but a value set behind the frozen
     * dataclass's back may be near 2**63: a sum that would overflow is not vouched for. */
    if (scheduled > LLONG_MAX - computed)
        goto done;
    long long frontier = computed + scheduled < num_tokens ? computed + scheduled : num_tokens;
    for (Py_ssize_t g = 0; g < L->groups; g++) {
        PyObject *table = PyList_GET_ITEM(tables, g);
        if ((PyObject *)Py_TYPE(table) != L->array_type)
            goto done;
        long long have = resumed == Py_True ? 0 : (long long)Py_SIZE(table);
        if (lists)
            have += new_len[g];
        if (have * L->tokens[g] < frontier)
            goto done;
    }
    ok = 1;
done:
    if (ok == 0 && PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_MemoryError))
        PyErr_Clear();
    else if (ok == 0 && PyErr_Occurred())
        ok = -1;
    Py_XDECREF(rid);
    Py_XDECREF(state);
    Py_XDECREF(flag);
    Py_XDECREF(chain);
    Py_XDECREF(hashes);
    Py_XDECREF(ids);
    Py_XDECREF(tables);
    Py_XDECREF(resumed);
    return ok;
}

static PyObject *step_vouch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    VouchLayout L;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "step_vouch(requests, states, preempted, layout, "
                        "hash_len) takes 5 arguments");
        return NULL;
    }
    if (!vouch_layout(args[3], &L))
        return NULL;
    long long hash_len = id_value(args[4]);
    Py_ssize_t n = 0;
    PyObject **items = NULL;
    PyObject **gone = NULL;
    Py_ssize_t n_gone = 0;
    /* The requests as StepInput holds them, an exact tuple: its items cannot change. */
    if (hash_len < 0 || !PyTuple_CheckExact(args[0]) || !items_of(args[0], &items, &n) ||
        !PyDict_CheckExact(args[1]) ||
        !items_of(args[2], &gone, &n_gone))
        return PyLong_FromLong(-1);
    /* Reading an attribute may allocate, and an allocation may run a garbage collection
     * whose finalizers run Python code: hold the tuple (and each request while it is
     * read) so that what is read stays alive. */
    PyObject *held = args[0];
    Py_INCREF(held);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *sr = items[i];
        Py_INCREF(sr);
        int fine = vouch_request(&L, sr, args[1], args[2], &hash_len);
        Py_DECREF(sr);
        if (fine < 0) {
            Py_DECREF(held);
            return NULL;
        }
        if (fine == 0) {
            hash_len = -1;
            break;
        }
    }
    Py_DECREF(held);
    return PyLong_FromLongLong(hash_len);
}

/* The quiet-store rule (kvcore/scheduler/_rules.py, ``quiet_cursors``) for one
 * request with no busy list, as C: the cursors after a step in which no group has a
 * chunk to offer, written into moved[]; 1 when quiet, 0 when some group may offer (the
 * Python path decides then). ``shape`` is the scheduler's quiet layout: per group
 * (tokens per chunk, draft, keep-rule period or 0, the kept offsets' (start, stop)
 * spans). Read from a layout checked by quiet_layout. */
typedef struct {
    long long tokens;
    int draft;
    long long period;   /* 0: every chunk kept (no keep rule) */
    PyObject *spans;    /* borrowed: a tuple of (start, stop) exact-int pairs */
} QuietGroup;

static int kept_offset(const QuietGroup *q, long long offset)
{
    Py_ssize_t n = PyTuple_GET_SIZE(q->spans);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *span = PyTuple_GET_ITEM(q->spans, i);
        long long start = PyLong_AsLongLong(PyTuple_GET_ITEM(span, 0));
        long long stop = PyLong_AsLongLong(PyTuple_GET_ITEM(span, 1));
        if (start <= offset && offset < stop)
            return 1;
    }
    return 0;
}

static int quiet_rule(const QuietGroup *shape, Py_ssize_t groups, long long frontier,
                      long long storable, long long *moved)
{
    for (Py_ssize_t g = 0; g < groups; g++) {
        const QuietGroup *q = &shape[g];
        long long end = storable / q->tokens;
        if (q->draft) {
            long long cap = frontier / q->tokens - 1;
            if (cap < 0)
                cap = 0;
            if (cap < end)
                end = cap;
        }
        long long cursor = moved[g];
        if (end <= cursor)
            continue;
        if (q->period == 0 || end - cursor >= q->period)
            return 0; /* no keep rule, or a whole segment passed: it holds a kept chunk */
        for (long long chunk = cursor; chunk < end; chunk++)
            if (kept_offset(q, chunk % q->period))
                return 0;
        moved[g] = end;
    }
    return 1;
}

/* The quiet layout: 1 when well formed (filled into shape[], *groups), else 0 with
 * ValueError set. */
static int quiet_layout(PyObject *layout, QuietGroup *shape, Py_ssize_t *groups)
{
    PyObject **items = NULL;
    if (!PyTuple_CheckExact(layout) || !items_of(layout, &items, groups) || *groups < 1 ||
        *groups > VOUCH_MAX_GROUPS)
        goto bad;
    for (Py_ssize_t g = 0; g < *groups; g++) {
        PyObject *entry = items[g];
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4)
            goto bad;
        QuietGroup *q = &shape[g];
        q->tokens = id_value(PyTuple_GET_ITEM(entry, 0));
        PyObject *draft = PyTuple_GET_ITEM(entry, 1);
        q->period = id_value(PyTuple_GET_ITEM(entry, 2));
        q->spans = PyTuple_GET_ITEM(entry, 3);
        if (q->tokens < 1 || (draft != Py_True && draft != Py_False) || q->period < 0 ||
            !PyTuple_CheckExact(q->spans))
            goto bad;
        q->draft = draft == Py_True;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(q->spans); i++) {
            PyObject *span = PyTuple_GET_ITEM(q->spans, i);
            if (!PyTuple_CheckExact(span) || PyTuple_GET_SIZE(span) != 2 ||
                id_value(PyTuple_GET_ITEM(span, 0)) < 0 || id_value(PyTuple_GET_ITEM(span, 1)) < 0)
                goto bad;
        }
    }
    return 1;
bad:
    PyErr_SetString(PyExc_ValueError, "quiet layout: one (tokens per chunk, draft, period "
                    "or 0, ((start, stop), ...)) per group");
    return 0;
}

/* quiet_step(shape, cursors, frontier, storable) -> list | None: ``quiet_cursors`` with
 * no busy list, for tests/unit/test_quiet_cursors.py to hold the C rule to the Python
 * one. */
static PyObject *quiet_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    QuietGroup shape[VOUCH_MAX_GROUPS];
    long long moved[VOUCH_MAX_GROUPS];
    Py_ssize_t groups = 0, n = 0;
    PyObject **cursors = NULL;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "quiet_step(shape, cursors, frontier, storable)");
        return NULL;
    }
    if (!quiet_layout(args[0], shape, &groups))
        return NULL;
    long long frontier = id_value(args[2]), storable = id_value(args[3]);
    if (!items_of(args[1], &cursors, &n) || n != groups || frontier < 0 || storable < 0) {
        PyErr_SetString(PyExc_ValueError, "quiet_step: one cursor per group, ints >= 0");
        return NULL;
    }
    for (Py_ssize_t g = 0; g < groups; g++) {
        moved[g] = id_value(cursors[g]);
        if (moved[g] < 0) {
            PyErr_SetString(PyExc_ValueError, "quiet_step: one cursor per group, ints >= 0");
            return NULL;
        }
    }
    if (!quiet_rule(shape, groups, frontier, storable, moved))
        Py_RETURN_NONE;
    PyObject *out = PyList_New(groups);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t g = 0; g < groups; g++) {
        PyObject *v = PyLong_FromLongLong(moved[g]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, g, v);
    }
    return out;
}

static PyObject *a_jobs, *a_max_offload_tokens, *a_cursors, *a_placed, *m_extend,
    *m_frombytes, *m_place, *m_clear_tables;

/* An attribute that must be there: a new reference, or NULL with RuntimeError set. */
static PyObject *must_attr(PyObject *o, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL && !PyErr_ExceptionMatches(PyExc_MemoryError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_RuntimeError, "step_apply: %R is gone from a vouched step", name);
    }
    return v;
}

static int changed(Py_ssize_t i)
{
    PyErr_Format(PyExc_RuntimeError, "step_apply: request %zd changed after step_vouch "
                 "vouched for it", i);
    return -1;
}

/* Apply one vouched request's new hashes and blocks (``_apply_blocks``): 0, or -1 with
 * an error set. */
static int apply_request(PyObject *sr, PyObject *state, const int *window,
                         Py_ssize_t groups, long long pack_from, PyObject *step_no,
                         Py_ssize_t i)
{
    int rc = -1;
    PyObject *hashes = NULL, *chain = NULL, *resumed = NULL, *ids = NULL, *tables = NULL;
    PyObject *placed = NULL;
    hashes = must_attr(sr, a_new_hashes);
    if (hashes == NULL)
        goto done;
    if (!PyTuple_CheckExact(hashes)) {
        changed(i);
        goto done;
    }
    if (PyTuple_GET_SIZE(hashes)) {
        chain = must_attr(state, a_hashes);
        if (chain == NULL)
            goto done;
        PyObject *r = PyObject_CallMethodOneArg(chain, m_extend, hashes);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    resumed = must_attr(sr, a_resumed);
    if (resumed == NULL)
        goto done;
    if (resumed == Py_True) {
        PyObject *r = PyObject_CallMethodNoArgs(state, m_clear_tables);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    ids = must_attr(sr, a_new_block_ids);
    if (ids == NULL)
        goto done;
    if (!PyTuple_CheckExact(ids) || (PyTuple_GET_SIZE(ids) && PyTuple_GET_SIZE(ids) != groups)) {
        changed(i);
        goto done;
    }
    if (PyTuple_GET_SIZE(ids)) {
        /* Read after clear_tables, which replaces both lists. */
        tables = must_attr(state, a_tables);
        placed = must_attr(state, a_placed);
        if (tables == NULL || placed == NULL)
            goto done;
        if (!PyList_CheckExact(tables) || PyList_GET_SIZE(tables) != groups ||
            !PyList_CheckExact(placed) || PyList_GET_SIZE(placed) != groups) {
            changed(i);
            goto done;
        }
    }
    for (Py_ssize_t g = 0; g < PyTuple_GET_SIZE(ids); g++) {
        PyObject *t = PyTuple_GET_ITEM(ids, g);
        if (!PyTuple_CheckExact(t)) {
            changed(i);
            goto done;
        }
        Py_ssize_t n = PyTuple_GET_SIZE(t);
        if (n == 0)
            continue;
        PyObject *table = PyList_GET_ITEM(tables, g);
        Py_INCREF(table);
        PyObject *r = NULL;
        if (window[g]) {
            Py_ssize_t len = PyObject_Size(table);
            PyObject *first = len < 0 ? NULL : PyLong_FromSsize_t(len);
            if (first != NULL) {
                PyObject *call[3] = {PyList_GET_ITEM(placed, g), first, step_no};
                r = PyObject_VectorcallMethod(m_place, call, 3, NULL);
                Py_DECREF(first);
            }
            if (r == NULL) {
                Py_DECREF(table);
                goto done;
            }
            Py_DECREF(r);
        }
        if (n < pack_from) {
            r = PyObject_CallMethodOneArg(table, m_extend, t);
        } else {
            PyObject *packed = pack_ids(NULL, t);
            r = packed == NULL ? NULL : PyObject_CallMethodOneArg(table, m_frombytes, packed);
            Py_XDECREF(packed);
        }
        Py_DECREF(table);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    rc = 0;
done:
    Py_XDECREF(hashes);
    Py_XDECREF(chain);
    Py_XDECREF(resumed);
    Py_XDECREF(ids);
    Py_XDECREF(tables);
    Py_XDECREF(placed);
    return rc;
}

/* 1 when request i's store step is quiet (its cursors moved here), 0 when the Python
 * store path must run for it, -1 with an error set. Quiet needs: no job in flight (the
 * Python path reads their kinds), no cap on U (U = the frontier), and no group with a
 * chunk to offer. */
static int quiet_request(PyObject *sr, PyObject *state, const QuietGroup *shape,
                         Py_ssize_t groups)
{
    int rc = 0;
    long long moved[VOUCH_MAX_GROUPS];
    PyObject *jobs = NULL, *cap = NULL, *cursors = NULL;
    jobs = must_attr(state, a_jobs);
    cap = jobs == NULL ? NULL : must_attr(state, a_max_offload_tokens);
    cursors = cap == NULL ? NULL : must_attr(state, a_cursors);
    if (cursors == NULL) {
        rc = -1;
        goto done;
    }
    if (!PyAnySet_CheckExact(jobs) || PySet_GET_SIZE(jobs) != 0 || cap != Py_None)
        goto done; /* a job in flight or a cap on U: the Python path */
    if (!PyList_CheckExact(cursors) || PyList_GET_SIZE(cursors) != groups)
        goto done; /* not the list the scheduler made: the Python path reads it */
    long long computed = int_attr(sr, a_computed_tokens);
    long long scheduled = int_attr(sr, a_scheduled_tokens);
    long long num_tokens = int_attr(sr, a_num_tokens);
    if (computed < 0 || scheduled < 0 || num_tokens < 0 || scheduled > LLONG_MAX - computed)
        goto done; /* the Python path reads them (step_vouch declined such a sum) */
    long long frontier = computed + scheduled < num_tokens ? computed + scheduled : num_tokens;
    for (Py_ssize_t g = 0; g < groups; g++) {
        moved[g] = id_value(PyList_GET_ITEM(cursors, g));
        if (moved[g] < 0)
            goto done; /* not an exact int in range: the Python path */
    }
    if (!quiet_rule(shape, groups, frontier, frontier, moved))
        goto done;
    for (Py_ssize_t g = 0; g < groups; g++) {
        if (moved[g] == id_value(PyList_GET_ITEM(cursors, g)))
            continue;
        PyObject *v = PyLong_FromLongLong(moved[g]);
        if (v == NULL || PyList_SetItem(cursors, g, v) < 0) {
            rc = -1;
            goto done;
        }
    }
    rc = 1;
done:
    Py_XDECREF(jobs);
    Py_XDECREF(cap);
    Py_XDECREF(cursors);
    return rc;
}

/* step_apply(requests, states, preempted, layout, step_no, quiet) -> list[int]
 *
 * The rest of ``build_step``'s per-request loop, for a step step_vouch vouched for:
 * applies every request's new hashes and blocks (``_apply_blocks``: the same calls on
 * the same objects, in the same order), and with ``quiet`` (checks off) answers the
 * quiet store steps too (``_store_step``'s fast path: the cursors move, nothing is
 * offered). It answers the indexes of the requests, not preempted, whose store step the
 * Python path must still run, in order. ``layout`` is (window flags per group, the quiet
 * shape, pack_from): built once per scheduler. */
static PyObject *step_apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "step_apply(requests, states, preempted, layout, "
                        "step_no, quiet) takes 6 arguments");
        return NULL;
    }
    PyObject *layout = args[3], *step_no = args[4];
    int quiet = PyObject_IsTrue(args[5]);
    QuietGroup shape[VOUCH_MAX_GROUPS];
    int window[VOUCH_MAX_GROUPS];
    Py_ssize_t groups = 0, nw = 0, n = 0, n_gone = 0;
    PyObject **flags = NULL, **items = NULL, **gone = NULL;
    if (quiet < 0)
        return NULL;
    if (!PyTuple_CheckExact(layout) || PyTuple_GET_SIZE(layout) != 3 ||
        !items_of(PyTuple_GET_ITEM(layout, 0), &flags, &nw) ||
        !quiet_layout(PyTuple_GET_ITEM(layout, 1), shape, &groups) || nw != groups ||
        id_value(PyTuple_GET_ITEM(layout, 2)) < 1 || id_value(step_no) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "step_apply: layout is (window flags, quiet "
                            "shape, pack_from) and step_no an int >= 0");
        return NULL;
    }
    long long pack_from = id_value(PyTuple_GET_ITEM(layout, 2));
    for (Py_ssize_t g = 0; g < groups; g++)
        window[g] = flags[g] == Py_True;
    if (!PyTuple_CheckExact(args[0]) || !items_of(args[0], &items, &n) ||
        !PyDict_CheckExact(args[1]) || !items_of(args[2], &gone, &n_gone)) {
        PyErr_SetString(PyExc_RuntimeError, "step_apply: the step changed after step_vouch "
                        "vouched for it");
        return NULL;
    }
    PyObject *held = args[0], *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    Py_INCREF(held);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *sr = items[i];
        Py_INCREF(sr);
        PyObject *rid = must_attr(sr, a_request_id);
        if (rid != NULL && !PyUnicode_CheckExact(rid)) {
            Py_CLEAR(rid);
            changed(i);
        }
        PyObject *state = rid == NULL ? NULL : PyDict_GetItemWithError(args[1], rid);
        if (state == NULL) {
            if (!PyErr_Occurred())
                changed(i);
            Py_XDECREF(rid);
            Py_DECREF(sr);
            goto fail;
        }
        Py_INCREF(state);
        int rc = apply_request(sr, state, window, groups, pack_from, step_no, i);
        int preempted = 0;
        if (rc == 0) {
            items_of(args[2], &gone, &n_gone);
            for (Py_ssize_t k = 0; k < n_gone && !preempted; k++)
                preempted = PyUnicode_CheckExact(gone[k]) && PyUnicode_Compare(gone[k], rid) == 0;
        }
        if (rc == 0 && !preempted) {
            int fast = quiet ? quiet_request(sr, state, shape, groups) : 0;
            if (fast < 0) {
                rc = -1;
            } else if (fast == 0) {
                PyObject *index = PyLong_FromSsize_t(i);
                if (index == NULL || PyList_Append(out, index) < 0)
                    rc = -1;
                Py_XDECREF(index);
            }
        }
        Py_DECREF(state);
        Py_DECREF(rid);
        Py_DECREF(sr);
        if (rc < 0)
            goto fail;
    }
    Py_DECREF(held);
    return out;
fail:
    Py_DECREF(held);
    Py_DECREF(out);
    return NULL;
}

/* stamp_ids(at, ids, step) -> None: at[id] = step for every id, where ``at`` is an
 * int64 array('q') and ``ids`` an exact set or frozenset of exact ints in 0..len(at)-1
 * (``StaleWindows.advance``: a decode step hands out hundreds of ids, a resumed
 * request's whole table tens of thousands, at about 30 ns each as a Python loop). Every
 * id is checked before any is written: ValueError and nothing written otherwise. */
static PyObject *stamp_ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "stamp_ids(at, ids, step) takes 3 arguments");
        return NULL;
    }
    long long step = id_value(args[2]);
    if (step < 0 || !PyAnySet_CheckExact(args[1])) {
        PyErr_SetString(PyExc_ValueError, "stamp_ids: ids must be a set of ints and step "
                        "an int >= 0");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return NULL;
    int ok = view.itemsize == 8 && view.format != NULL && strcmp(view.format, "q") == 0;
    Py_ssize_t len = ok ? view.len / 8 : 0;
    long long *at = view.buf;
    /* Two passes over the set (no Python code runs while it is read: exact ints only), so
     * a bad id writes nothing. */
    for (int pass = 0; pass < 2 && ok; pass++) {
        PyObject *it = PyObject_GetIter(args[1]);
        if (it == NULL) {
            PyBuffer_Release(&view);
            return NULL;
        }
        PyObject *key;
        while ((key = PyIter_Next(it)) != NULL) {
            long long v = id_value(key);
            Py_DECREF(key);
            if (v < 0 || v >= len) {
                ok = 0;
                break;
            }
            if (pass)
                at[v] = step;
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) {
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    PyBuffer_Release(&view);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "stamp_ids: at must be array('q') and every id "
                        "an int in 0..len(at)-1");
        return NULL;
    }
    Py_RETURN_NONE;
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
    {"step_vouch", (PyCFunction)(void (*)(void))step_vouch, METH_FASTCALL,
     "step_vouch(requests, states, preempted, layout, hash_len) -> the hash length after "
     "the step when every scheduled request is certainly fine, else -1."},
    {"step_apply", (PyCFunction)(void (*)(void))step_apply, METH_FASTCALL,
     "step_apply(requests, states, preempted, layout, step_no, quiet) -> indexes of the "
     "requests whose store step the Python path must run."},
    {"quiet_step", (PyCFunction)(void (*)(void))quiet_step, METH_FASTCALL,
     "quiet_step(shape, cursors, frontier, storable) -> the quiet cursors, or None."},
    {"stamp_ids", (PyCFunction)(void (*)(void))stamp_ids, METH_FASTCALL,
     "stamp_ids(at, ids, step) -> None: at[id] = step for each id of a set (array('q'))."},
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

PyMODINIT_FUNC PyInit__scan(void)
{
    struct {
        PyObject **slot;
        const char *name;
    } names[] = {
        {&a_request_id, "request_id"}, {&a_scheduled_tokens, "scheduled_tokens"},
        {&a_computed_tokens, "computed_tokens"}, {&a_num_tokens, "num_tokens"},
        {&a_new_block_ids, "new_block_ids"}, {&a_new_hashes, "new_hashes"},
        {&a_resumed, "resumed"}, {&a_finished, "finished"}, {&a_hashes, "hashes"},
        {&a_size, "size"}, {&a_tables, "tables"}, {&a_jobs, "jobs"},
        {&a_max_offload_tokens, "max_offload_tokens"}, {&a_cursors, "cursors"},
        {&a_placed, "placed"}, {&m_extend, "extend"}, {&m_frombytes, "frombytes"},
        {&m_place, "place"}, {&m_clear_tables, "clear_tables"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].slot == NULL) {
            *names[i].slot = PyUnicode_InternFromString(names[i].name);
            if (*names[i].slot == NULL)
                return NULL;
        }
    }
    return PyModule_Create(&scan_module);
}
