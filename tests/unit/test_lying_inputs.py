"""Arguments that answer differently the second time they are read.

A list subclass whose ``__iter__`` or ``__getitem__`` changes its answer, or an int
subclass whose comparisons lie, passed every check that read the argument once and then
let the code read it again (found by an adversarial review of the public API). Each
entry now reads its argument once, as a plain tuple or an exact int, and uses what it
checked. Each test names the mutant it kills: the entry going back to the caller's
object after the check.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcore import (
    CPUOffloadManager,
    GroupKind,
    GroupSpec,
    OffloadConfig,
    OffloadScheduler,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    WorkerReport,
)
from kvcore.spec.errors import (
    ArgumentRangeError,
    BadKeyError,
    ConfigError,
    KVCoreError,
    TransferArgumentError,
)
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import make_key


class Liar(list):  # type: ignore[type-arg]
    """Holds ``good``; its own ``__iter__`` answers ``good`` for its first ``honest``
    calls, then ``bad``; indexing always answers ``item`` when one is given. With
    ``honest=0`` every pass through the subclass lies, so an entry that goes back to
    the caller's object at all (after checking its items) meets the lie."""

    def __init__(self, good: list[Any], bad: list[Any] | None = None, honest: int = 0,
                 item: Any = None) -> None:
        super().__init__(good)
        self.bad, self.honest, self.item, self.passes = bad, honest, item, 0

    def __iter__(self) -> Any:
        self.passes += 1
        if self.bad is None or self.passes <= self.honest:
            return super().__iter__()
        return iter(self.bad)

    def __getitem__(self, index: Any) -> Any:
        return self.item if self.item is not None else super().__getitem__(index)


K1, K2 = make_key(b"h" * 8, 0), make_key(b"i" * 8, 0)
ONE_GROUP = OffloadConfig(groups=(GroupSpec(GroupKind.FULL, 4),), hash_block_tokens=4,
                          num_gpu_blocks=64, num_cpu_blocks=32)


def _scheduler(make: str) -> Any:
    """kvcore's scheduler (checks on) or the reference, on the one-group layout."""
    from kvcore.spec.model import ReferenceScheduler
    manager = CPUOffloadManager.for_config(ONE_GROUP)
    if make == "kvcore":
        return OffloadScheduler(ONE_GROUP, manager, check=True)
    return ReferenceScheduler(ONE_GROUP, manager)


def _unchecked(cls: type) -> Any:
    """A subclass of a hook object whose ``__post_init__`` checks nothing."""
    return type(f"Unchecked{cls.__name__}", (cls,), {"__post_init__": lambda self: None})
TOO_LONG = b"z" * 100 + bytes(4)


def _tier() -> CPUOffloadManager:
    tier = CPUOffloadManager(4)
    tier.prepare_store([K1, K2])
    tier.complete_store([K1, K2])
    tier.take_events()
    return tier


def _state(tier: CPUOffloadManager) -> tuple[object, ...]:
    return (tier.stats(), tier.state_of(K1), tier.state_of(K2), tier.state_of(TOO_LONG[:68]))


def test_a_store_uses_the_keys_it_checked() -> None:
    """Mutant: ``prepare_store`` iterates the caller's list again after ``check_keys``:
    a 104-byte key (the limit is 68) entered the tier, and no later call could name it,
    so its slot was lost for good."""
    tier = _tier()
    out = tier.prepare_store(Liar([make_key(b"j" * 8, 0)], [TOO_LONG]))
    assert out is not None and out.keys_to_store == (make_key(b"j" * 8, 0),)
    tier.complete_store(list(out.keys_to_store))
    assert tier.stats().used == 3 and tier.stats().writing == 0


@pytest.mark.parametrize("call", ["complete_load", "prepare_load", "touch", "prepare_store",
                                  "complete_store", "lookup_many"])
def test_every_key_entry_reads_its_list_once(call: str) -> None:
    """A list that holds one valid key but iterates as non-keys: the entry does exactly
    what it does for the plain list ``[K1]`` (before: bare KeyError,
    ValueError or TypeError, some after a pin had changed)."""
    outcomes = []
    for keys in (Liar([K1], [K1, 5, "s"]), [K1]):
        tier = _tier()
        if call == "complete_load":
            tier.prepare_load([K1])
        try:
            answer: object = getattr(tier, call)(keys)
        except KVCoreError as e:  # pragma: no cover - a refusal must be the same too
            answer = type(e)
        outcomes.append((answer, _state(tier), tier.take_events()))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("make", ["kvcore", "reference"])
def test_after_alloc_plans_with_the_counts_it_checked(make: str) -> None:
    """Mutant: ``after_alloc`` hands the caller's ``valid_blocks`` to the load planner
    after checking a copy: a list whose items read 99 was accepted for a 4-block table,
    and the load it returned moved nothing while the engine was told 16 tokens."""
    sched = _scheduler(make)
    hashes = tuple(i.to_bytes(8, "big") for i in range(4))
    sched.add_request(RequestInfo("r0", 16, hashes))
    plan = sched.build_step(StepInput((ScheduledRequest("r0", 16, 0, 16, ((1, 2, 3, 4),)),),
                                      allocated_ids=frozenset({1, 2, 3, 4})))
    sched.worker_output([WorkerReport(0, j.job_id) for j in plan.stores])
    sched.request_finished("r0")
    sched.add_request(RequestInfo("r1", 16, hashes))
    assert sched.lookup("r1", 0, 16) == 16
    load = sched.after_alloc("r1", ((10, 11, 12, 13),), Liar([0], item=99), 0, 16)
    assert load is not None and load.groups[0].gpu_block_ids == (10, 11, 12, 13)


@pytest.mark.parametrize("capacity", [[4, 4], (4,)])
def test_a_capacity_list_is_read_once(capacity: Any) -> None:
    """Mutant: the manager keeps ``tuple(capacity)`` read again after the check."""
    liar = Liar(list(capacity), [-1] * len(capacity))
    tier = CPUOffloadManager(liar)
    assert tier.stats().capacity == sum(capacity)


class _LyingInt(int):
    def __le__(self, other: object) -> bool:
        return False

    def __gt__(self, other: object) -> bool:
        return False


@pytest.mark.parametrize("capacity", [_LyingInt(-3), _LyingInt(2**80), [_LyingInt(0)]])
def test_an_int_subclass_is_no_capacity(capacity: Any) -> None:
    """Mutant: ``isinstance(capacity, int)`` instead of exactly int: -3 and 2**80 passed."""
    with pytest.raises(ConfigError) as info:
        CPUOffloadManager(capacity)
    assert info.value.field == "capacity"


def test_a_plan_id_list_is_read_once_and_a_job_id_is_exactly_int() -> None:
    """Mutants: ``_check_ints`` copies the caller's list after checking it (a subclass
    then hands the copy a str), and ``check_plan`` takes an int subclass as a job id,
    which ``wait`` refuses later, for an id the caller never passed to it."""
    from kvcore.transfer import TransferEngine

    with TransferEngine(ONE_GROUP, [[torch.zeros(64, 16, dtype=torch.uint8)]]) as engine:
        ids = Liar([1, 2], [1, "2"])
        engine.submit(TransferPlan(1, JobKind.STORE, "r", (GroupTransfer(ids, 0, (0, 1)),)))
        assert [r.success for r in engine.wait([1], timeout=60)] == [True]

        class JobId(int):
            pass

        with pytest.raises(TransferArgumentError, match=r"^plan\.job_id: "):
            engine.submit(TransferPlan(JobId(2), JobKind.STORE, "r",
                                       (GroupTransfer((1,), 0, (0,)),)))
        assert engine.drain(timeout=60) == []


def test_a_too_long_key_after_the_check_is_still_refused_later() -> None:
    """The store above stored what it checked; a direct store of the long key is
    refused with the key error, naming it (the limit the liar got around)."""
    with pytest.raises(BadKeyError):
        _tier().prepare_store([TOO_LONG])


def test_after_alloc_refuses_a_count_past_its_table() -> None:
    """The plain form of the liar's 99: refused by range, before any state changes."""
    sched = OffloadScheduler(ONE_GROUP, CPUOffloadManager.for_config(ONE_GROUP))
    sched.add_request(RequestInfo("r1", 16, tuple(i.to_bytes(8, "big") for i in range(4))))
    with pytest.raises(ArgumentRangeError, match=r"valid_blocks\[0\]"):
        sched.after_alloc("r1", ((10, 11, 12, 13),), [99], 0, 0)


@pytest.mark.parametrize("make", ["kvcore", "reference"])
def test_a_hook_object_subclass_that_skips_its_checks_is_refused(make: str) -> None:
    """The hook objects are validated in ``__post_init__``; a subclass can replace it
    and hand in a prompt of -5 tokens and a str of hashes (tracked before, then a lookup
    failed deep inside the tier) or a report for job "x" (a bare TypeError). Mutants:
    ``isinstance`` instead of the exact type at each entry; a ScheduledRequest subclass
    taken without the base's checks."""
    from kvcore.spec.errors import ArgumentTypeError

    sched = _scheduler(make)
    with pytest.raises(ArgumentTypeError, match=r"^add_request: info="):
        sched.add_request(_unchecked(RequestInfo)("r", -5, "ab"))  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match=r"reports\[0\]"):
        sched.worker_output([_unchecked(WorkerReport)(0, "x")])  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="step"):
        sched.build_step(_unchecked(StepInput)(("nothing",)))  # type: ignore[arg-type]
    # An engine's own ScheduledRequest type is served (the simulator has one), but
    # checked by kvcore's rules whatever its __post_init__ says.
    with pytest.raises(ArgumentRangeError, match="scheduled_tokens"):
        StepInput((_unchecked(ScheduledRequest)("r", -1, 0, 0, ()),))
    assert sched.tracked_requests() == frozenset() and sched.stats().lookups == 0


def test_a_scheduled_request_subclass_that_redefines_a_field_is_refused() -> None:
    """The scheduler reads a request's fields several times; a subclass whose field is a
    property (or that overrides attribute reads) can pass the checks and answer
    differently later: with checks off, a store of GPU id 99999 of 64 was returned.
    Mutant: the subclass's class dictionaries not looked at."""
    from kvcore.sim._engine import EngineScheduledRequest
    from kvcore.spec.errors import ArgumentTypeError

    class Moving(ScheduledRequest):
        reads = 0

        @property  # type: ignore[misc]
        def new_block_ids(self) -> Any:
            Moving.reads += 1
            return ((1,),) if Moving.reads < 5 else ((99999,),)

    class Reads(ScheduledRequest):
        def __getattribute__(self, name: str) -> Any:
            return object.__getattribute__(self, name)

    for cls, field in ((Moving, "new_block_ids"), (Reads, "__getattribute__")):
        sr = object.__new__(cls)
        sr.__dict__.update(request_id="r", scheduled_tokens=4, computed_tokens=0,
                           num_tokens=4, new_hashes=(), resumed=False)
        if cls is Reads:
            sr.__dict__["new_block_ids"] = ((1,),)
        with pytest.raises(ArgumentTypeError, match=rf"redefines {field}"):
            StepInput((sr,))
    # The simulator's own subclass, which redefines nothing, is served.
    StepInput((EngineScheduledRequest("r", 4, 0, 4, ((1,),)),))
