"""TransferEngine: the scheduler's load and store jobs, executed as validated block copies.

The engine registers the inference engine's GPU KV tensors per group and allocates the CPU
tier beside them: for every GPU tensor a CPU tensor of ``num_cpu_blocks`` chunks, each row
``blocks_per_chunk`` GPU rows wide. A job (``kvcore.spec.plans.TransferPlan``) becomes one
descriptor table over those regions, following the sequential mapping of ``spec/plans.py``:
GPU block ``i`` of a group goes to sub-block ``(block_index % bpc + i) % bpc`` of chunk
``cpu_slots[(block_index % bpc + i) // bpc]``. STORE copies GPU -> CPU, LOAD CPU -> GPU.

Checks are paired (docs/style.md): the plan is checked in Python, where the error can name the
job, the group and the role of the bad id, and the table again in C before the first byte
moves. Either way a bad job moves zero bytes and is reported as *failed*, never complete.

Jobs run on one background worker thread, in submission order. On the C path the copy
releases the GIL; on the CUDA path the worker enqueues on its own stream, after the
submitter's current stream, and waits on an event. ``wait()`` is how the scheduler's fence
and preemption flushes make sure a source block is no longer read.
"""

from __future__ import annotations

import bisect
import math
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvcore import _cuda, _native
from kvcore._cuda import cuda_available, cuda_unavailable_reason
from kvcore._native import DescriptorTable, ErrorRecord, Region, RegionTable, Side, Status
from kvcore.spec.errors import KVCopyError
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan, chunks_spanned
from kvcore.spec.types import OffloadConfig

__all__ = ["TransferEngine", "TransferResult", "cuda_available", "cuda_unavailable_reason"]

MAX_QUEUED_JOBS = 4096  # submit() blocks beyond this; the worker always drains the queue


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
class _Registered:
    """One GPU KV tensor, its CPU-tier twin, and their region indices."""

    gpu: torch.Tensor
    cpu: torch.Tensor
    row_bytes: int
    gpu_region: int
    cpu_region: int


def _row_layout(t: object, where: str) -> tuple[int, int]:
    """(row_bytes, row_stride_bytes) of a tensor whose dim 0 is the block id.

    Each row must be one contiguous byte range (any dtype; it is copied as bytes); rows may
    be strided, which covers per-layer views of a packed cross-layer tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where} must be a torch.Tensor, not {type(t).__name__}")
    if t.layout != torch.strided or t.dim() < 1:
        raise ValueError(f"{where} must be a strided tensor with a block dimension first")
    if t.is_conj() or t.is_neg():
        raise ValueError(f"{where} has a lazy conj/neg bit; pass t.resolve_conj().resolve_neg()")
    expected = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:], strict=True))):
        if size > 1 and stride != expected:
            raise ValueError(f"{where} rows are not contiguous (shape {tuple(t.shape)}, "
                             f"strides {t.stride()}); each block's bytes must be contiguous, "
                             "e.g. use .contiguous() on the pool")
        expected *= size
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    stride_bytes = t.stride(0) * t.element_size()
    if row_bytes == 0:
        raise ValueError(f"{where} has 0 bytes per block (shape {tuple(t.shape)})")
    if t.shape[0] > 1 and stride_bytes < row_bytes:
        raise ValueError(f"{where} rows overlap (row stride {stride_bytes} bytes < row "
                         f"{row_bytes} bytes)")
    return row_bytes, stride_bytes


def _region_of(t: torch.Tensor, row_bytes: int, stride_bytes: int, flags: int) -> Region:
    rows = t.shape[0]
    size = (rows - 1) * stride_bytes + row_bytes if rows else 0
    return Region(base=t.data_ptr(), size_bytes=size, row_stride_bytes=stride_bytes,
                  row_bytes=row_bytes, num_rows=rows, flags=flags)


def _kv_error(message: str, code: int, *, job_id: int, group: int, index: int | None,
              value: int | None = None, bound: int | None = None) -> KVCopyError:
    return KVCopyError(message, code=code, descriptor_index=index, job_id=job_id, group=group,
                       value=value, bound=bound)


def _check_ints(name: str, values: object) -> tuple[int, ...]:
    """A tuple of plain ints, or ValueError (wrong Python types are not copy errors)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name}={values!r} must be a sequence of ints")
    out = tuple(values)
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} holds {v!r} ({type(v).__name__}); ids must be ints")
    return out


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
    """Type checks (ValueError) for one group's share of a plan."""
    if not isinstance(gt, GroupTransfer):
        raise ValueError(f"job {plan.job_id}: groups[{g}]={gt!r} must be a GroupTransfer")
    ids = _check_ints(f"job {plan.job_id} group {g} gpu_block_ids", gt.gpu_block_ids)
    slots = _check_ints(f"job {plan.job_id} group {g} cpu_slots", gt.cpu_slots)
    (block_index,) = _check_ints(f"job {plan.job_id} group {g} block_index", (gt.block_index,))
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
                            "no bytes were copied.", Status.E_OVERLAP, job_id=plan.job_id,
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


class TransferEngine:
    """Moves KV blocks between the engine's GPU tensors and a CPU tier it allocates.

    ``gpu_tensors[g]`` lists group ``g``'s tensors: per-layer tensors (dim 0 = block id, any
    dtype, copied as bytes), or one packed cross-layer tensor whose rows hold every layer
    (or per-layer views of it, whose rows are strided). Every tensor needs
    ``shape[0] == config.num_gpu_blocks``. On a machine without a GPU the "GPU" tensors are
    CPU tensors and the C library does the copies; with CUDA tensors the CUDA library does.

    Thread use: ``submit``/``poll``/``wait``/``close`` may be called from any thread; one
    worker thread executes jobs in submission order.
    """

    def __init__(self, config: OffloadConfig, gpu_tensors: Sequence[Sequence[torch.Tensor]],
                 *, pin_memory: bool | None = None, cuda_method: str = "auto",
                 max_queued_jobs: int = MAX_QUEUED_JOBS) -> None:
        if not isinstance(config, OffloadConfig):
            raise ValueError(f"config must be an OffloadConfig, not {type(config).__name__}")
        if len(gpu_tensors) != len(config.groups):
            raise ValueError(f"gpu_tensors has {len(gpu_tensors)} groups but the config has "
                             f"{len(config.groups)}; pass one list of tensors per group")
        if cuda_method not in _cuda.METHODS:
            raise ValueError(f"cuda_method={cuda_method!r}; choose one of {sorted(_cuda.METHODS)}")
        self.config = config
        self.device = self._common_device(gpu_tensors)
        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        self._groups, regions = self._register(gpu_tensors, pin_memory)
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
        devices = {t.device for ts in gpu_tensors for t in ts if isinstance(t, torch.Tensor)}
        if len(devices) > 1:
            raise ValueError(f"GPU tensors live on several devices {sorted(map(str, devices))}; "
                             "one TransferEngine serves one device")
        device = next(iter(devices), torch.device("cpu"))
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensors on {device} are not supported (cpu or cuda only)")
        if device.type == "cuda" and not cuda_available():
            raise ValueError(f"GPU tensors are on {device} but kvcore's CUDA library is "
                             f"unavailable: {cuda_unavailable_reason()}")
        return device

    def _register(self, gpu_tensors: Sequence[Sequence[torch.Tensor]], pin: bool
                  ) -> tuple[list[list[_Registered]], list[Region]]:
        """Check every GPU tensor, allocate its CPU twin, and lay out the region table."""
        cfg = self.config
        gpu_flags = _native.REGION_REFUSE_ROW0
        if self.device.type == "cuda":
            gpu_flags |= _native.REGION_DEVICE
        groups: list[list[_Registered]] = []
        regions: list[Region] = []
        for g, tensors in enumerate(gpu_tensors):
            if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
                raise ValueError(f"gpu_tensors[{g}] must be a list of tensors (one per layer, "
                                 "or one packed tensor)")
            bpc = cfg.groups[g].blocks_per_chunk
            regs: list[_Registered] = []
            for k, t in enumerate(tensors):
                where = f"gpu_tensors[{g}][{k}]"
                row_bytes, stride = _row_layout(t, where)
                if t.shape[0] != cfg.num_gpu_blocks:
                    raise ValueError(f"{where} has {t.shape[0]} blocks but num_gpu_blocks="
                                     f"{cfg.num_gpu_blocks}; dim 0 must be the block id")
                cpu = torch.empty((cfg.num_cpu_blocks, bpc * row_bytes), dtype=torch.uint8,
                                  pin_memory=pin)
                regions.append(_region_of(t, row_bytes, stride, gpu_flags))
                regions.append(_region_of(cpu, bpc * row_bytes, bpc * row_bytes, 0))
                regs.append(_Registered(t, cpu, row_bytes, len(regions) - 2, len(regions) - 1))
            groups.append(regs)
        return groups, regions

    def _open_cuda(self) -> None:
        index = self.device.index if self.device.index is not None else \
            torch.cuda.current_device()
        self._cuda = _cuda.CudaCopier(index)
        self._torch_stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        self._stream = int(self._torch_stream.cuda_stream)
        self._event = self._cuda.event_create()

    # -- plans -----------------------------------------------------------------------------

    def _prepare(self, plan: TransferPlan) -> _Job:
        """Check a plan in Python (naming job, group and role) and build its table."""
        if not isinstance(plan, TransferPlan) or not isinstance(plan.kind, JobKind):
            raise ValueError(f"expected a TransferPlan with a JobKind, got {plan!r}")
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
        for g, grp in enumerate(groups):
            _check_group_ranges(plan, g, grp, cfg.groups[g].blocks_per_chunk, cfg.num_gpu_blocks,
                                cfg.num_cpu_blocks, offsets[g], total)
        parts = [_group_table(plan.kind, grp, cfg.groups[g].blocks_per_chunk, self._groups[g])
                 for g, grp in enumerate(groups) if grp.ids and self._groups[g]]
        table = torch.cat(parts).contiguous() if parts else torch.zeros((0, 7), dtype=torch.int64)
        nbytes = sum(len(grp.ids) * sum(r.row_bytes for r in self._groups[g])
                     for g, grp in enumerate(groups))
        roles, _, _ = _roles(plan.kind)
        return _Job(DescriptorTable.from_address(table.data_ptr(), total, table), nbytes,
                    tuple(offsets), f"{plan.kind.value}, job {plan.job_id}", roles)

    def validate(self, plan: TransferPlan) -> None:
        """Check a plan without moving a byte: KVCopyError (fields set) for the first bad id.

        Runs the Python checks and the C validation (the dry-run entry point) on the exact
        table a submit would copy. Wrong Python types raise ValueError.
        """
        job = self._prepare(plan)
        _native.validate(self._regions, job.table, context=job.context, roles=job.roles,
                         job_id=plan.job_id, group_of=job.group_of)

    # -- execution -------------------------------------------------------------------------

    def submit(self, plan: TransferPlan) -> None:
        """Queue a job; its TransferResult arrives through poll(). Never raises for bad ids.

        A plan that fails validation finishes as a failed result with zero bytes moved.
        ValueError only for something that is not a TransferPlan or a job id already in
        flight; RuntimeError after close().
        """
        if not isinstance(plan, TransferPlan):
            raise ValueError(f"submit() takes a TransferPlan, not {type(plan).__name__}")
        with self._cond:
            if self._closed:
                raise RuntimeError("TransferEngine is closed")
            if plan.job_id in self._pending:
                raise ValueError(f"job {plan.job_id} is already in flight; job ids must be "
                                 "unique among unfinished jobs")
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
            if self._cuda is None:
                _native.copy(self._regions, job.table, context=job.context, roles=job.roles,
                             job_id=plan.job_id, group_of=job.group_of)
            else:
                self._copy_cuda(job, ready, plan.job_id)
        except Exception as exc:  # KVCopyError, ValueError, CUDA failures: all are failures
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
        """Bytes allocated for the CPU tier (all groups, all tensors)."""
        return sum(r.cpu.numel() for regs in self._groups for r in regs)

    def num_tensors(self, group: int) -> int:
        return len(self._groups[group])

    def cpu_tensor(self, group: int, tensor: int) -> torch.Tensor:
        """The CPU tier tensor of one registered tensor: (num_cpu_blocks, bpc * row_bytes)."""
        return self._groups[group][tensor].cpu

    def read_cpu_chunk(self, group: int, tensor: int, slot: int) -> bytes:
        """A copy of one CPU chunk's bytes (for tests and the integrity simulator)."""
        cpu = self._groups[group][tensor].cpu
        if not 0 <= slot < cpu.shape[0]:
            raise ValueError(f"slot={slot} is outside 0..{cpu.shape[0] - 1}")
        return bytes(cpu[slot].tolist())
