/*
 * kvcore_copy.c: validated gather/scatter of KV blocks between registered host regions.
 *
 * One read, then two passes over local memory. kvc_snapshot_take copies every region and
 * every descriptor out of the caller's tables exactly once (volatile reads, so the compiler
 * cannot re-load a field), checks them and resolves each descriptor to (src, dst, size); it
 * then checks overlap between descriptors with one sort of the destinations (and one of the
 * sources when their address spans meet). The copy reads only that snapshot: with the GIL
 * released and tables borrowed from live tensors, another thread rewriting a size between
 * check and copy changes nothing (the upstream bug this replaces was a segfault inside the
 * batched copy). Nothing moves unless the whole table is valid.
 *
 * No global mutable state and no Python: every function depends only on its arguments.
 */
#include "kvcore_copy.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVC_HAVE_SSE2 1
#else
#define KVC_HAVE_SSE2 0
#endif

/*
 * Runs at least this large are copied with non-temporal stores by default: they skip the
 * read-for-ownership of each destination line and do not evict the cache. On the 2-core
 * development VM (benchmarks/bench_copy.py, docs/native.md) streaming gained ~15-20% at
 * 2 MiB, was neutral at 256 KiB and lost ~10% at 32 KiB, hence 1 MiB.
 */
#define KVC_STREAM_MIN_BYTES (1024u * 1024u)

static const char *const kvc_status_texts[KVC_STATUS_COUNT] = {
    "ok",
    "a table pointer is NULL while its count is not 0",
    "too many regions or descriptors for one call",
    "unknown flag bits",
    "inconsistent region layout",
    "an address computation would overflow 64 bits",
    "descriptor names a region that does not exist",
    "row id is outside the region's rows",
    "row 0 is the null block and this region refuses it",
    "byte offset or size is negative",
    "descriptor moves 0 bytes",
    "size is larger than a row",
    "offset + size runs past the end of the row",
    "source and destination bytes overlap",
    "lists of mismatched length",
    "CUDA support is not available",
    "the legacy default CUDA stream is refused; pass a stream you created",
    "a CUDA call failed",
    "not ready yet",
    "unknown or unavailable CUDA copy method",
    "host region is not pinned; the CUDA kernel path needs pinned (cudaHostAlloc) memory",
    "two descriptors write overlapping destination bytes",
    "a descriptor reads bytes that another descriptor of the call writes",
    "the per-call scratch memory could not be allocated",
    "a registered tensor's storage was freed, resized or moved after registration",
};

int kvc_abi_version(void) { return KVC_ABI_VERSION; }
size_t kvc_sizeof_region(void) { return sizeof(kvc_region); }
size_t kvc_sizeof_desc(void) { return sizeof(kvc_desc); }
size_t kvc_sizeof_error(void) { return sizeof(kvc_error); }

const char *kvc_status_text(int status)
{
    if (status < 0 || status >= KVC_STATUS_COUNT) {
        return "unknown status code";
    }
    return kvc_status_texts[status];
}

/* Clamp an unsigned quantity into the signed error fields (only huge bounds are clamped). */
static int64_t kvc_clamp(uint64_t v) { return v > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)v; }

static int kvc_fail(kvc_error *error, int status, uint64_t index, int side, int64_t value,
                    int64_t bound)
{
    if (error != NULL) {
        error->index = kvc_clamp(index);
        error->value = value;
        error->bound = bound;
        error->side = side;
        error->status = status;
    }
    return status;
}

/* A region is consistent when every row it admits lies inside [base, base + size_bytes). */
static int kvc_check_region(const kvc_region *r, uint64_t index, kvc_error *error)
{
    const uint64_t known_flags = KVC_REGION_REFUSE_ROW0 | KVC_REGION_DEVICE;
    if ((r->flags & ~known_flags) != 0) {
        return kvc_fail(error, KVC_E_FLAGS, index, KVC_SIDE_REGION, kvc_clamp(r->flags),
                        (int64_t)known_flags);
    }
    if (r->base > UINT64_MAX - r->size_bytes) {
        return kvc_fail(error, KVC_E_OVERFLOW, index, KVC_SIDE_REGION, kvc_clamp(r->size_bytes),
                        kvc_clamp(UINT64_MAX - r->base));
    }
    if (r->num_rows == 0) {
        return KVC_OK;
    }
    if (r->base == 0) {
        return kvc_fail(error, KVC_E_REGION, index, KVC_SIDE_REGION, 0, 1);
    }
    if (r->num_rows > 1 && r->row_bytes > r->row_stride_bytes) {
        return kvc_fail(error, KVC_E_REGION, index, KVC_SIDE_REGION, kvc_clamp(r->row_bytes),
                        kvc_clamp(r->row_stride_bytes));
    }
    /* extent = (num_rows - 1) * stride + row_bytes, computed without overflow. */
    uint64_t last = r->num_rows - 1;
    if (r->row_stride_bytes != 0 && last > UINT64_MAX / r->row_stride_bytes) {
        return kvc_fail(error, KVC_E_OVERFLOW, index, KVC_SIDE_REGION, kvc_clamp(r->num_rows),
                        kvc_clamp(UINT64_MAX / r->row_stride_bytes));
    }
    uint64_t last_start = last * r->row_stride_bytes;
    if (last_start > UINT64_MAX - r->row_bytes || last_start + r->row_bytes > r->size_bytes) {
        return kvc_fail(error, KVC_E_REGION, index, KVC_SIDE_REGION, kvc_clamp(r->num_rows),
                        kvc_clamp(r->size_bytes));
    }
    return KVC_OK;
}

/*
 * Check one side of a descriptor and compute its address. Order of checks is the order of
 * the status codes, so the reported rule is the most basic one that fails.
 */
static inline int kvc_check_side(const kvc_region *regions, uint64_t num_regions,
                                 int64_t region, int64_t row, int64_t offset, int64_t size,
                                 int side, uint64_t index, kvc_error *error, uint64_t *addr)
{
    if (region < 0 || (uint64_t)region >= num_regions) {
        return kvc_fail(error, KVC_E_REGION_ID, index, side, region, kvc_clamp(num_regions));
    }
    const kvc_region *r = &regions[region];
    if (row < 0 || (uint64_t)row >= r->num_rows) {
        return kvc_fail(error, KVC_E_ROW_RANGE, index, side, row, kvc_clamp(r->num_rows));
    }
    if (row == 0 && (r->flags & KVC_REGION_REFUSE_ROW0) != 0) {
        return kvc_fail(error, KVC_E_NULL_ROW, index, side, row, 1);
    }
    if (offset < 0) {
        return kvc_fail(error, KVC_E_NEGATIVE, index, side, offset, 0);
    }
    if ((uint64_t)size > r->row_bytes) {
        return kvc_fail(error, KVC_E_SIZE, index, side, size, kvc_clamp(r->row_bytes));
    }
    if ((uint64_t)offset > r->row_bytes - (uint64_t)size) {
        return kvc_fail(error, KVC_E_OFFSET, index, side, offset,
                        kvc_clamp(r->row_bytes - (uint64_t)size));
    }
    *addr = r->base + (uint64_t)row * r->row_stride_bytes + (uint64_t)offset;
    return KVC_OK;
}

/* Check one descriptor; on success store its source and destination addresses. */
static inline int kvc_check_desc(const kvc_region *regions, uint64_t num_regions,
                                 const kvc_desc *d, uint64_t index, kvc_error *error,
                                 uint64_t *src, uint64_t *dst)
{
    if (d->size_bytes < 0) {
        return kvc_fail(error, KVC_E_NEGATIVE, index, KVC_SIDE_NONE, d->size_bytes, 0);
    }
    if (d->size_bytes == 0) {
        return kvc_fail(error, KVC_E_ZERO_SIZE, index, KVC_SIDE_NONE, 0, 1);
    }
    int status = kvc_check_side(regions, num_regions, d->src_region, d->src_row,
                                d->src_offset_bytes, d->size_bytes, KVC_SIDE_SRC, index, error,
                                src);
    if (status != KVC_OK) {
        return status;
    }
    status = kvc_check_side(regions, num_regions, d->dst_region, d->dst_row,
                            d->dst_offset_bytes, d->size_bytes, KVC_SIDE_DST, index, error, dst);
    if (status != KVC_OK) {
        return status;
    }
    uint64_t n = (uint64_t)d->size_bytes;
    if (*src < *dst + n && *dst < *src + n) {
        return kvc_fail(error, KVC_E_OVERLAP, index, KVC_SIDE_DST, kvc_clamp(*dst),
                        kvc_clamp(*src));
    }
    return KVC_OK;
}

/* Read a region from caller memory: each field exactly once (volatile: no re-load later). */
static void kvc_read_region(const kvc_region *p, kvc_region *out)
{
    const volatile kvc_region *v = p;
    out->base = v->base;
    out->size_bytes = v->size_bytes;
    out->row_stride_bytes = v->row_stride_bytes;
    out->row_bytes = v->row_bytes;
    out->num_rows = v->num_rows;
    out->flags = v->flags;
}

static void kvc_read_desc(const kvc_desc *p, kvc_desc *out)
{
    const volatile kvc_desc *v = p;
    out->src_region = v->src_region;
    out->src_row = v->src_row;
    out->src_offset_bytes = v->src_offset_bytes;
    out->dst_region = v->dst_region;
    out->dst_row = v->dst_row;
    out->dst_offset_bytes = v->dst_offset_bytes;
    out->size_bytes = v->size_bytes;
}

static inline uint64_t kvc_key(const kvc_entry *e, uint64_t i, int by_src)
{
    return by_src ? e[i].src : e[i].dst;
}

/* Descriptor indices fit 24 bits (KVC_MAX_DESCRIPTORS), so a sort item packs key and index. */
#define KVC_INDEX_BITS 24
#define KVC_INDEX_MASK ((1ull << KVC_INDEX_BITS) - 1)
#define KVC_KEY_BITS (64 - KVC_INDEX_BITS)
typedef char kvc_check_index_bits[KVC_MAX_DESCRIPTORS <= (1ull << KVC_INDEX_BITS) ? 1 : -1];

/* One stable counting pass of an LSD radix sort: digit (v >> shift) & mask, in -> out. */
static void kvc_radix_pass(const uint64_t *in, uint64_t *out, uint32_t n, int shift,
                           uint32_t mask, uint32_t *count)
{
    memset(count, 0, (mask + 2) * sizeof(uint32_t));
    for (uint32_t i = 0; i < n; i++) {
        count[((in[i] >> shift) & mask) + 1]++;
    }
    for (uint32_t d = 0; d <= mask; d++) {
        count[d + 1] += count[d];
    }
    for (uint32_t i = 0; i < n; i++) {
        out[count[(in[i] >> shift) & mask]++] = in[i];
    }
}

/* What one pass over the keys learns: which bits differ, the lowest key, already sorted? */
typedef struct kvc_keys {
    uint64_t first;
    uint64_t prev;
    uint64_t diff;
    uint64_t low;
    int sorted;
} kvc_keys;

static inline void kvc_keys_add(kvc_keys *k, uint64_t key, uint64_t index)
{
    if (index == 0) {
        k->first = k->prev = k->low = key;
        k->diff = 0;
        k->sorted = 1;
        return;
    }
    k->diff |= key ^ k->first;
    k->sorted &= key >= k->prev;
    k->low = key < k->low ? key : k->low;
    k->prev = key;
}

/*
 * Sort the entries by source or destination address (`keys` describes them). Returns n
 * items, each (key << 24 | index), ascending (ties in index order), in `a` or `b` (both n
 * long). Only the bits in which the keys differ are sorted on: blocks of one pool differ in
 * about 16-20 bits, which is two or three passes of 8-bit digits (8 bits beat 11 here: 256
 * write streams stay in L1). Keys whose differing bits do not fit the 40 bits next to the
 * index are sorted in a second round on the high bits (LSD order, so still stable).
 */
static uint64_t *kvc_sort(const kvc_entry *e, uint32_t n, int by_src, const kvc_keys *keys,
                          uint64_t *a, uint64_t *b)
{
    uint64_t diff = keys->diff, low = keys->low;
    int sorted = keys->sorted;
    int lo = diff != 0 ? __builtin_ctzll(diff) : 0;
    int bits = diff != 0 ? 64 - __builtin_clzll(diff) - lo : 0;
    int wide = bits > KVC_KEY_BITS;
    /* Wide keys: sort on the low 40 differing bits now, then on the rest below. */
    int now_bits = wide ? KVC_KEY_BITS : bits;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t rel = ((kvc_key(e, i, by_src) - low) >> lo) & ((1ull << now_bits) - 1);
        a[i] = (rel << KVC_INDEX_BITS) | i;
    }
    if (sorted || bits == 0) {
        if (wide) { /* already in key order: keep the order, the packed keys are unused */
            for (uint32_t i = 0; i < n; i++) {
                a[i] = (uint64_t)i;
            }
        }
        return a;
    }
    uint32_t count[257];
    const int width = 8;
    const uint32_t mask = 255;
    uint64_t *in = a, *out = b;
    for (int done = 0; done < now_bits; done += width) {
        kvc_radix_pass(in, out, n, KVC_INDEX_BITS + done, mask, count);
        uint64_t *swap = in;
        in = out;
        out = swap;
    }
    if (!wide) {
        return in;
    }
    /* Second round for wide keys: re-pack the high differing bits, in the order so far. */
    for (uint32_t i = 0; i < n; i++) {
        uint64_t idx = in[i] & KVC_INDEX_MASK;
        uint64_t rel = ((kvc_key(e, idx, by_src) - low) >> lo) >> KVC_KEY_BITS;
        in[i] = (rel << KVC_INDEX_BITS) | idx;
    }
    for (int done = 0; done < bits - KVC_KEY_BITS; done += width) {
        kvc_radix_pass(in, out, n, KVC_INDEX_BITS + done, mask, count);
        uint64_t *swap = in;
        in = out;
        out = swap;
    }
    return in;
}

/*
 * No byte may be written by two descriptors, nor read by one and written by another: then
 * the result does not depend on copy order (the CUDA batch and kernel have none) and the
 * sequential C path means the same thing. `work` holds 3 * n 64-bit items.
 */
static int kvc_check_overlaps(const kvc_entry *e, uint64_t count, const kvc_keys *dst_keys,
                              uint64_t src_lo, uint64_t src_hi, uint64_t *work,
                              kvc_error *error)
{
    if (count < 2) {
        return KVC_OK;
    }
    uint32_t n = (uint32_t)count;
    uint64_t *by_dst = kvc_sort(e, n, 0, dst_keys, work, work + n);
    for (uint32_t k = 1; k < n; k++) {
        uint64_t a = by_dst[k - 1] & KVC_INDEX_MASK, b = by_dst[k] & KVC_INDEX_MASK;
        if (e[b].dst < e[a].dst + e[a].size) { /* sorted and disjoint so far: a is the last end */
            uint64_t later = a > b ? a : b, earlier = a > b ? b : a;
            return kvc_fail(error, KVC_E_DST_OVERLAP, later, KVC_SIDE_DST, (int64_t)earlier, 0);
        }
    }
    uint64_t last = by_dst[n - 1] & KVC_INDEX_MASK;
    uint64_t dst_lo = e[by_dst[0] & KVC_INDEX_MASK].dst, dst_hi = e[last].dst + e[last].size;
    if (src_hi <= dst_lo || dst_hi <= src_lo) {
        return KVC_OK; /* the usual case: sources and destinations live in different pools */
    }
    kvc_keys src_keys = {0, 0, 0, 0, 1};
    for (uint32_t i = 0; i < n; i++) {
        kvc_keys_add(&src_keys, e[i].src, i);
    }
    /* The destination order must survive the source sort: it uses the two other thirds. */
    uint64_t *spare = by_dst == work ? work + n : work;
    uint64_t *by_src = kvc_sort(e, n, 1, &src_keys, spare, work + 2 * (size_t)n);
    uint32_t j = 0; /* destinations are disjoint and sorted: one merge pass finds any hit */
    for (uint32_t k = 0; k < n; k++) {
        const kvc_entry *s = &e[by_src[k] & KVC_INDEX_MASK];
        while (j < n && e[by_dst[j] & KVC_INDEX_MASK].dst + e[by_dst[j] & KVC_INDEX_MASK].size
                            <= s->src) {
            j++;
        }
        if (j < n && e[by_dst[j] & KVC_INDEX_MASK].dst < s->src + s->size) {
            return kvc_fail(error, KVC_E_READS_WRITTEN, by_src[k] & KVC_INDEX_MASK,
                            KVC_SIDE_SRC, (int64_t)(by_dst[j] & KVC_INDEX_MASK), 0);
        }
    }
    return KVC_OK;
}

/* The one allocation of a call: regions, entries and the sort indices, or the inline arrays. */
static int kvc_snapshot_alloc(kvc_snapshot *snap, uint64_t num_regions, uint64_t num_descs,
                              uint64_t **work, kvc_error *error)
{
    snap->heap = NULL;
    snap->num_regions = num_regions;
    snap->num_entries = num_descs;
    if (num_regions <= KVC_SMALL_REGIONS && num_descs <= KVC_SMALL_DESCS) {
        snap->regions = snap->small_regions;
        snap->entries = snap->small_entries;
        *work = snap->small_work;
        return KVC_OK;
    }
    /* Both counts are bounded by the KVC_MAX_* limits, so these products cannot overflow. */
    size_t bytes = (size_t)num_regions * sizeof(kvc_region)
                   + (size_t)num_descs * (sizeof(kvc_entry) + 3 * sizeof(uint64_t));
    unsigned char *heap = (unsigned char *)malloc(bytes > 0 ? bytes : 1);
    if (heap == NULL) {
        return kvc_fail(error, KVC_E_NO_MEMORY, 0, KVC_SIDE_NONE, kvc_clamp(bytes), 0);
    }
    snap->heap = heap;
    snap->regions = (kvc_region *)(void *)heap;
    snap->entries = (kvc_entry *)(void *)(heap + (size_t)num_regions * sizeof(kvc_region));
    *work = (uint64_t *)(void *)(snap->entries + num_descs);
    return KVC_OK;
}

void kvc_snapshot_release(kvc_snapshot *snap)
{
    free(snap->heap);
    snap->heap = NULL;
    snap->num_entries = 0;
    snap->num_regions = 0;
}

static int kvc_snapshot_fill(const kvc_region *regions, const kvc_desc *descs,
                             kvc_snapshot *snap, uint64_t *work, kvc_error *error)
{
    for (uint64_t i = 0; i < snap->num_regions; i++) {
        kvc_read_region(&regions[i], &snap->regions[i]);
        int status = kvc_check_region(&snap->regions[i], i, error);
        if (status != KVC_OK) {
            return status;
        }
    }
    kvc_keys dst_keys = {0, 0, 0, 0, 1};
    uint64_t src_lo = UINT64_MAX, src_hi = 0;
    for (uint64_t i = 0; i < snap->num_entries; i++) {
        kvc_desc d;
        kvc_read_desc(&descs[i], &d);
        kvc_entry *out = &snap->entries[i];
        int status = kvc_check_desc(snap->regions, snap->num_regions, &d, i, error, &out->src,
                                    &out->dst);
        if (status != KVC_OK) {
            return status;
        }
        out->size = (uint64_t)d.size_bytes;
        kvc_keys_add(&dst_keys, out->dst, i); /* the facts the overlap sort needs, for free */
        src_lo = out->src < src_lo ? out->src : src_lo;
        src_hi = out->src + out->size > src_hi ? out->src + out->size : src_hi;
    }
    return kvc_check_overlaps(snap->entries, snap->num_entries, &dst_keys, src_lo, src_hi, work,
                              error);
}

int kvc_snapshot_take(const kvc_region *regions, uint64_t num_regions, const kvc_desc *descs,
                      uint64_t num_descs, kvc_snapshot *snap, kvc_error *error)
{
    if (error != NULL) {
        error->index = -1;
        error->value = 0;
        error->bound = 0;
        error->side = KVC_SIDE_NONE;
        error->status = KVC_OK;
    }
    snap->heap = NULL;
    snap->num_regions = 0;
    snap->num_entries = 0;
    if (num_regions > KVC_MAX_REGIONS) {
        return kvc_fail(error, KVC_E_LIMIT, 0, KVC_SIDE_REGION, kvc_clamp(num_regions),
                        KVC_MAX_REGIONS);
    }
    if (num_descs > KVC_MAX_DESCRIPTORS) {
        return kvc_fail(error, KVC_E_LIMIT, 0, KVC_SIDE_NONE, kvc_clamp(num_descs),
                        KVC_MAX_DESCRIPTORS);
    }
    if ((regions == NULL && num_regions != 0) || (descs == NULL && num_descs != 0)) {
        return kvc_fail(error, KVC_E_NULL_ARGUMENT, 0, KVC_SIDE_NONE, 0, 0);
    }
    uint64_t *work = NULL;
    int status = kvc_snapshot_alloc(snap, num_regions, num_descs, &work, error);
    if (status == KVC_OK) {
        status = kvc_snapshot_fill(regions, descs, snap, work, error);
    }
    if (status != KVC_OK) {
        kvc_snapshot_release(snap);
    }
    return status;
}

int kvc_validate(const kvc_region *regions, uint64_t num_regions, const kvc_desc *descs,
                 uint64_t num_descs, kvc_error *error)
{
    kvc_snapshot snap;
    int status = kvc_snapshot_take(regions, num_regions, descs, num_descs, &snap, error);
    kvc_snapshot_release(&snap);
    return status;
}

/* Copy with non-temporal stores: the destination is not read first and not cached. */
static void kvc_stream_copy(unsigned char *dst, const unsigned char *src, uint64_t n)
{
#if KVC_HAVE_SSE2
    uint64_t head = (16u - ((uintptr_t)dst & 15u)) & 15u;
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    while (n >= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(src + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + 48));
        _mm_stream_si128((__m128i *)(void *)(dst + 0), a);
        _mm_stream_si128((__m128i *)(void *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(void *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(void *)(dst + 48), d);
        dst += 64;
        src += 64;
        n -= 64;
    }
#endif
    memcpy(dst, src, n);
}

static void kvc_copy_run(uint64_t dst, uint64_t src, uint64_t n, uint64_t flags, int *streamed)
{
    int stream = (flags & KVC_COPY_STREAM) != 0
                 || ((flags & KVC_COPY_NO_STREAM) == 0 && n >= KVC_STREAM_MIN_BYTES);
    if (stream && KVC_HAVE_SSE2) {
        kvc_stream_copy((unsigned char *)(uintptr_t)dst, (const unsigned char *)(uintptr_t)src,
                        n);
        *streamed = 1;
    } else {
        memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n);
    }
}

int kvc_copy(const kvc_region *regions, uint64_t num_regions, const kvc_desc *descs,
             uint64_t num_descs, uint64_t flags, kvc_error *error)
{
    const uint64_t known = KVC_COPY_PLAIN | KVC_COPY_STREAM | KVC_COPY_NO_STREAM;
    if ((flags & ~known) != 0) {
        return kvc_fail(error, KVC_E_FLAGS, 0, KVC_SIDE_NONE, kvc_clamp(flags), (int64_t)known);
    }
    kvc_snapshot snap;
    int status = kvc_snapshot_take(regions, num_regions, descs, num_descs, &snap, error);
    if (status != KVC_OK) {
        return status;
    }
    /* From here on only the snapshot is read. Runs contiguous on both sides are merged into
     * one copy (unless KVC_COPY_PLAIN); destinations are disjoint, so any order is right. */
    int coalesce = (flags & KVC_COPY_PLAIN) == 0;
    int streamed = 0;
    uint64_t run_src = 0, run_dst = 0, run_len = 0;
    for (uint64_t i = 0; i < snap.num_entries; i++) {
        const kvc_entry *e = &snap.entries[i];
        if (coalesce && run_len != 0 && e->src == run_src + run_len
            && e->dst == run_dst + run_len) {
            run_len += e->size;
            continue;
        }
        if (run_len != 0) {
            kvc_copy_run(run_dst, run_src, run_len, flags, &streamed);
        }
        run_src = e->src;
        run_dst = e->dst;
        run_len = e->size;
    }
    if (run_len != 0) {
        kvc_copy_run(run_dst, run_src, run_len, flags, &streamed);
    }
#if KVC_HAVE_SSE2
    if (streamed) {
        _mm_sfence(); /* make streaming stores visible before the caller reads the data */
    }
#endif
    kvc_snapshot_release(&snap);
    return KVC_OK;
}
