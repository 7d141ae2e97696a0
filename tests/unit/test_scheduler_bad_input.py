"""Bad hook calls: each raises its documented error and leaves the scheduler as it was.

Goal: the engine-facing hooks treat bad input as an operating error (docs/style.md): an unknown
request id, block id lists of the wrong group count, hashes shorter than the tokens
claimed, a completion for an unknown job, more completions than workers, a duplicate
report. Each raises a ``KeyError``/``ValueError`` subclass from ``kvcore.spec.errors``
whose message names the request or job, and the rejected call changes nothing.

Method: one parametrized table. Every row builds the same history on two schedulers (a
request with a store half reported, a request with a load queued, a finished prefix in
the CPU tier), makes the bad call on one, and checks (1) the error class and the name in
its message, (2) the observable state (tracked requests, cursors, jobs, stats, the CPU
tier's stats) against a snapshot taken before the call, and (3) that a continuation (a
step that stores and re-allocates a window block, then every report) gives the same
results on both schedulers, which catches hidden changes such as a block table edited
before the error was raised. The table runs against the implementation (checks on) and
against the reference model, so both honour it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from bad_input_layout import CFG, hashes

from kvcore.manager import CPUOffloadManager
from kvcore.scheduler import (
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    WorkerReport,
)
from kvcore.sim._lockstep import observable, plain
from kvcore.spec.errors import (
    BadReportError,
    BadStepError,
    UnknownJobError,
    UnknownRequestError,
)
from kvcore.spec.model import ReferenceScheduler

A_HASHES, C_HASHES, D_HASHES = hashes(6), hashes(3, seed=1), hashes(4, seed=2)
STORE_JOB, C_JOB, LOAD_JOB = 1, 2, 3


def history(s: Any) -> None:
    """'a' (16 tokens) has store job 1 reported by worker 0 only; 'c' stored its 8-token
    prompt (job 2, complete); 'b' repeats c's prompt and has load job 3 queued; 'd' has
    been looked up and has no jobs."""
    s.add_request(RequestInfo("a", 16, A_HASHES[:4]))
    s.add_request(RequestInfo("c", 9, C_HASHES[:2]))
    assert s.lookup("a", 0, 16) == 0 and s.lookup("c", 0, 9) == 0
    step = StepInput((ScheduledRequest("a", 16, 0, 16, ((1, 2, 3, 4), (5, 6, 7, 8))),
                      ScheduledRequest("c", 9, 0, 9, ((11, 12, 13), (14, 15, 16)))),
                     (), frozenset(range(1, 9)) | frozenset(range(11, 17)))
    assert [p.job_id for p in s.build_step(step).stores] == [STORE_JOB, C_JOB]
    s.worker_output([WorkerReport(0, STORE_JOB), WorkerReport(0, C_JOB),
                     WorkerReport(1, C_JOB)])
    s.request_finished("c")
    s.add_request(RequestInfo("b", 9, C_HASHES[:2]))
    assert s.lookup("b", 0, 9) == 8
    assert s.after_alloc("b", ((21, 22, 23), (24, 25, 26)), (0, 0), 0, 8).job_id == LOAD_JOB
    s.add_request(RequestInfo("d", 16, D_HASHES))
    assert s.lookup("d", 0, 16) == 0


def continuation(s: Any) -> list[Any]:
    """What the engine does next, as plain data: 'a' decodes a chunk (its window block 5
    handed out again), every report arrives, the CPU tier is reset, and 'a' decodes one
    more chunk, storing from chunk 0 again: that step reads every block table entry, so
    an entry changed by a rejected call shows up in its plan."""
    first = StepInput((ScheduledRequest("a", 4, 16, 20, ((31,), (5,)), A_HASHES[4:5]),),
                      (), frozenset({31, 5}))
    plan = s.build_step(first)
    reports = [WorkerReport(w, j) for j in (STORE_JOB, LOAD_JOB, *(p.job_id for p in plan.stores))
               for w in (0, 1) if not (j == STORE_JOB and w == 0)]
    out = s.worker_output(reports)
    flush = s.reset()
    second = StepInput((ScheduledRequest("a", 4, 20, 24, ((33,), (34,)), A_HASHES[5:]),),
                       (), frozenset({33, 34}))
    return [plain(plan), plain(out), flush, plain(s.build_step(second)),
            plain(s.take_events()), observable(s)]


@dataclass(frozen=True)
class Bad:
    """One bad call: what it does, the error it must raise, and a name its message gives."""

    call: Callable[[Any], object]
    error: type[Exception]
    names: str


def step(*requests: ScheduledRequest, preempted: tuple[str, ...] = (),
         allocated: frozenset[int] = frozenset()) -> Callable[[Any], object]:
    return lambda s: s.build_step(StepInput(requests, preempted, allocated))


def report(*pairs: tuple[int, int]) -> Callable[[Any], object]:
    return lambda s: s.worker_output([WorkerReport(w, j) for j, w in pairs])


GOOD_A = ScheduledRequest("a", 4, 16, 20, ((31,), (32,)), A_HASHES[4:])

BAD: dict[str, Bad] = {
    # -- unknown request ids ---------------------------------------------------------------
    "lookup, unknown request": Bad(lambda s: s.lookup("zz", 0, 4), UnknownRequestError,
                                   "'zz'"),
    "add_hashes, unknown request": Bad(lambda s: s.add_hashes("zz", [b"x"]),
                                       UnknownRequestError, "'zz'"),
    "after_alloc, unknown request": Bad(lambda s: s.after_alloc("zz", ((1,), (2,)), (0, 0), 0,
                                                                4), UnknownRequestError, "'zz'"),
    "build_step, unknown request after a good one": Bad(
        step(GOOD_A, ScheduledRequest("zz", 4, 0, 4)), UnknownRequestError, "'zz'"),
    "build_step, unknown preempted request": Bad(
        step(preempted=("a", "zz"), allocated=frozenset({6})), UnknownRequestError, "'zz'"),
    "request_finished, unknown request": Bad(lambda s: s.request_finished("zz"),
                                             UnknownRequestError, "'zz'"),
    # -- call order -------------------------------------------------------------------------
    "reset, with 'b's load queued but not handed out": Bad(lambda s: s.reset(), BadStepError,
                                                           "loads [3]"),
    "cursors, unknown request": Bad(lambda s: s.cursors("zz"), UnknownRequestError, "'zz'"),
    "add_request, id already tracked": Bad(lambda s: s.add_request(RequestInfo("a", 4)),
                                           BadStepError, "'a'"),
    # -- block id lists of the wrong group count -------------------------------------------
    "after_alloc, request with jobs in flight": Bad(
        lambda s: s.after_alloc("a", ((41,), (42,)), (0, 0), 0, 4), BadStepError, "'a'"),
    "after_alloc, one table for two groups": Bad(
        lambda s: s.after_alloc("d", ((41, 42),), (0,), 0, 8), BadStepError, "'d'"),
    "build_step, one block list for two groups": Bad(
        step(GOOD_A, ScheduledRequest("b", 1, 8, 9, ((41, 42, 43),))), BadStepError, "'b'"),
    "build_step, three block lists for two groups": Bad(
        step(ScheduledRequest("a", 4, 16, 20, ((31,), (32,), (33,)), A_HASHES[4:])),
        BadStepError, "'a'"),
    # -- hashes shorter than the tokens claimed --------------------------------------------
    "lookup, 20 tokens but hashes for 16": Bad(lambda s: s.lookup("a", 0, 20), BadStepError,
                                               "'a'"),
    "lookup, computed beyond the tokens": Bad(lambda s: s.lookup("a", 17, 16), BadStepError,
                                              "'a'"),
    "build_step, 20 tokens but hashes for 16": Bad(
        step(GOOD_A, ScheduledRequest("d", 20, 0, 20, ((41, 42, 43, 44, 45),) * 2)),
        BadStepError, "'d'"),
    "build_step, block tables shorter than the tokens computed": Bad(
        step(GOOD_A, ScheduledRequest("d", 16, 0, 16, ((41, 42), (43, 44)))),
        BadStepError, "'d'"),
    # -- worker reports ----------------------------------------------------------------------
    "worker_output, unknown job": Bad(report((99, 0)), UnknownJobError, "job 99"),
    "worker_output, completed job": Bad(report((C_JOB, 0)), UnknownJobError, f"job {C_JOB}"),
    # Job 1 is issued and half reported; load job 3 is queued (no worker has it yet).
    "worker_output, good report then unknown job": Bad(report((STORE_JOB, 1), (99, 0)),
                                                       UnknownJobError, "job 99"),
    "worker_output, a queued load": Bad(report((LOAD_JOB, 0)), BadReportError,
                                        f"job {LOAD_JOB} was queued"),
    "worker_output, worker outside num_workers": Bad(report((STORE_JOB, 2)), BadReportError,
                                                     f"job {STORE_JOB}: worker 2"),
    "worker_output, more completions than workers": Bad(
        report((STORE_JOB, 1), (STORE_JOB, 1), (STORE_JOB, 0)), BadReportError,
        f"job {STORE_JOB}: worker 1 reported twice"),
    "worker_output, duplicate in one batch": Bad(report((STORE_JOB, 1), (STORE_JOB, 1)),
                                                 BadReportError, f"job {STORE_JOB}: worker 1"),
    "worker_output, duplicate of an earlier batch": Bad(report((STORE_JOB, 0)),
                                                        BadReportError, f"job {STORE_JOB}"),
}

# Known implementation defects: the row's call raises something else, or raises only after
# changing state. Each names the bug; the fix turns the row green and strict xfail red.
# (Empty: the four found by the refinement work are fixed; build_step and after_alloc
# now validate everything before changing anything.)
KNOWN: dict[str, str] = {}

SCHEDULERS: dict[str, Callable[[], Any]] = {
    "implementation": lambda: OffloadScheduler(
        CFG, CPUOffloadManager.for_config(CFG, check=True), check=True),
    "model": lambda: ReferenceScheduler(CFG),
}


def rows() -> list[Any]:
    out = []
    for kind in SCHEDULERS:
        for name in BAD:
            reason = KNOWN.get(name) if kind == "implementation" else None
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(kind, name, marks=marks, id=f"{kind}: {name}"))
    return out


@pytest.mark.parametrize(("kind", "name"), rows())
def test_bad_call_raises_and_changes_nothing(kind: str, name: str) -> None:
    bad = BAD[name]
    victim, control = SCHEDULERS[kind](), SCHEDULERS[kind]()
    history(victim)
    history(control)
    before = observable(victim)
    with pytest.raises(bad.error) as info:
        bad.call(victim)
    assert bad.names in str(info.value)
    assert observable(victim) == before
    assert continuation(victim) == continuation(control)


def test_history_is_what_the_rows_assume() -> None:
    """The shared history: jobs 1 (half reported) and 3 (queued load) in flight."""
    for make in SCHEDULERS.values():
        s = make()
        history(s)
        assert s.jobs_of("a") == {STORE_JOB} and s.jobs_of("b") == {LOAD_JOB}
        assert s.tracked_requests() == {"a", "b", "d"}


@pytest.mark.parametrize("kind", ["impl", "model"])
def test_a_manager_without_a_pool_for_a_group_is_refused_at_construction(kind: str) -> None:
    """One capacity for a two-group config: group 1's first store would raise
    KeyGroupError inside build_step, after the step had extended the tables. Refused up
    front, naming the field and the group."""
    from kvcore.spec.errors import ConfigError
    from kvcore.spec.manager_model import ReferenceManager
    assert len(CFG.groups) == 2
    make: Callable[[], object] = (
        (lambda: OffloadScheduler(CFG, CPUOffloadManager([4]))) if kind == "impl"
        else (lambda: ReferenceScheduler(CFG, ReferenceManager((4,)))))
    with pytest.raises(ConfigError, match=r"^manager: .*group.*\b1\b"):
        make()
    if kind == "impl":  # one int is every group's capacity; one per group is fine too
        OffloadScheduler(CFG, CPUOffloadManager(4))
        OffloadScheduler(CFG, CPUOffloadManager([4, 4]))
    else:
        ReferenceScheduler(CFG, ReferenceManager((4, 4)))


@pytest.mark.parametrize("make", [OffloadScheduler, ReferenceScheduler])
def test_preempting_a_request_in_the_step_that_hands_out_its_load_is_refused(
        make: Any) -> None:
    """The load would be handed out with the step and submitted after its flush, into
    the blocks preemption frees; the next step gave them to another request with no
    flush (found by an adversarial review). Refused, nothing changed: the same load goes
    out with the next step that keeps the request. Mutant: the queued-load test gone."""
    from kvcore import GroupKind, GroupSpec, OffloadConfig

    cfg = OffloadConfig(groups=(GroupSpec(GroupKind.FULL, 4),), hash_block_tokens=4,
                        num_gpu_blocks=64, num_cpu_blocks=32)
    s = make(cfg, CPUOffloadManager.for_config(cfg))
    h = tuple(i.to_bytes(8, "big") for i in range(4))
    s.add_request(RequestInfo("A", 17, h))
    plan = s.build_step(StepInput((ScheduledRequest("A", 17, 0, 17, ((1, 2, 3, 4, 5),)),),
                                  allocated_ids=frozenset({1, 2, 3, 4, 5})))
    s.worker_output([WorkerReport(0, p.job_id) for p in plan.stores])
    s.request_finished("A")
    s.add_request(RequestInfo("B", 17, h))
    assert s.lookup("B", 0, 17) == 16
    load = s.after_alloc("B", [[6, 7, 8, 9, 10]], [0], 0, 16)
    assert load is not None
    with pytest.raises(BadStepError, match=r"preempted in the step|preempted while its load"):
        s.build_step(StepInput((ScheduledRequest("B", 0, 0, 17, ((6, 7, 8, 9, 10),)),),
                               ("B",), frozenset({6, 7, 8, 9, 10})))
    plan = s.build_step(StepInput((ScheduledRequest("B", 0, 0, 17, ((6, 7, 8, 9, 10),)),),
                                  (), frozenset({6, 7, 8, 9, 10})))
    assert [p.job_id for p in plan.loads] == [load.job_id]
