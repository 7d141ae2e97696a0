"""TransferEngine under a hostile or careless engine: freed pools, bad registrations, bad calls.

Goal: nothing an engine does through the public API makes kvcore read or write memory it
does not own (a signal), copy a byte of a refused job, or change its own state on a refused
call. Method: what could crash runs in a fresh interpreter (``run_child``), so a segfault
is a negative return code and fails the test instead of killing pytest; storage is shrunk,
freed, grown and swapped with torch's own calls; every refused call compares every GPU and
CPU byte and the engine's bookkeeping before and after.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvcore import _native as native
from kvcore._native import Status
from kvcore.spec.errors import KVCopyError, TransferArgumentError
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig
from kvcore.transfer import TransferEngine, TransferResult

BLOCKS, SLOTS = 12, 6

PRELUDE = """
import gc, weakref, torch
from kvcore._native import Status
from kvcore.spec.errors import KVCopyError, TransferArgumentError
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig
from kvcore.transfer import TransferEngine
cfg = OffloadConfig(groups=(GroupSpec(GroupKind.FULL, 4, blocks_per_chunk=2),),
                    hash_block_tokens=4, num_gpu_blocks=12, num_cpu_blocks=6)
STORE = TransferPlan(1, JobKind.STORE, "r", (GroupTransfer((3, 4), 0, (5,)),))
LOAD = TransferPlan(2, JobKind.LOAD, "r", (GroupTransfer((7, 8), 0, (5,)),))
def run(engine, plan):
    engine.submit(plan)
    (result,) = engine.wait([plan.job_id], timeout=60)
    assert engine.poll() == [result]
    return result
def refused(engine, plan):
    try:
        engine.validate(plan)
    except KVCopyError as exc:
        assert exc.code == Status.E_STORAGE and exc.job_id == plan.job_id, exc
        assert "no bytes were copied" in str(exc) and "rebind_gpu_tensors" in str(exc), exc
    else:
        raise AssertionError("validate accepted a job on a changed pool")
    before = engine.cpu_tensor(0, 0).clone()
    result = run(engine, plan)
    assert not result.success and result.bytes == 0, result
    assert "storage" in result.error or "points at" in result.error, result
    assert torch.equal(engine.cpu_tensor(0, 0), before), "a refused job wrote the CPU tier"
    assert engine.in_flight() == []
"""


def run_child(body: str, timeout: float = 120) -> str:
    """Run PRELUDE + body in a fresh interpreter: a crash is a signal there, a failure here."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint('child ok')\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (f"child exited with {proc.returncode} (negative: killed by "
                                  f"signal {-proc.returncode})\n{proc.stdout}{proc.stderr}")
    assert "child ok" in proc.stdout
    return proc.stdout


# -- storage that is not (or no longer) what was registered ------------------------------------

def test_a_storage_smaller_than_its_shape_is_refused_at_registration() -> None:
    run_child("""
        kv = torch.ones((12, 4, 64))
        kv.untyped_storage().resize_(64)  # shape still says 12 x 1 KiB
        try:
            TransferEngine(cfg, [[kv]])
        except TransferArgumentError as exc:
            assert exc.where == "gpu_tensors[0][0]" and exc.bound == 64, exc
            assert exc.value == 12 * 4 * 64 * 4 and "resize_" in str(exc), exc
        else:
            raise AssertionError("registered a tensor whose storage is 64 bytes")
        view = torch.ones((24, 4, 64))[12:]  # a view at an offset: bound is offset + extent
        view.untyped_storage().resize_(13 * 4 * 64 * 4)
        try:
            TransferEngine(cfg, [[view]])
        except TransferArgumentError as exc:
            assert exc.value == 24 * 4 * 64 * 4 and exc.bound == 13 * 4 * 64 * 4, exc
        else:
            raise AssertionError("registered a view past its storage's end")
    """)


def test_a_pool_freed_after_registration_fails_jobs_and_copies_nothing() -> None:
    """``resize_(0)`` (sleep mode) frees the bytes under a registered tensor: stores and
    loads then fail with KVC_E_STORAGE, until the engine rebinds a new pool."""
    run_child("""
        kv = torch.randn((12, 4, 64))
        engine = TransferEngine(cfg, [[kv]])
        assert run(engine, STORE).success
        stored = engine.cpu_tensor(0, 0)[5].clone()
        kv.untyped_storage().resize_(0)
        refused(engine, STORE)
        refused(engine, LOAD)
        assert torch.equal(engine.cpu_tensor(0, 0)[5], stored)
        kv.untyped_storage().resize_(12 * 4 * 64 * 4)  # same size again, new allocation
        if kv.untyped_storage().data_ptr() != engine._groups[0][0].gpu_pool.storage_ptr:
            refused(engine, LOAD)
        fresh = torch.zeros((12, 4, 64))
        engine.rebind_gpu_tensors([[fresh]])
        assert run(engine, LOAD).success  # the CPU tier survived the rebind
        assert torch.equal(fresh[7:9].reshape(-1).view(torch.uint8), stored)
        engine.close()
    """)


def test_a_pool_freed_after_submit_is_caught_before_the_copy() -> None:
    """The worker looks again right before the C call: a pool freed while the job waited in
    the queue (submit saw it intact) fails the job instead of reading freed memory."""
    run_child("""
        import threading
        kv = torch.randn((12, 4, 1 << 16))  # 3 MiB: freed pages really go back to the OS
        engine = TransferEngine(cfg, [[kv]])
        gate, real = threading.Event(), engine._execute
        def held(plan, ready):
            gate.wait(60)
            return real(plan, ready)
        engine._execute = held
        before = engine.cpu_tensor(0, 0).clone()
        engine.submit(STORE)
        kv.untyped_storage().resize_(0)
        gate.set()
        (result,) = engine.wait([1], timeout=60)
        assert not result.success and result.bytes == 0 and "storage" in result.error, result
        assert torch.equal(engine.cpu_tensor(0, 0), before)
        engine.close()
    """)


def test_a_pool_grown_or_swapped_after_registration_fails_jobs() -> None:
    run_child("""
        kv = torch.randn((12, 4, 64))
        engine = TransferEngine(cfg, [[kv]])
        kv.untyped_storage().resize_(1 << 22)  # larger: the bytes moved to a new allocation
        refused(engine, STORE)
        other = torch.randn((12, 4, 64))
        kv2 = torch.randn((12, 4, 64))
        engine2 = TransferEngine(cfg, [[kv2]])
        kv2.set_(other.untyped_storage(), 0, kv2.shape, kv2.stride())  # now elsewhere
        refused(engine2, STORE)
        engine.close()
        engine2.close()
    """)


def test_a_pool_view_moved_inside_its_own_storage_fails_jobs() -> None:
    """Same storage, same size, but the tensor now starts one row later (``set_`` with an
    offset): block ids would address other rows than the registered ones."""
    run_child("""
        whole = torch.randn((13, 4, 64))
        kv = whole[:12]
        engine = TransferEngine(cfg, [[kv]])
        kv.set_(whole.untyped_storage(), 4 * 64, kv.shape, kv.stride())
        refused(engine, STORE)
        before = whole.clone()
        result = run(engine, LOAD)
        assert not result.success and "now points at" in result.error, result
        assert torch.equal(whole, before), "a refused load wrote the GPU pool"
        engine.close()
    """)


def test_dropping_the_engines_reference_frees_nothing_kvcore_copies() -> None:
    """The engine keeps each storage alive: ``del kv`` and a collection later, a store and
    a load still move the right bytes through memory that is still allocated."""
    run_child("""
        def build():
            kv = torch.randn((12, 4, 64))
            return TransferEngine(cfg, [[kv]]), weakref.ref(kv), kv.clone()
        engine, ref, original = build()
        gc.collect()
        kv = ref()
        assert kv is not None, "the registered tensor was freed"
        assert run(engine, STORE).success and run(engine, LOAD).success
        assert torch.equal(kv[7:9], original[3:5]) and torch.equal(kv[:7], original[:7])
        engine.close()
    """)


# -- bad registrations ------------------------------------------------------------------------

def _config(groups: int = 1) -> OffloadConfig:
    return OffloadConfig(groups=tuple(GroupSpec(GroupKind.FULL, 4, blocks_per_chunk=2)
                                      for _ in range(groups)),
                         hash_block_tokens=4, num_gpu_blocks=BLOCKS, num_cpu_blocks=SLOTS)


def _pool() -> torch.Tensor:
    return torch.randn((BLOCKS, 4, 8))


def _packed() -> torch.Tensor:
    return torch.randn((BLOCKS, 3, 8))


SHARED = _pool()
PACKED = _packed()

BAD_REGISTRATIONS: list[tuple[str, Callable[[], Any], str]] = [
    ("same tensor twice", lambda: TransferEngine(_config(), [[SHARED, SHARED]]),
     "gpu_tensors[0][1]"),
    ("same tensor in two groups", lambda: TransferEngine(_config(2), [[SHARED], [SHARED]]),
     "gpu_tensors[1][0]"),
    ("views sharing a layer", lambda: TransferEngine(
        _config(), [[PACKED[:, 0:2], PACKED[:, 1:3]]]), "gpu_tensors[0][1]"),
    ("a row view inside a whole pool", lambda: TransferEngine(
        _config(), [[PACKED, PACKED[:, 1]]]), "gpu_tensors[0]"),
    ("empty group", lambda: TransferEngine(_config(), [[]]), "gpu_tensors[0]"),
    ("tensor instead of a list of lists", lambda: TransferEngine(_config(), _pool()),
     "gpu_tensors"),
    ("None", lambda: TransferEngine(_config(), None), "gpu_tensors"),  # type: ignore[arg-type]
    ("meta tensor", lambda: TransferEngine(_config(), [[torch.empty((BLOCKS, 4),
                                                                    device="meta")]]),
     "gpu_tensors"),
    ("block count", lambda: TransferEngine(_config(), [[_pool()[:BLOCKS - 1]]]),
     "gpu_tensors[0][0]"),
    ("max_queued_jobs=0", lambda: TransferEngine(_config(), [[_pool()]], max_queued_jobs=0),
     "max_queued_jobs"),
    ("max_queued_jobs=True", lambda: TransferEngine(_config(), [[_pool()]],
                                                    max_queued_jobs=True), "max_queued_jobs"),
    ("pin_memory='no'", lambda: TransferEngine(_config(), [[_pool()]],
                                               pin_memory="no"),  # type: ignore[arg-type]
     "pin_memory"),
    ("cuda_method=1", lambda: TransferEngine(_config(), [[_pool()]],
                                             cuda_method=1),  # type: ignore[arg-type]
     "cuda_method"),
]


@pytest.mark.parametrize(("why", "make", "where"), BAD_REGISTRATIONS,
                         ids=[row[0] for row in BAD_REGISTRATIONS])
def test_bad_registrations_are_refused(why: str, make: Callable[[], Any], where: str) -> None:
    with pytest.raises(TransferArgumentError) as info:
        make()
    assert info.value.where.startswith(where), info.value


def test_interleaved_views_and_k_v_halves_are_accepted() -> None:
    """The layouts the disjointness check must not refuse: per-layer views of a packed
    tensor and the two halves of a (2, blocks, ...) FlashAttention-style pool."""
    packed = _packed()
    kv = torch.randn((2, BLOCKS, 4, 8))
    TransferEngine(_config(2), [[packed[:, i] for i in range(3)], [kv[0], kv[1]]]).close()


# -- bad calls ------------------------------------------------------------------------------

def _plan(job: object = 9, kind: object = JobKind.STORE, groups: object = None) -> TransferPlan:
    if groups is None:
        groups = (GroupTransfer((3, 4), 0, (1,)),)
    return TransferPlan(job, kind, "r", groups)  # type: ignore[arg-type]


def _group(ids: object = (3, 4), index: object = 0, slots: object = (1,)) -> tuple[Any, ...]:
    return (GroupTransfer(ids, index, slots),)  # type: ignore[arg-type]


# (why, what is submitted, "raise" or "fail" at submit, the code validate() raises;
#  None: TransferArgumentError)
BAD_CALLS: list[tuple[str, Any, str, int | None]] = [
    ("not a plan", "store 3", "raise", None),
    ("None", None, "raise", None),
    ("str job id", _plan(job="9"), "raise", None),
    ("bool job id", _plan(job=True), "raise", None),
    ("negative job id", _plan(job=-1), "raise", None),
    ("job id beyond int64", _plan(job=1 << 64), "raise", None),
    ("kind as str", _plan(kind="store"), "raise", None),
    ("groups None", TransferPlan(9, JobKind.STORE, "r", None), "raise", None),  # type: ignore[arg-type]
    ("too few groups", _plan(groups=()), "fail", Status.E_SHAPE),
    ("too many groups", _plan(groups=_group() * 2), "fail", Status.E_SHAPE),
    ("group not a GroupTransfer", _plan(groups=(((3, 4), 0, (1,)),)), "fail", None),
    ("ids as a tensor", _plan(groups=_group(ids=torch.tensor([3, 4]))), "fail", None),
    ("ids as a huge range", _plan(groups=_group(ids=range(10**12))), "fail", None),
    ("float id", _plan(groups=_group(ids=(3.0, 4))), "fail", None),
    ("null block", _plan(groups=_group(ids=(0, 4))), "fail", Status.E_NULL_ROW),
    ("id = num_gpu_blocks", _plan(groups=_group(ids=(3, BLOCKS))), "fail", Status.E_ROW_RANGE),
    ("negative id", _plan(groups=_group(ids=(-1, 4))), "fail", Status.E_ROW_RANGE),
    ("slot = capacity", _plan(groups=_group(slots=(SLOTS,))), "fail", Status.E_ROW_RANGE),
    ("negative slot", _plan(groups=_group(slots=(-1,))), "fail", Status.E_ROW_RANGE),
    ("str block_index", _plan(groups=_group(index="0")), "fail", None),
    ("negative block_index", _plan(groups=_group(index=-1)), "fail", Status.E_NEGATIVE),
    ("missing slot", _plan(groups=_group(ids=(3, 4, 5), slots=(1,))), "fail", Status.E_SHAPE),
    ("load writes a block twice", _plan(kind=JobKind.LOAD, groups=_group(ids=(3, 3))),
     "fail", Status.E_DST_OVERLAP),
    ("store writes a chunk twice", _plan(groups=_group(ids=(3, 4, 5, 6), slots=(1, 1))),
     "fail", Status.E_DST_OVERLAP),
]


def _state(engine: TransferEngine) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was: every byte and the bookkeeping."""
    gpu = [[bytes(r.gpu.view(torch.uint8).reshape(-1).tolist()) for r in regs]
           for regs in engine._groups]
    cpu = [[bytes(r.cpu.reshape(-1).tolist()) for r in regs] for regs in engine._groups]
    return (gpu, cpu, engine.in_flight(), engine._regions.regions,
            [[(r.gpu_region, r.cpu_region, r.row_bytes) for r in regs] for regs in engine._groups])


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    with TransferEngine(_config(), [[torch.randn((BLOCKS, 4, 8))]]) as e:
        yield e


@pytest.mark.parametrize(("why", "plan", "mode", "code"), BAD_CALLS,
                         ids=[row[0] for row in BAD_CALLS])
def test_bad_calls_change_nothing(engine: TransferEngine, why: str, plan: Any, mode: str,
                                  code: int | None) -> None:
    before = _state(engine)
    with pytest.raises((KVCopyError, TransferArgumentError)) as info:
        engine.validate(plan)
    if code is None:
        assert isinstance(info.value, TransferArgumentError), info.value
    else:
        assert isinstance(info.value, KVCopyError) and info.value.code == code, info.value
    if mode == "raise":
        with pytest.raises(TransferArgumentError):
            engine.submit(plan)
        assert engine.poll() == []
    else:
        began = time.perf_counter()
        engine.submit(plan)
        (result,) = engine.wait([plan.job_id], timeout=60)
        # The job's own time lies inside the span that enclosed it (a failed result's
        # seconds once counted from the wrong origin: held-out mutation seed 34, m35).
        assert 0 <= result.seconds <= time.perf_counter() - began, result
        assert engine.poll() == [result]
        assert not result.success and result.bytes == 0 and result.error
    assert _state(engine) == before
    assert engine.wait([9], timeout=60) == []  # the engine still works afterwards
    good = _plan(job=10)
    engine.submit(good)
    assert engine.wait([10], timeout=60)[0].success


def test_the_id_limit_admits_exactly_its_bound(engine: TransferEngine,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``MAX_IDS_PER_GROUP`` ids in a group (and as many descriptors in the job) pass;
    one id more is refused by name. Checked at a bound of 4: at the real 2**24 a plan
    costs gigabytes. Kills ``>`` -> ``>=`` on the id count and on the descriptor total
    (held-out mutation seed 34, m31), and a limit that is never checked."""
    from kvcore.transfer import _plans

    monkeypatch.setattr(_plans, "MAX_IDS_PER_GROUP", 4)
    engine.validate(_plan(groups=_group(ids=(3, 4, 5, 6), slots=(1, 2))))
    with pytest.raises(TransferArgumentError) as info:
        engine.validate(_plan(groups=_group(ids=(3, 4, 5, 6, 7, 8), slots=(1, 2, 3))))
    assert info.value.bound == 4 and info.value.value == 6, info.value


def test_the_descriptor_limit_counts_every_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Descriptors are ids x tensors: 4 ids of a group with K and V tensors make 8, over a
    limit of 4 that the ids alone meet. The total is refused by name before any byte
    moves (a check of the id count alone would let a K/V job through at twice the limit).
    """
    from kvcore.transfer import _plans

    monkeypatch.setattr(_plans, "MAX_IDS_PER_GROUP", 4)
    k, v = torch.randn((BLOCKS, 4, 8)), torch.randn((BLOCKS, 4, 8))
    with TransferEngine(_config(), [[k, v]]) as two:
        before = two.cpu_tensor(0, 0).clone(), two.cpu_tensor(0, 1).clone()
        plan = _plan(groups=_group(ids=(3, 4, 5, 6), slots=(1, 2)))
        with pytest.raises(KVCopyError) as info:
            two.validate(plan)
        assert info.value.code == Status.E_LIMIT and info.value.job_id == 9, info.value
        assert "8 descriptors" in str(info.value) and "no bytes were copied" in str(info.value)
        two.submit(plan)
        (result,) = two.wait([plan.job_id], timeout=60)
        assert not result.success and result.bytes == 0, result
        assert torch.equal(two.cpu_tensor(0, 0), before[0])
        assert torch.equal(two.cpu_tensor(0, 1), before[1])


def test_a_job_id_in_flight_is_refused_and_the_first_job_still_runs(
        engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = engine._execute

    def held(plan: TransferPlan, ready: object) -> TransferResult:
        gate.wait(60)
        return real(plan, ready)

    monkeypatch.setattr(engine, "_execute", held)
    engine.submit(_plan(job=5))
    with pytest.raises(TransferArgumentError) as info:
        engine.submit(_plan(job=5))
    assert info.value.job_id == 5 and engine.in_flight() == [5]
    gate.set()
    (result,) = engine.wait([5], timeout=60)
    assert result.success and engine.poll() == [result]


class _HeldGpu:
    """Stands in for CudaCopier on CPU tensors: ``copy`` only queues the table, the copies
    run (in order) when an event after them is waited for, and nothing is done before
    ``gate`` opens: a GPU still busy with the first job."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.queued: list[tuple[Any, Any, int]] = []
        self.marks: dict[int, int] = {}
        self.ran = 0

    def copy(self, regions: Any, table: Any, stream: int, **kw: Any) -> None:
        self.queued.append((regions, table, kw["job_id"]))

    def event_record(self, event: int, stream: int) -> None:
        self.marks[event] = len(self.queued)

    def event_done(self, event: int) -> bool:
        return self.gate.is_set() and self.ran >= self.marks[event]

    def event_synchronize(self, event: int) -> None:
        assert self.gate.wait(60)
        for regions, table, _ in self.queued[self.ran:self.marks[event]]:
            native.copy(regions, table)
        self.ran = max(self.ran, self.marks[event])


def test_cuda_jobs_are_queued_back_to_back_and_finish_in_order(
        engine: TransferEngine) -> None:
    """The worker does not wait on each CUDA job: while the first copy has not run, the
    next two are already enqueued; each finishes only once its event has, in order, with
    its bytes in the tier."""
    gpu = _HeldGpu()
    engine._cuda, engine._stream = gpu, 0  # type: ignore[assignment]
    engine._free_events, engine._events = [101, 102, 103], ()
    engine.submit(_plan(job=1))
    engine.submit(_plan(job=2, groups=_group(ids=(5, 6), slots=(2,))))
    engine.submit(_plan(job=3, groups=_group(ids=(7,), slots=(3,))))
    deadline = time.monotonic() + 20  # generous: enqueueing three jobs takes milliseconds
    while len(gpu.queued) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [job for _, _, job in gpu.queued] == [1, 2, 3] and gpu.ran == 0
    assert engine.in_flight() == [1, 2, 3] and engine.poll() == []
    gpu.gate.set()
    results = engine.wait([1, 2, 3], timeout=60)
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True), (3, True)]
    gpu_rows = engine._groups[0][0].gpu
    for slot, rows in ((1, (3, 4)), (2, (5, 6)), (3, (7,))):
        want = b"".join(bytes(gpu_rows[r].contiguous().view(torch.uint8).flatten().tolist())
                        for r in rows)
        assert engine.read_cpu_chunk(0, 0, slot)[:len(want)] == want
    assert sorted(engine._free_events) == [101, 102, 103]
    engine._cuda = None  # close() must not destroy the stand-in's events


@pytest.mark.parametrize("call", [
    lambda e: e.cpu_tensor(1, 0), lambda e: e.cpu_tensor(0, 1), lambda e: e.cpu_tensor(-1, 0),
    lambda e: e.read_cpu_chunk(0, 0, SLOTS), lambda e: e.read_cpu_chunk(0, 0, True),
    lambda e: e.num_tensors("0"),
    lambda e: e.rebind_gpu_tensors([[torch.randn((BLOCKS, 4, 9))]]),
    lambda e: e.rebind_gpu_tensors([[torch.randn((BLOCKS, 4, 8))], []]),
    lambda e: e.rebind_gpu_tensors([[e.cpu_tensor(0, 0).view(torch.float32).view(BLOCKS, 4,
                                                                                 8)]]),
], ids=["group", "tensor", "negative group", "slot", "bool slot", "str group",
        "rebind row size", "rebind group count", "rebind onto the CPU tier"])
def test_bad_accessor_and_rebind_calls(engine: TransferEngine,
                                       call: Callable[[TransferEngine], Any]) -> None:
    before = _state(engine)
    with pytest.raises(TransferArgumentError):
        call(engine)
    assert _state(engine) == before
