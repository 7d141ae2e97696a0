/*
 * kvcore_copy_cuda.h: the CUDA copy API of kvcore (host <-> device, device <-> device).
 *
 * Same regions, descriptors, status codes and validation as kvcore_copy.h: every descriptor
 * is checked on the host before anything is enqueued, so a bad id never reaches the driver.
 * Copies are enqueued on a caller-created stream (the legacy default stream is refused:
 * the batched copy API rejects it and it would serialise with the engine's compute).
 *
 * A kvc_cuda context holds only what kvc_cuda_open resolved (device, versions, the batched
 * copy entry point); it is never written afterwards, so one context may be used from several
 * threads at once. Per-call scratch memory is allocated per call.
 *
 * The block between CFFI-BEGIN and CFFI-END is read by kvcore/_cuda.py as cffi declarations.
 */
#ifndef KVCORE_COPY_CUDA_H
#define KVCORE_COPY_CUDA_H

#include "kvcore_copy.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CFFI-BEGIN */

#define KVC_CUDA_ABI_VERSION 2

/* Descriptors per driver call (cuMemcpyBatchAsync) and per kernel launch. */
#define KVC_CUDA_MAX_BATCH 4096
#define KVC_CUDA_KERNEL_BATCH 512

/* Copy methods. AUTO = BATCH when the driver offers it, else PER_COPY. */
#define KVC_CUDA_AUTO 0
#define KVC_CUDA_BATCH 1
#define KVC_CUDA_PER_COPY 2
#define KVC_CUDA_KERNEL 3
#define KVC_CUDA_BATCH_V12080 4 /* force the 12.8 (9-argument) ABI, to prove both ABIs work */

typedef struct kvc_cuda kvc_cuda;

typedef struct kvc_cuda_info {
    int32_t device;
    int32_t driver_version;     /* cudaDriverGetVersion, e.g. 13000 */
    int32_t runtime_version;    /* the runtime linked into this library */
    int32_t batch_abi;          /* 0: no batched copy, 12080: 9-arg form, 13000: 8-arg form */
    int32_t unified_addressing;
    int32_t can_use_host_pointer;
    int32_t async_engine_count;
    int32_t multiprocessor_count;
} kvc_cuda_info;

int kvc_cuda_abi_version(void);

/* Number of usable devices; KVC_E_NO_CUDA (value = CUDA error) when there is no driver. */
int kvc_cuda_device_count(int32_t *count, kvc_error *error);

int kvc_cuda_open(int32_t device, kvc_cuda **out, kvc_error *error);
void kvc_cuda_close(kvc_cuda *ctx);
int kvc_cuda_get_info(const kvc_cuda *ctx, kvc_cuda_info *info);

/*
 * Validate all descriptors on the host, then enqueue the copies on `stream` with `method`.
 * The call returns once the copies are enqueued; record an event to learn when they finish.
 * Host memory must be pinned for the copies to be asynchronous (and for KVC_CUDA_KERNEL,
 * which refuses pageable regions). `kernel_ctas` bounds the CTAs of KVC_CUDA_KERNEL (0 = auto).
 */
int kvc_cuda_copy(const kvc_cuda *ctx, const kvc_region *regions, uint64_t num_regions,
                  const kvc_desc *descs, uint64_t num_descs, uint64_t stream, int32_t method,
                  int32_t kernel_ctas, kvc_error *error);

/* Streams and events, as opaque 64-bit handles. */
int kvc_cuda_stream_create(const kvc_cuda *ctx, uint64_t *stream, kvc_error *error);
int kvc_cuda_stream_destroy(const kvc_cuda *ctx, uint64_t stream);
int kvc_cuda_event_create(const kvc_cuda *ctx, uint64_t *event, kvc_error *error);
int kvc_cuda_event_record(const kvc_cuda *ctx, uint64_t event, uint64_t stream,
                          kvc_error *error);
/* KVC_OK when the event completed, KVC_E_NOT_READY while it is pending. */
int kvc_cuda_event_query(const kvc_cuda *ctx, uint64_t event, kvc_error *error);
int kvc_cuda_event_synchronize(const kvc_cuda *ctx, uint64_t event, kvc_error *error);
int kvc_cuda_event_destroy(const kvc_cuda *ctx, uint64_t event);

/* CFFI-END */

#ifdef __cplusplus
}
#endif

#endif /* KVCORE_COPY_CUDA_H */
