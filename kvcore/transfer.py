"""TransferEngine: the scheduler's load and store jobs, executed as validated block copies.

The engine registers the inference engine's GPU KV tensors per group and allocates the CPU
tier beside them: for every GPU tensor a CPU tensor of ``num_cpu_blocks`` chunks, each row
``blocks_per_chunk`` GPU rows wide. A job (``kvcore.spec.plans.TransferPlan``) becomes one
descriptor table over those regions, following the sequential mapping of ``spec/plans.py``:
GPU block ``i`` of a group goes to sub-block ``(block_index % bpc + i) % bpc`` of chunk
``cpu_slots[(block_index % bpc + i) // bpc]``. STORE copies GPU -> CPU, LOAD CPU -> GPU.

Checks are paired: the plan is checked in Python, where the error can name the
job, the group and the role of the bad id, and the table again in C before the first byte
moves. Either way a bad job moves zero bytes and is reported as *failed*, never complete.

Jobs run on one background worker thread, in submission order. On the C path the copy
releases the GIL; on the CUDA path the worker enqueues on its own stream, after the
submitter's current stream, and waits on an event. ``wait()`` is how the scheduler's fence
and preemption flushes make sure a source block is no longer read.

Registered memory is owned: every tensor's storage bounds are checked at registration and
its storage is kept alive; its pointer and size are compared with the registered ones at
every submit and right before every copy, so a pool freed or resized by the engine is a
failed job (``KVC_E_STORAGE``), never a read of freed memory. What Python cannot see is a
pool freed *while* C copies it; the engine must ``drain()`` first (docs/native.md).
"""

from __future__ import annotations

import bisect
import math
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from kvcore import _cuda, _native
from kvcore._cuda import cuda_available, cuda_unavailable_reason
from kvcore._native import DescriptorTable, ErrorRecord, Region, RegionTable, Side, Status
from kvcore.manager._capacity import group_capacity
from kvcore.spec.errors import KVCopyError, TransferArgumentError
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan, chunks_spanned
from kvcore.spec.types import OffloadConfig

__all__ = ["TransferEngine", "TransferResult", "cpu_capacity", "cuda_available",
           "cuda_unavailable_reason"]

MAX_QUEUED_JOBS = 4096  # submit() blocks beyond this; the worker always drains the queue
MAX_QUEUED_JOBS_LIMIT = 1 << 20  # the bound on max_queued_jobs itself (memory is per job)
# Ids per group in one job: the C library takes at most 2**24 descriptors per call, and a
# job's table holds ids x tensors of them; the full check is on the table's total.
MAX_IDS_PER_GROUP = 1 << 24
MAX_JOB_ID = (1 << 63) - 1
CPU_BUFFER_ALIGNMENT = 64  # an engine-provided CPU tier buffer starts on a cache line


@dataclass(frozen=True)
class TransferResult:
    """A finished job: success or failure, the payload bytes moved, and how long it took.

    A failed job reports ``bytes == 0`` and ``error`` says why; the scheduler must treat it
    as failed (a failed store removes its keys, a failed load is recomputed). Validation
    failures moved no byte at all; only a CUDA driver error after enqueueing began (its
    message says so) can leave some destination blocks written, which failure covers too.
    """

    job_id: int
    success: bool
    bytes: int
    seconds: float
    error: str | None = None


@dataclass(frozen=True)
class _Pool:
    """One registered tensor's memory as it was at registration, its storage kept alive.

    Holding ``storage`` means the engine dropping its own reference (``del kv``) frees
    nothing kvcore still copies to. Freeing or moving the bytes in place
    (``untyped_storage().resize_()``, ``set_()``) cannot be prevented from Python, so
    ``changed()`` compares the storage's pointer and size, and the tensor's own pointer,
    with what was registered; every submit and every copy asks it first.
    """

    where: str
    tensor: torch.Tensor
    storage: torch.UntypedStorage
    storage_ptr: int
    storage_nbytes: int
    base: int
    row_bytes: int
    stride_bytes: int

    @property
    def rows(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def extent(self) -> int:
        """Bytes from ``base`` to the end of the last row (0 for a tensor without rows)."""
        return (self.rows - 1) * self.stride_bytes + self.row_bytes if self.rows else 0

    def region(self, flags: int) -> Region:
        return Region(base=self.base, size_bytes=self.extent, row_stride_bytes=self.stride_bytes,
                      row_bytes=self.row_bytes, num_rows=self.rows, flags=flags)

    def changed(self) -> str | None:
        """What changed since registration, or None while the memory is the registered one."""
        ptr, nbytes = self.storage.data_ptr(), self.storage.nbytes()
        if ptr != self.storage_ptr or nbytes != self.storage_nbytes:
            return (f"{self.where}'s storage was registered at {self.storage_ptr:#x} with "
                    f"{self.storage_nbytes} bytes and is now at {ptr:#x} with {nbytes} bytes "
                    "(freed or resized, e.g. untyped_storage().resize_())")
        if self.tensor.data_ptr() != self.base:
            return (f"{self.where} now points at {self.tensor.data_ptr():#x}, not the "
                    f"registered {self.base:#x} (set_() or a new storage)")
        return None


@dataclass(frozen=True)
class _Registered:
    """One GPU KV tensor, its CPU-tier twin, and their region indices."""

    gpu: torch.Tensor
    cpu: torch.Tensor
    row_bytes: int
    gpu_region: int
    cpu_region: int
    gpu_pool: _Pool
    cpu_pool: _Pool


def _bad(where: str, message: str, *, value: int | None = None,
         bound: int | None = None) -> TransferArgumentError:
    return TransferArgumentError(where, message, value=value, bound=bound)


def _row_layout(t: object, where: str) -> tuple[int, int]:
    """(row_bytes, row_stride_bytes) of a tensor whose dim 0 is the block id.

    Each row must be one contiguous byte range (any dtype; it is copied as bytes); rows may
    be strided, which covers per-layer views of a packed cross-layer tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise _bad(where, f"must be a torch.Tensor, not {type(t).__name__}")
    if t.layout != torch.strided or t.dim() < 1:
        raise _bad(where, f"must be a strided tensor with a block dimension first (layout "
                          f"{t.layout}, {t.dim()} dims)")
    if t.is_conj() or t.is_neg():
        raise _bad(where, "has a lazy conj/neg bit; pass t.resolve_conj().resolve_neg()")
    if any(s < 0 for s in t.stride()):
        raise _bad(where, f"has negative strides {t.stride()}; pass a tensor with "
                          "non-negative strides", value=min(t.stride()), bound=0)
    expected = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:], strict=True))):
        if size > 1 and stride != expected:
            raise _bad(where, f"rows are not contiguous (shape {tuple(t.shape)}, strides "
                              f"{t.stride()}); each block's bytes must be contiguous, e.g. "
                              "use .contiguous() on the pool", value=stride, bound=expected)
        expected *= size
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    stride_bytes = t.stride(0) * t.element_size()
    if row_bytes == 0:
        raise _bad(where, f"has 0 bytes per block (shape {tuple(t.shape)})", value=0, bound=1)
    if t.shape[0] > 1 and stride_bytes < row_bytes:
        raise _bad(where, f"rows overlap (row stride {stride_bytes} bytes < row {row_bytes} "
                          "bytes)", value=stride_bytes, bound=row_bytes)
    return row_bytes, stride_bytes


def _pool_of(t: object, where: str, device: torch.device) -> _Pool:
    """Check a tensor's layout, device and storage bounds; keep its storage.

    The bound is the one the C library cannot check: every byte a row id can reach,
    ``storage_offset * element_size + extent``, must lie inside the storage's allocation
    (a tensor whose storage was shrunk with ``untyped_storage().resize_()`` keeps its
    shape and would let a valid block id read freed memory).
    """
    row_bytes, stride_bytes = _row_layout(t, where)
    if not isinstance(t, torch.Tensor):  # _row_layout refused everything else already
        raise _bad(where, "must be a torch.Tensor")
    if t.device != device:
        raise _bad(where, f"is on {t.device}, but this engine's tensors are on {device}; "
                          "one TransferEngine serves one device")
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    offset = int(t.storage_offset()) * t.element_size()
    reach = (sum(int(n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) \
        * t.element_size() if t.numel() else 0
    if offset + reach > nbytes:
        raise _bad(where, f"reaches byte {offset + reach} of its storage (offset {offset} + "
                          f"extent {reach}), but the storage holds {nbytes} bytes (shrunk or "
                          "freed, e.g. by untyped_storage().resize_()); register a tensor "
                          "whose storage covers its shape", value=offset + reach, bound=nbytes)
    if t.data_ptr() != storage.data_ptr() + offset:
        raise _bad(where, f"data_ptr {t.data_ptr():#x} is not its storage's "
                          f"{storage.data_ptr():#x} + offset {offset}")
    return _Pool(where, t, storage, storage.data_ptr(), nbytes, t.data_ptr(), row_bytes,
                 stride_bytes)


def _rows_may_meet(a: _Pool, b: _Pool) -> bool:
    """Whether two pools whose byte spans intersect may share a byte.

    Views of one packed tensor interleave (layer k's rows sit between layer k-1's), so spans
    alone say nothing: with one common row stride, rows stay apart exactly when b's rows
    start at least a row of a after a's rows start, modulo the stride, and end before the
    next row of a. Other layouts whose spans meet are refused as not provably disjoint.
    """
    if a.rows > 1 and b.rows > 1 and a.stride_bytes == b.stride_bytes:
        d = (b.base - a.base) % a.stride_bytes
        return d < a.row_bytes or d + b.row_bytes > a.stride_bytes
    return True


def _check_disjoint(pools: Sequence[_Pool]) -> None:
    """No two registered tensors may share a byte: a load into one would change the other.

    One sweep over the spans in address order; only pairs whose spans meet are compared.
    """
    order = sorted((p for p in pools if p.rows), key=lambda p: p.base)
    active: list[_Pool] = []
    for p in order:
        active = [q for q in active if q.base + q.extent > p.base]
        for q in active:
            if _rows_may_meet(q, p):
                raise _bad(p.where, f"shares memory with {q.where} (bytes {p.base:#x}.."
                                    f"{p.base + p.extent:#x} and {q.base:#x}.."
                                    f"{q.base + q.extent:#x}); register each KV tensor once, "
                                    "in one group")
        active.append(p)


def _kv_error(message: str, code: int, *, job_id: int, group: int, index: int | None,
              value: int | None = None, bound: int | None = None) -> KVCopyError:
    return KVCopyError(message, code=code, descriptor_index=index, job_id=job_id, group=group,
                       value=value, bound=bound)


def _check_ints(name: str, values: object, job_id: int) -> tuple[int, ...]:
    """A tuple of plain ints (wrong Python types are argument errors, not copy errors).

    Only tuples and lists, at most ``MAX_IDS_PER_GROUP`` long, checked before they are
    copied: a tensor, a generator or ``range(10**12)`` is refused, not materialised.
    """
    if not isinstance(values, (tuple, list)):
        raise TransferArgumentError(name, f"{short_repr(values)} must be a tuple of ints, not "
                                          f"{type(values).__name__} (use .tolist() on a tensor)",
                                    job_id=job_id)
    if len(values) > MAX_IDS_PER_GROUP:
        raise TransferArgumentError(name, f"holds {len(values)} ids; at most "
                                          f"{MAX_IDS_PER_GROUP} per group and job",
                                    value=len(values), bound=MAX_IDS_PER_GROUP, job_id=job_id)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TransferArgumentError(name, f"holds {short_repr(v)} ({type(v).__name__}); "
                                              "ids must be ints", job_id=job_id)
    return tuple(values)


def short_repr(value: object) -> str:
    """A repr cut to a readable length (messages name the value without flooding a log)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:56] + "...>"


@dataclass(frozen=True)
class _Job:
    """A checked plan turned into one descriptor table (all groups, all tensors)."""

    table: DescriptorTable
    nbytes: int
    offsets: tuple[int, ...]  # first descriptor of each group
    context: str
    roles: tuple[str, str]

    def group_of(self, index: int) -> int:
        return bisect.bisect_right(self.offsets, index) - 1


def _roles(kind: JobKind) -> tuple[tuple[str, str], Side, Side]:
    """(source and destination role names, the GPU side, the CPU side) of a job kind."""
    if kind is JobKind.STORE:
        return ("GPU block", "CPU chunk"), Side.SRC, Side.DST
    return ("CPU chunk", "GPU block"), Side.DST, Side.SRC


@dataclass(frozen=True)
class _GroupIds:
    """One group's ids after the type checks: plain ints, ready for the range checks."""

    ids: tuple[int, ...]
    block_index: int
    slots: tuple[int, ...]


def _normalize_group(plan: TransferPlan, g: int, gt: object) -> _GroupIds:
    """Type checks (TransferArgumentError, a ValueError) for one group's share of a plan."""
    job = plan.job_id
    if not isinstance(gt, GroupTransfer):
        raise TransferArgumentError(f"job {job} plan.groups[{g}]", f"{short_repr(gt)} must be "
                                    "a GroupTransfer", job_id=job)
    ids = _check_ints(f"job {job} group {g} gpu_block_ids", gt.gpu_block_ids, job)
    slots = _check_ints(f"job {job} group {g} cpu_slots", gt.cpu_slots, job)
    (block_index,) = _check_ints(f"job {job} group {g} block_index", (gt.block_index,), job)
    return _GroupIds(ids, block_index, slots)


def _check_group_ranges(plan: TransferPlan, g: int, grp: _GroupIds, bpc: int,
                        num_gpu_blocks: int, num_cpu_blocks: int, first: int,
                        total: int) -> None:
    """B1 in Python, with names: ids in range, null block refused, shape, no double write."""
    roles, gpu_side, cpu_side = _roles(plan.kind)
    ctx = f"{plan.kind.value}, job {plan.job_id}, group {g}"

    def fail(status: int, i: int, value: int, bound: int, side: int) -> KVCopyError:
        rec = ErrorRecord(status, first + i, value, bound, side)
        return _native.make_error(rec, num_descs=total, context=ctx, roles=roles,
                                  job_id=plan.job_id, group=g)

    if grp.block_index < 0:
        raise _kv_error(f"{ctx}: block_index={grp.block_index} is negative; no bytes were "
                        "copied.", Status.E_NEGATIVE, job_id=plan.job_id, group=g,
                        index=first, value=grp.block_index, bound=0)
    expected = chunks_spanned(len(grp.ids), grp.block_index, bpc)
    if len(grp.slots) != expected:
        raise _kv_error(
            f"{ctx}: {len(grp.ids)} GPU blocks from block_index {grp.block_index} with "
            f"blocks_per_chunk={bpc} span {expected} chunks, but {len(grp.slots)} cpu_slots "
            "were given; no bytes were copied.", Status.E_SHAPE, job_id=plan.job_id,
            group=g, index=first, value=len(grp.slots), bound=expected)
    for i, b in enumerate(grp.ids):
        if not 0 < b < num_gpu_blocks:
            status = Status.E_NULL_ROW if b == 0 else Status.E_ROW_RANGE
            raise fail(status, i, b, num_gpu_blocks, gpu_side)
    lead = grp.block_index % bpc
    for c, s in enumerate(grp.slots):
        if not 0 <= s < num_cpu_blocks:
            raise fail(Status.E_ROW_RANGE, max(0, c * bpc - lead), s, num_cpu_blocks, cpu_side)
    written = grp.ids if plan.kind is JobKind.LOAD else grp.slots
    seen: set[int] = set()
    for pos, x in enumerate(written):
        if x in seen:
            i = pos if plan.kind is JobKind.LOAD else max(0, pos * bpc - lead)
            what = "GPU block" if plan.kind is JobKind.LOAD else "CPU chunk"
            raise _kv_error(f"{ctx}: destination {what} {x} is written twice in one job; "
                            "no bytes were copied.", Status.E_DST_OVERLAP, job_id=plan.job_id,
                            group=g, index=first + i, value=x, bound=len(seen))
        seen.add(x)


def _group_table(kind: JobKind, grp: _GroupIds, bpc: int,
                 regs: Sequence[_Registered]) -> torch.Tensor:
    """The (tensors x blocks, 7) descriptor rows of one group, tensor-major (C coalesces)."""
    n, t = len(grp.ids), len(regs)
    i64 = torch.int64
    pos = torch.arange(n, dtype=i64) + grp.block_index % bpc
    cpu_row = torch.tensor(grp.slots, dtype=i64)[pos // bpc].expand(t, n)
    gpu_row = torch.tensor(grp.ids, dtype=i64).expand(t, n)
    row_bytes = torch.tensor([r.row_bytes for r in regs], dtype=i64).unsqueeze(1)
    cpu_off = (pos % bpc).unsqueeze(0) * row_bytes
    gpu_reg = torch.tensor([r.gpu_region for r in regs], dtype=i64).unsqueeze(1).expand(t, n)
    cpu_reg = torch.tensor([r.cpu_region for r in regs], dtype=i64).unsqueeze(1).expand(t, n)
    zero = torch.zeros((t, n), dtype=i64)
    size = row_bytes.expand(t, n)
    if kind is JobKind.STORE:
        cols = [gpu_reg, gpu_row, zero, cpu_reg, cpu_row, cpu_off, size]
    else:
        cols = [cpu_reg, cpu_row, cpu_off, gpu_reg, gpu_row, zero, size]
    return torch.stack(cols, dim=2).reshape(t * n, 7)


def cpu_capacity(config: OffloadConfig, group: int) -> int:
    """CPU chunk rows the tier holds for ``group``: its slot ids are 0..capacity-1.

    Capacities are per group (a slot holds one chunk of one group), so the pinned bytes are
    exactly the sum over groups of capacity x bytes per chunk. The number comes from
    ``kvcore.manager._capacity.group_capacity``, the function ``CPUOffloadManager.for_config``
    sizes its pools with, so the engine and the manager cannot disagree about a pool.
    """
    return group_capacity(config, group)


def _check_options(config: object, gpu_tensors: object, pin_memory: object,
                   cuda_method: object, max_queued_jobs: object) -> None:
    """The constructor's arguments other than the tensors themselves: types and ranges."""
    if not isinstance(config, OffloadConfig):
        raise _bad("config", f"must be an OffloadConfig, not {type(config).__name__}")
    if isinstance(gpu_tensors, torch.Tensor) or not isinstance(gpu_tensors, (list, tuple)):
        raise _bad("gpu_tensors", f"must be a list with one list of tensors per group, not "
                                  f"{type(gpu_tensors).__name__}")
    if len(gpu_tensors) != len(config.groups):
        raise _bad("gpu_tensors", f"has {len(gpu_tensors)} groups but the config has "
                                  f"{len(config.groups)}; pass one list of tensors per group",
                   value=len(gpu_tensors), bound=len(config.groups))
    if not isinstance(cuda_method, str) or cuda_method not in _cuda.METHODS:
        raise _bad("cuda_method", f"{cuda_method!r} is not one of {sorted(_cuda.METHODS)}")
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise _bad("pin_memory", f"{pin_memory!r} must be True, False or None (auto)")
    if isinstance(max_queued_jobs, bool) or not isinstance(max_queued_jobs, int) \
            or not 1 <= max_queued_jobs <= MAX_QUEUED_JOBS_LIMIT:
        raise _bad("max_queued_jobs", f"{max_queued_jobs!r} must be an int in "
                                      f"1..{MAX_QUEUED_JOBS_LIMIT}")


def _check_buffer(buf: object, where: str, nbytes: int, pinned: bool) -> torch.Tensor:
    """An engine-provided CPU tier buffer: exactly the bytes the groups need, nothing else.

    1-D contiguous uint8 on the CPU, its storage covering it, ``CPU_BUFFER_ALIGNMENT``-byte
    aligned, page-locked when the engine copies to a GPU (``pin_memory``), and exactly
    ``nbytes`` long: a larger buffer would be pinned memory no slot can use.
    """
    if not isinstance(buf, torch.Tensor):
        raise _bad(where, f"must be a torch.Tensor, not {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.layout != torch.strided:
        raise _bad(where, f"must be a 1-D uint8 tensor (got {buf.dtype}, shape "
                          f"{tuple(buf.shape)}); pass torch.empty(n, dtype=torch.uint8, "
                          "pin_memory=True)")
    if buf.device.type != "cpu":
        raise _bad(where, f"is on {buf.device}; the CPU tier lives in host memory")
    _pool_of(buf, where, torch.device("cpu"))  # its storage must cover it
    if buf.numel() > 1 and buf.stride(0) != 1:
        raise _bad(where, f"is not contiguous (stride {buf.stride(0)})", value=buf.stride(0),
                   bound=1)
    if buf.numel() != nbytes:
        raise _bad(where, f"holds {buf.numel()} bytes; the CPU tier needs exactly {nbytes} "
                          "(sum over its tensors of capacity x blocks_per_chunk x bytes per "
                          "block)", value=buf.numel(), bound=nbytes)
    if buf.data_ptr() % CPU_BUFFER_ALIGNMENT:
        raise _bad(where, f"starts at {buf.data_ptr():#x}, not a multiple of "
                          f"{CPU_BUFFER_ALIGNMENT} bytes", value=buf.data_ptr() %
                   CPU_BUFFER_ALIGNMENT, bound=0)
    if pinned and not buf.is_pinned():
        raise _bad(where, "is not page-locked; copies to the GPU need pinned memory "
                          "(torch.empty(..., pin_memory=True), or pass pin_memory=False)")
    return buf


class TransferEngine:
    """Moves KV blocks between the engine's GPU tensors and a CPU tier of chunk slots.

    ``gpu_tensors[g]`` lists group ``g``'s tensors: per-layer tensors (dim 0 = block id, any
    dtype, copied as bytes), or one packed cross-layer tensor whose rows hold every layer
    (or per-layer views of it, whose rows are strided). Every tensor needs
    ``shape[0] == config.num_gpu_blocks``. On a machine without a GPU the "GPU" tensors are
    CPU tensors and the C library does the copies; with CUDA tensors the CUDA library does.

    The CPU tier holds, for group ``g``, ``cpu_capacity(config, g)`` chunk slots (slot ids
    are per group: 0..capacity-1) of ``blocks_per_chunk`` blocks of each of its tensors,
    and nothing else: ``pinned_bytes()`` is the sum over groups of capacity x bytes per
    chunk. It is allocated here (pinned when the GPU tensors are on CUDA), or carved from
    ``cpu_buffer``, an engine-provided uint8 tensor of exactly that size (or one per group).

    Lifetime: the engine keeps a reference to every registered storage, so dropping a
    tensor frees nothing it copies. Freeing or resizing a pool in place (sleep mode, cache
    resizing) is detected at every submit and before every copy (a failed job, code
    ``KVC_E_STORAGE``, nothing copied), but not during a copy: wait for in-flight jobs
    (``drain()``) before freeing, then ``rebind_gpu_tensors()`` with the new tensors.

    Thread use: ``submit``/``poll``/``wait``/``drain``/``close`` may be called from any
    thread; one worker thread executes jobs in submission order.
    """

    def __init__(self, config: OffloadConfig, gpu_tensors: Sequence[Sequence[torch.Tensor]],
                 *, pin_memory: bool | None = None, cuda_method: str = "auto",
                 max_queued_jobs: int = MAX_QUEUED_JOBS,
                 cpu_buffer: torch.Tensor | Sequence[torch.Tensor] | None = None) -> None:
        _check_options(config, gpu_tensors, pin_memory, cuda_method, max_queued_jobs)
        self.config = config
        self.device = self._common_device(gpu_tensors)
        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        gpu_pools = self._gpu_pools(gpu_tensors)
        self._buffers = self._cpu_buffers(gpu_pools, cpu_buffer, pin_memory)
        self._groups, regions = self._register(gpu_pools, self._buffers)
        self._regions = RegionTable(regions)
        self._cuda: _cuda.CudaCopier | None = None
        self._method = _cuda.METHODS[cuda_method]
        if self.device.type == "cuda":
            self._open_cuda()
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._done: list[TransferResult] = []
        self._closed = False
        self._queue: queue.Queue[tuple[TransferPlan, object] | None] = queue.Queue(
            maxsize=max_queued_jobs)
        self._thread = threading.Thread(target=self._worker, name="kvcore-transfer",
                                        daemon=True)
        self._thread.start()

    # -- registration --------------------------------------------------------------------

    @staticmethod
    def _common_device(gpu_tensors: Sequence[Sequence[torch.Tensor]]) -> torch.device:
        devices = {t.device for ts in gpu_tensors if isinstance(ts, (list, tuple))
                   for t in ts if isinstance(t, torch.Tensor)}
        if len(devices) > 1:
            raise _bad("gpu_tensors", f"live on several devices {sorted(map(str, devices))}; "
                                      "one TransferEngine serves one device")
        device = next(iter(devices), torch.device("cpu"))
        if device.type not in ("cpu", "cuda"):
            raise _bad("gpu_tensors", f"are on {device}; only cpu and cuda are supported")
        if device.type == "cuda" and not cuda_available():
            raise _bad("gpu_tensors", f"are on {device} but kvcore's CUDA library is "
                                      f"unavailable: {cuda_unavailable_reason()}")
        return device

    def _gpu_pools(self, gpu_tensors: Sequence[Sequence[torch.Tensor]]) -> list[list[_Pool]]:
        """Every GPU tensor checked (layout, device, block count, storage bounds)."""
        cfg = self.config
        out: list[list[_Pool]] = []
        for g, tensors in enumerate(gpu_tensors):
            if not isinstance(tensors, (list, tuple)) or not tensors:
                raise _bad(f"gpu_tensors[{g}]", "must be a non-empty list of tensors (one per "
                                                "layer, or one packed tensor); a group "
                                                "without tensors would store no bytes")
            pools = [_pool_of(t, f"gpu_tensors[{g}][{k}]", self.device)
                     for k, t in enumerate(tensors)]
            for p in pools:
                if p.rows != cfg.num_gpu_blocks:
                    raise _bad(p.where, f"has {p.rows} blocks but num_gpu_blocks="
                                        f"{cfg.num_gpu_blocks}; dim 0 must be the block id",
                               value=p.rows, bound=cfg.num_gpu_blocks)
            out.append(pools)
        _check_disjoint([p for pools in out for p in pools])
        return out

    def _chunk_bytes(self, gpu_pools: list[list[_Pool]], g: int) -> list[int]:
        """Bytes of one CPU chunk of each of group ``g``'s tensors."""
        bpc = self.config.groups[g].blocks_per_chunk
        return [bpc * p.row_bytes for p in gpu_pools[g]]

    def _cpu_buffers(self, gpu_pools: list[list[_Pool]], cpu_buffer: object, pin: bool
                     ) -> list[torch.Tensor]:
        """One flat uint8 buffer per group: carved from the engine's, or allocated here.

        Group g needs ``cpu_capacity(config, g)`` chunks per tensor and nothing more; a
        single engine buffer holds the groups back to back, in group order.
        """
        needs = [cpu_capacity(self.config, g) * sum(self._chunk_bytes(gpu_pools, g))
                 for g in range(len(gpu_pools))]
        if cpu_buffer is None:
            return [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in needs]
        if isinstance(cpu_buffer, torch.Tensor):
            flat = _check_buffer(cpu_buffer, "cpu_buffer", sum(needs), pin)
            starts = [sum(needs[:g]) for g in range(len(needs))]
            return [flat[a:a + n] for a, n in zip(starts, needs, strict=True)]
        if not isinstance(cpu_buffer, (list, tuple)) or len(cpu_buffer) != len(needs):
            raise _bad("cpu_buffer", f"must be one uint8 tensor or a list of {len(needs)} "
                                     "(one per group)")
        return [_check_buffer(b, f"cpu_buffer[{g}]", n, pin)
                for g, (b, n) in enumerate(zip(cpu_buffer, needs, strict=True))]

    def _register(self, gpu_pools: list[list[_Pool]], buffers: list[torch.Tensor]
                  ) -> tuple[list[list[_Registered]], list[Region]]:
        """Carve each GPU tensor's CPU twin out of its group's buffer; lay out the regions."""
        gpu_flags = _native.REGION_REFUSE_ROW0
        if self.device.type == "cuda":
            gpu_flags |= _native.REGION_DEVICE
        groups: list[list[_Registered]] = []
        regions: list[Region] = []
        cpu_pools: list[_Pool] = []
        for g, pools in enumerate(gpu_pools):
            rows, at = cpu_capacity(self.config, g), 0
            regs: list[_Registered] = []
            for k, (p, chunk) in enumerate(zip(pools, self._chunk_bytes(gpu_pools, g),
                                               strict=True)):
                cpu = buffers[g][at:at + rows * chunk].view(rows, chunk)
                at += rows * chunk
                cpu_pool = _pool_of(cpu, f"cpu tier [{g}][{k}]", torch.device("cpu"))
                cpu_pools.append(cpu_pool)
                regions.append(p.region(gpu_flags))
                regions.append(cpu_pool.region(0))
                regs.append(_Registered(p.tensor, cpu, p.row_bytes, len(regions) - 2,
                                        len(regions) - 1, p, cpu_pool))
            groups.append(regs)
        _check_disjoint([p for pools in gpu_pools for p in pools] + cpu_pools)
        return groups, regions

    def rebind_gpu_tensors(self, gpu_tensors: Sequence[Sequence[torch.Tensor]],
                           timeout: float | None = None) -> None:
        """Register the engine's re-allocated GPU pools; the CPU tier and its contents stay.

        For sleep modes and cache resizing: ``drain()``, free the old pools, allocate new
        ones, call this. The new tensors must match the old ones group by group and tensor
        by tensor in bytes per block (the CPU chunks are laid out by it) and in block count.
        Waits (up to ``timeout`` s, TimeoutError) until no job is in flight, then swaps the
        regions atomically: jobs submitted later copy to the new pools. On any error the
        engine is unchanged and keeps the old registration.
        """
        if isinstance(gpu_tensors, torch.Tensor) or not isinstance(gpu_tensors, (list, tuple)) \
                or len(gpu_tensors) != len(self._groups):
            raise _bad("gpu_tensors", f"must be a list of {len(self._groups)} lists of tensors, "
                                      "as registered")
        if self._common_device(gpu_tensors) != self.device:
            raise _bad("gpu_tensors", f"must stay on {self.device}")
        pools = self._gpu_pools(gpu_tensors)
        for g, (new, old) in enumerate(zip(pools, self._groups, strict=True)):
            if len(new) != len(old):
                raise _bad(f"gpu_tensors[{g}]", f"has {len(new)} tensors; {len(old)} are "
                                                "registered", value=len(new), bound=len(old))
            for p, r in zip(new, old, strict=True):
                if p.row_bytes != r.row_bytes:
                    raise _bad(p.where, f"has {p.row_bytes} bytes per block; the registered "
                                        f"tensor has {r.row_bytes} (the CPU tier is laid out "
                                        "by it)", value=p.row_bytes, bound=r.row_bytes)
        _check_disjoint([p for ps in pools for p in ps] + [r.cpu_pool for regs in self._groups
                                                           for r in regs])
        gpu_flags = self._regions.regions[self._groups[0][0].gpu_region].flags
        regions = list(self._regions.regions)
        groups = [[replace(r, gpu=p.tensor, gpu_pool=p) for p, r in zip(ps, regs, strict=True)]
                  for ps, regs in zip(pools, self._groups, strict=True)]
        for regs in groups:
            for r in regs:
                regions[r.gpu_region] = r.gpu_pool.region(gpu_flags)
        table = RegionTable(regions)
        with self._cond:
            if not self._cond.wait_for(lambda: not self._pending, timeout):
                raise TimeoutError(f"jobs {sorted(self._pending)} still running after "
                                   f"{timeout} s; nothing was rebound")
            self._groups, self._regions = groups, table

    def _open_cuda(self) -> None:
        index = self.device.index if self.device.index is not None else \
            torch.cuda.current_device()
        self._cuda = _cuda.CudaCopier(index)
        self._torch_stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        self._stream = int(self._torch_stream.cuda_stream)
        self._event = self._cuda.event_create()

    # -- plans -----------------------------------------------------------------------------

    def _check_plan(self, plan: object) -> TransferPlan:
        """The plan's own types (TransferArgumentError): what submit() refuses to queue."""
        if not isinstance(plan, TransferPlan):
            raise _bad("plan", f"must be a TransferPlan, not {type(plan).__name__}")
        job = plan.job_id
        if isinstance(job, bool) or not isinstance(job, int) or not 0 <= job <= MAX_JOB_ID:
            raise _bad("plan.job_id", f"{short_repr(job)} must be an int in 0..{MAX_JOB_ID}")
        if not isinstance(plan.kind, JobKind):
            raise TransferArgumentError("plan.kind", f"{short_repr(plan.kind)} must be a "
                                        "JobKind (STORE or LOAD)", job_id=job)
        if not isinstance(plan.groups, (tuple, list)):
            raise TransferArgumentError("plan.groups", f"{short_repr(plan.groups)} must be a "
                                        "tuple of GroupTransfer", job_id=job)
        return plan

    def _storage_error(self, plan: TransferPlan, kinds: int = 0) -> KVCopyError | None:
        """The first pool of a group this plan copies whose memory changed, as an error.

        Checked at submit and again on the worker right before the C call: a pool freed or
        resized in between is a failed job with nothing copied. It cannot cover a pool
        freed while the copy runs; that is the engine's side of the contract (drain first).
        """
        for g, gt in enumerate(plan.groups[:len(self._groups)]):
            ids = gt.gpu_block_ids if isinstance(gt, GroupTransfer) else ()
            if not isinstance(ids, (tuple, list)) or not ids:
                continue
            for r in self._groups[g]:
                for pool in (r.gpu_pool, r.cpu_pool):
                    change = pool.changed()
                    if change is not None:
                        return _kv_error(
                            f"{plan.kind.value}, job {plan.job_id}, group {g}: {change}. "
                            "Wait for in-flight jobs (drain()) before freeing a pool and "
                            "register the new one with rebind_gpu_tensors(); no bytes were "
                            "copied.", Status.E_STORAGE, job_id=plan.job_id, group=g,
                            index=None, value=pool.storage.nbytes(), bound=pool.storage_nbytes)
        return None

    def _prepare(self, plan: TransferPlan) -> _Job:
        """Check a plan in Python (naming job, group and role) and build its table."""
        plan = self._check_plan(plan)
        cfg = self.config
        if len(plan.groups) != len(cfg.groups):
            raise _kv_error(
                f"job {plan.job_id} has {len(plan.groups)} group entries but the config has "
                f"{len(cfg.groups)} groups (one GroupTransfer per group, possibly empty); "
                "no bytes were copied.", Status.E_SHAPE, job_id=plan.job_id, group=0,
                index=None, value=len(plan.groups), bound=len(cfg.groups))
        groups = [_normalize_group(plan, g, gt) for g, gt in enumerate(plan.groups)]
        counts = [len(grp.ids) * len(self._groups[g]) for g, grp in enumerate(groups)]
        offsets = [sum(counts[:g]) for g in range(len(counts))]
        total = sum(counts)
        if total > MAX_IDS_PER_GROUP:
            raise _kv_error(f"job {plan.job_id} needs {total} descriptors (ids x tensors); one "
                            f"call takes at most {MAX_IDS_PER_GROUP}: split the job; no bytes "
                            "were copied.", Status.E_LIMIT, job_id=plan.job_id, group=0,
                            index=None, value=total, bound=MAX_IDS_PER_GROUP)
        for g, grp in enumerate(groups):
            _check_group_ranges(plan, g, grp, cfg.groups[g].blocks_per_chunk, cfg.num_gpu_blocks,
                                cpu_capacity(cfg, g), offsets[g], total)
        parts = [_group_table(plan.kind, grp, cfg.groups[g].blocks_per_chunk, self._groups[g])
                 for g, grp in enumerate(groups) if grp.ids]
        table = torch.cat(parts).contiguous() if parts else torch.zeros((0, 7), dtype=torch.int64)
        nbytes = sum(len(grp.ids) * sum(r.row_bytes for r in self._groups[g])
                     for g, grp in enumerate(groups))
        roles, _, _ = _roles(plan.kind)
        return _Job(DescriptorTable.from_address(table.data_ptr(), total, table), nbytes,
                    tuple(offsets), f"{plan.kind.value}, job {plan.job_id}", roles)

    def validate(self, plan: TransferPlan) -> None:
        """Check a plan without moving a byte: KVCopyError (fields set) for the first bad id.

        Runs the Python checks, the storage check and the C validation (the dry-run entry
        point) on the exact table a submit would copy. Wrong Python types raise
        TransferArgumentError (a ValueError).
        """
        job = self._prepare(plan)
        failure = self._storage_error(plan)
        if failure is not None:
            raise failure
        _native.validate(self._regions, job.table, context=job.context, roles=job.roles,
                         job_id=plan.job_id, group_of=job.group_of)

    # -- execution -------------------------------------------------------------------------

    def submit(self, plan: TransferPlan) -> None:
        """Queue a job; its TransferResult arrives through poll(). Never raises for bad ids.

        A plan that fails validation finishes as a failed result with zero bytes moved; so
        does one whose pools were freed or resized (checked here and again before the copy).
        TransferArgumentError for something that is not a well-typed TransferPlan or a job
        id already in flight; RuntimeError after close().
        """
        plan = self._check_plan(plan)
        with self._cond:
            if self._closed:
                raise RuntimeError("TransferEngine is closed")
            if plan.job_id in self._pending:
                raise TransferArgumentError("plan.job_id", f"job {plan.job_id} is already in "
                                            "flight; job ids must be unique among unfinished "
                                            "jobs", job_id=plan.job_id)
            failure = self._storage_error(plan)
            if failure is not None:  # finished at once, never queued
                self._done.append(TransferResult(plan.job_id, False, 0, 0.0, str(failure)))
                self._cond.notify_all()
                return
            self._pending.add(plan.job_id)
        ready: object = None
        if self._cuda is not None:  # the copy must follow work already queued on the GPU
            ready = torch.cuda.current_stream(self.device).record_event()
        self._queue.put((plan, ready))

    def poll(self) -> list[TransferResult]:
        """Finished jobs since the last poll, in completion order (each returned once)."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def in_flight(self) -> list[int]:
        """Job ids submitted and not finished yet, in ascending order."""
        with self._cond:
            return sorted(self._pending)

    def wait(self, job_ids: Iterable[int], timeout: float | None = None
             ) -> list[TransferResult]:
        """Block until the given jobs have finished; return their not-yet-polled results.

        Used by the fence (a store's source block is not reused before the store is done)
        and by preemption/reset flushes. Ids not in flight count as finished. The results
        stay queued for poll(). TimeoutError if ``timeout`` seconds pass first.
        """
        ids = set(job_ids)
        with self._cond:
            if not self._cond.wait_for(lambda: not ids & self._pending, timeout):
                raise TimeoutError(f"jobs {sorted(ids & self._pending)} still running after "
                                   f"{timeout} s")
            return [r for r in self._done if r.job_id in ids]

    def drain(self, timeout: float | None = None) -> list[TransferResult]:
        """Wait for every job in flight (before freeing or resizing a registered pool)."""
        return self.wait(self.in_flight(), timeout)

    def _worker(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                plan, ready = item
                result = self._execute(plan, ready)
                with self._cond:
                    self._pending.discard(plan.job_id)
                    self._done.append(result)
                    self._cond.notify_all()
        finally:  # never leave a waiter hanging, even if the worker dies
            with self._cond:
                for job_id in sorted(self._pending):
                    self._done.append(TransferResult(job_id, False, 0, 0.0,
                                                     "transfer worker stopped"))
                self._pending.clear()
                self._cond.notify_all()

    def _execute(self, plan: TransferPlan, ready: object) -> TransferResult:
        """Run one job; every failure becomes a failed result (zero bytes moved)."""
        start = time.perf_counter()
        try:
            job = self._prepare(plan)
            failure = self._storage_error(plan)  # the last look before C reads the pools
            if failure is not None:
                raise failure
            if self._cuda is None:
                _native.copy(self._regions, job.table, context=job.context, roles=job.roles,
                             job_id=plan.job_id, group_of=job.group_of)
            else:
                self._copy_cuda(job, ready, plan.job_id)
        except Exception as exc:  # KVCopyError, argument errors, CUDA failures: all failures
            text = str(exc) if isinstance(exc, KVCopyError) else f"{type(exc).__name__}: {exc}"
            return TransferResult(plan.job_id, False, 0, time.perf_counter() - start, text)
        return TransferResult(plan.job_id, True, job.nbytes, time.perf_counter() - start)

    def _copy_cuda(self, job: _Job, ready: object, job_id: int) -> None:
        """Enqueue on the engine's stream after ``ready``, then wait on an event."""
        assert self._cuda is not None
        if isinstance(ready, torch.cuda.Event):
            self._torch_stream.wait_event(ready)
        self._cuda.copy(self._regions, job.table, self._stream, method=self._method,
                        context=job.context, roles=job.roles, job_id=job_id,
                        group_of=job.group_of)
        self._cuda.event_record(self._event, self._stream)
        self._cuda.event_synchronize(self._event)

    def close(self) -> None:
        """Finish queued jobs, stop the worker and release CUDA handles. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join()
        if self._cuda is not None:
            self._cuda.event_destroy(self._event)
            self._cuda.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the CPU tier ----------------------------------------------------------------------

    def cpu_tier_bytes(self) -> int:
        """Bytes of the CPU tier (all groups, all tensors); the same as ``pinned_bytes()``."""
        return self.pinned_bytes()

    def pinned_bytes(self, group: int | None = None) -> int:
        """Bytes of the CPU tier of one group, or of all groups (page-locked on CUDA).

        The size of the group's buffer as allocated (or handed in), which is exactly
        ``cpu_capacity(config, g) x blocks_per_chunk x bytes per block`` summed over the
        group's tensors: every byte belongs to a slot of its group.
        """
        if group is None:
            return sum(self.pinned_bytes(g) for g in range(len(self._groups)))
        self._registered(group, 0)
        return int(self._buffers[group].numel())

    def _registered(self, group: object, tensor: object) -> _Registered:
        """The registration of tensor ``tensor`` of ``group``; TransferArgumentError if none."""
        if isinstance(group, bool) or not isinstance(group, int) \
                or not 0 <= group < len(self._groups):
            raise _bad("group", f"{short_repr(group)} is not a group id 0..{len(self._groups) - 1}")
        regs = self._groups[group]
        if isinstance(tensor, bool) or not isinstance(tensor, int) or not 0 <= tensor < len(regs):
            raise _bad("tensor", f"{short_repr(tensor)} is not a tensor index 0..{len(regs) - 1} "
                                 f"of group {group}")
        return regs[tensor]

    def num_tensors(self, group: int) -> int:
        self._registered(group, 0)  # every group has at least one tensor
        return len(self._groups[group])

    def cpu_tensor(self, group: int, tensor: int) -> torch.Tensor:
        """The CPU tier tensor of one registered tensor: (capacity, bpc * row_bytes) uint8."""
        return self._registered(group, tensor).cpu

    def read_cpu_chunk(self, group: int, tensor: int, slot: int) -> bytes:
        """A copy of one CPU chunk's bytes (for tests and the integrity simulator)."""
        cpu = self._registered(group, tensor).cpu
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < cpu.shape[0]:
            raise _bad("slot", f"{short_repr(slot)} is outside 0..{cpu.shape[0] - 1}")
        return bytes(cpu[slot].tolist())
