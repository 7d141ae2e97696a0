"""The transfer engine's asynchronous path on CPU, through its stand-in stream.

Goal: with ``simulate_stream`` the engine runs the code CUDA runs (jobs enqueued behind
events, up to ``MAX_IN_FLIGHT`` at once, retired in order when their events pass), copies
land late, and a worker that reports a job before its copy has landed, or hands one
event to two jobs, is caught under X2 by the "transfer engine" stage and by the
simulator, and a job never reported is X2, not a hang. Each test names the defect it kills.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcore import _enginecheck
from kvcore.presets import preset
from kvcore.sim import SimOptions, Simulator
from kvcore.spec.errors import InvariantViolation, TransferArgumentError
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.transfer import TransferEngine, _engine, _stream
from kvcore.transfer._results import MAX_IN_FLIGHT

DEFAULT = "deepseek-v4-mtp"


def _store(job: int, block: int, slot: int, groups: int) -> TransferPlan:
    return TransferPlan(job, JobKind.STORE, "r", tuple(
        GroupTransfer((block,), 0, (slot,), (b"k%d" % job,)) if g == 0 else GroupTransfer()
        for g in range(groups)))


def test_copies_land_only_when_their_event_is_waited_for() -> None:
    """The stand-in defers: a queued copy has not run until the event behind it passed."""
    cfg = preset(DEFAULT)
    gpu = [[torch.full((cfg.num_gpu_blocks, 8), g + 1, dtype=torch.uint8)] for g in
           range(len(cfg.groups))]
    with TransferEngine(cfg, gpu, simulate_stream=3) as engine:
        stream = engine._cuda
        assert isinstance(stream, _stream.SimulatedStream)
        engine.submit(_store(1, 5, 0, len(cfg.groups)))
        (result,) = engine.wait([1])
        assert result.success and result.bytes == 8
        assert engine.read_cpu_chunk(0, 0, 0) == bytes([1] * 8)
    assert stream.live_events() == 0  # close destroyed every event


def test_jobs_fly_together_and_retire_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bursts put several jobs behind events at once (the flight CUDA has), and they are
    reported in submission order; the plain C path never has more than one."""
    most = [0]
    done = _stream.SimulatedStream.event_done

    def counting(self: Any, event: int) -> bool:
        most[0] = max(most[0], len(self._pending))
        return done(self, event)

    monkeypatch.setattr(_stream.SimulatedStream, "event_done", counting)
    cfg = preset(DEFAULT)
    gpu = [[torch.zeros((cfg.num_gpu_blocks, 8), dtype=torch.uint8)] for _ in cfg.groups]
    order = []
    with TransferEngine(cfg, gpu, simulate_stream=7) as engine:
        for job in range(1, 3 * MAX_IN_FLIGHT):
            engine.submit(_store(job, job, job % 4, len(cfg.groups)))
        engine.drain()
        order = [r.job_id for r in engine.poll()]
    assert order == list(range(1, 3 * MAX_IN_FLIGHT))
    assert most[0] > 1


def test_a_full_flight_waits_for_its_oldest_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that never advances on its own (a busy GPU): the flight fills to exactly
    ``MAX_IN_FLIGHT`` jobs, then the worker blocks on the oldest before enqueueing the
    next, and every job still lands and is reported in order. The seeded stand-in usually
    advances at a query, so the flight seldom filled: blocking one job late (``>`` for
    ``>=``) ran out of events on the ninth and survived every other test."""
    most = [0]
    record = _stream.SimulatedStream.event_record

    def stalled(self: Any, event: int) -> bool:
        self._known(event, "querying")
        return bool(self._passed(event))

    def counting(self: Any, event: int, stream: int) -> None:
        record(self, event, stream)
        most[0] = max(most[0], len(self._pending))

    monkeypatch.setattr(_stream.SimulatedStream, "event_done", stalled)
    monkeypatch.setattr(_stream.SimulatedStream, "event_record", counting)
    cfg = preset(DEFAULT)
    gpu = [[torch.zeros((cfg.num_gpu_blocks, 8), dtype=torch.uint8)] for _ in cfg.groups]
    with TransferEngine(cfg, gpu, simulate_stream=7) as engine:
        for job in range(1, 3 * MAX_IN_FLIGHT):
            engine.submit(_store(job, job, job % 4, len(cfg.groups)))
        engine.drain()
        results = engine.poll()
    assert [r.job_id for r in results] == list(range(1, 3 * MAX_IN_FLIGHT))
    assert all(r.success for r in results), [r for r in results if not r.success][:1]
    assert most[0] == MAX_IN_FLIGHT


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", 1 << 64])
def test_a_bad_seed_is_refused_naming_it(bad: object) -> None:
    cfg = preset(DEFAULT)
    gpu = [[torch.zeros((cfg.num_gpu_blocks, 8), dtype=torch.uint8)] for _ in cfg.groups]
    with pytest.raises(TransferArgumentError, match="simulate_stream"):
        TransferEngine(cfg, gpu, simulate_stream=bad)  # type: ignore[arg-type]


def test_engine_stage_catches_a_report_before_the_copy(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Defect: the worker reports a job without waiting for its event (a synchronize
    that does not wait is the same defect). The stage's stream pass sees the pool still
    holding the old bytes after a successful result: X2."""
    monkeypatch.setattr(_stream.SimulatedStream, "event_synchronize",
                        lambda self, event: None)
    with pytest.raises(InvariantViolation, match="X2"):
        _enginecheck.run_transfer_engine(preset(DEFAULT), _enginecheck.ENGINE_CASES, {})


def test_simulator_catches_an_event_handed_to_two_jobs(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Defect: a retired job's event is not handed back, but a copy of the one in use is
    (``_free_events`` refilled with the head's event twice). The second job's record of
    a pending event is refused by the stream: the valid plan fails, X2."""
    retire = _engine.TransferEngine._retire

    def leaky(self: Any, flight: Any, block: bool) -> None:
        if flight and flight[0].event is not None and len(self._free_events) > 1:
            self._free_events.append(flight[0].event)  # one event twice in the free list
        retire(self, flight, block)

    monkeypatch.setattr(_engine.TransferEngine, "_retire", leaky)
    opts = SimOptions(seed=1, requests=6, context_tokens=400, simulate_stream=True,
                      delay_rate=0.0, fail_rate=0.0, abort_rate=0.0, reset_rate=0.0)
    sim = Simulator(preset(DEFAULT), opts)
    try:
        with pytest.raises(InvariantViolation, match="X2"):
            sim.run()
    finally:
        sim.transfer.close()


def test_a_job_never_reported_is_x2_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect: the worker loses a job (here: the first is taken as pending and never
    queued, as a worker that retires the newest job first leaves the oldest). Every wait
    for it would block for good; the simulator names it X2 after JOB_SECONDS."""
    from kvcore.sim import _engine as sim_engine
    monkeypatch.setattr(sim_engine, "JOB_SECONDS", 1.0)
    submit = _engine.TransferEngine.submit

    def lose_first(self: Any, plan: TransferPlan) -> None:
        if plan.job_id == 1:
            with self._cond:
                self._pending.add(plan.job_id)
            return
        submit(self, plan)

    monkeypatch.setattr(_engine.TransferEngine, "submit", lose_first)
    sim = Simulator(preset(DEFAULT), SimOptions(seed=0, requests=4, context_tokens=400))
    try:
        with pytest.raises(InvariantViolation, match=r"X2: job 1.*not reported"):
            sim.run()
    finally:
        with sim.transfer._cond:
            sim.transfer._pending.discard(1)
        sim.transfer.close()


def test_a_wait_that_times_out_with_nothing_pending_is_x2(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect: ``TransferEngine.wait``'s test inverted, so every wait raises TimeoutError,
    even one for no job (held-out seed 28's m28). The simulator names X2, with a record for
    each job it waited for, or job -1 for a wait for none, instead of crashing."""
    def always_late(self: Any, job_ids: Any, timeout: float | None = None) -> list[Any]:
        raise TimeoutError(f"jobs {sorted(job_ids)} still running after {timeout} s")

    monkeypatch.setattr(_engine.TransferEngine, "wait", always_late)
    sim = Simulator(preset(DEFAULT), SimOptions(seed=0, requests=4, context_tokens=400))
    try:
        for ids in ([], [7]):
            with pytest.raises(InvariantViolation, match=f"X2: job {ids[0] if ids else -1}:"):
                sim._wait(ids)
    finally:
        sim.transfer.close()


def test_a_copy_failing_after_it_was_enqueued_fails_its_job_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver error while the stream runs a copy (CUDA reports it at the event behind the
    copy) must fail that job, never report it as landed; the next job still lands."""
    real_copy = _stream._native.copy
    calls = [0]

    def copy(regions: Any, descs: Any, **funnel: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("CUDA error 700: an illegal memory access was encountered")
        real_copy(regions, descs, **funnel)

    monkeypatch.setattr(_stream._native, "copy", copy)
    cfg = preset(DEFAULT)
    gpu = [[torch.full((cfg.num_gpu_blocks, 8), g + 1, dtype=torch.uint8)] for g in
           range(len(cfg.groups))]
    with TransferEngine(cfg, gpu, simulate_stream=5) as engine:
        before = engine.read_cpu_chunk(0, 0, 0)
        engine.submit(_store(1, 5, 0, len(cfg.groups)))
        engine.submit(_store(2, 6, 1, len(cfg.groups)))
        first, second = engine.wait([1, 2])
        assert (first.job_id, first.success, first.bytes) == (1, False, 0)
        assert "illegal memory access" in (first.error or "")
        assert (second.job_id, second.success, second.bytes) == (2, True, 8)
        assert engine.read_cpu_chunk(0, 0, 0) == before  # job 1 wrote nothing
        assert engine.read_cpu_chunk(0, 0, 1) == bytes([1] * 8)


def test_the_stand_in_refuses_events_the_driver_would() -> None:
    """Unknown, destroyed and excess events raise instead of answering (the driver's
    CUDA_ERROR_INVALID_HANDLE; a leak of events would otherwise go unseen)."""
    stream = _stream.SimulatedStream(0)
    with pytest.raises(_stream.StreamMisuse, match="not alive"):
        stream.event_synchronize(1)
    events = [stream.event_create() for _ in range(_stream.MAX_EVENTS)]
    with pytest.raises(_stream.StreamMisuse, match=f"more than {_stream.MAX_EVENTS} events"):
        stream.event_create()
    stream.event_destroy(events[0])
    with pytest.raises(_stream.StreamMisuse, match="not alive"):
        stream.event_done(events[0])
    assert stream.live_events() == _stream.MAX_EVENTS - 1
    stream.event_create()  # a destroyed event's place is free again


def test_injected_faults_fail_exactly_their_jobs() -> None:
    """``simulate_faults``: the jobs ``injected_fault`` names fail with no bytes (nothing
    landed for a fault before the copy, everything for one after it) and every other job
    lands. Kills a stream that drops a deferred failure (held-out seed 43's m24: the
    attribution test negated), or hands it to the wrong event."""
    cfg = preset(DEFAULT)
    groups = len(cfg.groups)
    gpu = [[torch.full((cfg.num_gpu_blocks, 8), g + 1, dtype=torch.uint8)] for g in
           range(groups)]
    seed, share, jobs = 11, 0.5, 24
    kinds = [_stream.injected_fault(seed, job, share) for job in range(1, jobs + 1)]
    # The seed was chosen so that every kind occurs, the stream's order mixes them.
    assert {_stream.NO_FAULT, _stream.FAULT_BEFORE, _stream.FAULT_AFTER} <= set(kinds)
    with TransferEngine(cfg, gpu, simulate_stream=seed, simulate_faults=share) as engine:
        before = [engine.read_cpu_chunk(0, 0, slot) for slot in range(jobs)]
        for job in range(1, jobs + 1):
            engine.submit(_store(job, 1 + job % 3, job - 1, groups))
        results = engine.wait(list(range(1, jobs + 1)))
        for result, kind in zip(results, kinds, strict=True):
            slot = result.job_id - 1
            landed = engine.read_cpu_chunk(0, 0, slot) != before[slot]
            if kind == _stream.NO_FAULT:
                assert (result.success, result.bytes, landed) == (True, 8, True), result
            else:
                assert (result.success, result.bytes) == (False, 0), result
                assert "SimulatedFault" in (result.error or "")
                assert landed == (kind == _stream.FAULT_AFTER), result


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "0.1"])
def test_a_bad_fault_share_is_refused_naming_it(bad: object) -> None:
    cfg = preset(DEFAULT)
    gpu = [[torch.zeros((cfg.num_gpu_blocks, 8), dtype=torch.uint8)] for _ in cfg.groups]
    with pytest.raises(TransferArgumentError, match="simulate_faults"):
        TransferEngine(cfg, gpu, simulate_stream=1, simulate_faults=bad)  # type: ignore[arg-type]
    with pytest.raises(TransferArgumentError, match=r"simulate_faults.*simulate_stream"):
        TransferEngine(cfg, gpu, simulate_faults=0.5)


def test_simulator_catches_a_lost_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect: the stream never attributes a deferred copy's failure to the event behind
    it (the job is reported as landed). With injected faults the simulator knows which
    jobs failed and names X1 before the stale bytes are ever read."""
    monkeypatch.setattr(_stream.SimulatedStream, "_passed",
                        lambda self, event: event not in self._pending)
    opts = SimOptions(seed=1, requests=6, context_tokens=400, simulate_stream=True,
                      stream_fault_rate=0.3, delay_rate=0.0, fail_rate=0.0,
                      abort_rate=0.0, reset_rate=0.0)
    sim = Simulator(preset(DEFAULT), opts)
    try:
        with pytest.raises(InvariantViolation, match=r"X1: job .*copy failed"):
            sim.run()
    finally:
        sim.transfer.close()


def test_simulator_settles_with_injected_faults() -> None:
    """Correct code under injected device errors: every failed job is reported failed and
    recomputed, and the run settles with its byte checks passing."""
    opts = SimOptions(seed=2, requests=8, context_tokens=400, simulate_stream=True,
                      stream_fault_rate=0.2, delay_rate=0.3, fail_rate=0.0,
                      abort_rate=0.0, reset_rate=0.0)
    sim = Simulator(preset(DEFAULT), opts)
    try:
        stats = sim.run()
    finally:
        sim.transfer.close()
    assert sim.checked.get("X1", 0) > 0
    assert stats.failed_loads + stats.failed_stores > 0
