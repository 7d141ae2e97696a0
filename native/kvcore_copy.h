/*
 * kvcore_copy.h: the validated block-copy API of kvcore (host side).
 *
 * The caller registers memory *regions* (a base address and a row layout) and passes a list
 * of copy *descriptors* (region, row id and byte offset on each side, and a byte count).
 * Every region and every descriptor is validated before the first byte moves (invariant B1);
 * on failure nothing is copied and the error record names the first bad descriptor.
 *
 * Rules the code keeps (docs/style.md, native/): the C code knows no Python, keeps no global
 * mutable state (every function is a pure function of its arguments plus the memory it is
 * told to copy, so it is safe to call from several threads at once), and returns an int
 * status; kvc_status_text() is the one place a status becomes text.
 *
 * The block between CFFI-BEGIN and CFFI-END is read verbatim by native/build_native.py as
 * the cffi declarations, so it holds only plain C declarations and integer #defines.
 */
#ifndef KVCORE_COPY_H
#define KVCORE_COPY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* CFFI-BEGIN */

/* Bumped whenever a struct layout or a signature changes; the smoke test compares it. */
#define KVC_ABI_VERSION 1

/* Limits on one call (put a limit on everything): regions registered, descriptors passed. */
#define KVC_MAX_REGIONS 65536
#define KVC_MAX_DESCRIPTORS 16777216

/* Status codes. 0 is success; every other value names one rule that was broken. */
#define KVC_OK 0
#define KVC_E_NULL_ARGUMENT 1  /* a table pointer is NULL while its count is not 0 */
#define KVC_E_LIMIT 2          /* more regions or descriptors than the KVC_MAX_* limits */
#define KVC_E_FLAGS 3          /* an unknown flag bit (copy flags or region flags) */
#define KVC_E_REGION 4         /* a region's layout is inconsistent (index = region) */
#define KVC_E_OVERFLOW 5       /* an address computation would overflow 64 bits */
#define KVC_E_REGION_ID 6      /* a descriptor names a region that does not exist */
#define KVC_E_ROW_RANGE 7      /* a row id is negative or >= the region's row count */
#define KVC_E_NULL_ROW 8       /* row 0 in a region registered with KVC_REGION_REFUSE_ROW0 */
#define KVC_E_NEGATIVE 9       /* a byte offset or size is negative */
#define KVC_E_ZERO_SIZE 10     /* a descriptor moves 0 bytes (refused: a caller bug) */
#define KVC_E_SIZE 11          /* size_bytes exceeds the region's row_bytes */
#define KVC_E_OFFSET 12        /* offset + size runs past the end of the row */
#define KVC_E_OVERLAP 13       /* source and destination byte ranges overlap */
#define KVC_E_SHAPE 14         /* caller-side: lists of mismatched length (plan shape) */
#define KVC_E_NO_CUDA 15       /* CUDA support is not built or no device is usable */
#define KVC_E_DEFAULT_STREAM 16 /* the legacy/default CUDA stream was passed */
#define KVC_E_CUDA 17          /* a CUDA call failed (value = the CUDA error code) */
#define KVC_E_NOT_READY 18     /* an event has not completed yet (not an error) */
#define KVC_E_METHOD 19        /* an unknown or unavailable CUDA copy method */
#define KVC_E_PAGEABLE 20      /* the CUDA kernel path was given pageable host memory */
#define KVC_STATUS_COUNT 21

/* Which side of a descriptor an error is about (kvc_error.side). */
#define KVC_SIDE_NONE 0
#define KVC_SIDE_SRC 1
#define KVC_SIDE_DST 2
#define KVC_SIDE_REGION 3

/* Region flags. */
#define KVC_REGION_REFUSE_ROW0 1  /* row 0 is the engine's null GPU block: never copy it */
#define KVC_REGION_DEVICE 2       /* the region is GPU memory (used by the CUDA path only) */

/* kvc_copy flags: the default (0) lets the library choose its fast paths. */
#define KVC_COPY_PLAIN 1          /* one memcpy per descriptor: no coalescing, no streaming */
#define KVC_COPY_STREAM 2         /* force non-temporal stores for every descriptor */
#define KVC_COPY_NO_STREAM 4      /* never use non-temporal stores */

/*
 * A registered memory region: row r starts at base + r * row_stride_bytes and holds
 * row_bytes usable bytes. Strided rows (row_bytes < row_stride_bytes) describe a
 * per-layer view of a packed cross-layer tensor. A region with num_rows == 0 is valid and
 * refuses every row id.
 */
typedef struct kvc_region {
    uint64_t base;
    uint64_t size_bytes;
    uint64_t row_stride_bytes;
    uint64_t row_bytes;
    uint64_t num_rows;
    uint64_t flags;
} kvc_region;

/*
 * One copy: size_bytes from (src_region, src_row, src_offset_bytes) to
 * (dst_region, dst_row, dst_offset_bytes). All fields are signed 64-bit so that a negative
 * id from a buggy caller arrives intact and is refused, and so that a table can be built
 * as an (n, 7) int64 tensor and passed without conversion.
 */
typedef struct kvc_desc {
    int64_t src_region;
    int64_t src_row;
    int64_t src_offset_bytes;
    int64_t dst_region;
    int64_t dst_row;
    int64_t dst_offset_bytes;
    int64_t size_bytes;
} kvc_desc;

/* Where a failure is: the first bad descriptor (or region), the value and its bound. */
typedef struct kvc_error {
    int64_t index;
    int64_t value;
    int64_t bound;
    int32_t side;
    int32_t status;
} kvc_error;

int kvc_abi_version(void);
size_t kvc_sizeof_region(void);
size_t kvc_sizeof_desc(void);
size_t kvc_sizeof_error(void);

/* The one status -> text function; never returns NULL. */
const char *kvc_status_text(int status);

/* Validate regions and descriptors without copying (a dry run for engines). */
int kvc_validate(const kvc_region *regions, uint64_t num_regions,
                 const kvc_desc *descs, uint64_t num_descs, kvc_error *error);

/* Validate everything, then copy; on any error nothing is copied. */
int kvc_copy(const kvc_region *regions, uint64_t num_regions,
             const kvc_desc *descs, uint64_t num_descs, uint64_t flags, kvc_error *error);

/* CFFI-END */

/*
 * Internal to the native libraries (not part of the cffi API): check descriptor `index` of
 * `descs` exactly as kvc_validate does and return its source and destination addresses.
 * The CUDA library uses it so that host and device paths share one validation.
 */
int kvc_resolve(const kvc_region *regions, uint64_t num_regions, const kvc_desc *descs,
                uint64_t index, kvc_error *error, uint64_t *src, uint64_t *dst);

#ifdef __cplusplus
}
#endif

#endif /* KVCORE_COPY_H */
