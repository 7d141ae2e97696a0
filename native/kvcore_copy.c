/*
 * kvcore_copy.c: validated gather/scatter of KV blocks between registered host regions.
 *
 * Two passes. The first checks every region and every descriptor and stops at the first bad
 * one, so a bad id is an error code and nothing moves (the upstream bug this replaces was a
 * segfault inside the batched copy). The second pass copies; it re-runs the same cheap
 * per-descriptor check, so a table that another thread rewrites between the passes can at
 * worst end in a partial copy and an error status, never in an out-of-range access.
 *
 * No global mutable state and no Python: every function depends only on its arguments.
 */
#include "kvcore_copy.h"

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

int kvc_resolve(const kvc_region *regions, uint64_t num_regions, const kvc_desc *descs,
                uint64_t index, kvc_error *error, uint64_t *src, uint64_t *dst)
{
    return kvc_check_desc(regions, num_regions, &descs[index], index, error, src, dst);
}

int kvc_validate(const kvc_region *regions, uint64_t num_regions, const kvc_desc *descs,
                 uint64_t num_descs, kvc_error *error)
{
    if (error != NULL) {
        error->index = -1;
        error->value = 0;
        error->bound = 0;
        error->side = KVC_SIDE_NONE;
        error->status = KVC_OK;
    }
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
    for (uint64_t i = 0; i < num_regions; i++) {
        int status = kvc_check_region(&regions[i], i, error);
        if (status != KVC_OK) {
            return status;
        }
    }
    for (uint64_t i = 0; i < num_descs; i++) {
        uint64_t src, dst;
        int status = kvc_check_desc(regions, num_regions, &descs[i], i, error, &src, &dst);
        if (status != KVC_OK) {
            return status;
        }
    }
    return KVC_OK;
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
    int status = kvc_validate(regions, num_regions, descs, num_descs, error);
    if (status != KVC_OK) {
        return status;
    }
    /* Runs contiguous on both sides are merged into one copy (unless KVC_COPY_PLAIN). */
    int coalesce = (flags & KVC_COPY_PLAIN) == 0;
    int streamed = 0;
    uint64_t run_src = 0, run_dst = 0, run_len = 0;
    for (uint64_t i = 0; i < num_descs; i++) {
        uint64_t src, dst;
        status = kvc_check_desc(regions, num_regions, &descs[i], i, error, &src, &dst);
        if (status != KVC_OK) {
            break;
        }
        uint64_t n = (uint64_t)descs[i].size_bytes;
        if (coalesce && run_len != 0 && src == run_src + run_len && dst == run_dst + run_len
            && (src + n <= run_dst || dst + n <= run_src)) {
            /* Merged only while the merged ranges stay disjoint, so memcpy stays defined. */
            run_len += n;
            continue;
        }
        if (run_len != 0) {
            kvc_copy_run(run_dst, run_src, run_len, flags, &streamed);
        }
        run_src = src;
        run_dst = dst;
        run_len = n;
    }
    if (run_len != 0) {
        kvc_copy_run(run_dst, run_src, run_len, flags, &streamed);
    }
#if KVC_HAVE_SSE2
    if (streamed) {
        _mm_sfence(); /* make streaming stores visible before the caller reads the data */
    }
#endif
    return status;
}
