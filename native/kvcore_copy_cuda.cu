/*
 * kvcore_copy_cuda.cu: validated KV block copies between pinned host memory and the GPU.
 *
 * Every descriptor is validated on the host by the same code as the C path
 * (kvc_snapshot_take from kvcore_copy.c: the caller's tables are read once into local
 * memory, checked, and overlap between descriptors refused) before anything is enqueued;
 * the driver never sees a bad id, and batch or kernel, which have no order, never see two
 * descriptors racing on one byte. Then contiguous runs of the snapshot are merged and
 * submitted by one of three methods:
 *   - BATCH: cuMemcpyBatchAsync, resolved at run time with cudaGetDriverEntryPointByVersion
 *     and a typedef that matches the version asked for. CUDA 12.8's form has a failIdx
 *     argument that 13.0 dropped; calling one with the other's signature moves the stream
 *     into the wrong register and crashes, so each version gets its own typedef.
 *   - PER_COPY: one cudaMemcpyAsync per run (the fallback when the driver has no batch).
 *   - KERNEL: an SM gather/scatter kernel that receives up to KVC_CUDA_KERNEL_BATCH
 *     (src, dst, size) triples by value, so no staging buffer has to outlive the call.
 * The legacy default stream is refused: the batched API rejects it, and copies on it would
 * serialise with the engine's compute.
 */
#include "kvcore_copy_cuda.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if CUDA_VERSION >= 12080
#define KVC_HAVE_BATCH 1
typedef CUresult (*kvc_batch_v12080_fn)(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                        size_t count, CUmemcpyAttributes *attrs,
                                        size_t *attrs_idxs, size_t num_attrs, size_t *fail_idx,
                                        CUstream stream);
typedef CUresult (*kvc_batch_v13000_fn)(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                        size_t count, CUmemcpyAttributes *attrs,
                                        size_t *attrs_idxs, size_t num_attrs, CUstream stream);
#else
#define KVC_HAVE_BATCH 0
typedef void *kvc_batch_v12080_fn;
typedef void *kvc_batch_v13000_fn;
#endif

struct kvc_cuda {
    kvc_cuda_info info;
    kvc_batch_v12080_fn batch_v12080; /* resolved with version 12080 (9 arguments) */
    kvc_batch_v13000_fn batch_v13000; /* resolved with version 13000 (8 arguments) */
};

/* One merged copy: a run of descriptors contiguous on both sides. */
typedef struct kvc_run {
    uint64_t src;
    uint64_t dst;
    uint64_t size;
    uint64_t first; /* index of the run's first descriptor, for error reports */
} kvc_run;

/* Kernel arguments by value (12 KiB; CUDA >= 12.1 allows 32 KiB of parameters). */
typedef struct kvc_kernel_batch {
    unsigned long long src[KVC_CUDA_KERNEL_BATCH];
    unsigned long long dst[KVC_CUDA_KERNEL_BATCH];
    unsigned long long size[KVC_CUDA_KERNEL_BATCH];
    unsigned int count;
} kvc_kernel_batch;

#define KVC_KERNEL_THREADS 256

static int kvc_cuda_fail(kvc_error *error, int status, uint64_t index, int side, int64_t value,
                         int64_t bound)
{
    if (error != NULL) {
        error->index = (int64_t)index;
        error->value = value;
        error->bound = bound;
        error->side = side;
        error->status = status;
    }
    return status;
}

static int kvc_cuda_error(kvc_error *error, cudaError_t err, uint64_t index)
{
    (void)cudaGetLastError(); /* clear a sticky-free error so the next call starts clean */
    return kvc_cuda_fail(error, KVC_E_CUDA, index, KVC_SIDE_NONE, (int64_t)err, 0);
}

/* Run a call on the context's device and give the caller back its current device. */
static int kvc_enter(const kvc_cuda *ctx, int *previous, kvc_error *error)
{
    cudaError_t err = cudaGetDevice(previous);
    if (err == cudaSuccess && *previous != ctx->info.device) {
        err = cudaSetDevice(ctx->info.device);
    }
    return err == cudaSuccess ? KVC_OK : kvc_cuda_error(error, err, 0);
}

static void kvc_leave(const kvc_cuda *ctx, int previous)
{
    if (previous != ctx->info.device) {
        (void)cudaSetDevice(previous);
    }
}

static int kvc_is_default_stream(uint64_t stream)
{
    return stream == 0 || stream == (uint64_t)(uintptr_t)cudaStreamLegacy
           || stream == (uint64_t)(uintptr_t)cudaStreamPerThread;
}

__global__ void __launch_bounds__(KVC_KERNEL_THREADS)
kvc_copy_kernel(const __grid_constant__ kvc_kernel_batch batch)
{
    for (unsigned int i = blockIdx.x; i < batch.count; i += gridDim.x) {
        const unsigned char *src = (const unsigned char *)batch.src[i];
        unsigned char *dst = (unsigned char *)batch.dst[i];
        unsigned long long n = batch.size[i];
        unsigned long long head = 0;
        if (((batch.src[i] | batch.dst[i]) & 15ull) == 0) {
            const uint4 *s4 = (const uint4 *)src;
            uint4 *d4 = (uint4 *)dst;
            unsigned long long words = n / 16;
            for (unsigned long long k = threadIdx.x; k < words; k += blockDim.x) {
                d4[k] = s4[k];
            }
            head = words * 16;
        }
        for (unsigned long long k = head + threadIdx.x; k < n; k += blockDim.x) {
            dst[k] = src[k];
        }
    }
}

extern "C" int kvc_cuda_abi_version(void) { return KVC_CUDA_ABI_VERSION; }

extern "C" int kvc_cuda_device_count(int32_t *count, kvc_error *error)
{
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    *count = 0;
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return kvc_cuda_fail(error, KVC_E_NO_CUDA, 0, KVC_SIDE_NONE, (int64_t)err, 0);
    }
    *count = n;
    return KVC_OK;
}

/* Resolve cuMemcpyBatchAsync once per context, by the driver version it runs on. */
static void kvc_resolve_batch(kvc_cuda *ctx)
{
#if KVC_HAVE_BATCH
    void *fn = NULL;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (ctx->info.driver_version >= 13000
        && cudaGetDriverEntryPointByVersion("cuMemcpyBatchAsync", &fn, 13000, cudaEnableDefault,
                                            &found) == cudaSuccess
        && found == cudaDriverEntryPointSuccess && fn != NULL) {
        ctx->batch_v13000 = (kvc_batch_v13000_fn)fn;
        ctx->info.batch_abi = 13000;
    }
    fn = NULL;
    found = cudaDriverEntryPointSymbolNotFound;
    if (ctx->info.driver_version >= 12080
        && cudaGetDriverEntryPointByVersion("cuMemcpyBatchAsync", &fn, 12080, cudaEnableDefault,
                                            &found) == cudaSuccess
        && found == cudaDriverEntryPointSuccess && fn != NULL) {
        ctx->batch_v12080 = (kvc_batch_v12080_fn)fn;
        if (ctx->info.batch_abi == 0) {
            ctx->info.batch_abi = 12080;
        }
    }
    (void)cudaGetLastError();
#else
    (void)ctx;
#endif
}

static void kvc_read_attributes(kvc_cuda *ctx)
{
    int device = ctx->info.device;
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrUnifiedAddressing, device) == cudaSuccess) {
        ctx->info.unified_addressing = v;
    }
    if (cudaDeviceGetAttribute(&v, cudaDevAttrCanUseHostPointerForRegisteredMem, device)
        == cudaSuccess) {
        ctx->info.can_use_host_pointer = v;
    }
    if (cudaDeviceGetAttribute(&v, cudaDevAttrAsyncEngineCount, device) == cudaSuccess) {
        ctx->info.async_engine_count = v;
    }
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) {
        ctx->info.multiprocessor_count = v;
    }
    (void)cudaGetLastError();
}

extern "C" int kvc_cuda_open(int32_t device, kvc_cuda **out, kvc_error *error)
{
    *out = NULL;
    int32_t count = 0;
    int status = kvc_cuda_device_count(&count, error);
    if (status != KVC_OK) {
        return status;
    }
    if (device < 0 || device >= count) {
        return kvc_cuda_fail(error, KVC_E_NO_CUDA, 0, KVC_SIDE_NONE, device, count);
    }
    kvc_cuda *ctx = (kvc_cuda *)calloc(1, sizeof(kvc_cuda));
    if (ctx == NULL) {
        return kvc_cuda_fail(error, KVC_E_CUDA, 0, KVC_SIDE_NONE,
                             (int64_t)cudaErrorMemoryAllocation, 0);
    }
    ctx->info.device = device;
    int v = 0;
    if (cudaDriverGetVersion(&v) == cudaSuccess) {
        ctx->info.driver_version = v;
    }
    if (cudaRuntimeGetVersion(&v) == cudaSuccess) {
        ctx->info.runtime_version = v;
    }
    kvc_read_attributes(ctx);
    kvc_resolve_batch(ctx);
    *out = ctx;
    return KVC_OK;
}

extern "C" void kvc_cuda_close(kvc_cuda *ctx) { free(ctx); }

extern "C" int kvc_cuda_get_info(const kvc_cuda *ctx, kvc_cuda_info *info)
{
    if (ctx == NULL || info == NULL) {
        return KVC_E_NULL_ARGUMENT;
    }
    *info = ctx->info;
    return KVC_OK;
}

/*
 * Merge the snapshot's descriptors into runs (same rule as the C path). Only the snapshot is
 * read: it was validated, overlap included, so the runs can be enqueued in any order.
 */
static uint64_t kvc_build_runs(const kvc_snapshot *snap, kvc_run *runs)
{
    uint64_t n = 0;
    for (uint64_t i = 0; i < snap->num_entries; i++) {
        const kvc_entry *e = &snap->entries[i];
        kvc_run *last = n > 0 ? &runs[n - 1] : NULL;
        if (last != NULL && e->src == last->src + last->size
            && e->dst == last->dst + last->size) {
            last->size += e->size;
            continue;
        }
        runs[n].src = e->src;
        runs[n].dst = e->dst;
        runs[n].size = e->size;
        runs[n].first = i;
        n++;
    }
    return n;
}

static int kvc_submit_batch(const kvc_cuda *ctx, const kvc_run *runs, uint64_t num_runs,
                            cudaStream_t stream, int force_v12080, kvc_error *error)
{
#if KVC_HAVE_BATCH
    size_t cap = num_runs < KVC_CUDA_MAX_BATCH ? (size_t)num_runs : KVC_CUDA_MAX_BATCH;
    CUdeviceptr *srcs = (CUdeviceptr *)malloc(cap * sizeof(CUdeviceptr));
    CUdeviceptr *dsts = (CUdeviceptr *)malloc(cap * sizeof(CUdeviceptr));
    size_t *sizes = (size_t *)malloc(cap * sizeof(size_t));
    int status = KVC_OK;
    if (srcs == NULL || dsts == NULL || sizes == NULL) {
        status = kvc_cuda_fail(error, KVC_E_CUDA, 0, KVC_SIDE_NONE,
                               (int64_t)cudaErrorMemoryAllocation, 0);
    }
    CUmemcpyAttributes attr;
    memset(&attr, 0, sizeof(attr));
    attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM; /* never read after return */
    size_t attr_idx = 0; /* numAttrs entries (1), not count entries */
    for (uint64_t start = 0; status == KVC_OK && start < num_runs; start += cap) {
        size_t count = (size_t)(num_runs - start < cap ? num_runs - start : cap);
        for (size_t k = 0; k < count; k++) {
            srcs[k] = (CUdeviceptr)runs[start + k].src;
            dsts[k] = (CUdeviceptr)runs[start + k].dst;
            sizes[k] = (size_t)runs[start + k].size;
        }
        size_t fail = (size_t)-1;
        CUresult r;
        if (ctx->batch_v13000 != NULL && !force_v12080) {
            r = ctx->batch_v13000(dsts, srcs, sizes, count, &attr, &attr_idx, 1,
                                  (CUstream)stream);
        } else {
            r = ctx->batch_v12080(dsts, srcs, sizes, count, &attr, &attr_idx, 1, &fail,
                                  (CUstream)stream);
        }
        if (r != CUDA_SUCCESS) {
            uint64_t at = runs[start + (fail < count ? fail : 0)].first;
            status = kvc_cuda_fail(error, KVC_E_CUDA, at, KVC_SIDE_NONE, (int64_t)r, 0);
        }
    }
    free(srcs);
    free(dsts);
    free(sizes);
    return status;
#else
    (void)ctx; (void)runs; (void)num_runs; (void)stream; (void)force_v12080;
    return kvc_cuda_fail(error, KVC_E_METHOD, 0, KVC_SIDE_NONE, KVC_CUDA_BATCH, 0);
#endif
}

static int kvc_submit_per_copy(const kvc_run *runs, uint64_t num_runs, cudaStream_t stream,
                               kvc_error *error)
{
    for (uint64_t i = 0; i < num_runs; i++) {
        cudaError_t err = cudaMemcpyAsync((void *)(uintptr_t)runs[i].dst,
                                          (const void *)(uintptr_t)runs[i].src,
                                          (size_t)runs[i].size, cudaMemcpyDefault, stream);
        if (err != cudaSuccess) {
            return kvc_cuda_error(error, err, runs[i].first);
        }
    }
    return KVC_OK;
}

/* The kernel reads and writes host memory directly, so every host region must be pinned. */
static int kvc_check_kernel_regions(const kvc_cuda *ctx, const kvc_region *regions,
                                    uint64_t num_regions, kvc_error *error)
{
    for (uint64_t i = 0; i < num_regions; i++) {
        if (regions[i].num_rows == 0) {
            continue;
        }
        cudaPointerAttributes attr;
        cudaError_t err = cudaPointerGetAttributes(&attr, (const void *)(uintptr_t)regions[i].base);
        if (err != cudaSuccess) {
            return kvc_cuda_error(error, err, i);
        }
        int host = attr.type == cudaMemoryTypeHost;
        if (attr.type == cudaMemoryTypeUnregistered
            || (host && (!ctx->info.can_use_host_pointer
                         || attr.devicePointer != (void *)(uintptr_t)regions[i].base))) {
            return kvc_cuda_fail(error, KVC_E_PAGEABLE, i, KVC_SIDE_REGION, (int64_t)attr.type,
                                 (int64_t)cudaMemoryTypeHost);
        }
    }
    return KVC_OK;
}

static int kvc_submit_kernel(const kvc_cuda *ctx, const kvc_run *runs, uint64_t num_runs,
                             cudaStream_t stream, int32_t kernel_ctas, kvc_error *error)
{
    kvc_kernel_batch *batch = (kvc_kernel_batch *)malloc(sizeof(kvc_kernel_batch));
    if (batch == NULL) {
        return kvc_cuda_fail(error, KVC_E_CUDA, 0, KVC_SIDE_NONE,
                             (int64_t)cudaErrorMemoryAllocation, 0);
    }
    int max_ctas = kernel_ctas > 0 ? kernel_ctas : 4 * (ctx->info.multiprocessor_count + 1);
    int status = KVC_OK;
    for (uint64_t start = 0; status == KVC_OK && start < num_runs;
         start += KVC_CUDA_KERNEL_BATCH) {
        uint64_t left = num_runs - start;
        unsigned int count = (unsigned int)(left < KVC_CUDA_KERNEL_BATCH ? left
                                                                         : KVC_CUDA_KERNEL_BATCH);
        for (unsigned int k = 0; k < count; k++) {
            batch->src[k] = runs[start + k].src;
            batch->dst[k] = runs[start + k].dst;
            batch->size[k] = runs[start + k].size;
        }
        batch->count = count;
        unsigned int grid = count < (unsigned int)max_ctas ? count : (unsigned int)max_ctas;
        kvc_copy_kernel<<<grid, KVC_KERNEL_THREADS, 0, stream>>>(*batch);
        cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) {
            status = kvc_cuda_error(error, err, runs[start].first);
        }
    }
    free(batch);
    return status;
}

/* Pick the method: AUTO = BATCH when resolved (and the stream is not capturing). */
static int kvc_choose_method(const kvc_cuda *ctx, int32_t method, cudaStream_t stream,
                             kvc_error *error)
{
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
        (void)cudaGetLastError();
        capture = cudaStreamCaptureStatusNone;
    }
    int has_batch = ctx->batch_v13000 != NULL || ctx->batch_v12080 != NULL;
    int capturing = capture != cudaStreamCaptureStatusNone;
    if (method == KVC_CUDA_AUTO) {
        return has_batch && !capturing ? KVC_CUDA_BATCH : KVC_CUDA_PER_COPY;
    }
    if ((method == KVC_CUDA_BATCH && (!has_batch || capturing))
        || (method == KVC_CUDA_BATCH_V12080 && (ctx->batch_v12080 == NULL || capturing))
        || method < KVC_CUDA_AUTO || method > KVC_CUDA_BATCH_V12080) {
        return -kvc_cuda_fail(error, KVC_E_METHOD, 0, KVC_SIDE_NONE, method,
                              ctx->info.batch_abi);
    }
    return method;
}

/* Choose the method, build the runs and enqueue them; the snapshot is already validated. */
static int kvc_enqueue(const kvc_cuda *ctx, const kvc_snapshot *snap, cudaStream_t s,
                       int32_t method, int32_t kernel_ctas, kvc_error *error)
{
    int chosen = kvc_choose_method(ctx, method, s, error);
    if (chosen < 0) {
        return -chosen;
    }
    if (chosen == KVC_CUDA_KERNEL) {
        int status = kvc_check_kernel_regions(ctx, snap->regions, snap->num_regions, error);
        if (status != KVC_OK) {
            return status;
        }
    }
    kvc_run *runs = (kvc_run *)malloc((size_t)snap->num_entries * sizeof(kvc_run));
    if (runs == NULL) {
        return kvc_cuda_fail(error, KVC_E_NO_MEMORY, 0, KVC_SIDE_NONE,
                             (int64_t)(snap->num_entries * sizeof(kvc_run)), 0);
    }
    uint64_t num_runs = kvc_build_runs(snap, runs);
    int status;
    if (chosen == KVC_CUDA_BATCH || chosen == KVC_CUDA_BATCH_V12080) {
        status = kvc_submit_batch(ctx, runs, num_runs, s, chosen == KVC_CUDA_BATCH_V12080, error);
    } else if (chosen == KVC_CUDA_KERNEL) {
        status = kvc_submit_kernel(ctx, runs, num_runs, s, kernel_ctas, error);
    } else {
        status = kvc_submit_per_copy(runs, num_runs, s, error);
    }
    free(runs);
    return status;
}

extern "C" int kvc_cuda_copy(const kvc_cuda *ctx, const kvc_region *regions,
                             uint64_t num_regions, const kvc_desc *descs, uint64_t num_descs,
                             uint64_t stream, int32_t method, int32_t kernel_ctas,
                             kvc_error *error)
{
    if (ctx == NULL) {
        return kvc_cuda_fail(error, KVC_E_NULL_ARGUMENT, 0, KVC_SIDE_NONE, 0, 0);
    }
    if (kvc_is_default_stream(stream)) {
        return kvc_cuda_fail(error, KVC_E_DEFAULT_STREAM, 0, KVC_SIDE_NONE, (int64_t)stream, 0);
    }
    /* The one read of the caller's tables: validation, overlap and copy all use the snapshot. */
    kvc_snapshot snap;
    int status = kvc_snapshot_take(regions, num_regions, descs, num_descs, &snap, error);
    if (status != KVC_OK || num_descs == 0) {
        kvc_snapshot_release(&snap);
        return status;
    }
    int previous = 0;
    status = kvc_enter(ctx, &previous, error);
    if (status == KVC_OK) {
        status = kvc_enqueue(ctx, &snap, (cudaStream_t)(uintptr_t)stream, method, kernel_ctas,
                             error);
        kvc_leave(ctx, previous);
    }
    kvc_snapshot_release(&snap);
    return status;
}

extern "C" int kvc_cuda_stream_create(const kvc_cuda *ctx, uint64_t *stream, kvc_error *error)
{
    int previous = 0;
    int status = kvc_enter(ctx, &previous, error);
    if (status != KVC_OK) {
        return status;
    }
    cudaStream_t s = NULL;
    cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    kvc_leave(ctx, previous);
    *stream = (uint64_t)(uintptr_t)s;
    return err == cudaSuccess ? KVC_OK : kvc_cuda_error(error, err, 0);
}

extern "C" int kvc_cuda_stream_destroy(const kvc_cuda *ctx, uint64_t stream)
{
    (void)ctx;
    if (kvc_is_default_stream(stream)) {
        return KVC_E_DEFAULT_STREAM;
    }
    return cudaStreamDestroy((cudaStream_t)(uintptr_t)stream) == cudaSuccess ? KVC_OK
                                                                              : KVC_E_CUDA;
}

extern "C" int kvc_cuda_event_create(const kvc_cuda *ctx, uint64_t *event, kvc_error *error)
{
    int previous = 0;
    int status = kvc_enter(ctx, &previous, error);
    if (status != KVC_OK) {
        return status;
    }
    cudaEvent_t e = NULL;
    cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    kvc_leave(ctx, previous);
    *event = (uint64_t)(uintptr_t)e;
    return err == cudaSuccess ? KVC_OK : kvc_cuda_error(error, err, 0);
}

extern "C" int kvc_cuda_event_record(const kvc_cuda *ctx, uint64_t event, uint64_t stream,
                                     kvc_error *error)
{
    if (kvc_is_default_stream(stream)) {
        return kvc_cuda_fail(error, KVC_E_DEFAULT_STREAM, 0, KVC_SIDE_NONE, (int64_t)stream, 0);
    }
    int previous = 0;
    int status = kvc_enter(ctx, &previous, error);
    if (status != KVC_OK) {
        return status;
    }
    cudaError_t err = cudaEventRecord((cudaEvent_t)(uintptr_t)event,
                                      (cudaStream_t)(uintptr_t)stream);
    kvc_leave(ctx, previous);
    return err == cudaSuccess ? KVC_OK : kvc_cuda_error(error, err, 0);
}

extern "C" int kvc_cuda_event_query(const kvc_cuda *ctx, uint64_t event, kvc_error *error)
{
    (void)ctx;
    cudaError_t err = cudaEventQuery((cudaEvent_t)(uintptr_t)event);
    if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return KVC_E_NOT_READY;
    }
    return err == cudaSuccess ? KVC_OK : kvc_cuda_error(error, err, 0);
}

extern "C" int kvc_cuda_event_synchronize(const kvc_cuda *ctx, uint64_t event, kvc_error *error)
{
    (void)ctx;
    cudaError_t err = cudaEventSynchronize((cudaEvent_t)(uintptr_t)event);
    return err == cudaSuccess ? KVC_OK : kvc_cuda_error(error, err, 0);
}

extern "C" int kvc_cuda_event_destroy(const kvc_cuda *ctx, uint64_t event)
{
    (void)ctx;
    return cudaEventDestroy((cudaEvent_t)(uintptr_t)event) == cudaSuccess ? KVC_OK : KVC_E_CUDA;
}
