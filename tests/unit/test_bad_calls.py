"""The boundary table: every bad call raises its own kvcore error and changes nothing.

Goal: the validation layer of issue 8 (items 2-5): at every public entry of
``OffloadScheduler`` and ``CPUOffloadManager``, a wrong type, an out-of-range number, an
unknown id, a duplicate, a hash of the wrong type or length, a block id outside the GPU
pool or a null where none may be, is rejected with a specific error class from
``kvcore.spec.errors`` (never a bare ``TypeError``/``KeyError``/``IndexError``), and the
whole state, not only what the hooks show, is exactly as before.

Method: one parametrized table. Each row is a call (building its argument inside the
call, so a rejection by a hook dataclass's own checks counts as the call's) and the exact
error class it must raise. Every row runs on a fresh history (``history``: a store half
reported, a load queued, a READY prefix pinned by that load, a lookup hit not yet
allocated, a request with windows tables) under three set-ups: the implementation with
runtime checks on, with them off, and the reference model (which must reject the same
calls with the same classes, since the refinement tests compare the two). The state is
compared with ``state_snapshot.snapshot``, a deep walk over every attribute of the
scheduler and its manager (tables, cursors, hashes, jobs, fence and window indexes,
entries, policy order, events, counters). A continuation then drives both the victim
and an untouched twin through the same next steps and compares every answer.
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
from kvcore.sim._lockstep import plain
from kvcore.sim._snapshot import snapshot
from kvcore.spec import errors as E
from kvcore.spec.model import ReferenceScheduler
from kvcore.spec.types import make_key

A, C, D = hashes(6), hashes(3, seed=1), hashes(4, seed=2)
STORE_JOB, C_JOB, LOAD_JOB = 1, 2, 3
A_WRITING = make_key(A[3], 0)  # a's store job 1 is half reported: WRITING
C_READY = make_key(C[1], 0)  # stored by c, pinned once by b's load


def history(s: Any) -> None:
    """'a' has store job 1 reported by worker 0 only; 'c' stored its 8-token prompt and
    finished; 'b' and 'e' repeat c's prompt and were looked up (8 each); 'b' then has
    load job 3 queued, 'e' is not allocated yet; 'd' was looked up (0)."""
    s.add_request(RequestInfo("a", 16, A[:4]))
    s.add_request(RequestInfo("c", 9, C[:2]))
    assert s.lookup("a", 0, 16) == 0 and s.lookup("c", 0, 9) == 0
    step = StepInput((ScheduledRequest("a", 16, 0, 16, ((1, 2, 3, 4), (5, 6, 7, 8))),
                      ScheduledRequest("c", 9, 0, 9, ((11, 12, 13), (14, 15, 16)))),
                     (), frozenset(range(1, 9)) | frozenset(range(11, 17)))
    assert [p.job_id for p in s.build_step(step).stores] == [STORE_JOB, C_JOB]
    s.worker_output([WorkerReport(0, STORE_JOB), WorkerReport(0, C_JOB),
                     WorkerReport(1, C_JOB)])
    s.request_finished("c")
    s.add_request(RequestInfo("b", 9, C[:2]))
    assert s.lookup("b", 0, 9) == 8
    s.add_request(RequestInfo("e", 9, C[:2]))
    assert s.lookup("e", 0, 9) == 8
    assert s.after_alloc("b", ((21, 22, 23), (24, 25, 26)), (0, 0), 0, 8).job_id == LOAD_JOB
    s.add_request(RequestInfo("d", 16, D))
    assert s.lookup("d", 0, 16) == 0


def continuation(s: Any) -> list[Any]:
    """The engine's next steps as plain data: 'e' is allocated and loads, 'a' decodes a
    chunk (its window block 5 handed out again), every report arrives, the tier is reset
    and 'a' stores from chunk 0 again, reading every block table entry."""
    load = s.after_alloc("e", ((41, 42, 43), (44, 45, 46)), (0, 0), 0, 8)
    first = StepInput((ScheduledRequest("a", 4, 16, 20, ((31,), (5,)), A[4:5]),),
                      (), frozenset({31, 5, 41, 42, 43, 44, 45, 46}))
    plan = s.build_step(first)
    reports = [WorkerReport(w, j) for j in (STORE_JOB, LOAD_JOB, load.job_id,
                                            *(p.job_id for p in plan.stores))
               for w in (0, 1) if not (j == STORE_JOB and w == 0)]
    out = s.worker_output(reports)
    flush = s.reset()
    second = StepInput((ScheduledRequest("a", 4, 20, 24, ((33,), (34,)), A[5:]),),
                       (), frozenset({33, 34}))
    return [plain(load), plain(plan), plain(out), flush, plain(s.build_step(second)),
            plain(s.take_events()), plain(s.stats())]


@dataclass(frozen=True)
class Bad:
    """One bad call and the exact error class it must raise."""

    call: Callable[[Any], object]
    error: type[Exception]


def step(*requests: ScheduledRequest, preempted: Any = (), allocated: Any = frozenset()
         ) -> Callable[[Any], object]:
    return lambda s: s.build_step(StepInput(requests, preempted, allocated))


def sr(rid: str = "a", new_ids: Any = ((31,), (32,)), new_hashes: Any = A[4:5], **kw: Any
       ) -> Callable[[], ScheduledRequest]:
    """A scheduled request built at call time (its own checks may be what rejects)."""
    args = {"scheduled_tokens": 4, "computed_tokens": 16, "num_tokens": 20, **kw}
    return lambda: ScheduledRequest(rid, new_block_ids=new_ids, new_hashes=new_hashes,
                                    **args)


def step_of(*makers: Callable[[], ScheduledRequest], preempted: Any = (),
            allocated: Any = frozenset()) -> Callable[[Any], object]:
    return lambda s: s.build_step(StepInput(tuple(m() for m in makers), preempted, allocated))


def report(**kw: Any) -> Callable[[Any], object]:
    args = {"worker": 0, "job_id": LOAD_JOB, **kw}
    return lambda s: s.worker_output([WorkerReport(**args)])


def info(rid: Any = "f", prompt: Any = 8, block_hashes: Any = (), **kw: Any
         ) -> Callable[[Any], object]:
    return lambda s: s.add_request(RequestInfo(rid, prompt, block_hashes, **kw))


def alloc(rid: Any = "e", tables: Any = ((41, 42, 43), (44, 45, 46)), valid: Any = (0, 0),
          computed: Any = 0, load: Any = 8) -> Callable[[Any], object]:
    return lambda s: s.after_alloc(rid, tables, valid, computed, load)


def mgr(method: str, *args: Any, **kw: Any) -> Callable[[Any], object]:
    return lambda s: getattr(s.manager, method)(*args, **kw)


H8 = b"h" * 8
T, R = E.ArgumentTypeError, E.ArgumentRangeError

BAD: dict[str, Bad] = {
    # -- add_request ------------------------------------------------------------------------
    "add_request: not a RequestInfo": Bad(lambda s: s.add_request({"request_id": "f"}), T),
    "add_request: int request id": Bad(info(rid=123), T),
    "add_request: empty request id": Bad(info(rid=""), R),
    "add_request: request id of 2000 chars": Bad(info(rid="x" * 2000), R),
    "add_request: negative prompt_tokens": Bad(info(prompt=-1), R),
    "add_request: bool prompt_tokens": Bad(info(prompt=True), T),
    "add_request: str hash": Bad(info(block_hashes=("ab" * 4,)), T),
    "add_request: int hash (was bytes(n), a false hit)": Bad(info(block_hashes=(8,)), T),
    "add_request: bytearray hash": Bad(info(block_hashes=(bytearray(8),)), T),
    "add_request: empty hash": Bad(info(block_hashes=(b"",)), R),
    "add_request: 65-byte hash": Bad(info(block_hashes=(b"x" * 65,)), R),
    "add_request: hashes of two lengths": Bad(info(block_hashes=(H8, b"y" * 4)), R),
    "add_request: hash length differs from the scheduler's": Bad(
        info(block_hashes=(b"x" * 4,)), E.HashError),
    "add_request: one bytes object as the hashes": Bad(info(block_hashes=H8), T),
    "add_request: negative max_offload_tokens": Bad(info(max_offload_tokens=-1), R),
    "add_request: skip_reading='no'": Bad(info(skip_reading="no"), T),
    "add_request: id already tracked": Bad(info(rid="a"), E.BadStepError),
    # -- add_hashes -------------------------------------------------------------------------
    "add_hashes: unknown request": Bad(lambda s: s.add_hashes("zz", [H8]),
                                       E.UnknownRequestError),
    "add_hashes: str hash": Bad(lambda s: s.add_hashes("a", ["h" * 8]), T),
    "add_hashes: int hash": Bad(lambda s: s.add_hashes("a", [7]), T),
    "add_hashes: wrong length": Bad(lambda s: s.add_hashes("a", [b"h" * 16]), E.HashError),
    "add_hashes: bytes object as the list": Bad(lambda s: s.add_hashes("a", H8), T),
    "add_hashes: int request id": Bad(lambda s: s.add_hashes(5, [H8]), T),
    "add_hashes: list request id (unhashable)": Bad(lambda s: s.add_hashes(["a"], [H8]), T),
    # -- lookup -----------------------------------------------------------------------------
    "lookup: unknown request": Bad(lambda s: s.lookup("zz", 0, 4), E.UnknownRequestError),
    "lookup: negative computed_tokens": Bad(lambda s: s.lookup("d", -4, 16), R),
    "lookup: bool num_tokens": Bad(lambda s: s.lookup("d", 0, True), T),
    "lookup: float num_tokens": Bad(lambda s: s.lookup("d", 0, 16.0), T),
    "lookup: num_tokens 10**15": Bad(lambda s: s.lookup("d", 0, 10**15), R),
    "lookup: more tokens than hashes": Bad(lambda s: s.lookup("d", 0, 20), E.BadStepError),
    "lookup: computed beyond num_tokens": Bad(lambda s: s.lookup("d", 17, 16),
                                              E.BadStepError),
    "lookup: None request id": Bad(lambda s: s.lookup(None, 0, 4), T),
    # -- after_alloc ------------------------------------------------------------------------
    "after_alloc: unknown request": Bad(alloc(rid="zz"), E.UnknownRequestError),
    "after_alloc: negative load_tokens": Bad(alloc(load=-8), R),
    "after_alloc: load_tokens beyond the lookup's 0": Bad(alloc(rid="d", tables=(
        (41, 42, 43, 44), (45, 46, 47, 48)), load=8), R),
    "after_alloc: load_tokens other than the lookup's hit": Bad(alloc(load=4), R),
    "after_alloc: computed_tokens other than the lookup's": Bad(alloc(computed=4, load=4), R),
    "after_alloc: block id = num_gpu_blocks": Bad(alloc(tables=((41, 42, 64), (44, 45, 46))),
                                                  E.BlockIdError),
    "after_alloc: null block in a FULL group": Bad(alloc(tables=((41, 0, 43), (44, 45, 46))),
                                                   E.BlockIdError),
    "after_alloc: negative block id": Bad(alloc(tables=((41, 42, 43), (-1, 45, 46))), R),
    "after_alloc: bool block id": Bad(alloc(tables=((41, True, 43), (44, 45, 46))), T),
    "after_alloc: tables as a str": Bad(alloc(tables="41,42"), T),
    "after_alloc: valid_blocks beyond the table": Bad(alloc(valid=(4, 0)), R),
    "after_alloc: one table for two groups": Bad(alloc(tables=((41, 42, 43),), valid=(0,)),
                                                 E.BadStepError),
    "after_alloc: request with jobs in flight": Bad(alloc(rid="a", load=4), E.BadStepError),
    "after_alloc: str computed_tokens": Bad(alloc(computed="0"), T),
    # -- build_step -------------------------------------------------------------------------
    "build_step: not a StepInput": Bad(lambda s: s.build_step(((), (), frozenset())), T),
    "build_step: one request twice": Bad(step_of(sr(), sr(new_ids=((33,), (34,)))),
                                         E.DuplicateRequestError),
    "build_step: preempted twice": Bad(step(preempted=("d", "d")), E.DuplicateRequestError),
    "build_step: allocated id 0": Bad(step(allocated=frozenset({0, 31})), E.BlockIdError),
    "build_step: allocated id = num_gpu_blocks": Bad(step(allocated=frozenset({64})),
                                                     E.BlockIdError),
    "build_step: negative allocated id": Bad(step(allocated=frozenset({-3})), R),
    "build_step: allocated ids as a str": Bad(step(allocated="31"), T),
    "build_step: new block id >= num_gpu_blocks": Bad(step_of(sr(new_ids=((31,), (99,)))),
                                                      E.BlockIdError),
    "build_step: null block in a FULL group": Bad(step_of(sr(new_ids=((0,), (32,)))),
                                                  E.BlockIdError),
    "build_step: negative new block id": Bad(step_of(sr(new_ids=((-31,), (32,)))), R),
    "build_step: bool new block id": Bad(step_of(sr(new_ids=((31,), (False,)))), T),
    "build_step: str new hash": Bad(step_of(sr(new_hashes=("h" * 8,))), T),
    "build_step: int new hash": Bad(step_of(sr(new_hashes=(3,))), T),
    "build_step: new hash of another length": Bad(step_of(sr(new_hashes=(b"h" * 4,))),
                                                  E.HashError),
    "build_step: negative scheduled_tokens": Bad(step_of(sr(scheduled_tokens=-4)), R),
    "build_step: bool num_tokens": Bad(step_of(sr(num_tokens=True)), T),
    "build_step: resumed='yes'": Bad(step_of(sr(resumed="yes")), T),
    # A resumed table is rebuilt from new_block_ids alone: 20 tokens need 5 blocks per
    # group, 4 are one short (kills counting a resumed table's old blocks as well).
    "build_step: resumed table one block short": Bad(step_of(sr(
        new_ids=((31, 32, 33, 34), (0, 0, 35, 36)), resumed=True)), E.BadStepError),
    "build_step: unknown request after a good one": Bad(
        step_of(sr(), sr("zz", new_ids=(), new_hashes=(), computed_tokens=0, num_tokens=4)),
        E.UnknownRequestError),
    "build_step: unknown preempted request": Bad(step(preempted=("d", "zz")),
                                                 E.UnknownRequestError),
    "build_step: preempted as a str": Bad(step(preempted="d"), T),
    "build_step: a tuple among the requests": Bad(
        lambda s: s.build_step(StepInput((("a", 4, 16, 20),))), T),  # type: ignore[arg-type]
    "build_step: three block lists for two groups": Bad(
        step_of(sr(new_ids=((31,), (32,), (33,)))), E.BadStepError),
    "build_step: bad second request, good first": Bad(
        step_of(sr(), sr("d", new_ids=((41, 42, 43, 44), (45, 46, 47, 64)), new_hashes=(),
                         computed_tokens=0, num_tokens=16, scheduled_tokens=16)),
        E.BlockIdError),
    # -- worker_output ----------------------------------------------------------------------
    "worker_output: job_id 0 (was ignored)": Bad(report(job_id=0), R),
    "worker_output: negative job_id": Bad(report(job_id=-1), R),
    "worker_output: str job_id": Bad(report(job_id="3"), T),
    "worker_output: negative bytes": Bad(report(bytes=-64), R),
    "worker_output: success='no' (was a success)": Bad(report(success="no"), T),
    "worker_output: success=1": Bad(report(success=1), T),
    "worker_output: bool worker": Bad(report(worker=False), T),
    "worker_output: NaN seconds": Bad(report(seconds=float("nan")), R),
    # (job 1: issued, so the worker is what is wrong; job 3 is still queued)
    "worker_output: worker outside num_workers": Bad(report(worker=2, job_id=STORE_JOB),
                                                     E.BadReportError),
    "worker_output: unknown job": Bad(report(job_id=99), E.UnknownJobError),
    "worker_output: already reported": Bad(report(job_id=STORE_JOB), E.BadReportError),
    "worker_output: None for the batch": Bad(lambda s: s.worker_output(None), T),
    "worker_output: a tuple in the batch": Bad(lambda s: s.worker_output([(0, LOAD_JOB)]), T),
    "worker_output: good report then unknown job": Bad(
        lambda s: s.worker_output([WorkerReport(1, STORE_JOB), WorkerReport(0, 99)]),
        E.UnknownJobError),
    # Settling a load no worker has yet would unpin the slots it is about to read.
    "worker_output: a load queued, not yet handed out": Bad(
        lambda s: s.worker_output([WorkerReport(0, LOAD_JOB)]), E.BadReportError),
    "build_step: a FULL id twice in one table": Bad(lambda s: s.build_step(StepInput(
        (ScheduledRequest("d", 16, 0, 16, ((41, 41, 42, 43), (45, 46, 47, 48))),), (),
        frozenset({41, 42, 43, 45, 46, 47, 48}))), E.BlockIdError),
    # -- request_finished and the views -----------------------------------------------------
    "request_finished: unknown request": Bad(lambda s: s.request_finished("zz"),
                                             E.UnknownRequestError),
    "request_finished: int request id": Bad(lambda s: s.request_finished(1), T),
    "cursors: int request id": Bad(lambda s: s.cursors(1), T),
    "jobs_of: unknown request": Bad(lambda s: s.jobs_of("zz"), E.UnknownRequestError),
    # -- the manager ------------------------------------------------------------------------
    "manager.lookup: str key": Bad(mgr("lookup", "k" * 12), E.BadKeyError),
    "manager.lookup: empty key": Bad(mgr("lookup", b""), E.BadKeyError),
    "manager.lookup: 100-byte key": Bad(mgr("lookup", b"k" * 100), E.BadKeyError),
    "manager.touch: one bytes object as the keys": Bad(mgr("touch", C_READY), T),
    "manager.touch: int among the keys": Bad(mgr("touch", [C_READY, 5]), E.BadKeyError),
    "manager.prepare_load: absent key": Bad(mgr("prepare_load", [C_READY, b"absent!!x"]),
                                            E.KeyNotReadyError),
    "manager.prepare_load: WRITING key": Bad(mgr("prepare_load", [A_WRITING]),
                                             E.KeyNotReadyError),
    "manager.prepare_load: str key": Bad(mgr("prepare_load", ["k"]), E.BadKeyError),
    "manager.complete_load: more releases than pins": Bad(
        mgr("complete_load", [C_READY, C_READY]), E.NotPinnedError),
    "manager.complete_load: unpinned key": Bad(mgr("complete_load", [make_key(A[0], 0)]),
                                               E.NotPinnedError),
    "manager.prepare_store: str key among good ones": Bad(
        mgr("prepare_store", [b"new-key-1", "new-key-2"]), E.BadKeyError),
    "manager.prepare_store: keys as a str": Bad(mgr("prepare_store", "new-key"), T),
    "manager.complete_store: success='no'": Bad(mgr("complete_store", [A_WRITING], "no"), T),
    "manager.complete_store: success=1": Bad(mgr("complete_store", [A_WRITING], 1), T),
    "manager.complete_store: int key": Bad(mgr("complete_store", [A_WRITING, 3]),
                                           E.BadKeyError),
    "manager.slot_of: list key (unhashable)": Bad(mgr("slot_of", [C_READY]), E.BadKeyError),
    "manager.state_of: str key": Bad(mgr("state_of", "key"), E.BadKeyError),
}

SETUPS: dict[str, Callable[[], Any]] = {
    "checks on": lambda: OffloadScheduler(
        CFG, CPUOffloadManager.for_config(CFG, check=True), check=True),
    "checks off": lambda: OffloadScheduler(
        CFG, CPUOffloadManager.for_config(CFG, check=False), check=False),
    "model": lambda: ReferenceScheduler(CFG),
}


def test_the_table_is_large_enough() -> None:
    assert len(BAD) >= 60


def test_scheduler_wants_a_config() -> None:
    with pytest.raises(E.ArgumentTypeError):
        OffloadScheduler({"groups": ()}, CPUOffloadManager(4))  # type: ignore[arg-type]
    s = SETUPS["checks off"]()
    with pytest.raises(E.ArgumentTypeError):
        s.job_in_flight("1")  # type: ignore[arg-type]


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_call_raises_and_changes_nothing(setup: str, name: str) -> None:
    bad = BAD[name]
    victim, twin = SETUPS[setup](), SETUPS[setup]()
    history(victim)
    history(twin)
    before = snapshot(victim)
    assert before == snapshot(twin)
    with pytest.raises(Exception) as caught:
        bad.call(victim)
    assert type(caught.value) is bad.error, f"{type(caught.value).__name__}: {caught.value}"
    assert snapshot(victim) == before
    assert continuation(victim) == continuation(twin)


def test_error_fields_name_argument_value_and_bound() -> None:
    """The facts are fields, not only message text (``--json`` output reads them). Kills
    a request-id prefix dropped from (or misplaced in) a step's HashError argument."""
    s = SETUPS["checks off"]()
    history(s)
    with pytest.raises(E.BlockIdError) as caught:
        alloc(tables=((41, 42, 64), (44, 45, 46)))(s)
    e = caught.value
    assert (e.where, e.argument, e.value, e.group) == ("after_alloc", "block_ids[0][2]", 64, 0)
    assert "63" in e.bound and "num_gpu_blocks" in e.fix
    with pytest.raises(E.BlockIdError) as null:  # the range a FULL group's ids must be in
        alloc(tables=((41, 0, 43), (44, 45, 46)))(s)
    assert (null.value.argument, null.value.value, null.value.group) == ("block_ids[0][1]", 0, 0)
    assert null.value.bound.startswith("1..63:")
    with pytest.raises(E.HashError) as hashed:
        s.add_hashes("a", [b"h" * 16])
    assert (hashed.value.argument, hashed.value.value) == ("len(hashes[0])", 16)
    assert "8 bytes" in hashed.value.bound
    # In a step, the argument names the request whose hash is wrong (among many).
    with pytest.raises(E.HashError) as in_step:
        step_of(sr(rid="a", new_hashes=(b"h" * 4,)))(s)
    assert (in_step.value.argument, in_step.value.value) == ("len(a.new_hashes[0])", 4)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_lookup_hit_is_loaded_once(setup: str) -> None:
    """After 'b''s load settles, the same hit cannot be loaded again without a lookup
    (the engine would otherwise pin and copy the chunks twice), and a new lookup allows
    it again."""
    s = SETUPS[setup]()
    history(s)
    s.build_step(StepInput((), (), frozenset(range(21, 27))))
    s.worker_output([WorkerReport(0, LOAD_JOB), WorkerReport(1, LOAD_JOB)])
    before = snapshot(s)
    with pytest.raises(E.ArgumentRangeError):
        s.after_alloc("b", ((21, 22, 23), (24, 25, 26)), (0, 0), 0, 8)
    assert snapshot(s) == before
    assert s.lookup("b", 0, 9) == 8
    assert s.after_alloc("b", ((21, 22, 23), (24, 25, 26)), (0, 0), 0, 8) is not None


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_finished_load_is_flushed_when_its_blocks_come_back(setup: str) -> None:
    """'b' finishes while its load writes blocks 21..26; the engine frees them at once, so
    the step that hands them to 'd' must flush the load (else it writes d's blocks)."""
    s = SETUPS[setup]()
    history(s)
    assert [p.job_id for p in s.build_step(StepInput((), (), frozenset())).loads] == [LOAD_JOB]
    s.request_finished("b")
    plan = s.build_step(StepInput((ScheduledRequest("d", 16, 0, 16, (
        (21, 22, 23, 24), (25, 26, 27, 28))),), (), frozenset(range(21, 29))))
    assert LOAD_JOB in plan.flush


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_finished_request_with_jobs_is_refused_by_every_hook(setup: str) -> None:
    """'a' finishes while store job 1 is in flight: it is kept until the job settles, but
    no hook may store, look up or extend it again (its blocks are freed)."""
    s = SETUPS[setup]()
    history(s)
    s.request_finished("a")
    before = snapshot(s)
    calls = [
        lambda: s.build_step(StepInput((ScheduledRequest("a", 4, 16, 20, ((31,), (32,)),
                                                         A[4:5]),), (), frozenset({31, 32}))),
        lambda: s.add_hashes("a", [A[4]]),
        lambda: s.lookup("a", 0, 16),
        lambda: s.after_alloc("a", ((1, 2, 3, 4), (5, 6, 7, 8)), (0, 0), 0, 0),
    ]
    for call in calls:
        with pytest.raises(E.UnknownRequestError, match="was finished"):
            call()
        assert snapshot(s) == before
    assert s.jobs_of("a") == {STORE_JOB}  # still there for its report


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_preempted_request_listed_first_does_not_stop_the_others_storing(setup: str) -> None:
    """'a' is scheduled and preempted in one step, listed before 'd': 'd' still stores
    its prompt (held-out seed 32's m24, ``continue`` -> ``break``, passed every test)."""
    s = SETUPS[setup]()
    history(s)
    plan = s.build_step(StepInput(
        (ScheduledRequest("a", 4, 16, 20, ((31,), (32,)), A[4:5]),
         ScheduledRequest("d", 16, 0, 16, ((41, 42, 43, 44), (45, 46, 47, 48)))),
        ("a",), frozenset({31, 32, *range(41, 49)})))
    assert [p.request_id for p in plan.stores] == ["d"]
