"""TransferEngine against a careless or hostile caller: findings of a review, each a test.

Goal: a refused call raises kvcore's own error and leaves the engine as it was, and no
call can hang, segfault or hand back two results under one id. Each test names what the
code did before its fix (so each fails on that code)."""

from __future__ import annotations

import itertools
import mmap
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvcore.spec.errors import KVCopyError, TransferArgumentError
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig
from kvcore.transfer import TransferEngine
from kvcore.transfer._setup import MAX_UNPOLLED_JOBS

CFG = OffloadConfig((GroupSpec(GroupKind.FULL, 4, 2),), hash_block_tokens=4,
                    num_gpu_blocks=8, num_cpu_blocks=4)


def store(job: int, ids: tuple[int, ...] = (1, 2), slot: int = 0) -> TransferPlan:
    return TransferPlan(job, JobKind.STORE, "r", (GroupTransfer(ids, 0, (slot,)),))


def engine() -> TransferEngine:
    return TransferEngine(CFG, [[torch.arange(128, dtype=torch.uint8).view(8, 16)]])


def test_a_job_id_stays_taken_until_its_result_is_polled() -> None:
    """Before: an id whose result waited for poll() could be submitted again, and poll()
    answered two results for one job, which the scheduler cannot tell apart."""
    e = engine()
    try:
        e.submit(store(5))
        e.wait([5], timeout=30)
        before = e.cpu_tensor(0, 0).clone()
        with pytest.raises(TransferArgumentError, match="not yet handed out by poll"):
            e.submit(store(5, slot=1))
        assert torch.equal(e.cpu_tensor(0, 0), before) and e.in_flight() == []
        assert [r.job_id for r in e.poll()] == [5]
        e.submit(store(5, slot=1))  # polled: the id is free again
        assert [r.job_id for r in e.wait([5], timeout=30)] == [5]
    finally:
        e.close()


def test_a_plan_is_read_once() -> None:
    """Before: a subclass whose job_id answered anew at each read registered one id and
    was reported under another, so drain() never returned; a groups list whose __len__
    disagreed with its items raised a bare IndexError from inside the checks."""
    counter = itertools.count(1)

    class Shifting(TransferPlan):
        @property  # type: ignore[override]
        def job_id(self) -> int:
            return next(counter)

        @job_id.setter
        def job_id(self, value: int) -> None:
            pass

    class LyingLen(list[Any]):
        def __len__(self) -> int:
            return 1

    e = engine()
    try:
        e.submit(Shifting(1, JobKind.STORE, "r", (GroupTransfer((1, 2), 0, (0,)),)))
        e.drain(timeout=30)
        assert e.in_flight() == [] and len(e.poll()) == 1
        good = GroupTransfer((1, 2), 0, (0,))
        with pytest.raises((TransferArgumentError, KVCopyError)):
            e.validate(TransferPlan(2, JobKind.STORE, "r", LyingLen([good, good])))
    finally:
        e.close()


def test_wait_refuses_an_endless_list_of_ids() -> None:
    """Before: wait(itertools.count()) read ids until memory ran out, whatever the
    timeout; ``range(10**10)`` was a bare MemoryError."""
    def endless() -> Iterator[int]:
        for i in itertools.count():
            assert i <= MAX_UNPOLLED_JOBS + 1, "wait() read past the most ids it can need"
            yield i

    e = engine()
    try:
        for ids in (endless(), range(MAX_UNPOLLED_JOBS + 5)):
            with pytest.raises(TransferArgumentError, match="MAX_UNPOLLED_JOBS"):
                e.wait(ids, timeout=0.1)
        assert e.wait(range(MAX_UNPOLLED_JOBS), timeout=0.1) == []  # at the limit: fine
    finally:
        e.close()


def test_read_only_memory_is_refused_at_registration() -> None:
    """Before: a tensor over a read-only mapping passed every check, and the first load
    into it killed the process (SIGSEGV in the copy)."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("the system does not list its mappings")
    mm = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable
        pool = torch.frombuffer(mm, dtype=torch.uint8)[:128].view(8, 16)
    with pytest.raises(TransferArgumentError, match="not writable"):
        TransferEngine(CFG, [[pool]])
    TransferEngine(CFG, [[pool.clone()]]).close()  # the same layout, writable: accepted


def test_reading_a_freed_tier_is_a_storage_error() -> None:
    """Before: read_cpu_chunk after the tier's storage was freed raised torch's own
    RuntimeError."""
    e = engine()
    try:
        e.cpu_tensor(0, 0).untyped_storage().resize_(0)
        with pytest.raises(KVCopyError, match="freed or resized") as info:
            e.read_cpu_chunk(0, 0, 0)
        assert info.value.group == 0
    finally:
        e.close()


def test_an_engine_dropped_without_close_is_freed() -> None:
    """Before: the worker thread's target was the engine's bound method, so an engine
    dropped without close() lived (with its CPU tier, pinned on CUDA, and its thread)
    until the process ended: one tier leaked per rebuild. Now the thread holds it weakly
    while idle and a finalizer stops it. An engine with jobs done but unpolled, and one
    on the stand-in stream (events to release), are freed alike."""
    import gc
    import weakref

    refs, threads = [], []
    for i in range(6):
        e = TransferEngine(CFG, [[torch.zeros(8, 16, dtype=torch.uint8)]],
                           simulate_stream=i if i % 2 else None)
        e.submit(store(1))
        e.wait([1], timeout=30)
        refs.append(weakref.ref(e))
        threads.append(e._thread)
        del e
    gc.collect()
    assert [r() for r in refs] == [None] * 6
    for thread in threads:  # each stops once it takes its finalizer's stop mark
        thread.join(timeout=60)  # a hang guard, not a time budget
    assert not any(t.is_alive() for t in threads)


def test_an_engine_dropped_with_jobs_queued_runs_them_first() -> None:
    """The engine stays alive while a job it queued is waiting for the worker (each job
    holds its engine): dropped right after submit, its loads still land. The first
    version of the weak worker dropped them (the worker found the engine gone)."""
    import gc

    gpu = torch.zeros(8, 16, dtype=torch.uint8)
    tier = torch.arange(4 * 32, dtype=torch.uint8) % 251
    e = TransferEngine(CFG, [[gpu]], cpu_buffer=tier, simulate_stream=3)
    thread = e._thread
    for job, slot, ids in ((1, 0, (1, 2)), (2, 1, (3, 4))):
        e.submit(TransferPlan(job, JobKind.LOAD, "r", (GroupTransfer(ids, 0, (slot,)),)))
    del e
    gc.collect()
    thread.join(timeout=60)  # a hang guard, not a time budget
    assert not thread.is_alive()
    assert torch.equal(gpu[1:5].reshape(-1), tier[:64])


def test_an_engine_closed_at_exit_is_released_once() -> None:
    """An engine still alive at interpreter exit is the engine's to close (an atexit
    handler, a ``with`` block unwinding): its finalizer must not release the stream's
    events first. It did (``weakref.finalize`` runs at exit by default), and the
    handler's ``close()`` then destroyed events already destroyed (StreamMisuse here, a
    second cudaEventDestroy on CUDA)."""
    import subprocess
    import sys

    code = (
        "import atexit, sys\n"
        "holder = []\n"
        "def close_at_exit():\n"
        "    holder[0].close(timeout=30)\n"
        "    print('closed at exit', flush=True)\n"
        "atexit.register(close_at_exit)\n"
        "import torch\n"
        "from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan\n"
        "from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig\n"
        "from kvcore.transfer import TransferEngine\n"
        "cfg = OffloadConfig((GroupSpec(GroupKind.FULL, 4, 2),), hash_block_tokens=4,\n"
        "                    num_gpu_blocks=8, num_cpu_blocks=4)\n"
        "e = TransferEngine(cfg, [[torch.zeros(8, 16, dtype=torch.uint8)]],\n"
        "                   simulate_stream=3)\n"
        "e.submit(TransferPlan(1, JobKind.STORE, 'r', (GroupTransfer((1, 2), 0, (0,)),)))\n"
        "e.wait([1], timeout=30)\n"
        "holder.append(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and "closed at exit" in proc.stdout, proc.stderr[-2000:]
    assert "StreamMisuse" not in proc.stderr, proc.stderr[-2000:]


def test_tensor_lists_are_read_once() -> None:
    """Before: a list subclass whose __len__ disagreed with its items passed the group
    count check and failed later with a bare IndexError (constructor) or ValueError
    (rebind_gpu_tensors)."""

    class LyingLen(list[Any]):
        def __len__(self) -> int:
            return 1

    g, g2 = (torch.zeros(8, 16, dtype=torch.uint8) for _ in range(2))
    with pytest.raises(TransferArgumentError, match="has 2 groups"):
        TransferEngine(CFG, LyingLen([[g], [g2]]))
    e = TransferEngine(CFG, [[g]])
    try:
        with pytest.raises(TransferArgumentError, match="gpu_tensors"):
            e.rebind_gpu_tensors(LyingLen([[g2], [torch.zeros(8, 16, dtype=torch.uint8)]]))
        e.rebind_gpu_tensors(LyingLen([[g2]]))  # one group, as registered: accepted
    finally:
        e.close()
