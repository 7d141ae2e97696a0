"""TransferEngine on CPU tensors: round trips, hostile plans, registration, the async API.

Goal: a store then a load leaves exactly the source bytes in the destination blocks, changes
no other byte and never changes the source; a plan with any bad id fails as a whole (a
failed result, zero bytes moved, never a success) and ``validate`` names it. Method: a
reference model applies ``spec/plans.py``'s sequential sub-block mapping to byte snapshots
of every GPU row and every CPU chunk; each executed job must leave the engine's memory
equal to the model's. Hypothesis generates valid jobs and hostile mutations of them.
"""

from __future__ import annotations

import ctypes
import math
import re
from collections.abc import Iterator

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from kvcore._native import Status
from kvcore.spec.errors import KVCopyError, TransferArgumentError
from kvcore.spec.plans import (
    GroupTransfer,
    JobKind,
    TransferPlan,
    chunks_spanned,
    sub_block_position,
)
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig
from kvcore.transfer import TransferEngine, TransferResult

NUM_GPU_BLOCKS = 12
NUM_CPU_BLOCKS = 6
DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.int16)


def make_config(bpcs: tuple[int, ...]) -> OffloadConfig:
    groups = tuple(GroupSpec(GroupKind.FULL, tokens_per_block=4, blocks_per_chunk=b)
                   for b in bpcs)
    return OffloadConfig(groups=groups, hash_block_tokens=4, num_gpu_blocks=NUM_GPU_BLOCKS,
                         num_cpu_blocks=NUM_CPU_BLOCKS)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (never zeros, so a missed copy shows)."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def rows_of(t: torch.Tensor) -> list[bytes]:
    """Each dim-0 row's bytes (rows may be strided; each row is contiguous)."""
    es = t.element_size()
    row = math.prod(t.shape[1:]) * es
    return [ctypes.string_at(t.data_ptr() + i * t.stride(0) * es, row) for i in range(t.shape[0])]


class Model:
    """Byte snapshots of every GPU row and CPU chunk, and the reference effect of a job."""

    def __init__(self, engine: TransferEngine, tensors: list[list[torch.Tensor]]) -> None:
        self.engine = engine
        self.tensors = tensors

    def snapshot(self) -> list[list[tuple[list[bytes], list[bytes]]]]:
        return [[(rows_of(t), rows_of(self.engine.cpu_tensor(g, k)))
                 for k, t in enumerate(ts)] for g, ts in enumerate(self.tensors)]

    def apply(self, plan: TransferPlan, snap: list[list[tuple[list[bytes], list[bytes]]]]
              ) -> list[list[tuple[list[bytes], list[bytes]]]]:
        out = [[(list(gpu), list(cpu)) for gpu, cpu in grp] for grp in snap]
        for g, gt in enumerate(plan.groups):
            bpc = self.engine.config.groups[g].blocks_per_chunk
            for gpu, cpu in out[g]:
                rb = len(gpu[0])
                for i, block in enumerate(gt.gpu_block_ids):
                    c, j = sub_block_position(i, gt.block_index, bpc)
                    slot = gt.cpu_slots[c]
                    chunk = bytearray(cpu[slot])
                    if plan.kind is JobKind.STORE:
                        chunk[j * rb:(j + 1) * rb] = gpu[block]
                        cpu[slot] = bytes(chunk)
                    else:
                        gpu[block] = bytes(chunk[j * rb:(j + 1) * rb])
        return out


def run_job(engine: TransferEngine, plan: TransferPlan) -> TransferResult:
    engine.submit(plan)
    (result,) = engine.wait([plan.job_id])
    assert engine.poll() == [result]
    return result


def make_engine(bpcs: tuple[int, ...], layers: int = 2, seed: int = 0,
                packed: bool = False) -> tuple[TransferEngine, list[list[torch.Tensor]]]:
    """Per group: ``layers`` per-layer tensors of mixed dtypes, or one packed tensor."""
    tensors: list[list[torch.Tensor]] = []
    for g in range(len(bpcs)):
        if packed:
            pool = random_tensor((NUM_GPU_BLOCKS, layers, 2, 4, 3), torch.float16, seed + g)
            tensors.append([pool])
        else:
            tensors.append([random_tensor((NUM_GPU_BLOCKS, 4, 2 + k), DTYPES[(g + k) % 5],
                                          seed + 10 * g + k) for k in range(layers)])
    return TransferEngine(make_config(bpcs), tensors), tensors


# -- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("bpc", [1, 2, 3, 4])
@pytest.mark.parametrize("load_start", [0, 1, 2])
def test_store_then_load_round_trip(bpc: int, load_start: int) -> None:
    """Store 2 chunks' worth of blocks, then load them (from mid-chunk) into other ids."""
    engine, tensors = make_engine((bpc, 1), layers=3)
    model = Model(engine, tensors)
    n = 2 * bpc
    stored = tuple(range(1, n + 1))
    slots = (4, 1)
    store = TransferPlan(1, JobKind.STORE, "r", (GroupTransfer(stored, 0, slots),
                                                 GroupTransfer()))
    before = model.snapshot()
    assert run_job(engine, store).success
    assert model.snapshot() == model.apply(store, before)
    start = min(load_start, n - 1)
    targets = tuple(range(NUM_GPU_BLOCKS - 1, NUM_GPU_BLOCKS - 1 - (n - start), -1))
    load = TransferPlan(2, JobKind.LOAD, "r", (
        GroupTransfer(targets, start, slots[start // bpc:]), GroupTransfer()))
    mid = model.snapshot()
    result = run_job(engine, load)
    assert result.success and result.bytes == len(targets) * sum(
        len(rows_of(t)[0]) for t in tensors[0])
    after = model.snapshot()
    assert after == model.apply(load, mid)
    for k, _t in enumerate(tensors[0]):  # the loaded blocks hold the stored source bytes
        rows = after[0][k][0]
        for i, target in enumerate(targets):
            assert rows[target] == before[0][k][0][stored[start + i]]
    engine.close()


@pytest.mark.parametrize("packed", [False, True])
def test_several_groups_and_empty_groups(packed: bool) -> None:
    engine, tensors = make_engine((2, 1, 3), layers=2, packed=packed)
    model = Model(engine, tensors)
    plan = TransferPlan(7, JobKind.STORE, "r", (
        GroupTransfer((5, 6, 7), 1, (0, 3)), GroupTransfer(), GroupTransfer((9,), 2, (5,))))
    before = model.snapshot()
    assert run_job(engine, plan).success
    assert model.snapshot() == model.apply(plan, before)
    empty = TransferPlan(8, JobKind.LOAD, "r", (GroupTransfer(),) * 3)
    result = run_job(engine, empty)
    assert result.success and result.bytes == 0
    engine.close()


def test_per_layer_views_of_a_packed_tensor() -> None:
    """Strided rows: each layer's view of a (blocks, layers, ...) pool is its own region."""
    pool = random_tensor((NUM_GPU_BLOCKS, 3, 2, 8), torch.bfloat16, 5)
    views = [pool[:, layer] for layer in range(3)]
    engine = TransferEngine(make_config((2,)), [views])
    model = Model(engine, [views])
    store = TransferPlan(1, JobKind.STORE, "r", (GroupTransfer((3, 4), 0, (2,)),))
    before = model.snapshot()
    assert run_job(engine, store).success
    assert model.snapshot() == model.apply(store, before)
    bits = pool.view(torch.int16)  # compare bits: random bytes include NaNs
    untouched = bits.clone()
    load = TransferPlan(2, JobKind.LOAD, "r", (GroupTransfer((8,), 1, (2,)),))
    assert run_job(engine, load).success
    assert torch.equal(bits[8], untouched[4])
    assert torch.equal(bits[:8], untouched[:8]) and torch.equal(bits[9:], untouched[9:])
    engine.close()


def test_cpu_tier_size_and_chunk_reads() -> None:
    engine, tensors = make_engine((3, 1), layers=2)
    expected = sum(NUM_CPU_BLOCKS * engine.config.groups[g].blocks_per_chunk
                   * len(rows_of(t)[0]) for g, ts in enumerate(tensors) for t in ts)
    assert engine.cpu_tier_bytes() == expected
    plan = TransferPlan(1, JobKind.STORE, "r", (GroupTransfer((1, 2, 3), 0, (4,)),
                                                GroupTransfer()))
    assert run_job(engine, plan).success
    chunk = engine.read_cpu_chunk(0, 1, 4)
    assert chunk == b"".join(rows_of(tensors[0][1])[b] for b in (1, 2, 3))
    with pytest.raises(ValueError):
        engine.read_cpu_chunk(0, 0, NUM_CPU_BLOCKS)
    engine.close()


# -- generated valid and hostile plans -------------------------------------------------------

@st.composite
def valid_plans(draw: st.DrawFn, bpcs: tuple[int, ...], job_id: int) -> TransferPlan:
    kind = draw(st.sampled_from(JobKind))
    groups = []
    for bpc in bpcs:
        n = draw(st.integers(0, 6))
        block_index = draw(st.integers(0, 9))
        ids = draw(st.lists(st.integers(1, NUM_GPU_BLOCKS - 1), min_size=n, max_size=n,
                            unique=kind is JobKind.LOAD))
        slots = draw(st.lists(st.integers(0, NUM_CPU_BLOCKS - 1),
                              min_size=chunks_spanned(len(ids), block_index, bpc),
                              max_size=chunks_spanned(len(ids), block_index, bpc),
                              unique=kind is JobKind.STORE))
        groups.append(GroupTransfer(tuple(ids), block_index, tuple(slots)))
    return TransferPlan(job_id, kind, "req", tuple(groups))


EDGE_IDS = [0, -1, NUM_GPU_BLOCKS, NUM_CPU_BLOCKS, 2**63, -(2**63), 2**64, 10**30]


@st.composite
def hostile_plans(draw: st.DrawFn, bpcs: tuple[int, ...], job_id: int) -> TransferPlan:
    """A valid plan with one fault: a bad id or slot, a shape mismatch, a double write."""
    plan = draw(valid_plans(bpcs, job_id))
    g = draw(st.integers(0, len(bpcs) - 1))
    gt = plan.groups[g]
    fault = draw(st.sampled_from(["gpu_id", "slot", "extra_slot", "missing_slot",
                                  "block_index", "groups", "double_write"]))
    event(fault)
    ids, slots = list(gt.gpu_block_ids) or [1], list(gt.cpu_slots)
    block_index = -1 if fault == "block_index" else gt.block_index
    if not gt.gpu_block_ids:
        slots = [0] * chunks_spanned(1, gt.block_index, bpcs[g])
    if fault == "gpu_id":
        ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from(
            [x for x in EDGE_IDS if not 0 < x < NUM_GPU_BLOCKS]))
    elif fault == "slot":
        slots[draw(st.integers(0, len(slots) - 1))] = draw(st.sampled_from(
            [x for x in EDGE_IDS if not 0 <= x < NUM_CPU_BLOCKS]))
    elif fault == "extra_slot":
        slots.append(0)
    elif fault == "missing_slot":
        slots.pop()
    elif fault == "double_write":  # a LOAD writes one GPU block twice, a STORE one chunk
        block_index = 0
        if plan.kind is JobKind.LOAD:
            ids, slots = [2, 2], [0] * chunks_spanned(2, 0, bpcs[g])
        else:
            ids, slots = list(range(1, 2 * bpcs[g] + 1)), [3, 3]
    bad = GroupTransfer(tuple(ids), block_index, tuple(slots))
    groups = (*plan.groups[:g], bad, *plan.groups[g + 1:])
    if fault == "groups":
        groups = groups[:-1] if draw(st.booleans()) else (*groups, GroupTransfer())
    return TransferPlan(job_id, plan.kind, plan.request_id, groups)


BPCS = (3, 1, 2)


@pytest.fixture(scope="module")
def shared_engine() -> Iterator[TransferEngine]:
    engine, _ = make_engine(BPCS, layers=2, seed=11)
    yield engine
    engine.close()


@given(st.lists(valid_plans(BPCS, 0), min_size=1, max_size=4))
def test_valid_jobs_match_the_model(shared_engine: TransferEngine,
                                    plans: list[TransferPlan]) -> None:
    model = Model(shared_engine, [[r.gpu for r in regs] for regs in shared_engine._groups])
    for n, plan in enumerate(plans):
        plan = TransferPlan(1000 + n, plan.kind, plan.request_id, plan.groups)
        before = model.snapshot()
        shared_engine.validate(plan)
        result = run_job(shared_engine, plan)
        assert result.success and result.error is None
        assert model.snapshot() == model.apply(plan, before)


@given(hostile_plans(BPCS, 77))
def test_hostile_jobs_fail_whole_and_move_nothing(shared_engine: TransferEngine,
                                                  plan: TransferPlan) -> None:
    model = Model(shared_engine, [[r.gpu for r in regs] for regs in shared_engine._groups])
    before = model.snapshot()
    with pytest.raises(KVCopyError) as info:
        shared_engine.validate(plan)
    err = info.value
    assert err.job_id == 77 and err.code != Status.OK and "no bytes were copied" in str(err)
    assert err.group is not None
    result = run_job(shared_engine, plan)
    assert not result.success and result.bytes == 0 and result.error == str(err)
    assert model.snapshot() == before


def test_failed_job_names_the_id_and_its_bound() -> None:
    engine, _ = make_engine((1, 1), layers=2)
    plan = TransferPlan(5, JobKind.STORE, "r", (GroupTransfer(), GroupTransfer((3, 9000), 0,
                                                                               (0, 1))))
    with pytest.raises(KVCopyError) as info:
        engine.validate(plan)
    e = info.value
    assert (e.code, e.descriptor_index, e.job_id, e.group, e.value, e.bound) == \
        (Status.E_ROW_RANGE, 1, 5, 1, 9000, NUM_GPU_BLOCKS)
    assert str(e) == ("descriptor 1 of 4 (store, job 5, group 1): GPU block id 9000 is "
                      "outside 1..11; no bytes were copied.")
    null = TransferPlan(6, JobKind.LOAD, "r", (GroupTransfer((0,), 0, (0,)), GroupTransfer()))
    with pytest.raises(KVCopyError) as info:
        engine.validate(null)
    assert info.value.code == Status.E_NULL_ROW and info.value.group == 0
    engine.close()


def _first_block_in_chunk(pos: int, n: int, block_index: int, bpc: int) -> int:
    """The first of ``n`` blocks (starting at ``block_index``) that lands in chunk ``pos``,
    found by scanning the spec's sub-block mapping, not by the engine's arithmetic."""
    return next(i for i in range(n) if sub_block_position(i, block_index, bpc)[0] == pos)


# (kind, group 1's transfer, the id written twice, its position in the written list)
DOUBLE_WRITES = [
    ("load, GPU block", JobKind.LOAD, GroupTransfer((3, 5, 7, 5), 0, (1, 2)), 5, 3),
    ("store, CPU chunk, no lead", JobKind.STORE, GroupTransfer((2, 3, 4, 5, 6, 7, 8), 0, (1, 4, 4)),
     4, 2),
    # block_index 4 with 3 blocks per chunk: the first chunk holds 2 blocks (lead 1).
    ("store, CPU chunk, lead 1", JobKind.STORE,
     GroupTransfer((2, 3, 4, 5, 6, 7), 4, (2, 4, 4)), 4, 2),
    ("store, CPU chunk, lead 2", JobKind.STORE, GroupTransfer((2, 3, 4, 5), 5, (0, 0)), 0, 1),
]


@pytest.mark.parametrize(("why", "kind", "gt", "twice", "pos"), DOUBLE_WRITES,
                         ids=[row[0] for row in DOUBLE_WRITES])
def test_a_destination_written_twice_is_named_exactly(why: str, kind: JobKind,
                                                      gt: GroupTransfer, twice: int,
                                                      pos: int) -> None:
    """A job that writes one GPU block (load) or one CPU chunk (store) twice would leave
    whichever copy ran last, so it is refused whole: ``validate`` raises E_DST_OVERLAP
    naming the destination, the job, the group and the first descriptor of the second
    write, and ``submit`` finishes it failed with zero bytes and no byte changed.

    The descriptor index is found independently: group 0's descriptors come first (its
    blocks x its tensors), and within group 1 the second write starts at the load's
    position, or at the store chunk's first block by the spec's sub-block mapping. Kills a
    missing Python double-write check (the C library's refusal names no role or job) and
    a store index computed with ``+ lead`` instead of ``- lead``."""
    bpc = 3
    engine, tensors = make_engine((1, bpc), layers=2)
    model = Model(engine, tensors)
    other = GroupTransfer((8, 9), 0, (0, 5))
    plan = TransferPlan(41, kind, "r", (other, gt))
    first = len(other.gpu_block_ids) * len(tensors[0])
    n = len(gt.gpu_block_ids)
    within = pos if kind is JobKind.LOAD else _first_block_in_chunk(pos, n, gt.block_index, bpc)
    with pytest.raises(KVCopyError) as info:
        engine.validate(plan)
    e = info.value
    assert (e.code, e.descriptor_index, e.job_id, e.group, e.value) == \
        (Status.E_DST_OVERLAP, first + within, 41, 1, twice)
    what = "GPU block" if kind is JobKind.LOAD else "CPU chunk"
    assert str(e) == (f"{kind.value}, job 41, group 1: destination {what} {twice} is written "
                      "twice in one job; no bytes were copied.")
    before = model.snapshot()
    result = run_job(engine, plan)
    assert not result.success and result.bytes == 0 and result.error == str(e)
    assert model.snapshot() == before
    engine.close()


@pytest.mark.parametrize("bad_id", [1.0, "3", None, True])
def test_wrongly_typed_ids(bad_id: object) -> None:
    engine, _tensors = make_engine((1,), layers=1)
    plan = TransferPlan(1, JobKind.STORE, "r", (GroupTransfer((bad_id,), 0, (0,)),))  # type: ignore[arg-type]
    with pytest.raises(TransferArgumentError):
        engine.validate(plan)
    before = rows_of(engine.cpu_tensor(0, 0))
    result = run_job(engine, plan)
    assert not result.success and result.bytes == 0
    assert "TransferArgumentError" in (result.error or "")
    assert rows_of(engine.cpu_tensor(0, 0)) == before
    with pytest.raises(ValueError):
        engine.submit("not a plan")  # type: ignore[arg-type]
    engine.close()


def test_a_huge_bad_value_is_named_in_a_short_message() -> None:
    """A plan whose group, or whose id list, is a 100,000-character string is refused with
    a message that names the value cut to 60 characters (``short_repr``), not all of it."""
    engine, _tensors = make_engine((1,), layers=1)
    huge = "x" * 100_000
    cut = "'" + "x" * 55 + "...>"
    as_group = TransferPlan(1, JobKind.STORE, "r", (huge,))  # type: ignore[arg-type]
    as_ids = TransferPlan(2, JobKind.STORE, "r", (GroupTransfer(huge, 0, (0,)),))  # type: ignore[arg-type]
    for plan in (as_group, as_ids):
        with pytest.raises(TransferArgumentError) as info:
            engine.validate(plan)
        text = str(info.value)
        assert cut in text and len(text) < 160, text
    engine.close()


# -- registration ---------------------------------------------------------------------------

def _pool(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return random_tensor((NUM_GPU_BLOCKS, 4, 8), dtype, 3)


@pytest.mark.parametrize("make_bad", [
    lambda: _pool().transpose(1, 2),              # rows not contiguous
    lambda: _pool()[:, :, ::2],                   # strided inside a row
    lambda: _pool()[:6],                          # wrong block count
    lambda: torch.empty((NUM_GPU_BLOCKS, 0)),     # zero bytes per block
    lambda: torch.empty(()),                      # no block dimension
    lambda: [[1, 2], [3, 4]],                     # not a tensor
    lambda: _pool()[:1].expand(NUM_GPU_BLOCKS, 4, 8),  # every block aliases one row
    lambda: torch.randn(NUM_GPU_BLOCKS, 4, dtype=torch.complex64).conj(),  # lazy conj bit
    lambda: _pool().to_sparse(),                  # not strided
], ids=["transposed", "strided-row", "block-count", "zero-bytes", "scalar", "list",
        "aliased-rows", "conj", "sparse"])
def test_bad_tensors_are_value_errors(make_bad: object) -> None:
    with pytest.raises(ValueError):
        TransferEngine(make_config((1,)), [[make_bad()]])  # type: ignore[operator]


def test_a_tensor_reporting_negative_strides_is_named_with_its_bound() -> None:
    """torch builds no tensor with a negative stride today, but a subclass or a later torch
    may report one; the row check must not take it for a layout it can address. The error
    carries the offending stride and the bound (0) so a caller can act on it."""
    bad = _pool()
    bad.stride = lambda *dim: (-32, 8, 1)  # type: ignore[method-assign]
    with pytest.raises(TransferArgumentError, match="negative strides") as info:
        TransferEngine(make_config((1,)), [[bad]])
    assert (info.value.where, info.value.value, info.value.bound) == (
        "gpu_tensors[0][0]", -32, 0), info.value


def test_group_count_and_options_are_checked() -> None:
    with pytest.raises(ValueError):
        TransferEngine(make_config((1, 1)), [[_pool()]])
    with pytest.raises(ValueError):
        TransferEngine(make_config((1,)), [_pool()])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        TransferEngine(make_config((1,)), [[_pool()]], cuda_method="warp")
    with pytest.raises(ValueError):
        TransferEngine("config", [[_pool()]])  # type: ignore[arg-type]


# -- the asynchronous API ---------------------------------------------------------------------

def test_close_drains_queued_jobs_and_refuses_new_ones() -> None:
    engine, _ = make_engine((2,), layers=2)
    for job in range(20):
        engine.submit(TransferPlan(job, JobKind.STORE, "r",
                                   (GroupTransfer((1 + job % 10, 2), 0, (job % 6,)),)))
    engine.close()
    results = engine.poll()
    assert sorted(r.job_id for r in results) == list(range(20))
    assert all(r.success and r.bytes > 0 and r.seconds >= 0 for r in results)
    engine.close()  # idempotent
    with pytest.raises(RuntimeError):
        engine.submit(TransferPlan(99, JobKind.STORE, "r", (GroupTransfer(),)))


@pytest.mark.parametrize("full_queue", [False, True])
def test_close_with_a_timeout_names_a_worker_that_does_not_stop(
        monkeypatch: pytest.MonkeyPatch, full_queue: bool) -> None:
    """A copy that never finishes makes ``close(timeout)`` a TimeoutError naming the job,
    not a hang (kills a close that joins the worker without its limit), also when the
    queue behind it is full (the stop mark cannot be queued in time). Once the copy
    ends, the worker finishes every job and stops, and a second ``close`` releases the
    engine (kills a stop mark dropped on a full queue, and a second close that returns
    while the worker still runs)."""
    import threading
    config, tensors = make_config((1,)), make_engine((1,), layers=1)[1]
    engine = TransferEngine(config, tensors, max_queued_jobs=1)
    release, started = threading.Event(), threading.Event()
    execute = engine._execute

    def stuck(*args: object) -> object:
        started.set()
        release.wait(60)
        return execute(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "_execute", stuck)
    engine.submit(TransferPlan(7, JobKind.STORE, "r", (GroupTransfer((1,), 0, (0,)),)))
    assert started.wait(60)
    jobs = [7]
    if full_queue:  # the worker holds job 7; job 8 fills the one-job queue
        engine.submit(TransferPlan(8, JobKind.STORE, "r", (GroupTransfer((2,), 0, (1,)),)))
        jobs.append(8)
    with pytest.raises(TimeoutError, match=rf"not stopped after 0.2 s: jobs \[{jobs[0]}"):
        engine.close(timeout=0.2)
    with pytest.raises(TimeoutError):  # still running: a second close does not pretend
        engine.close(timeout=0.1)
    release.set()
    engine.close(timeout=60)  # the worker stops now: released
    assert not engine._thread.is_alive()
    assert sorted((r.job_id, r.success) for r in engine.poll()) == [(j, True) for j in jobs]
    engine.close(timeout=0.1)  # released already: returns at once


def test_wait_returns_results_and_leaves_them_for_poll() -> None:
    with make_engine((1,), layers=1)[0] as engine:
        assert engine.wait([123]) == []  # never submitted: nothing to wait for
        engine.submit(TransferPlan(1, JobKind.STORE, "r", (GroupTransfer((1,), 0, (0,)),)))
        engine.submit(TransferPlan(2, JobKind.STORE, "r", (GroupTransfer((99,), 0, (0,)),)))
        waited = engine.wait([1, 2], timeout=60)
        assert {r.job_id: r.success for r in waited} == {1: True, 2: False}
        assert sorted(r.job_id for r in engine.poll()) == [1, 2]
        assert engine.poll() == []


@pytest.mark.parametrize(("call", "where"), [
    (lambda e: e.wait(None), "wait(job_ids)"),
    (lambda e: e.wait(3), "wait(job_ids)"),
    (lambda e: e.wait("12"), "wait(job_ids)"),
    (lambda e: e.wait([1, "1"]), "wait(job_ids)"),  # "1" would never match: a silent pass
    (lambda e: e.wait([[1]]), "wait(job_ids)"),
    (lambda e: e.wait([1], timeout="x"), "wait(timeout)"),
    (lambda e: e.wait([1], timeout=-1), "wait(timeout)"),
    (lambda e: e.wait([1], timeout=math.nan), "wait(timeout)"),
    (lambda e: e.wait([1], timeout=True), "wait(timeout)"),
    (lambda e: e.drain(timeout=1e300), "drain(timeout)"),
    (lambda e: e.wait([1], timeout=10**400), "wait(timeout)"),  # past float: not Overflow
    (lambda e: e.drain(timeout=-10**400), "drain(timeout)"),
    (lambda e: e.close(timeout=10**400), "close(timeout)"),
    (lambda e: e.rebind_gpu_tensors([], timeout="5"), "rebind_gpu_tensors(timeout)"),
    (lambda e: e.close(timeout=-1), "close(timeout)"),  # checked before the engine closes
])
def test_a_bad_wait_argument_is_named_before_waiting(call: object, where: str) -> None:
    """Not a bare TypeError from the condition variable, nor an id that never matches
    (the fence it stands for would pass at once); the engine goes on working."""
    with make_engine((1,), layers=1)[0] as engine:
        with pytest.raises(TransferArgumentError, match=rf"^{re.escape(where)}: "):
            call(engine)  # type: ignore[operator]
        engine.submit(TransferPlan(1, JobKind.STORE, "r", (GroupTransfer((1,), 0, (0,)),)))
        assert [r.success for r in engine.wait((1,), timeout=math.inf)] == [True]
        assert engine.drain(timeout=60) == []  # nothing in flight any more


def test_a_descriptor_index_maps_to_its_plan_group() -> None:
    """A C refusal names the plan's group through ``_Job.group_of`` (descriptor index to
    group); Python refuses every fault it knows first, so only this reaches it on CPU.
    Mutant: ``bisect_right(...) - 0`` (every index one group too far, an empty group's
    neighbour named). Checked against the counts, per index, for random valid plans."""
    import random

    from kvcore import _enginecheck
    from kvcore.presets import preset
    from kvcore.transfer import TransferEngine, cpu_capacity
    cfg = _enginecheck._layout(preset("deepseek-v4-mtp"))
    rng = random.Random(7)
    gpu = _enginecheck._tensors(cfg, rng)
    caps = tuple(cpu_capacity(cfg, g) for g in range(len(cfg.groups)))
    with TransferEngine(cfg, gpu) as engine:
        seen_empty = False
        for job in range(1, 60):
            plan = _enginecheck._valid_plan(rng, job, cfg, caps)
            prepared = engine._prepare(plan)
            want = [g for g, gt in enumerate(plan.groups)
                    for _ in range(len(gt.gpu_block_ids) * len(gpu[g]))]
            seen_empty |= any(not gt.gpu_block_ids for gt in plan.groups)
            assert [prepared.group_of(i) for i in range(len(want))] == want
        assert seen_empty  # an empty group between two others is among the plans


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_that_dies_fails_its_pending_jobs_instead_of_hanging_waiters() -> None:
    """If the worker thread dies (a kvcore bug, not a bad plan: those fail one job), every
    job still pending is reported failed, "transfer worker stopped", so ``wait`` returns
    instead of hanging. Mutant: the cleanup loop over pending jobs removed (the wait
    returns no result; with the pending set's clear() removed too, it times out)."""
    import random

    from kvcore import _enginecheck
    from kvcore.presets import preset
    from kvcore.transfer import TransferEngine, cpu_capacity
    cfg = _enginecheck._layout(preset("deepseek-v4-mtp"))
    rng = random.Random(3)
    gpu = _enginecheck._tensors(cfg, rng)
    caps = tuple(cpu_capacity(cfg, g) for g in range(len(cfg.groups)))
    engine = TransferEngine(cfg, gpu)

    def dies(*args: object) -> object:
        raise RuntimeError("injected: the worker dies")

    engine._execute = dies  # type: ignore[method-assign]
    plan = _enginecheck._valid_plan(rng, 1, cfg, caps)
    engine.submit(plan)
    (result,) = engine.wait([plan.job_id], timeout=10)
    # Like every failed job, it reports 0 bytes (mutant: the cleanup's result says 1).
    assert not result.success and result.error == "transfer worker stopped"
    assert result.bytes == 0
    engine.close()


def test_a_tier_that_cannot_be_allocated_is_a_config_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's allocator error named neither the field nor the size asked; a config may
    allow 2**28 chunks that no host holds (the allocator is made to fail here, since
    whether 4 TiB of virtual memory is refused depends on the host's overcommit)."""
    from kvcore.spec.errors import ConfigError
    from kvcore.transfer import _setup

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    pools = [[torch.zeros(NUM_GPU_BLOCKS, 16)]]  # before the allocator fails (one torch)
    monkeypatch.setattr(_setup.torch, "empty", refuse)
    with pytest.raises(ConfigError, match=r"^num_cpu_blocks: group 0's CPU tier of \d+ chunks"):
        TransferEngine(make_config((1,)), pools)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA is")
def test_pinning_without_cuda_is_a_config_error() -> None:
    from kvcore.spec.errors import ConfigError
    with pytest.raises(ConfigError, match=r"^pin_memory: page-locked memory needs a CUDA"):
        TransferEngine(make_config((1,)), [[torch.zeros(NUM_GPU_BLOCKS, 16)]], pin_memory=True)


def test_a_nested_tensor_is_refused_by_name() -> None:
    nested = torch.nested.nested_tensor([torch.zeros(16)] * NUM_GPU_BLOCKS)
    with pytest.raises(TransferArgumentError, match=r"^gpu_tensors\[0\]\[0\]: .*nested"):
        TransferEngine(make_config((1,)), [[nested]])


def test_a_plan_built_without_its_constructor_and_a_closed_engine_are_named() -> None:
    """Each was a bare builtin: AttributeError on ``plan.job_id``, RuntimeError after
    close (now CallOrderError, still a RuntimeError); a float slot read as out of range."""
    from kvcore.spec.errors import CallOrderError
    engine, _ = make_engine((1,), layers=1)
    hollow = object.__new__(TransferPlan)
    for call in (engine.validate, engine.submit):
        with pytest.raises(TransferArgumentError,
                           match=r"^plan: has no job_id, kind, request_id, groups"):
            call(hollow)
    with pytest.raises(TransferArgumentError, match=r"^slot: 1.0 is a float, not an int"):
        engine.read_cpu_chunk(0, 0, 1.0)  # type: ignore[arg-type]
    engine.close()
    with pytest.raises(CallOrderError, match=r"^TransferEngine.submit: the engine is closed"):
        engine.submit(TransferPlan(1, JobKind.STORE, "r", (GroupTransfer((1,), 0, (0,)),)))


def test_a_size_one_dimension_with_stride_zero_is_a_valid_pool() -> None:
    """A size-1 dimension may carry stride 0 (``expand``, ``as_strided``): the rows are
    still each one contiguous byte range, so the pool is accepted and copies round-trip.
    Kills a stride check that refuses zero strides as well as negative ones (held-out
    seed 33 m28)."""
    base = random_tensor((NUM_GPU_BLOCKS, 4, 3), torch.float32, 7)
    pool = base.as_strided((NUM_GPU_BLOCKS, 1, 4, 3), (12, 0, 3, 1))
    assert 0 in pool.stride()
    with TransferEngine(make_config((1,)), [[pool]]) as engine:
        before = bytes(pool[2].contiguous().view(torch.uint8).flatten().tolist())
        assert run_job(engine, TransferPlan(1, JobKind.STORE, "r",
                                            (GroupTransfer((2,), 0, (0,)),))).success
        assert run_job(engine, TransferPlan(2, JobKind.LOAD, "r",
                                            (GroupTransfer((5,), 0, (0,)),))).success
        assert bytes(pool[5].contiguous().view(torch.uint8).flatten().tolist()) == before


def test_results_a_caller_never_polls_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """wait() leaves results for poll(): a caller that only waited kept every result
    the engine ever produced (10,000 jobs, 10,000 results). Past ``MAX_UNPOLLED_JOBS``
    submit refuses until poll(), with nothing queued; no result is dropped. Mutants: the
    check removed, or ``>`` for ``>=`` (a fourth job accepted)."""
    import kvcore.transfer._engine as engine_module
    from kvcore.spec.errors import CallOrderError
    monkeypatch.setattr(engine_module, "MAX_UNPOLLED_JOBS", 3)
    with make_engine((1,), layers=1)[0] as engine:
        def store(job: int) -> TransferPlan:
            return TransferPlan(job, JobKind.STORE, "r", (GroupTransfer((1,), 0, (0,)),))
        engine.submit(store(1))
        engine.submit(store(2))
        engine.wait([1, 2], timeout=60)
        engine.submit(store(3))  # two results waiting for poll, one job maybe in flight
        with pytest.raises(CallOrderError, match=r"MAX_UNPOLLED_JOBS.*call poll"):
            engine.submit(store(4))
        engine.wait([3], timeout=60)
        assert engine.in_flight() == [] and sorted(r.job_id for r in engine.poll()) == [1, 2, 3]
        engine.submit(store(4))  # polled: room again
        assert [r.job_id for r in engine.wait([4], timeout=60)] == [4]
