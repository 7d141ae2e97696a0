"""TransferEngine: the scheduler's load and store jobs, executed as validated block copies.

Jobs run on one background worker thread, in submission order. On the C path the copy
releases the GIL; on the CUDA path the worker enqueues on its own stream, after the
submitter's current stream, records an event and goes on with the next job: up to
``MAX_IN_FLIGHT`` jobs are queued on the stream at once (the GPU copies them back to back
while the worker checks the next plans), and each finishes when its event has.
``wait()`` is how the scheduler's fence and preemption flushes make sure a source block is
no longer read.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import cast

import torch

from kvcore import _cuda, _native
from kvcore._native import RegionTable, Status
from kvcore.spec.errors import CallOrderError, KVCopyError, TransferArgumentError, short_repr
from kvcore.spec.plans import GroupTransfer, TransferPlan
from kvcore.spec.types import OffloadConfig

from . import _setup
from ._memory import _bad, _Registered, check_pools
from ._plans import _Job, _kv_error, check_plan, prepare_plan
from ._results import MAX_IN_FLIGHT, TransferResult, _failed, _Flight
from ._setup import MAX_QUEUED_JOBS, MAX_UNPOLLED_JOBS, _check_options
from ._stream import SimulatedStream


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
    thread; one worker thread executes jobs in submission order (on CUDA, up to
    ``MAX_IN_FLIGHT`` of them queued on its stream at once).

    ``simulate_stream`` (a seed; CPU tensors only) runs the CUDA path's asynchronous flight
    without a GPU: jobs are enqueued on a seeded stand-in stream that copies later, in
    stream order, and each is reported when its event has passed (``SimulatedStream``).
    ``kvcore check`` and the simulator use it so that the event path, and a result
    reported before its bytes land, are checked on every machine; engines leave it None.
    ``simulate_faults`` (a share of jobs, 0..1; needs ``simulate_stream``) makes the stand-in
    fail that share of copies while it runs them, as a device error would, before or after
    their bytes land (``_stream.injected_fault`` says which jobs): each must be reported
    failed with zero bytes, and every other job as before.
    """

    def __init__(self, config: OffloadConfig, gpu_tensors: Sequence[Sequence[torch.Tensor]],
                 *, pin_memory: bool | None = None, cuda_method: str = "auto",
                 max_queued_jobs: int = MAX_QUEUED_JOBS,
                 cpu_buffer: torch.Tensor | Sequence[torch.Tensor] | None = None,
                 simulate_stream: int | None = None, simulate_faults: float = 0.0) -> None:
        gpu_tensors = cast("Sequence[Sequence[torch.Tensor]]", _setup.snapshot(gpu_tensors))
        if not isinstance(cpu_buffer, torch.Tensor):
            cpu_buffer = cast("Sequence[torch.Tensor] | None", _setup.snapshot(cpu_buffer))
        _check_options(config, gpu_tensors, pin_memory, cuda_method, max_queued_jobs,
                       simulate_stream, simulate_faults)
        self.config = config
        self.device = _setup.common_device(gpu_tensors)
        if simulate_stream is not None and self.device.type != "cpu":
            raise _bad("simulate_stream", f"is for CPU tensors; these are on {self.device}, "
                                          "where the real stream runs: pass None")
        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        self._capacities = _setup.tier_capacities(config)
        gpu_pools = _setup.gpu_pools(config, gpu_tensors, self.device)
        self._buffers = _setup.cpu_buffers(config, gpu_pools, self._capacities, cpu_buffer,
                                           pin_memory)
        self._groups, regions = _setup.register(config, self.device, gpu_pools,
                                                self._capacities, self._buffers)
        self._regions = RegionTable(regions)
        self._cuda: _cuda.CudaCopier | SimulatedStream | None = None
        self._method = _cuda.METHODS[cuda_method]
        if self.device.type == "cuda":
            self._open_cuda()
        elif simulate_stream is not None:
            self._open_stream(SimulatedStream(simulate_stream, float(simulate_faults)), 0)
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        # Finished and not yet polled, by job id, in completion order: an id stays taken
        # until poll() hands its result out (two results under one id could not be told
        # apart, and the scheduler would refuse the second report).
        self._done: dict[int, TransferResult] = {}
        self._closed = False
        self._released = False  # the worker stopped and the CUDA handles are freed
        self._queue: _Jobs = queue.Queue(maxsize=max_queued_jobs)
        # The thread holds the engine weakly (see _worker): an engine dropped without
        # close() stops its worker and frees its tier and handles here.
        self._thread = threading.Thread(target=TransferEngine._worker,
                                        args=(weakref.ref(self), self._queue),
                                        name="kvcore-transfer", daemon=True)
        self._finalizer = weakref.finalize(self, _dropped, self._queue, self._cuda,
                                           getattr(self, "_events", ()))
        self._finalizer.atexit = False
        self._thread.start()

    # -- registration --------------------------------------------------------------------
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
        timeout = _timeout("rebind_gpu_tensors", timeout)
        gpu_tensors = cast("Sequence[Sequence[torch.Tensor]]", _setup.snapshot(gpu_tensors))
        if isinstance(gpu_tensors, torch.Tensor) or not isinstance(gpu_tensors, (list, tuple)) \
                or len(gpu_tensors) != len(self._groups):
            raise _bad("gpu_tensors", f"must be a list of {len(self._groups)} lists of tensors, "
                                      "as registered")
        if _setup.common_device(gpu_tensors) != self.device:
            raise _bad("gpu_tensors", f"must stay on {self.device}")
        pools = _setup.gpu_pools(self.config, gpu_tensors, self.device)
        for g, (new, old) in enumerate(zip(pools, self._groups, strict=True)):
            if len(new) != len(old):
                raise _bad(f"gpu_tensors[{g}]", f"has {len(new)} tensors; {len(old)} are "
                                                "registered", value=len(new), bound=len(old))
            for p, r in zip(new, old, strict=True):
                if p.row_bytes != r.row_bytes:
                    raise _bad(p.where, f"has {p.row_bytes} bytes per block; the registered "
                                        f"tensor has {r.row_bytes} (the CPU tier is laid out "
                                        "by it)", value=p.row_bytes, bound=r.row_bytes)
        check_pools([p for ps in pools for p in ps] + [r.cpu_pool for regs in self._groups
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
        copier = _cuda.CudaCopier(index)
        self._torch_stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        self._open_stream(copier, int(self._torch_stream.cuda_stream))

    def _open_stream(self, copier: _cuda.CudaCopier | SimulatedStream, stream: int) -> None:
        """The asynchronous path: jobs enqueued on ``stream``, each retired by its event."""
        self._cuda = copier
        self._stream = stream
        self._free_events = [copier.event_create() for _ in range(MAX_IN_FLIGHT)]
        self._events = tuple(self._free_events)

    # -- plans -----------------------------------------------------------------------------

    def _storage_error(self, plan: TransferPlan) -> KVCopyError | None:
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
        """The plan checked against this engine's registration, as one descriptor table."""
        return prepare_plan(plan, self.config, self._groups, self._capacities)

    def validate(self, plan: TransferPlan) -> None:
        """Check a plan without moving a byte: KVCopyError (fields set) for the first bad id.

        Runs the Python checks, the storage check and the C validation (the dry-run entry
        point) on the exact table a submit would copy. Wrong Python types raise
        TransferArgumentError (a ValueError).
        """
        plan = check_plan(plan)  # the fields read once (a subclass may answer twice)
        job = self._prepare(plan)
        failure = self._storage_error(plan)
        if failure is not None:
            raise failure
        self._c_validate(plan, job)

    def _validate_in_c(self, plan: TransferPlan) -> None:
        """The C validator alone on ``plan``'s table, built without the Python id checks
        (a well-shaped plan only): KVCopyError as a job would fail if those checks missed
        the bad id. For ``kvcore check``, which compares this refusal with the Python one;
        engines call ``validate``."""
        self._c_validate(plan, prepare_plan(plan, self.config, self._groups,
                                            self._capacities, check_ranges=False))

    def _c_validate(self, plan: TransferPlan, job: _Job) -> None:
        _native.validate(self._regions, job.table, context=job.context, roles=job.roles,
                         job_id=plan.job_id, group_of=job.group_of)

    # -- execution -------------------------------------------------------------------------

    def submit(self, plan: TransferPlan) -> None:
        """Queue a job; its TransferResult arrives through poll(). Never raises for bad ids.

        A plan that fails validation finishes as a failed result with zero bytes moved; so
        does one whose pools were freed or resized (checked here and again before the copy).
        TransferArgumentError for something that is not a TransferPlan with a well-typed
        job id, kind and groups container, or for a job id already in flight; a group
        whose id lists are not lists of ints fails its job like a bad id (``validate``
        raises that TransferArgumentError). CallOrderError (a RuntimeError) after close(),
        or when ``MAX_UNPOLLED_JOBS`` jobs await ``poll()`` (nothing is queued then).
        """
        plan = check_plan(plan)
        with self._cond:
            if self._closed:
                raise CallOrderError("TransferEngine.submit", "the engine is closed; build a "
                                     "new one")
            unpolled = len(self._pending) + len(self._done)
            if unpolled >= MAX_UNPOLLED_JOBS:
                raise CallOrderError("TransferEngine.submit", f"{unpolled} jobs were "
                                     "submitted and not handed out by poll() (the limit, "
                                     f"MAX_UNPOLLED_JOBS, is {MAX_UNPOLLED_JOBS}); wait() "
                                     "leaves results for poll(): call poll()")
            if plan.job_id in self._pending or plan.job_id in self._done:
                state = "in flight" if plan.job_id in self._pending else "finished, its " \
                    "result not yet handed out by poll()"
                raise TransferArgumentError("plan.job_id", f"job {plan.job_id} is {state}; "
                                            "job ids must be unique among jobs not yet "
                                            "polled", job_id=plan.job_id)
            failure = self._storage_error(plan)
            if failure is not None:  # finished at once, never queued
                self._done[plan.job_id] = TransferResult(plan.job_id, False, 0, 0.0,
                                                         str(failure))
                self._cond.notify_all()
                return
            self._pending.add(plan.job_id)
        ready: object = None
        if self.device.type == "cuda":  # the copy must follow work already queued on the GPU
            ready = torch.cuda.current_stream(self.device).record_event()
        # The queued job holds its engine: dropped with jobs queued, it lives until the
        # worker has taken them (and runs them, as close() would).
        self._queue.put((plan, ready, self))

    def poll(self) -> list[TransferResult]:
        """Finished jobs since the last poll, in completion order (each returned once)."""
        with self._cond:
            done, self._done = self._done, {}
        return list(done.values())

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
        ids = _job_ids(job_ids)
        timeout = _timeout("wait", timeout)
        with self._cond:
            if not self._cond.wait_for(lambda: not ids & self._pending, timeout):
                raise TimeoutError(f"jobs {sorted(ids & self._pending)} still running after "
                                   f"{timeout} s")
            return [r for r in self._done.values() if r.job_id in ids]

    def drain(self, timeout: float | None = None) -> list[TransferResult]:
        """Wait for every job in flight (before freeing or resizing a registered pool)."""
        return self.wait(self.in_flight(), _timeout("drain", timeout))

    @staticmethod
    def _worker(ref: weakref.ref[TransferEngine], jobs: _Jobs) -> None:
        """The worker thread's loop. It holds its engine only while it has work: a queued
        job holds its engine, and jobs on the stream are held here. Idle, it waits on the
        queue with a weak reference, so an engine dropped without ``close()`` is freed, and
        its finalizer's stop mark ends this thread. While jobs are on the stream it waits
        for the oldest instead of blocking on an empty queue, so a finished copy is
        reported without a new submit."""
        flight: deque[_Flight] = deque()  # started, not reported, in submission order
        engine: TransferEngine | None = None  # set whenever flight is not empty
        try:
            while True:
                while flight:
                    try:
                        item = jobs.get_nowait()
                        break
                    except queue.Empty:
                        cast("TransferEngine", engine)._retire(flight, block=True)
                else:
                    engine = item = None  # idle: nothing of the engine is held while waiting
                    item = jobs.get()
                    engine = ref()
                if item is None or engine is None:
                    break
                flight.append(engine._execute(item[0], item[1]))
                engine._retire(flight, block=len(flight) >= MAX_IN_FLIGHT)
            while flight:
                cast("TransferEngine", engine)._retire(flight, block=True)
        finally:  # never leave a waiter hanging, even if the worker dies
            engine = engine or ref()
            if engine is not None:
                engine._fail_pending()

    def _fail_pending(self) -> None:
        with self._cond:
            for job_id in sorted(self._pending):
                self._done[job_id] = TransferResult(job_id, False, 0, 0.0,
                                                    "transfer worker stopped")
            self._pending.clear()
            self._cond.notify_all()

    def _retire(self, flight: deque[_Flight], block: bool) -> None:
        """Report the finished jobs at the head of ``flight``, in order; with ``block``,
        wait for the oldest first. Events on one stream complete in order."""
        while flight:
            head = flight[0]
            if head.event is not None:
                try:
                    if not block and not self._gpu().event_done(head.event):
                        return
                    self._gpu().event_synchronize(head.event)
                    result = TransferResult(head.job_id, True, head.nbytes,
                                            time.perf_counter() - head.start)
                except Exception as exc:  # a CUDA error after enqueueing: a failed job
                    result = _failed(head.job_id, exc, head.start)
                self._free_events.append(head.event)
            elif head.result is not None:
                result = head.result
            else:  # a _Flight holds an event or a result; never neither
                result = _failed(head.job_id, RuntimeError("no result"), head.start)
            flight.popleft()
            block = False
            with self._cond:
                self._pending.discard(head.job_id)
                self._done[head.job_id] = result
                self._cond.notify_all()

    def _execute(self, plan: TransferPlan, ready: object) -> _Flight:
        """Start one job: copied on CPU, enqueued on CUDA; a failure is a failed result
        (zero bytes moved)."""
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
                event = self._enqueue_cuda(job, ready, plan.job_id)
                return _Flight(plan.job_id, job.nbytes, start, event, None)
        except Exception as exc:  # KVCopyError, argument errors, CUDA failures: all failures
            return _Flight(plan.job_id, 0, start, None, _failed(plan.job_id, exc, start))
        return _Flight(plan.job_id, job.nbytes, start, None, TransferResult(
            plan.job_id, True, job.nbytes, time.perf_counter() - start))

    def _gpu(self) -> _cuda.CudaCopier | SimulatedStream:
        if self._cuda is None:
            raise RuntimeError("this TransferEngine has no CUDA copier")
        return self._cuda

    def _enqueue_cuda(self, job: _Job, ready: object, job_id: int) -> int:
        """Enqueue on the engine's stream after ``ready`` and record a free event (one is
        always free: at most MAX_IN_FLIGHT jobs hold one, and a full flight is retired
        before the next job starts)."""
        gpu = self._gpu()
        if not self._free_events:  # cannot happen (see above); refuse before enqueueing
            raise RuntimeError(f"all {MAX_IN_FLIGHT} CUDA events are in use")
        event = self._free_events.pop()
        try:
            if isinstance(ready, torch.cuda.Event):
                self._torch_stream.wait_event(ready)
            gpu.copy(self._regions, job.table, self._stream, method=self._method,
                     context=job.context, roles=job.roles, job_id=job_id,
                     group_of=job.group_of)
            gpu.event_record(event, self._stream)
        except Exception:
            self._free_events.append(event)
            raise
        return event

    def close(self, timeout: float | None = None) -> None:
        """Finish queued jobs, stop the worker and release CUDA handles. Idempotent.

        ``timeout`` bounds the wait for the worker, as for ``wait``: a worker that has not
        stopped by then (a copy that never finishes) is a TimeoutError instead of a hang.
        The engine is closed either way (no submit is taken), but its CUDA handles are
        kept while the worker may still use them: a later ``close`` waits again and
        releases them once the worker has stopped.
        """
        seconds = _timeout("close", timeout)
        with self._cond:
            if self._released:
                return
            first, self._closed = not self._closed, True
        deadline = None if seconds is None else time.monotonic() + seconds
        if first:
            try:
                self._queue.put(None, timeout=seconds)
            except queue.Full:
                # A full queue behind a stuck worker: the stop mark waits on its own
                # thread, so the worker still stops once the copy ends.
                threading.Thread(target=self._queue.put, args=(None,), daemon=True,
                                 name="kvcore-transfer-stop").start()
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            raise TimeoutError(f"the transfer worker has not stopped after {seconds} s: "
                               f"jobs {self.in_flight()[:8]} still in flight")
        with self._cond:
            if self._released:
                return
            self._released = True
        self._finalizer.detach()  # released here, not again when the engine is freed
        if self._cuda is not None:
            for event in self._events:
                self._cuda.event_destroy(event)
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
        if type(group) is not int \
                or not 0 <= group < len(self._groups):
            raise _bad("group", f"{short_repr(group)} is not a group id 0..{len(self._groups) - 1}")
        regs = self._groups[group]
        if type(tensor) is not int or not 0 <= tensor < len(regs):
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
        """A copy of one CPU chunk's bytes (for tests and the integrity simulator).

        KVCopyError (E_STORAGE) when the tier's memory was freed or resized since it was
        registered, as a job reading it would fail, instead of torch's own error."""
        reg = self._registered(group, tensor)
        cpu = reg.cpu
        change = reg.cpu_pool.changed()
        if change is not None:
            raise KVCopyError(f"read_cpu_chunk({group}, {tensor}): {change}; the tier was "
                              "freed or resized after registration", code=Status.E_STORAGE,
                              group=group, value=reg.cpu_pool.storage.nbytes(),
                              bound=reg.cpu_pool.storage_nbytes)
        if type(slot) is not int:
            raise _bad("slot", f"{short_repr(slot)} is a {type(slot).__name__}, not an int "
                               f"slot in 0..{cpu.shape[0] - 1}")
        if not 0 <= slot < cpu.shape[0]:
            raise _bad("slot", f"{short_repr(slot)} is outside 0..{cpu.shape[0] - 1}")
        return bytes(cpu[slot].tolist())


# A queued job: its plan, the CUDA event it follows, and its engine (kept alive by it).
_Jobs = queue.Queue["tuple[TransferPlan, object, TransferEngine] | None"]


def _dropped(jobs: _Jobs, copier: _cuda.CudaCopier | SimulatedStream | None,
             events: Sequence[object]) -> None:
    """An engine freed without ``close()``: stop its worker and release its handles.

    Runs when nothing holds the engine, so no job is queued (each holds its engine) or
    on the stream (the worker holds the engine then), and the worker uses no handle. Not
    at interpreter exit (``atexit`` off): a live engine's worker may still be copying
    then, and its own ``close()`` may still come."""
    with contextlib.suppress(queue.Full):  # empty by now: a queued job holds its engine
        jobs.put_nowait(None)
    if copier is not None:
        for event in events:
            copier.event_destroy(event)  # type: ignore[arg-type]
        copier.close()


def _timeout(where: str, timeout: object) -> float | None:
    """A wait's limit in seconds: None (no limit) or a number in 0..threading.TIMEOUT_MAX.

    Checked before waiting: ``"5"`` would fail inside the condition variable after the
    lock was taken, a negative limit is a sign mistake that reads as "already timed out",
    NaN never compares, and one beyond TIMEOUT_MAX is an OverflowError deep in the lock.
    ``math.inf`` means no limit.
    """
    if timeout is None:
        return None
    if type(timeout) not in (int, float):
        raise _bad(f"{where}(timeout)", f"{short_repr(timeout)} is a {type(timeout).__name__}; "
                                        "pass seconds as an int or float, or None to wait "
                                        "without a limit")
    # An int past float's range (10**400) is out of range too, not an OverflowError.
    seconds = float(cast(float, timeout)) if type(timeout) is float or \
        abs(cast(int, timeout)) <= threading.TIMEOUT_MAX else -1.0
    if seconds == float("inf"):
        return None
    if not 0 <= seconds <= threading.TIMEOUT_MAX:
        raise _bad(f"{where}(timeout)", f"{short_repr(timeout)} is outside "
                                        f"0..{threading.TIMEOUT_MAX:g} seconds; pass a "
                                        "non-negative limit, or None")
    return seconds


def _job_ids(job_ids: object) -> set[int]:
    """The job ids a wait is for: an iterable of ints (a str, a bare int or None is not).

    A non-int id would never match a job in flight, so the wait would return at once as if
    the job had finished: the fence it stands for would not hold.
    """
    if isinstance(job_ids, str | bytes) or not isinstance(job_ids, Iterable):
        raise _bad("wait(job_ids)", f"{short_repr(job_ids)} is not a list of job ids; pass "
                                    "the plans' job ids, e.g. [plan.job_id]")
    # At most MAX_UNPOLLED_JOBS ids can name unpolled jobs, so more is a mistake, and an
    # endless iterable (itertools.count()) must be refused, not read until memory runs out.
    items = list(itertools.islice(job_ids, MAX_UNPOLLED_JOBS + 1))
    if len(items) > MAX_UNPOLLED_JOBS:
        raise _bad("wait(job_ids)", f"holds more than {MAX_UNPOLLED_JOBS} ids "
                                    "(MAX_UNPOLLED_JOBS: no more jobs can await poll() at "
                                    "once); pass the ids of the jobs to wait for")
    if not set(map(type, items)) <= {int}:
        bad = next(i for i in items if type(i) is not int)
        raise _bad("wait(job_ids)", f"holds {short_repr(bad)}, a {type(bad).__name__}; job "
                                    "ids are ints (plan.job_id)")
    return set(items)
