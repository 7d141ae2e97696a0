/* kvcore._index: the CPU tier's keys, inline, for lookups and touches in batches.
 *
 * Why C: the tier maps every stored chunk key (a block hash plus a group suffix) to its
 * record, and keeps each group's keys in LRU order; a lookup of a 128K-token Llama prompt
 * reads 8,192 keys and then touches them. In a Python dict (or OrderedDict) of a few
 * million bytes keys each probe is about three cache misses (the index slot, the entry,
 * the key object it compares), 300 ns a key on this class of machine, and a batch cannot
 * overlap them. Here the keys sit inline in one dense array and the index is 8 bytes a
 * slot, so a probe is two misses, and the batch calls (``KeyIndex.read``,
 * ``KeyOrder.touch``) probe a window of keys in passes (hash and prefetch the slots,
 * prefetch the entries, compare), so the misses of a window overlap instead of queueing.
 *
 * Two types share one table. ``KeyIndex`` is a dict[bytes, int] for the tier's records.
 * ``KeyOrder`` is an ordered set of keys (an LRU order: oldest first), its links kept in
 * the entries. Keys are exact bytes of 1..255 bytes, KeyIndex values exact ints in
 * 0..2**63-1; anything else raises TypeError or ValueError before anything changes (the
 * manager checks keys first; this is the second wall, not the first).
 *
 * Layout. ``slots`` is an open-addressing table (linear probing, at most half full, no
 * tombstones: deletion shifts the run back), each slot 0 (empty) or ``tag << 32 |
 * (entry + 1)`` with ``tag`` the high half of the key's 64-bit hash; a key's home slot is
 * ``tag & mask``, so a slot alone says where its key belongs. ``dense`` holds the entries
 * packed (removal moves the last entry into the hole), each ``stride`` bytes: an 8-byte
 * word (the KeyIndex value, or the KeyOrder links), the hash, the key length, the key.
 * The stride fits the longest key stored so far (a tier's keys are all one length in
 * practice) and grows, with one copy, when a longer key arrives. Memory is bounded by
 * what is live: both arrays shrink when a quarter full (the stride then fits the longest
 * key left), and at most 2**31 - 1 keys are held. The hash is seeded per table from
 * os.urandom and mixes by a full 128-bit product, so colliding keys need the seed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_KEY 255                   /* a key's length fits its one length byte */
#define MAX_ENTRIES ((size_t)1 << 31) /* entry + 1 fits a slot's low 32 bits */
#define MIN_SLOTS 16
#define MIN_ENTRIES 8
#define FIRST_KEY 39 /* the first stride fits a 32-byte hash and a 4-byte group suffix */
#define HEAD 17      /* word (8), hash (8), length (1), then the key */
#define WINDOW 16    /* keys whose probes a batch call overlaps */
#define NIL 0xFFFFFFFFu /* no entry (KeyOrder links) */
#define LOW32 0xFFFFFFFFu

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)0)
#endif

typedef struct {
    uint64_t seed;
    uint64_t *slots;
    size_t mask; /* slots - 1; the table has a power of two slots */
    unsigned char *dense;
    size_t n, cap, stride; /* entries live, entries allocated, bytes per entry */
} Table;

/* ---- the table ------------------------------------------------------------------- */

/* The 64x64-bit product's halves folded together (wyhash's mix): not linear in any bit
 * of either side, unlike a multiply by a constant, which passes a flip of bit 63 through
 * unchanged (review found a seed-independent family of colliding keys in that fold). */
static inline uint64_t mum(uint64_t a, uint64_t b)
{
#if defined(__SIZEOF_INT128__)
    __uint128_t r = (__uint128_t)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
#else
    uint64_t al = a & 0xFFFFFFFFu, ah = a >> 32, bl = b & 0xFFFFFFFFu, bh = b >> 32;
    uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    uint64_t mid = (ll >> 32) + (lh & 0xFFFFFFFFu) + (hl & 0xFFFFFFFFu);
    return ((ll & 0xFFFFFFFFu) | mid << 32) ^ (hh + (lh >> 32) + (hl >> 32) + (mid >> 32));
#endif
}

/* A seeded 64-bit hash: each 8-byte word, masked with the seed, multiplied into the state
 * by ``mum``, then murmur3's fmix64, so every input bit reaches the high half, which
 * picks the home slot. A word that zeroes a product must equal the seed's mask, which a
 * caller without the seed cannot aim at. */
static uint64_t key_hash(uint64_t seed, const unsigned char *p, size_t len)
{
    uint64_t mask = seed | 1, h = seed ^ 0x9E3779B97F4A7C15ULL;
    size_t left = len;
    while (left >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = mum(w ^ mask, h ^ 0xBF58476D1CE4E5B9ULL);
        p += 8;
        left -= 8;
    }
    if (left) {
        uint64_t w = 0;
        memcpy(&w, p, left);
        h = mum(w ^ mask, h ^ 0xBF58476D1CE4E5B9ULL);
    }
    h ^= len;
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 33;
    return h;
}

static inline unsigned char *entry_at(const Table *t, size_t e)
{
    return t->dense + e * t->stride;
}

static inline uint64_t word_of(const Table *t, size_t e)
{
    uint64_t w;
    memcpy(&w, entry_at(t, e), 8);
    return w;
}

static inline void set_word(Table *t, size_t e, uint64_t w)
{
    memcpy(entry_at(t, e), &w, 8);
}

static inline uint64_t hash_of_entry(const Table *t, size_t e)
{
    uint64_t h;
    memcpy(&h, entry_at(t, e) + 8, 8);
    return h;
}

static inline size_t home_of(const Table *t, uint64_t h)
{
    return (size_t)(h >> 32) & t->mask;
}

static inline size_t entry_in(const Table *t, size_t at)
{
    return (size_t)(t->slots[at] & LOW32) - 1;
}

static inline size_t stride_for(size_t klen)
{
    return (HEAD + klen + 7) & ~(size_t)7;
}

/* 1 when `item` is exact bytes that, followed by `slen` suffix bytes (slen < MAX_KEY),
 * make a key of 1..MAX_KEY bytes; else an error set and 0. */
static int item_ok(PyObject *item, size_t slen)
{
    if (!PyBytes_CheckExact(item)) {
        PyErr_Format(PyExc_TypeError, "kvcore._index keys are bytes, not %.100s",
                     Py_TYPE(item)->tp_name);
        return 0;
    }
    size_t n = (size_t)PyBytes_GET_SIZE(item) + slen;
    if (n < 1 || n > MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "kvcore._index keys are 1..%d bytes, not %zu",
                     MAX_KEY, n);
        return 0;
    }
    return 1;
}

/* The key's bytes and length when it is exact bytes of 1..MAX_KEY bytes; else an error
 * set and 0. */
static int key_of(PyObject *key, const unsigned char **p, size_t *len)
{
    if (!item_ok(key, 0))
        return 0;
    *p = (const unsigned char *)PyBytes_AS_STRING(key);
    *len = (size_t)PyBytes_GET_SIZE(key);
    return 1;
}

/* The slot holding the key, or -1 (absent): the probe stops at the first empty slot. */
static Py_ssize_t find_from(const Table *t, size_t at, const unsigned char *p, size_t len,
                            uint64_t h)
{
    uint64_t tag = h >> 32;
    for (;;) {
        uint64_t s = t->slots[at];
        if (s == 0)
            return -1;
        if ((s >> 32) == tag) {
            const unsigned char *ent = entry_at(t, (size_t)(s & LOW32) - 1);
            if (memcmp(ent + 8, &h, 8) == 0 && ent[16] == len &&
                memcmp(ent + HEAD, p, len) == 0)
                return (Py_ssize_t)at;
        }
        at = (at + 1) & t->mask;
    }
}

/* The slot of `key`, -1 when absent, -2 with an error set when it is not a valid key. */
static Py_ssize_t find_key(const Table *t, PyObject *key)
{
    const unsigned char *p;
    size_t len;
    if (!key_of(key, &p, &len))
        return -2;
    uint64_t h = key_hash(t->seed, p, len);
    return find_from(t, home_of(t, h), p, len, h);
}

/* Point the first empty slot of entry e's probe run at it. */
static void place(Table *t, size_t e, uint64_t h)
{
    size_t at = home_of(t, h);
    while (t->slots[at] != 0)
        at = (at + 1) & t->mask;
    t->slots[at] = (h >> 32) << 32 | (uint64_t)(e + 1);
}

/* A fresh index of `count` slots (a power of two) over every entry; 0 and MemoryError
 * when it cannot be had (the old one stays). */
static int resize_slots(Table *t, size_t count)
{
    uint64_t *fresh = PyMem_Calloc(count, sizeof(uint64_t));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    PyMem_Free(t->slots);
    t->slots = fresh;
    t->mask = count - 1;
    for (size_t e = 0; e < t->n; e++)
        place(t, e, hash_of_entry(t, e));
    return 1;
}

/* Room for `cap` entries (>= n) of `stride` bytes (each live key fits it). */
static int resize_dense(Table *t, size_t cap, size_t stride)
{
    unsigned char *fresh;
    if (stride == t->stride) {
        fresh = PyMem_Realloc(t->dense, cap * stride);
        if (fresh == NULL) {
            PyErr_NoMemory();
            return 0;
        }
    } else {
        fresh = PyMem_Malloc(cap * stride);
        if (fresh == NULL) {
            PyErr_NoMemory();
            return 0;
        }
        for (size_t e = 0; e < t->n; e++) {
            const unsigned char *old = entry_at(t, e);
            memcpy(fresh + e * stride, old, HEAD + old[16]);
        }
        PyMem_Free(t->dense);
    }
    t->dense = fresh;
    t->cap = cap;
    t->stride = stride;
    return 1;
}

static int table_init(Table *t)
{
    uint64_t *slots = PyMem_Calloc(MIN_SLOTS, sizeof(uint64_t));
    unsigned char *dense = PyMem_Malloc(MIN_ENTRIES * stride_for(FIRST_KEY));
    if (slots == NULL || dense == NULL) {
        PyMem_Free(slots);
        PyMem_Free(dense);
        PyErr_NoMemory();
        return 0;
    }
    t->slots = slots;
    t->dense = dense;
    t->mask = MIN_SLOTS - 1;
    t->n = 0;
    t->cap = MIN_ENTRIES;
    t->stride = stride_for(FIRST_KEY);
    return 1;
}

/* Empty the table, keeping its seed; on MemoryError it is unchanged. */
static int table_clear(Table *t)
{
    Table fresh = *t;
    if (!table_init(&fresh))
        return 0;
    PyMem_Free(t->slots);
    PyMem_Free(t->dense);
    *t = fresh;
    return 1;
}

static int table_seed(Table *t)
{
    PyObject *os = PyImport_ImportModule("os");
    PyObject *raw = os == NULL ? NULL : PyObject_CallMethod(os, "urandom", "i", 8);
    Py_XDECREF(os);
    if (raw == NULL || !PyBytes_Check(raw) || PyBytes_GET_SIZE(raw) != 8) {
        Py_XDECREF(raw);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "os.urandom(8) gave no 8 bytes");
        return 0;
    }
    memcpy(&t->seed, PyBytes_AS_STRING(raw), 8);
    Py_DECREF(raw);
    return 1;
}

/* Append a new entry for an absent key (hash h) with word w; its entry index, or -1 and
 * an error (OverflowError past the limit, MemoryError) with nothing changed. */
static Py_ssize_t table_add(Table *t, const unsigned char *p, size_t len, uint64_t h,
                            uint64_t w)
{
    if (t->n + 1 >= MAX_ENTRIES) {
        PyErr_SetString(PyExc_OverflowError, "kvcore._index holds at most 2**31 - 1 keys");
        return -1;
    }
    size_t stride = stride_for(len) > t->stride ? stride_for(len) : t->stride;
    if (t->n == t->cap || stride != t->stride) {
        if (!resize_dense(t, t->n == t->cap ? t->cap * 2 : t->cap, stride))
            return -1;
    }
    if ((t->n + 1) * 2 > t->mask + 1 && !resize_slots(t, (t->mask + 1) * 2))
        return -1;
    unsigned char *ent = entry_at(t, t->n);
    memcpy(ent, &w, 8);
    memcpy(ent + 8, &h, 8);
    ent[16] = (unsigned char)len;
    memcpy(ent + HEAD, p, len);
    place(t, t->n, h);
    return (Py_ssize_t)t->n++;
}

/* Remove the entry in slot `at`: shift its probe run back over the hole (no tombstones),
 * move the last entry into the removed one's place, then shrink what is a quarter full.
 * Returns the removed entry's index e; when the last entry moved into e, *moved is its
 * old index, else NIL (the caller fixes whatever named it). */
static size_t table_remove(Table *t, size_t at, size_t *moved)
{
    size_t e = entry_in(t, at);
    size_t hole = at;
    size_t k = (hole + 1) & t->mask;
    while (t->slots[k] != 0) {
        size_t home = (size_t)(t->slots[k] >> 32) & t->mask;
        /* The slot at k may fill the hole when its home is not in (hole, k]. */
        if (((k - home) & t->mask) >= ((k - hole) & t->mask)) {
            t->slots[hole] = t->slots[k];
            hole = k;
        }
        k = (k + 1) & t->mask;
    }
    t->slots[hole] = 0;
    size_t last = t->n - 1;
    *moved = NIL;
    if (e != last) {
        uint64_t h = hash_of_entry(t, last);
        size_t s = home_of(t, h);
        while ((t->slots[s] & LOW32) != last + 1)
            s = (s + 1) & t->mask;
        t->slots[s] = (h >> 32) << 32 | (uint64_t)(e + 1);
        const unsigned char *src = entry_at(t, last);
        memcpy(entry_at(t, e), src, HEAD + src[16]);
        *moved = last;
    }
    t->n = last;
    /* Shrinking cannot fail the removal: a failed realloc keeps the larger arrays. A
     * shrink also fits the stride to the longest key still held (one long key, gone,
     * must not widen every entry for good): O(n) at a halving, so amortized O(1). At a
     * steady occupancy no halving comes and the wider stride stays, bounded by the
     * capacity times the longest key allowed (MAX_KEY). */
    if (t->cap > MIN_ENTRIES && t->n * 4 <= t->cap) {
        size_t longest = FIRST_KEY;
        for (size_t i = 0; i < t->n; i++)
            if (entry_at(t, i)[16] > longest)
                longest = entry_at(t, i)[16];
        if (!resize_dense(t, t->cap / 2, stride_for(longest)))
            PyErr_Clear();
    }
    if (t->mask + 1 > MIN_SLOTS && t->n * 8 <= t->mask + 1 &&
        !resize_slots(t, (t->mask + 1) / 2))
        PyErr_Clear();
    return e;
}

static PyObject *key_object(const Table *t, size_t e)
{
    const unsigned char *ent = entry_at(t, e);
    return PyBytes_FromStringAndSize((const char *)ent + HEAD, ent[16]);
}

static size_t table_bytes(const Table *t)
{
    return (t->mask + 1) * sizeof(uint64_t) + t->cap * t->stride;
}

/* Every item of a list or tuple checked as a key (the item followed by `slen` suffix
 * bytes), before any is used: a new reference to the sequence's fast form, or NULL with
 * the error. */
static PyObject *checked_keys(PyObject *seq, const char *what, size_t slen)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!item_ok(items[i], slen)) {
            Py_DECREF(fast);
            return NULL;
        }
    }
    return fast;
}

/* A batch call's keys: key i is items[i] followed by `suffix`. The suffix lets a lookup
 * pass a group's block hashes with the group's bytes once (``read(hashes, answers,
 * suffix)``) instead of 8,192 key objects made for one probe each: each key is assembled
 * in the window's buffer, next to the probe that reads it. */
typedef struct {
    PyObject **items;
    const unsigned char *suffix;
    size_t slen;
    unsigned char buf[WINDOW][MAX_KEY];
} Batch;

/* Items checked as keys with the suffix appended: exact bytes, 1..MAX_KEY bytes in all
 * (a new reference to the fast form, or NULL with the error); `suffix` is exact bytes of
 * at most MAX_KEY - 1 bytes, or NULL for none. */
static PyObject *checked_batch(PyObject *seq, PyObject *suffix, const char *what, Batch *b)
{
    b->suffix = NULL;
    b->slen = 0;
    if (suffix != NULL) {
        if (!PyBytes_CheckExact(suffix)) {
            PyErr_Format(PyExc_TypeError, "kvcore._index suffixes are bytes, not %.100s",
                         Py_TYPE(suffix)->tp_name);
            return NULL;
        }
        b->suffix = (const unsigned char *)PyBytes_AS_STRING(suffix);
        b->slen = (size_t)PyBytes_GET_SIZE(suffix);
    }
    if (b->slen >= MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "kvcore._index suffixes are 0..%d bytes, not %zu",
                     MAX_KEY - 1, b->slen);
        return NULL;
    }
    return checked_keys(seq, what, b->slen);
}

/* Key i of the batch, assembled in window buffer j when there is a suffix. */
static const unsigned char *batch_key(Batch *b, Py_ssize_t i, Py_ssize_t j, size_t *len)
{
    PyObject *k = b->items[i];
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(k);
    size_t n = (size_t)PyBytes_GET_SIZE(k);
    if (b->slen == 0) {
        *len = n;
        return p;
    }
    memcpy(b->buf[j], p, n);
    memcpy(b->buf[j] + n, b->suffix, b->slen);
    *len = n + b->slen;
    return b->buf[j];
}

/* The slots of keys base, base + step, ... (m of them, checked), -1 for an absent one,
 * probed together: hash each and prefetch its home slot, prefetch the entry a matching
 * tag names, then compare (a run past the home slot is rare at half load). */
static void probe_window(const Table *t, Batch *b, Py_ssize_t base, Py_ssize_t m,
                         Py_ssize_t step, Py_ssize_t *found)
{
    uint64_t hs[WINDOW];
    size_t at[WINDOW], lens[WINDOW];
    const unsigned char *ps[WINDOW];
    for (Py_ssize_t j = 0; j < m; j++) {
        ps[j] = batch_key(b, base + j * step, j, &lens[j]);
        hs[j] = key_hash(t->seed, ps[j], lens[j]);
        at[j] = home_of(t, hs[j]);
        PREFETCH(&t->slots[at[j]]);
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        uint64_t s = t->slots[at[j]];
        if (s != 0 && (s >> 32) == (hs[j] >> 32))
            PREFETCH(entry_at(t, (size_t)(s & LOW32) - 1));
    }
    for (Py_ssize_t j = 0; j < m; j++)
        found[j] = find_from(t, at[j], ps[j], lens[j], hs[j]);
}

/* ---- the Python object both types are --------------------------------------------- */

/* KeyIndex and KeyOrder both begin with this (KeyOrder adds its list ends), so the
 * functions that need only the table are written once, over it. */
typedef struct {
    PyObject_HEAD
    Table t;
} TableObject;

/* A new object of `type` with a seeded, empty table; `type->tp_basicsize` covers the
 * type's own fields, which tp_alloc zeroes (so a failed init frees NULL arrays). */
static PyObject *table_object_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_Format(PyExc_TypeError, "%s() takes no arguments", type->tp_name);
        return NULL;
    }
    TableObject *self = (TableObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (!table_seed(&self->t) || !table_init(&self->t)) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void table_object_dealloc(PyObject *self)
{
    PyMem_Free(((TableObject *)self)->t.slots);
    PyMem_Free(((TableObject *)self)->t.dense);
    Py_TYPE(self)->tp_free(self);
}

static Py_ssize_t table_object_len(PyObject *self)
{
    return (Py_ssize_t)((TableObject *)self)->t.n;
}

static int table_object_contains(PyObject *self, PyObject *key)
{
    Py_ssize_t at = find_key(&((TableObject *)self)->t, key);
    return at == -2 ? -1 : at >= 0;
}

static PyObject *table_object_sizeof(PyObject *self, PyObject *unused)
{
    (void)unused;
    return PyLong_FromSize_t((size_t)Py_TYPE(self)->tp_basicsize +
                             table_bytes(&((TableObject *)self)->t));
}

/* ---- KeyIndex: dict[bytes, int] -------------------------------------------------- */

typedef TableObject KeyIndex;

/* The value as a uint64 when it is an exact int in 0..2**63-1; else an error and 0. */
static int value_of(PyObject *v, uint64_t *out)
{
    if (!PyLong_CheckExact(v)) {
        PyErr_Format(PyExc_TypeError, "KeyIndex values are ints, not %.100s",
                     Py_TYPE(v)->tp_name);
        return 0;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred())
        return 0;
    if (overflow || x < 0) {
        PyErr_SetString(PyExc_ValueError, "KeyIndex values are ints in 0..2**63-1");
        return 0;
    }
    *out = (uint64_t)x;
    return 1;
}

static PyObject *value_at(const Table *t, Py_ssize_t at)
{
    return PyLong_FromUnsignedLongLong(word_of(t, entry_in(t, (size_t)at)));
}

static PyObject *ix_getitem(KeyIndex *self, PyObject *key)
{
    Py_ssize_t at = find_key(&self->t, key);
    if (at == -2)
        return NULL;
    if (at < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return value_at(&self->t, at);
}

static int ix_ass_subscript(KeyIndex *self, PyObject *key, PyObject *value)
{
    Table *t = &self->t;
    const unsigned char *p;
    size_t len;
    uint64_t v = 0;
    if (!key_of(key, &p, &len) || (value != NULL && !value_of(value, &v)))
        return -1;
    uint64_t h = key_hash(t->seed, p, len);
    Py_ssize_t at = find_from(t, home_of(t, h), p, len, h);
    if (value == NULL) {
        if (at < 0) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        size_t moved;
        table_remove(t, (size_t)at, &moved);
        return 0;
    }
    if (at >= 0) {
        set_word(t, entry_in(t, (size_t)at), v);
        return 0;
    }
    return table_add(t, p, len, h, v) < 0 ? -1 : 0;
}

static PyObject *ix_get(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None) takes 1 or 2 arguments");
        return NULL;
    }
    Py_ssize_t at = find_key(&self->t, args[0]);
    if (at == -2)
        return NULL;
    if (at >= 0)
        return value_at(&self->t, at);
    PyObject *dflt = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(dflt);
    return dflt;
}

static PyObject *ix_pop(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default]) takes 1 or 2 arguments");
        return NULL;
    }
    Py_ssize_t at = find_key(&self->t, args[0]);
    if (at == -2)
        return NULL;
    if (at < 0) {
        if (nargs == 2) {
            Py_INCREF(args[1]);
            return args[1];
        }
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    PyObject *v = value_at(&self->t, at);
    if (v != NULL) {
        size_t moved;
        table_remove(&self->t, (size_t)at, &moved);
    }
    return v;
}

static PyObject *ix_keys(KeyIndex *self, PyObject *unused)
{
    (void)unused;
    size_t n = self->t.n;
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (out == NULL)
        return NULL;
    /* Allocating the list may run a garbage collection, and Python code there (a gc
     * callback, a __del__) may change the index: refuse rather than read past the list.
     * Nothing below runs Python code (bytes objects are not collected). */
    if (self->t.n != n) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_RuntimeError, "KeyIndex changed while its keys were read");
        return NULL;
    }
    for (size_t e = 0; e < n; e++) {
        PyObject *k = key_object(&self->t, e);
        if (k == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)e, k);
    }
    return out;
}

/* Iteration hands out a snapshot of the keys, so deleting while iterating is safe. */
static PyObject *ix_iter(KeyIndex *self)
{
    PyObject *keys = ix_keys(self, NULL);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *ix_clear(KeyIndex *self, PyObject *unused)
{
    (void)unused;
    if (!table_clear(&self->t))
        return NULL;
    Py_RETURN_NONE;
}

/* Per key 0 (absent), 1 (present, even value) or 2 (present, odd value), as bytes: the
 * tier keeps "still writing" in its records' low bit, so this answers a block of a
 * lookup's MISS, HIT or PENDING (``read`` maps them). Every key is checked before any is
 * probed. */
static PyObject *ix_flags(KeyIndex *self, PyObject *seq, PyObject *suffix)
{
    const Table *t = &self->t;
    Batch b;
    PyObject *fast = checked_batch(seq, suffix, "read takes a list or tuple of keys", &b);
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    b.items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    unsigned char *res = (unsigned char *)PyBytes_AS_STRING(out);
    Py_ssize_t found[WINDOW];
    for (Py_ssize_t base = 0; base < n; base += WINDOW) {
        Py_ssize_t m = n - base < WINDOW ? n - base : WINDOW;
        probe_window(t, &b, base, m, 1, found);
        for (Py_ssize_t j = 0; j < m; j++)
            res[base + j] = found[j] < 0 ? 0
                : (unsigned char)(1 + (word_of(t, entry_in(t, (size_t)found[j])) & 1));
    }
    Py_DECREF(fast);
    return out;
}

/* read(keys, answers, suffix=b"") -> list: per key (each item + suffix) answers[0]
 * (absent), answers[1] (present, even value) or answers[2] (present, odd value), the
 * tier's statuses with no Python call per key. `answers` is a tuple of three. */
static PyObject *ix_read(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3 || !PyTuple_CheckExact(args[1])
            || PyTuple_GET_SIZE(args[1]) != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "read(keys, answers, suffix=b'') takes keys and a tuple of 3");
        return NULL;
    }
    PyObject *flags = ix_flags(self, args[0], nargs == 3 ? args[2] : NULL);
    if (flags == NULL)
        return NULL;
    Py_ssize_t n = PyBytes_GET_SIZE(flags);
    const unsigned char *codes = (const unsigned char *)PyBytes_AS_STRING(flags);
    PyObject *out = PyList_New(n);
    if (out != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *answer = PyTuple_GET_ITEM(args[1], codes[i]);
            Py_INCREF(answer);
            PyList_SET_ITEM(out, i, answer);
        }
    }
    Py_DECREF(flags);
    return out;
}

static PyMethodDef ix_methods[] = {
    {"get", (PyCFunction)(void (*)(void))ix_get, METH_FASTCALL,
     "get(key, default=None) -> the key's value, or default."},
    {"pop", (PyCFunction)(void (*)(void))ix_pop, METH_FASTCALL,
     "pop(key[, default]) -> remove the key and return its value."},
    {"keys", (PyCFunction)ix_keys, METH_NOARGS, "keys() -> a list of the keys (a snapshot)."},
    {"clear", (PyCFunction)ix_clear, METH_NOARGS, "clear() -> forget every key."},
    {"read", (PyCFunction)(void (*)(void))ix_read, METH_FASTCALL,
     "read(keys, answers, suffix=b'') -> [answers[flag] for each key + suffix's flag]."},
    {"__sizeof__", (PyCFunction)table_object_sizeof, METH_NOARGS, "bytes held, arrays included."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods ix_as_sequence = {
    .sq_contains = table_object_contains,
};

static PyMappingMethods ix_as_mapping = {
    .mp_length = table_object_len,
    .mp_subscript = (binaryfunc)ix_getitem,
    .mp_ass_subscript = (objobjargproc)ix_ass_subscript,
};

static PyTypeObject KeyIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcore._index.KeyIndex",
    .tp_basicsize = sizeof(KeyIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A map from key bytes (1..255 bytes) to ints in 0..2**63-1, keys inline; "
              "see native/kvcore_index.c.",
    .tp_new = table_object_new,
    .tp_dealloc = table_object_dealloc,
    .tp_iter = (getiterfunc)ix_iter,
    .tp_methods = ix_methods,
    .tp_as_sequence = &ix_as_sequence,
    .tp_as_mapping = &ix_as_mapping,
};

/* ---- KeyOrder: an ordered set of keys, oldest first -------------------------------- */

/* Each entry's word links it: the previous (older) entry in its low half, the next
 * (newer) in its high half, NIL at the ends. `version` counts changes, so an iterator
 * that outlives one raises instead of reading a moved entry. */
typedef struct {
    PyObject_HEAD
    Table t;             /* as in TableObject: the shared functions read it */
    uint32_t head, tail; /* oldest and newest entries, NIL when empty */
    uint64_t version;
} KeyOrder;

static inline uint32_t prev_of(const Table *t, size_t e) { return (uint32_t)(word_of(t, e) & LOW32); }
static inline uint32_t next_of(const Table *t, size_t e) { return (uint32_t)(word_of(t, e) >> 32); }

static inline void set_links(Table *t, size_t e, uint32_t prev, uint32_t next)
{
    set_word(t, e, (uint64_t)next << 32 | prev);
}

static void set_next(Table *t, uint32_t e, uint32_t next)
{
    set_links(t, e, prev_of(t, e), next);
}

static void set_prev(Table *t, uint32_t e, uint32_t prev)
{
    set_links(t, e, prev, next_of(t, e));
}

static void unlink_entry(KeyOrder *self, size_t e)
{
    Table *t = &self->t;
    uint32_t prev = prev_of(t, e), next = next_of(t, e);
    if (prev == NIL)
        self->head = next;
    else
        set_next(t, prev, next);
    if (next == NIL)
        self->tail = prev;
    else
        set_prev(t, next, prev);
}

static void append_entry(KeyOrder *self, size_t e)
{
    Table *t = &self->t;
    set_links(t, e, self->tail, NIL);
    if (self->tail == NIL)
        self->head = (uint32_t)e;
    else
        set_next(t, self->tail, (uint32_t)e);
    self->tail = (uint32_t)e;
}

/* Remove the key in slot `at` from the order and the table; the entry that moved into
 * its place is relinked under its new index. */
static void order_remove(KeyOrder *self, size_t at)
{
    Table *t = &self->t;
    unlink_entry(self, entry_in(t, at));
    size_t moved;
    size_t e = table_remove(t, at, &moved);
    if (moved != NIL) {
        uint32_t prev = prev_of(t, e), next = next_of(t, e);
        if (prev == NIL)
            self->head = (uint32_t)e;
        else
            set_next(t, prev, (uint32_t)e);
        if (next == NIL)
            self->tail = (uint32_t)e;
        else
            set_prev(t, next, (uint32_t)e);
    }
    self->version++;
}

static PyObject *ko_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    KeyOrder *self = (KeyOrder *)table_object_new(type, args, kwds);
    if (self != NULL)
        self->head = self->tail = NIL;
    return (PyObject *)self;
}

/* add_many(keys): each absent key joins at the newest end, in order; a present key keeps
 * its place (an OrderedDict's ``order[key] = None``). Checked before any is added. */
static PyObject *ko_add_many(KeyOrder *self, PyObject *seq)
{
    Table *t = &self->t;
    PyObject *fast = checked_keys(seq, "add_many takes a list or tuple of keys", 0);
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t added = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(items[i]);
        size_t len = (size_t)PyBytes_GET_SIZE(items[i]);
        uint64_t h = key_hash(t->seed, p, len);
        if (find_from(t, home_of(t, h), p, len, h) >= 0)
            continue;
        Py_ssize_t e = table_add(t, p, len, h, 0);
        if (e < 0) { /* the keys before it stay added: each is a whole step */
            Py_DECREF(fast);
            self->version += added;
            return NULL;
        }
        append_entry(self, (size_t)e);
        added = 1;
    }
    self->version += added; /* only a change ends a walk, as with an OrderedDict */
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

/* touch(keys, suffix=b""): for each key (item + suffix), last to first, a present key
 * moves to the newest end, so the first key ends newest (an OrderedDict's move_to_end
 * over reversed(keys)); absent keys are skipped. Checked before any moves. */
static PyObject *ko_touch(KeyOrder *self, PyObject *const *args, Py_ssize_t nargs)
{
    Table *t = &self->t;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "touch(keys, suffix=b'') takes 1 or 2 arguments");
        return NULL;
    }
    Batch b;
    PyObject *fast = checked_batch(args[0], nargs == 2 ? args[1] : NULL,
                                   "touch takes a list or tuple of keys", &b);
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    b.items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t found[WINDOW];
    uint64_t moved = 0;
    /* Moving an entry relinks it but moves no slot, so a window's probes stay valid. */
    for (Py_ssize_t top = n - 1; top >= 0; top -= WINDOW) {
        Py_ssize_t m = top + 1 < WINDOW ? top + 1 : WINDOW;
        probe_window(t, &b, top, m, -1, found);
        for (Py_ssize_t j = 0; j < m; j++) {
            if (found[j] < 0)
                continue;
            size_t e = entry_in(t, (size_t)found[j]);
            if (e != self->tail) {
                unlink_entry(self, e);
                append_entry(self, e);
                moved = 1;
            }
        }
    }
    self->version += moved;
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

/* remove_many(keys): every key must be present (KeyError names the first that is not,
 * before any is removed); a key listed twice is an error too. */
static PyObject *ko_remove_many(KeyOrder *self, PyObject *seq)
{
    Table *t = &self->t;
    PyObject *fast = checked_keys(seq, "remove_many takes a list or tuple of keys", 0);
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (find_key(t, items[i]) < 0) {
            PyErr_SetObject(PyExc_KeyError, items[i]);
            Py_DECREF(fast);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t at = find_key(t, items[i]);
        if (at < 0) { /* listed twice: the earlier ones are removed */
            PyErr_SetObject(PyExc_KeyError, items[i]);
            Py_DECREF(fast);
            return NULL;
        }
        order_remove(self, (size_t)at);
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

static PyObject *ko_discard(KeyOrder *self, PyObject *key)
{
    Py_ssize_t at = find_key(&self->t, key);
    if (at == -2)
        return NULL;
    if (at >= 0)
        order_remove(self, (size_t)at);
    Py_RETURN_NONE;
}

static PyObject *ko_clear(KeyOrder *self, PyObject *unused)
{
    (void)unused;
    if (!table_clear(&self->t))
        return NULL;
    self->head = self->tail = NIL;
    self->version++;
    Py_RETURN_NONE;
}

/* Iteration walks the links oldest first, lazily (an eviction walk reads only the
 * victims and what it skips); a change to the order while it walks raises RuntimeError,
 * as an OrderedDict's iterator does. */
typedef struct {
    PyObject_HEAD
    KeyOrder *order;
    uint32_t at;
    uint64_t version;
} KeyOrderIter;

static PyTypeObject KeyOrderIterType;

static PyObject *ko_iter(KeyOrder *self)
{
    KeyOrderIter *it = PyObject_New(KeyOrderIter, &KeyOrderIterType);
    if (it == NULL)
        return NULL;
    Py_INCREF(self);
    it->order = self;
    it->at = self->head;
    it->version = self->version;
    return (PyObject *)it;
}

static void koi_dealloc(KeyOrderIter *it)
{
    Py_DECREF(it->order);
    PyObject_Free(it);
}

static PyObject *koi_next(KeyOrderIter *it)
{
    KeyOrder *order = it->order;
    if (it->version != order->version) {
        PyErr_SetString(PyExc_RuntimeError, "KeyOrder changed during iteration");
        return NULL;
    }
    if (it->at == NIL)
        return NULL;
    size_t e = it->at;
    it->at = next_of(&order->t, e);
    return key_object(&order->t, e);
}

static PyTypeObject KeyOrderIterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcore._index.KeyOrderIterator",
    .tp_basicsize = sizeof(KeyOrderIter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)koi_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)koi_next,
};

static PyMethodDef ko_methods[] = {
    {"add_many", (PyCFunction)ko_add_many, METH_O,
     "add_many(keys): absent keys join at the newest end, in order."},
    {"touch", (PyCFunction)(void (*)(void))ko_touch, METH_FASTCALL,
     "touch(keys, suffix=b''): present keys (each item + suffix) move to the newest end, "
     "the first key newest."},
    {"remove_many", (PyCFunction)ko_remove_many, METH_O,
     "remove_many(keys): remove keys that are all present, else KeyError."},
    {"discard", (PyCFunction)ko_discard, METH_O, "discard(key): remove the key if present."},
    {"clear", (PyCFunction)ko_clear, METH_NOARGS, "clear() -> forget every key."},
    {"__sizeof__", (PyCFunction)table_object_sizeof, METH_NOARGS, "bytes held, arrays included."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods ko_as_sequence = {
    .sq_length = table_object_len,
    .sq_contains = table_object_contains,
};

static PyTypeObject KeyOrderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcore._index.KeyOrder",
    .tp_basicsize = sizeof(KeyOrder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An ordered set of key bytes, oldest first (an LRU order), keys inline; "
              "see native/kvcore_index.c.",
    .tp_new = ko_new,
    .tp_dealloc = table_object_dealloc,
    .tp_iter = (getiterfunc)ko_iter,
    .tp_methods = ko_methods,
    .tp_as_sequence = &ko_as_sequence,
};

static struct PyModuleDef index_module = {
    PyModuleDef_HEAD_INIT, "kvcore._index",
    "The CPU tier's keys, inline, with batched probes; see native/kvcore_index.c.",
    -1, NULL, NULL, NULL, NULL, NULL,
};

static int add_type(PyObject *m, PyTypeObject *type, const char *name)
{
    if (PyType_Ready(type) < 0)
        return -1;
    Py_INCREF(type);
    if (PyModule_AddObject(m, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__index(void)
{
    if (PyType_Ready(&KeyOrderIterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&index_module);
    if (m == NULL)
        return NULL;
    if (add_type(m, &KeyIndexType, "KeyIndex") < 0 || add_type(m, &KeyOrderType, "KeyOrder") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
